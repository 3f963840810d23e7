"""Exercise 08 — worked answers: a sharded parameter server from send/recv, and ZeRO's bytes per
gradient element measured on the sockets. See exercises/ex08_myths.py."""
import torch
import torch.distributed as dist

from zerolab import comm, models


def sharded_server_average(tensor, servers, group=None):
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    glob = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
    slices = tensor.view(-1).tensor_split(servers)        # slice k: server k's
    # In: each rank's slice k goes to server k (a server keeps its own); all posted before waiting.
    inbox = [torch.empty_like(slices[rank]) for _ in range(n)] if rank < servers else []
    works = [comm.isend(slices[k].contiguous(), glob(k), group=group) for k in range(servers) if k != rank]
    works += [comm.irecv(inbox[r], glob(r), group=group) for r in range(n) if rank < servers and r != rank]
    for w in works:
        w.wait()
    if rank < servers:                                    # the server's share of the work: Σ / N
        for r in range(n):
            if r != rank:
                slices[rank].add_(inbox[r])
        slices[rank].div_(n)
    # Out: each server sends its averaged slice to every other rank; each rank receives every slice.
    works = [comm.isend(slices[rank].contiguous(), glob(r), group=group)
             for r in range(n) if rank < servers and r != rank]
    works += [comm.irecv(slices[k], glob(k), group=group) for k in range(servers) if k != rank]
    for w in works:
        w.wait()
    return tensor


def bytes_per_element(param_dtype):
    import zerolab
    n, rank = dist.get_world_size(), dist.get_rank()
    model = models.build("gpt")
    engine = zerolab.initialize(model, stage=2, lr=1e-3, param_dtype=param_dtype)
    x, y = models.batch("gpt", seed=rank, model=model)
    for measured in (False, True):                        # the first step warms up (lazy state, sockets)
        dist.barrier()
        with comm.log() as log:
            engine.backward(engine(x, y))
            engine.step()
        engine.zero_grad()
    psi = sum(p.numel() for p in dict.fromkeys(model.parameters()) if p.requires_grad)
    return log.measured_bytes / (2 * (n - 1) / n * psi)   # reduce-scatter + all-gather, ring: 2(N-1)/N Ψ

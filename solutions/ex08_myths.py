"""Exercise 08 — worked answers: a sharded parameter server from send/recv, and ZeRO's bytes per
gradient element measured on the sockets. See exercises/ex08_myths.py."""
import torch
import torch.distributed as dist

from zerolab import comm, models


def sharded_server_average(tensor, servers, group=None):
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    # The contract: an int from 1 to the group's size; True (an int to Python) and 2.0 are refused.
    if isinstance(servers, bool) or not isinstance(servers, int) or not 1 <= servers <= n:
        raise ValueError(f"servers={servers!r}: choose a number of servers from 1 to the group's size ({n})")
    # tensor_split: K contiguous parts whose sizes differ by at most one (chunk would not: 10 -> 3,3,3,1,
    # and 6 -> only 3 parts for K = 4); views, so receiving an averaged part fills the tensor.
    parts = tensor.view(-1).tensor_split(servers)
    serving = rank < servers
    # In: each rank's part k goes to server k (a server keeps its own); every send and receive is
    # posted before any is waited for, so no order of arrival can deadlock. zerolab.comm takes GROUP
    # ranks and translates them itself.
    inbox = [torch.empty_like(parts[rank]) for _ in range(n)] if serving else []
    works = [comm.isend(parts[k].contiguous(), k, group=group) for k in range(servers) if k != rank]
    works += [comm.irecv(inbox[r], r, group=group) for r in range(n) if serving and r != rank]
    for w in works:
        w.wait()
    if serving:                                           # the server's share of the work: sum / N
        for r in range(n):
            if r != rank:
                parts[rank].add_(inbox[r])
        parts[rank].div_(n)
    # Out: each server sends its averaged part to every other rank; each rank receives every part.
    works = [comm.isend(parts[rank].contiguous(), r, group=group) for r in range(n) if serving and r != rank]
    works += [comm.irecv(parts[k], k, group=group) for k in range(servers) if k != rank]
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

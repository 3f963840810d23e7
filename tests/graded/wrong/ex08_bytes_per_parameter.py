"""Wrong answer to exercise 08: the server average is right; the bytes per element divide by the
parameters (Ψ) instead of the elements the ring carries (2(N-1)/N x Ψ for a reduce-scatter plus an
all-gather), so the number depends on N and reads as if ZeRO sent extra.

Caught by: test_bytes_per_element_measured."""
import torch
import torch.distributed as dist

from zerolab import comm, models


def sharded_server_average(tensor, servers, group=None):
    rank, n = dist.get_rank(group), dist.get_world_size(group)
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
    model = models.build("gpt")
    engine = zerolab.initialize(model, stage=2, lr=1e-3, param_dtype=param_dtype)
    x, y = models.batch("gpt", seed=dist.get_rank(), model=model)
    for _ in range(2):
        dist.barrier()
        with comm.log() as log:
            engine.backward(engine(x, y))
            engine.step()
        engine.zero_grad()
    return log.measured_bytes / sum(p.numel() for p in model.parameters())

"""Wrong answer to exercise 08: every rank sends its WHOLE tensor to each server, and each server
keeps the slice it serves: simpler indexing, right averages; K times the bytes on the way in.

Caught by: test_sharded_server_traffic."""
import torch
import torch.distributed as dist

from zerolab import comm, models


def sharded_server_average(tensor, servers, group=None):
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    if isinstance(servers, bool) or not isinstance(servers, int) or not 1 <= servers <= n:
        raise ValueError(f"servers={servers!r} must be between 1 and the group's size {n}")
    flat = tensor.view(-1)
    bounds = [t.numel() for t in flat.tensor_split(servers)]
    starts = [sum(bounds[:k]) for k in range(servers)]
    out = [comm.isend(flat.clone(), k, group=group) for k in range(servers) if k != rank]
    if rank < servers:
        lo, hi = starts[rank], starts[rank] + bounds[rank]
        for r in range(n):
            if r != rank:
                whole = torch.empty_like(flat)
                comm.recv(whole, r, group=group)
                flat[lo:hi] += whole[lo:hi]
        flat[lo:hi] /= n
    for w in out:
        w.wait()
    back = []
    if rank < servers:
        lo, hi = starts[rank], starts[rank] + bounds[rank]
        back += [comm.isend(flat[lo:hi].clone(), r, group=group) for r in range(n) if r != rank]
    for k in range(servers):
        if k != rank:
            comm.recv(flat[starts[k]:starts[k] + bounds[k]], k, group=group)
    for w in back:
        w.wait()
    return tensor


def bytes_per_element(param_dtype):
    import zerolab
    n, rank = dist.get_world_size(), dist.get_rank()
    model = models.build("gpt")
    engine = zerolab.initialize(model, stage=2, lr=1e-3, param_dtype=param_dtype)
    x, y = models.batch("gpt", seed=rank, model=model)
    engine.backward(engine(x, y))
    engine.step()
    engine.zero_grad()
    dist.barrier()
    with comm.log() as log:
        engine.backward(engine(x, y))
        engine.step()
    elements = 2 * (n - 1) / n * sum(p.numel() for p in dict.fromkeys(model.parameters()))
    return log.measured_bytes / elements

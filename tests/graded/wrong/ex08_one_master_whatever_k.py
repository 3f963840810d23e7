"""Wrong answer to exercise 08: K is ignored and rank 0 serves the whole tensor (lesson 08's master
scheme). Right averages, point-to-point only; with K > 1 the load is not shared.

Caught by: test_sharded_server_traffic."""
import torch
import torch.distributed as dist

from zerolab import comm, models


def sharded_server_average(tensor, servers, group=None):
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    if isinstance(servers, bool) or not isinstance(servers, int) or not 1 <= servers <= n:
        raise ValueError(f"servers={servers!r} must be between 1 and the group's size {n}")
    if rank == 0:
        tmp = torch.empty_like(tensor)
        for src in range(1, n):
            comm.recv(tmp, src, group=group)
            tensor += tmp
        tensor /= n
        for dst in range(1, n):
            comm.send(tensor, dst, group=group)
    else:
        comm.send(tensor, 0, group=group)
        comm.recv(tensor, 0, group=group)
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

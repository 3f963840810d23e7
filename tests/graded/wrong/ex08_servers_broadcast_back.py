"""Wrong answer to exercise 08: the slices go to their servers point to point, but each server hands
its averaged slice back with a broadcast (from the server to the group): right averages, a
collective where the exercise (and the myth being measured) is about who sends what to whom.

Caught by: test_sharded_server_average_values."""
import torch
import torch.distributed as dist

from zerolab import comm, models


def sharded_server_average(tensor, servers, group=None):
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    if isinstance(servers, bool) or not isinstance(servers, int) or not 1 <= servers <= n:
        raise ValueError(f"servers={servers!r} must be between 1 and the group's size {n}")
    parts = tensor.view(-1).tensor_split(servers)
    pending = [dist.isend(parts[k].clone(), k, group=group) for k in range(servers) if k != rank]
    if rank < servers:
        for src in range(n):
            if src != rank:
                incoming = torch.empty_like(parts[rank])
                dist.recv(incoming, src, group=group)
                parts[rank].add_(incoming)
        parts[rank].div_(n)
    for p in pending:
        p.wait()
    for k in range(servers):
        out = parts[k].clone()
        dist.broadcast(out, src=k, group=group)
        parts[k].copy_(out)
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

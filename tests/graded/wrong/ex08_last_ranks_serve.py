"""Wrong answer to exercise 08: the servers are the LAST K ranks instead of ranks 0..K-1 (a natural
choice: "rank 0 does enough already"). Right averages; but the wrong ranks serve, so every rank
talks to, and sends, what a different scheme than the one asked for implies.

Caught by: test_sharded_server_traffic."""
import torch
import torch.distributed as dist

from zerolab import comm, models


def sharded_server_average(tensor, servers, group=None):
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    if isinstance(servers, bool) or not isinstance(servers, int) or not 1 <= servers <= n:
        raise ValueError(f"servers={servers!r} must be between 1 and the group's size {n}")
    first = n - servers                                  # servers: ranks n-K .. n-1
    parts = tensor.view(-1).tensor_split(servers)
    me = rank - first                                    # my slice if I serve, else negative
    reqs, got = [], []
    for k in range(servers):
        if first + k != rank:
            reqs.append(dist.isend(parts[k].clone(), first + k, group=group))
    if me >= 0:
        for r in range(n):
            if r != rank:
                buf = torch.empty_like(parts[me])
                got.append(buf)
                reqs.append(dist.irecv(buf, r, group=group))
    for q in reqs:
        q.wait()
    if me >= 0:
        for buf in got:
            parts[me].add_(buf)
        parts[me].div_(n)
    reqs = []
    if me >= 0:
        reqs += [dist.isend(parts[me].clone(), r, group=group) for r in range(n) if r != rank]
    reqs += [dist.irecv(parts[k], first + k, group=group) for k in range(servers) if first + k != rank]
    for q in reqs:
        q.wait()
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

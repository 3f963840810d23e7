"""Exercise 11 — per-parameter sharding, the overflow check and clipping with sharded gradients
(worked answers). See exercises/ex11_fully_shard.py and zerolab/fully_sharded.py,
zerolab/mixed_precision.py for the versions the course runs."""
import torch
import torch.distributed as dist

from zerolab import comm


def shard_dim0(full, rank, world_size):
    rows = full.shape[0]
    c = -(-rows // world_size)                      # ceil: every piece has c rows
    lo, hi = min(rank * c, rows), min((rank + 1) * c, rows)
    out = full.new_zeros((c,) + tuple(full.shape[1:]))
    out[:hi - lo] = full[lo:hi]                     # the rest: zero rows (padding)
    return out


def unshard_dim0(shard, rows, group=None):
    n = dist.get_world_size(group)
    full = shard.new_empty((n * shard.shape[0],) + tuple(shard.shape[1:]))
    comm.all_gather(full, shard.contiguous(), group=group)    # rank order = row order
    return full[:rows]                                         # drop the padding rows


def found_inf(grads, group=None):
    flag = torch.zeros(1)
    for g in grads:
        if not torch.isfinite(g).all():            # only MY shard: someone else may hold the inf
            flag.fill_(1.0)
    comm.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)  # 1 if any rank saw one
    return bool(flag.item())


def clip_grad_norm_(sharded, replicated, max_norm, group=None):
    total = torch.zeros((), dtype=torch.float64)
    for g in sharded:                               # each element lives on exactly one rank
        total += g.double().pow(2).sum()
    if dist.get_rank(group) == 0:                   # identical everywhere: count them once
        for g in replicated:
            total += g.double().pow(2).sum()
    comm.all_reduce(total, group=group)             # Σ over ranks = ||g||²
    norm = total.sqrt()
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in list(sharded) + list(replicated):
        g.mul_(coef)
    return norm

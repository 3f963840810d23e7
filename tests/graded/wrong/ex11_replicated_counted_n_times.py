"""A plausible wrong answer to exercise 11: the replicated gradients are added on every rank, so
the all-reduce counts them N times. Must be rejected.

Caught by: test_clip_grad_norm_equals_torch.
"""
import torch
import torch.distributed as dist

from zerolab import comm


def shard_dim0(full, rank, world_size):
    rows = full.shape[0]
    c = -(-rows // world_size)
    lo, hi = min(rank * c, rows), min((rank + 1) * c, rows)
    out = full.new_zeros((c,) + tuple(full.shape[1:]))
    out[:hi - lo] = full[lo:hi]
    return out


def unshard_dim0(shard, rows, group=None):
    n = dist.get_world_size(group)
    full = shard.new_empty((n * shard.shape[0],) + tuple(shard.shape[1:]))
    comm.all_gather(full, shard.contiguous(), group=group)
    return full[:rows]


def found_inf(grads, group=None):
    flag = torch.tensor([float(any(not torch.isfinite(g).all() for g in grads))])
    comm.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item())


def clip_grad_norm_(sharded, replicated, max_norm, group=None):
    total = torch.zeros((), dtype=torch.float64)
    for g in list(sharded) + list(replicated):      # everything this rank holds
        total += g.double().pow(2).sum()
    comm.all_reduce(total, group=group)             # the bug: replicated ones summed N times
    norm = total.sqrt()
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in list(sharded) + list(replicated):
        g.mul_(coef)
    return norm

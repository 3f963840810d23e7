"""A plausible wrong answer to exercise 11: the overflow check looks only at this rank's shard, so an
inf held by another rank does not stop this rank's step (the ranks' shards drift apart). Must be
rejected.

Caught by: test_found_inf_same_decision_on_every_rank.
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
    return any(not torch.isfinite(g).all() for g in grads)      # mine only


def clip_grad_norm_(sharded, replicated, max_norm, group=None):
    total = sum((g.double().pow(2).sum() for g in sharded), torch.zeros((), dtype=torch.float64))
    if dist.get_rank(group) == 0:
        total = total + sum((g.double().pow(2).sum() for g in replicated), torch.zeros((), dtype=torch.float64))
    comm.all_reduce(total, group=group)
    norm = total.sqrt()
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in list(sharded) + list(replicated):
        g.mul_(coef)
    return norm

"""A plausible wrong answer to exercise 11: the norm of this rank's own pieces only (no all-reduce),
as clip_grad_norm_ on one process would compute it. Must be rejected.

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
    grads = list(sharded) + list(replicated)
    norm = torch.sqrt(sum(g.double().pow(2).sum() for g in grads))     # my pieces only
    coef = min(1.0, max_norm / (float(norm) + 1e-6))
    for g in grads:
        g.mul_(coef)
    return norm

"""A plausible wrong answer to exercise 11: torch.chunk for the pieces. It pads nothing: the last
pieces are shorter (or missing when rows < N). Must be rejected.

Caught by: test_shard_dim0_pads_and_gives_each_rank_its_rows.
"""
import torch
import torch.distributed as dist

from zerolab import comm


def shard_dim0(full, rank, world_size):
    pieces = torch.chunk(full, world_size, dim=0)           # the bug: unequal, unpadded pieces
    return pieces[rank].clone() if rank < len(pieces) else full[:0].clone()


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
    total = sum((g.double().pow(2).sum() for g in sharded), torch.zeros((), dtype=torch.float64))
    if dist.get_rank(group) == 0:
        total = total + sum((g.double().pow(2).sum() for g in replicated), torch.zeros((), dtype=torch.float64))
    comm.all_reduce(total, group=group)
    norm = total.sqrt()
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in list(sharded) + list(replicated):
        g.mul_(coef)
    return norm

"""A plausible wrong answer to exercise 11 (the graded tests must reject it).

The coefficient max_norm / (norm + 1e-6) is applied without capping it at 1: a norm below max_norm
is scaled UP to max_norm.

Caught by: test_clip_grad_norm_over_a_mixed_layout.
"""
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


def _slices(t, budget_bytes):
    """``t`` read flat in slices small enough that a float64 copy of one stays well inside the
    budget (8 bytes per element, and room for the collective's own few bytes)."""
    k = max(1, budget_bytes // 32)
    return t.reshape(-1).split(k)


def _sum_of_squares(pieces, group, budget_bytes):
    """Σ g² over the elements this rank is responsible for, in float64: every piece it holds, each
    copy of a piece held by k ranks weighted 1/k (so the k copies add up to one). The squares are
    taken in float64, slice by slice: an fp16 gradient of 300 squares to inf in fp16, and a
    float64 copy of a whole piece would be 4x an fp16 piece's bytes."""
    total = torch.zeros((), dtype=torch.float64)
    for g, holders in pieces:
        part = torch.zeros((), dtype=torch.float64)
        for s in _slices(g, budget_bytes):
            part += torch.linalg.vector_norm(s, dtype=torch.float64) ** 2
        total += part / len(holders)              # inf or NaN stay inf or NaN
    return total


def found_inf(pieces, group=None, *, budget_bytes=64 * 1024):
    flag = torch.zeros((), dtype=torch.float64)
    for g, _ in pieces:                            # only what I hold: a copy elsewhere is the same
        # largest and smallest element: NaN propagates through both, +inf and -inf each show in
        # one; no temporary the size of the piece (isfinite(g) would be one byte per element)
        if g.numel() and not (torch.isfinite(g.amax()) and torch.isfinite(g.amin())):
            flag.fill_(1.0)
            break
    comm.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)   # 1 on every rank if any rank saw one
    return bool(flag.item())


def clip_grad_norm_(pieces, max_norm, group=None, *, budget_bytes=64 * 1024):
    total = _sum_of_squares(pieces, group, budget_bytes)
    # ONE scalar on the wire answers both questions: a sum of squares is finite exactly when every
    # element is (squares are never negative: no inf - inf), so an overflow anywhere makes the
    # all-reduced sum inf or NaN on every rank.
    comm.all_reduce(total, group=group)
    norm = total.sqrt()
    if not torch.isfinite(norm):
        return norm                                # the step will be skipped: change nothing
    coef = float(max_norm / (norm + 1e-6))
    for g, _ in pieces:                            # every holder scales its copy alike
        g.mul_(coef)
    return norm

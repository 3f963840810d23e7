"""Graded: exercise 03, ZeRO-1. Properties checked besides the values: the optimizer state on each
rank is exactly the 1/N shard (a plain AdamW over all parameters fails), and the step moves its
bytes with a reduce-scatter and an all-gather, not with an all-reduce or a broadcast."""
import pytest
import torch
import torch.distributed as dist

from zerolab import models
from zerolab.grade.helpers import assert_close, exercise_module, record_collectives

# The reference implementation of this exercise: a submission that uses it scores 0
# (checked before and while the tests run, by zerolab.grade.references).
REFERENCE_MODULES = ["zerolab.zero1", "zerolab.shard_optim", "zerolab.Zero1Optimizer"]

LR = 1e-2


def _state_bytes(optimizer):
    return sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values()
               if torch.is_tensor(t) and t.dim() > 0)   # Adam's 0-dim step counter is not per-parameter


def _batch(step, rank, dtype):
    x, y = models.batch("mlp", seed=100 * step + rank, batch_size=4)
    return x.to(dtype), y.to(dtype)


@pytest.mark.points(2)
def test_shard_range():
    ex = exercise_module("ex03_zero1")
    for numel in (1, 5, 8, 2114):
        for n in (1, 2, 3, 4, 5):
            per = -(-numel // n)
            got = [tuple(ex.shard_range(numel, n, r)) for r in range(n)]
            want = [(r * per, (r + 1) * per) for r in range(n)]
            assert got == want, (f"shard_range({numel}, world_size={n}): got {got}; expected {want} "
                                 f"(equal contiguous shards of the buffer padded to {per * n})")


def check_state_is_one_nth():
    ex = exercise_module("ex03_zero1")
    n, rank = dist.get_world_size(), dist.get_rank()
    model = models.build("mlp", seed=0)
    psi = sum(p.numel() for p in model.parameters() if p.requires_grad)
    opt = ex.Zero1Optimizer(model.parameters(), torch.optim.AdamW, lr=LR)
    x, y = _batch(0, rank, torch.float32)
    model(x, y).backward()
    opt.step()
    got = _state_bytes(opt.local)
    shard = -(-psi // n)
    assert got == 2 * 4 * shard, (
        f"rank {rank}: the local optimizer holds {got} bytes of state; Adam's two fp32 moments for "
        f"this rank's shard of {shard} elements are {8 * shard} bytes (all {psi} parameters: {8 * psi})")


def check_matches_single_process():
    ex = exercise_module("ex03_zero1")
    n, rank = dist.get_world_size(), dist.get_rank()
    model, ref = models.build("mlp", seed=0, dtype=torch.float64), models.build("mlp", seed=0, dtype=torch.float64)
    opt = ex.Zero1Optimizer(model.parameters(), torch.optim.AdamW, lr=LR)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=LR)
    for step in range(3):
        x, y = _batch(step, rank, torch.float64)
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
        xs, ys = zip(*[_batch(step, r, torch.float64) for r in range(n)])   # the global batch
        ref(torch.cat(xs), torch.cat(ys)).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_close(p.detach(), q.detach(), f"parameter {name} after 3 steps vs one process on the "
                     f"global batch", rtol=1e-9, atol=1e-12)


def check_communication():
    ex = exercise_module("ex03_zero1")
    rank = dist.get_rank()
    model = models.build("mlp", seed=0)
    opt = ex.Zero1Optimizer(model.parameters(), torch.optim.AdamW, lr=LR)
    x, y = _batch(0, rank, torch.float32)
    model(x, y).backward()
    with record_collectives() as calls:
        opt.step()
    ops = [c["op"] for c in calls]
    assert "all_reduce" not in ops and "broadcast" not in ops, (
        f"rank {rank}: step() called {ops}: ZeRO-1 needs no all-reduce or broadcast; reduce-scatter the "
        f"gradients (each rank gets its shard's sum) and all-gather the updated parameters")
    assert "reduce_scatter" in ops or "isend" in ops, f"rank {rank}: no reduce-scatter in step(): {ops}"
    assert "all_gather" in ops or "isend" in ops, f"rank {rank}: no all-gather in step(): {ops}"


@pytest.mark.points(2)
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_optimizer_state_is_one_nth(on_ranks, world_size):
    on_ranks(world_size, check_state_is_one_nth)


@pytest.mark.points(2)
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_matches_single_process(on_ranks, world_size):
    on_ranks(world_size, check_matches_single_process)


@pytest.mark.points(1)
@pytest.mark.parametrize("world_size", [2, 4])
def test_step_is_reduce_scatter_and_all_gather(on_ranks, world_size):
    on_ranks(world_size, check_communication)

"""Graded: exercise 00, ring collectives from send/recv. Property checked besides the values:
only point-to-point sends are used, and each rank sends the ring's (N-1)/N bytes per phase."""
import pytest
import torch
import torch.distributed as dist

from zerolab import comm
from zerolab.grade.helpers import assert_close, exercise_module, point_to_point_only

# The reference implementation of this exercise: a submission that uses it scores 0
# (checked before and while the tests run, by zerolab.grade.references).
REFERENCE_MODULES = ["zerolab.ring", "zerolab.engine.reduce_scatter"]  # impl="ring" runs zerolab.ring
REFERENCE_ALLOWED = ["zerolab.ring.exchange"]  # one ring step, offered by the exercise

SIZES = [1, 7, 64, 1001]  # 1 and 7 are smaller than / not divisible by the world size


def _inputs(numel, dtype):
    g = torch.Generator().manual_seed(1234 + 7919 * dist.get_rank() + numel)
    return torch.randn(numel, generator=g, dtype=torch.float64).to(dtype)


def check_all_reduce():
    ex = exercise_module("ex00_collectives")
    n = dist.get_world_size()
    for numel in SIZES:
        for dtype in (torch.float32, torch.float64):
            x = _inputs(numel, dtype)
            expected = x.clone()
            dist.all_reduce(expected)
            with point_to_point_only("ring_all_reduce") as sent:
                ex.ring_all_reduce(x)
            assert_close(x, expected, f"ring_all_reduce of {numel} {dtype} elements")
            s = numel * x.element_size()
            ideal, slack = 2 * (n - 1) / n * s, 2 * -(-numel // n) * x.element_size()
            assert abs(sent["sent"] - ideal) <= slack, (
                f"rank {dist.get_rank()}: ring_all_reduce of {s} bytes sent {sent['sent']} bytes; a "
                f"ring sends 2(N-1)/N x S = {ideal:.0f} (within one chunk per phase, {slack})")


def check_reduce_scatter():
    ex = exercise_module("ex00_collectives")
    n, rank = dist.get_world_size(), dist.get_rank()
    for per_rank in (1, 5, 128):
        x = _inputs(per_rank * n, torch.float32)
        before = x.clone()
        out = torch.full((per_rank,), float("nan"))
        expected = torch.empty(per_rank)
        comm.reduce_scatter(expected, x.clone())  # torch's collective is the reference
        with point_to_point_only("ring_reduce_scatter") as sent:
            ex.ring_reduce_scatter(out, x)
        assert_close(out, expected, f"ring_reduce_scatter output ({per_rank} per rank)")
        assert_close(x, before, "ring_reduce_scatter must leave its input unchanged")
        ideal = (n - 1) * per_rank * 4
        assert sent["sent"] == ideal, (f"rank {rank}: ring_reduce_scatter sent {sent['sent']} bytes; "
                                       f"the ring sends exactly (N-1)/N x input = {ideal}")


def check_all_gather():
    ex = exercise_module("ex00_collectives")
    n, rank = dist.get_world_size(), dist.get_rank()
    for per_rank in (1, 5, 128):
        x = _inputs(per_rank, torch.float32)
        out = torch.full((per_rank * n,), float("nan"))
        expected = torch.empty(per_rank * n)
        comm.all_gather(expected, x)
        with point_to_point_only("ring_all_gather") as sent:
            ex.ring_all_gather(out, x)
        assert_close(out, expected, f"ring_all_gather output ({per_rank} per rank)")
        ideal = (n - 1) * per_rank * 4
        assert sent["sent"] == ideal, (f"rank {rank}: ring_all_gather sent {sent['sent']} bytes; "
                                       f"the ring sends exactly (N-1)/N x output = {ideal}")


@pytest.mark.points(2)
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_ring_reduce_scatter(on_ranks, world_size):
    on_ranks(world_size, check_reduce_scatter)


@pytest.mark.points(2)
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_ring_all_gather(on_ranks, world_size):
    on_ranks(world_size, check_all_gather)


@pytest.mark.points(3)
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_ring_all_reduce(on_ranks, world_size):
    on_ranks(world_size, check_all_reduce)

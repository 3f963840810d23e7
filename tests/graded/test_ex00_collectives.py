"""Graded: exercise 00, the bidirectional ring all-reduce and gloo's reduce measured. Besides the
values (against torch's own all_reduce): only point-to-point messages, each one recorded with its
destination; topology (a rank talks to its two neighbours only), bytes per neighbour ((N-1)/N x S
each way), and both directions in flight together (the sends alternate direction step by step).
The measurement is compared with the grader's own, taken on the same ranks."""
import pytest
import torch
import torch.distributed as dist

from zerolab import comm
from zerolab.grade.helpers import assert_close, exercise_module, point_to_point_only

# The reference implementation of this exercise: a submission that uses it scores 0
# (checked before and while the tests run, by zerolab.grade.references).
REFERENCE_MODULES = ["zerolab.ring", "zerolab.engine.reduce_scatter"]  # impl="ring" runs zerolab.ring
REFERENCE_ALLOWED = ["zerolab.ring.exchange"]  # one send-and-receive, offered by the exercise

SIZES = [1, 7, 64, 1001]  # 1 and 7 are smaller than / not divisible by 2N


def _inputs(numel, dtype):
    g = torch.Generator().manual_seed(1234 + 7919 * dist.get_rank() + numel)
    return torch.randn(numel, generator=g, dtype=torch.float64).to(dtype)


def check_values():
    ex = exercise_module("ex00_collectives")
    for numel in SIZES:
        for dtype in (torch.float32, torch.float64):
            x = _inputs(numel, dtype)
            expected = x.clone()
            dist.all_reduce(expected)                       # torch's collective: the reference
            with point_to_point_only("bidirectional_all_reduce"):
                ex.bidirectional_all_reduce(x)
            assert_close(x, expected, f"bidirectional_all_reduce of {numel} {dtype} elements")
    y = _inputs(60, torch.float64).view(3, 4, 5)           # any shape: the sum is elementwise
    expected = y.clone()
    dist.all_reduce(expected)
    with point_to_point_only("bidirectional_all_reduce"):
        ex.bidirectional_all_reduce(y)
    assert_close(y, expected, "bidirectional_all_reduce of a (3, 4, 5) tensor")


def check_links(numel):
    ex = exercise_module("ex00_collectives")
    rank, n = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % n, (rank - 1) % n
    x = _inputs(numel, torch.float32)
    with point_to_point_only("bidirectional_all_reduce") as sent:
        ex.bidirectional_all_reduce(x)
    others = sorted({d for d, _ in sent["to"] if d not in (left, right)})
    assert not others, (f"rank {rank} of {n} sent to ranks {others}: a ring talks only to its neighbours "
                        f"{left} and {right}")
    s = numel * 4
    ideal, slack = (n - 1) / n * s, 2 * (-(-numel // (2 * n)) * 4 + 4)
    for who, name in ((right, "right"), (left, "left")):
        got = sum(b for d, b in sent["to"] if d == who)
        assert abs(got - ideal) <= slack, (
            f"rank {rank}: sent {got} bytes to its {name} neighbour (rank {who}); each direction carries half "
            f"the tensor through a reduce-scatter and an all-gather: (N-1)/N x S = {ideal:.0f} (within {slack})")
    run, worst = 0, 0
    for d, b in sent["to"]:                                 # +1 for a message right, -1 for one left
        if b:
            run += 1 if d == right else -1
            worst = max(worst, abs(run))
    assert worst <= 2, (f"rank {rank}: at one point {worst} more messages had gone one way than the other: "
                        f"the two rings ran one after the other; send one chunk each way at every step")


def measure_reduce(numel, dst):
    """The grader's measurement: one gloo reduce, the bytes this rank's process wrote meanwhile."""
    x = torch.ones(numel)
    dist.barrier()
    with comm.log() as log:
        dist.reduce(x, dst=dst)
    return log.measured_bytes / (numel * 4)


def check_reduce_bytes(numel, dst):
    ex = exercise_module("ex00_collectives")
    theirs = ex.reduce_bytes(numel, dst)
    ours = measure_reduce(numel, dst)
    if ours is None:
        return None                                         # no kernel counter (not Linux)
    return theirs, ours


@pytest.mark.points(3)
@pytest.mark.parametrize("world_size", [2, 4])
def test_bidirectional_all_reduce_values(on_ranks, world_size):
    """values: equal to torch's all_reduce, any size and shape, send/recv only"""
    on_ranks(world_size, check_values)


@pytest.mark.points(4)
def test_both_directions_neighbours_only(on_ranks):
    """topology, bytes and overlap: neighbours only, (N-1)/N x S each way, both ways at once"""
    on_ranks(4, check_links, 4096)


@pytest.mark.points(3)
def test_reduce_bytes_measured(on_ranks):
    """measured: the bytes gloo's reduce makes each rank send"""
    for dst in (0, 3):
        rows = on_ranks(4, check_reduce_bytes, 2**18, dst)
        for rank, row in enumerate(rows):
            if row is None:
                pytest.skip("no per-process write counter here (/proc/self/io): nothing to compare with")
            theirs, ours = row
            assert theirs == pytest.approx(ours, rel=0.05, abs=0.01), (
                f"reduce to rank {dst}, rank {rank}: reduce_bytes = {theirs!r}; the grader measured "
                f"{ours:.3f} x the tensor's bytes on the same ranks")

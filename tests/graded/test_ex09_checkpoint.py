"""Graded: exercise 09, loading a sharded checkpoint into another world size. assemble and
load_shard are checked against a brute-force element-by-element map of the padded flat layout
(written here) with pieces saved by M ranks and loaded by N; validation (gaps, overlaps, bad pieces
raise ValueError; pieces this rank does not need are not its business); the memory load_shard
allocates, measured by torch's profiler; and the bytes a real load reads, against the grader's own
measurement on 2 ranks."""
import random
import tempfile

import pytest
import torch

from zerolab.grade.helpers import exercise_module

# The reference implementation of this exercise: a submission that uses it scores 0
# (checked before and while the tests run, by zerolab.grade.references).
REFERENCE_MODULES = ["zerolab.checkpoint"]
REFERENCE_ALLOWED = []

LAYOUTS = [[5], [3, 4], [7, 1, 9, 2], [1, 1, 1], [10, 10, 10, 10], [13, 37, 5, 1]]


def brute_force(numels, world_size, rank):
    """Every element's (parameter, element) position, run-length grouped: the ranges rank owns."""
    flat = [(i, e) for i, n in enumerate(numels) for e in range(n)]
    shard = -(-len(flat) // world_size)
    out = []
    for pos in range(rank * shard, (rank + 1) * shard):
        if pos >= len(flat):
            break                                               # padding
        i, e = flat[pos]
        if out and out[-1][0] == i and out[-1][2] == e:
            out[-1][2] += 1                                     # extends the current run
        else:
            out.append([i, e, e + 1, pos - rank * shard])
    return [tuple(r) for r in out]


@pytest.mark.points(2)
def test_assemble_puts_pieces_together_and_refuses_gaps_and_overlaps():
    ex = exercise_module("ex09_checkpoint")
    rng = random.Random(0)
    full = torch.arange(50, dtype=torch.float64) * 0.5
    cuts = sorted(rng.sample(range(1, 50), 7))
    pieces = [(lo, hi, full[lo:hi].clone()) for lo, hi in zip([0] + cuts, cuts + [50])]
    rng.shuffle(pieces)
    got = ex.assemble(50, pieces)
    assert torch.equal(got, full), "assemble: the pieces, put back, do not give the parameter"
    with pytest.raises(ValueError):
        ex.assemble(50, pieces[1:])                             # a gap: a missing file's part
    with pytest.raises(ValueError):
        ex.assemble(50, pieces + [(3, 5, full[3:5].clone())])   # an overlap: two saves mixed
    with pytest.raises(ValueError):
        ex.assemble(50, [(0, 50, full[:49])])                   # a truncated piece
    with pytest.raises(ValueError):      # overlap [25, 30) and gap [40, 45): sizes still add up to 50
        ex.assemble(50, [(0, 30, full[:30]), (25, 40, full[25:40]), (45, 50, full[45:])])




def saved_pieces(params, old_world_size):
    """{index: [(lo, hi, values)]}: what old_world_size ranks save, each its owned ranges (brute force)."""
    numels = [p.numel() for p in params]
    pieces = {i: [] for i in range(len(params))}
    for r in range(old_world_size):
        for i, lo, hi, _ in brute_force(numels, old_world_size, r):
            pieces[i].append((lo, hi, params[i][lo:hi].clone()))
    return pieces


def expected_shard(params, world_size, rank):
    flat = torch.cat(params)
    s = -(-flat.numel() // world_size)
    padded = torch.cat([flat, flat.new_zeros(s * world_size - flat.numel())])
    return padded[rank * s:(rank + 1) * s]


@pytest.mark.points(3)
def test_load_shard_reshards_m_ranks_into_n():
    """values: every new rank's shard from pieces saved by another number of ranks"""
    ex = exercise_module("ex09_checkpoint")
    torch.manual_seed(0)
    for numels in LAYOUTS:
        params = [torch.randn(n, dtype=torch.float64) for n in numels]
        for old in (1, 3, 4):
            pieces = saved_pieces(params, old)
            for rng in (random.Random(old),):
                for ps in pieces.values():
                    rng.shuffle(ps)
            for new in (1, 2, 3, 5):
                for r in range(new):
                    got = ex.load_shard(numels, pieces, new, r)
                    want = expected_shard(params, new, r)
                    assert torch.equal(got, want), (f"load_shard({numels}, pieces of {old} ranks, world_size={new}, "
                                                    f"rank={r}): got {got.tolist()}, expected {want.tolist()}")


@pytest.mark.points(2)
def test_load_shard_refuses_what_does_not_fit_and_ignores_what_it_does_not_need():
    """validation: gaps, overlaps and bad pieces in this rank's shard raise ValueError"""
    ex = exercise_module("ex09_checkpoint")
    torch.manual_seed(1)
    numels = [13, 37, 5, 1]
    params = [torch.randn(n, dtype=torch.float64) for n in numels]
    pieces = saved_pieces(params, 4)
    # rank 0 of 2 owns elements [0, 28): parameter 0 and the first 15 elements of parameter 1
    gap = {**pieces, 1: [p for p in pieces[1] if p[0] != 0]}
    overlap = {**pieces, 0: pieces[0] + [(2, 4, params[0][2:4].clone())]}
    short = {**pieces, 1: [(lo, hi, v[:-1]) if lo == 0 else (lo, hi, v) for lo, hi, v in pieces[1]]}
    for what, bad in (("a gap", gap), ("an overlap", overlap), ("a truncated piece", short)):
        with pytest.raises(ValueError):
            ex.load_shard(numels, bad, 2, 0)
            raise AssertionError(f"load_shard accepted {what} in the shard it builds")
    # rank 1 of 2 owns [28, 56): a gap in parameter 0's pieces is not its concern
    elsewhere = {**pieces, 0: pieces[0][:1]}
    got = ex.load_shard(numels, elsewhere, 2, 1)
    assert torch.equal(got, expected_shard(params, 2, 1)), "rank 1's shard with parameter 0 incomplete (not its part)"
    # rank 0 owns parameter 1's elements [0, 15) only: the pieces past them may be missing
    mine = {**pieces, 1: [p for p in pieces[1] if p[0] < 15]}
    got = ex.load_shard(numels, mine, 2, 0)
    assert torch.equal(got, expected_shard(params, 2, 0)), ("rank 0's shard when the pieces of parameter 1 "
                                                            "past its part are missing (not its part)")


@pytest.mark.points(3)
def test_load_shard_memory():
    """memory: no whole parameter, no whole model: about two shards and a piece, measured"""
    from zerolab.memory import allocation_trace
    ex = exercise_module("ex09_checkpoint")
    torch.manual_seed(2)
    numels = [200_000, 300_000, 100_000]                    # float32: 2.4 MB in all
    params = [torch.randn(n) for n in numels]
    pieces = saved_pieces(params, 16)                       # pieces of at most 37,500 elements
    largest = max(v.numel() for ps in pieces.values() for _, _, v in ps) * 4
    new = 8
    shard_bytes = -(-sum(numels) // new) * 4                # 300 kB
    bound = 2 * shard_bytes + largest + 16384
    for r in range(new):
        with allocation_trace() as trace:
            got = ex.load_shard(numels, pieces, new, r)
        assert torch.equal(got, expected_shard(params, new, r)), f"load_shard: rank {r} of {new}: wrong values"
        del got
        assert trace["peak"] <= bound, (
            f"load_shard for rank {r} of {new} allocated up to {trace['peak']} bytes (profiler); its shard is "
            f"{shard_bytes} bytes, the largest piece {largest}: build the shard from the pieces' overlaps "
            f"(at most {bound}), never a whole parameter ({max(numels) * 4} bytes) or the model ({sum(numels) * 4})")


def checkpoint_reads(path):
    import torch.distributed as dist

    import zerolab
    from zerolab import models
    ex = exercise_module("ex09_checkpoint")
    model = models.build("gpt", seed=0, dtype=torch.float64)
    engine = zerolab.initialize(model, stage=3, lr=1e-2)
    engine.backward(engine(*models.batch("gpt", seed=dist.get_rank(), batch_size=2, model=model)))
    engine.step()
    engine.save_checkpoint(path)
    engine.load_checkpoint(path)                            # warm: imports, first-call paths

    def rchar():
        with open("/proc/self/io") as f:
            return int(next(line for line in f if line.startswith("rchar:")).split()[1])
    theirs = ex.bytes_read(lambda: engine.load_checkpoint(path))
    before = rchar()
    engine.load_checkpoint(path)
    return theirs, rchar() - before


@pytest.mark.points(2)
def test_bytes_read_measured(on_ranks):
    """measured: the bytes one rank reads to load a checkpoint"""
    import os
    if not os.path.exists("/proc/self/io"):
        pytest.skip("no per-process read counter here (/proc/self/io)")
    with tempfile.TemporaryDirectory() as tmp:
        for rank, (theirs, ours) in enumerate(on_ranks(2, checkpoint_reads, os.path.join(tmp, "ckpt"))):
            assert theirs == pytest.approx(ours, rel=0.1, abs=65536), (
                f"rank {rank}: bytes_read = {theirs!r}; the grader measured {ours} bytes read by the same load "
                f"(the kernel's counter)")

"""Graded: exercise 09, loading a sharded checkpoint into another world size. The submission runs
only inside probes (its own processes); every verdict is decided here, on the plain data they
return. assemble and load_shard are checked against a brute-force element-by-element map of the
padded flat layout (written here) with pieces saved by M ranks and loaded by N; validation (gaps,
overlaps, truncated pieces and pieces outside their parameter's range raise ValueError; pieces this
rank does not need are not its business); the memory load_shard allocates, measured by torch's
profiler; and the bytes a real load reads (a checkpoint read by Python's files in this thread, the
data loader's state by numpy's C reader in another one), and the checkpoint's part of them, each
against the grader's own measurement (of the same load; of the checkpoint loaded alone) on 2 ranks
that never import the submission."""
import random

import pytest
import torch

from zerolab.grade.helpers import exercise_module

# The reference implementation of this exercise: a submission that uses it scores 0
# (checked before and while the tests run, by zerolab.grade.references).
REFERENCE_MODULES = ["zerolab.checkpoint"]
REFERENCE_ALLOWED = ["zerolab.checkpoint.read_metadata"]   # a checkpoint's file list: hint 2 of 09.3 points at it

LAYOUTS = [[5], [3, 4], [7, 1, 9, 2], [1, 1, 1], [10, 10, 10, 10], [13, 37, 5, 1]]


# -- probes: run the submission, return what it did (never a verdict) ------------------------------
def _results(function, calls):
    """``function`` of the exercise on each argument tuple of ``calls``: per call, {"value": what it
    returned} or {"raised": the exception's class and its bases, "message": ...}."""
    ex = exercise_module("ex09_checkpoint")
    out = []
    for args in calls:
        try:
            out.append({"value": getattr(ex, function)(*args)})
        except NotImplementedError:
            raise                  # an unfinished exercise: the test fails with the stub's message
        except Exception as exc:   # the verdict (should it have raised? what?) is the test's
            out.append({"raised": [c.__name__ for c in type(exc).__mro__], "message": str(exc)})
    return out


def _load_shard_memory(numels, pieces, world_size):
    """Each rank's shard and the peak bytes torch's profiler saw load_shard allocate for it."""
    from zerolab.memory import allocation_trace
    ex = exercise_module("ex09_checkpoint")
    out = []
    for r in range(world_size):
        with allocation_trace() as trace:
            got = ex.load_shard(numels, pieces, world_size, r)
        out.append({"shard": got.clone(), "peak": int(trace["peak"])})
        del got
    return out


LOADER_BYTES = (412_345, 1_337_421)   # each rank's data-loader state (rank 0, rank 1): its own file


def _resume_setup():
    """A stage-3 engine after one step, its checkpoint saved in a fresh folder, and each rank's
    data-loader state in a file of its own; returns (resume, folder). ``resume()`` is what the
    student's bytes_read and the grader measure alike: the model's checkpoint loaded in this
    thread (zerolab.checkpoint, Python's file objects) while a worker thread of the same process
    reads this rank's data-loader state with numpy's C reader. It has run once already (warm:
    imports, first-call paths), so the call measured reads exactly what a restart reads. Run by
    the student's ranks and by the grader's alike."""
    import tempfile
    import threading

    import numpy
    import torch.distributed as dist

    import zerolab
    from zerolab import models
    rank = dist.get_rank()
    model = models.build("gpt", seed=0, dtype=torch.float64)
    engine = zerolab.initialize(model, stage=3, lr=1e-2)
    engine.backward(engine(*models.batch("gpt", seed=rank, batch_size=2, model=model)))
    engine.step()
    folder = [tempfile.mkdtemp(prefix="ex09-") if rank == 0 else None]
    dist.broadcast_object_list(folder, src=0)              # one checkpoint: rank 0 names the folder
    path = f"{folder[0]}/ckpt"
    engine.save_checkpoint(path)
    if rank == 0:   # a later save that crashed before its metadata's rename left a file behind, unlisted
        with open(f"{path}/rank1-interrupted.pt.tmp", "wb") as f:
            f.write(bytes(200_003))
    dist.barrier()
    loader = f"{folder[0]}/loader-rank{rank}.bin"
    with open(loader, "wb") as f:
        f.write(bytes(range(256)) * (LOADER_BYTES[rank] // 256) + bytes(LOADER_BYTES[rank] % 256))
    calls = []

    def resume():
        calls.append(1)
        state = {}
        worker = threading.Thread(target=lambda: state.update(loader=numpy.fromfile(loader, dtype=numpy.uint8)))
        worker.start()                                      # the data loader's state, meanwhile
        engine.load_checkpoint(path)
        worker.join()
        if state["loader"].size != LOADER_BYTES[rank]:
            raise RuntimeError(f"the data loader's state came back with {state['loader'].size} bytes")
    resume()
    dist.barrier()
    calls.clear()
    return resume, calls, folder[0], lambda: engine.load_checkpoint(path)


def _bytes_read_by_student():
    """What the student's bytes_read returns around one resume (its two numbers, or what it returned
    instead), and the number of times it called it; just before, this process reads a file that is
    not part of the load (the loader's file once more)."""
    import shutil

    import torch.distributed as dist
    ex = exercise_module("ex09_checkpoint")
    resume, calls, folder, _ = _resume_setup()
    try:
        with open(f"{folder}/loader-rank{dist.get_rank()}.bin", "rb") as f:
            f.read()                                        # outside load(): must not be counted
        got = ex.bytes_read(resume, f"{folder}/ckpt")
        plain = isinstance(got, dict) and all(isinstance(got.get(k), (int, float)) and not isinstance(got.get(k), bool)
                                              for k in ("read", "checkpoint"))
        return {"got": {k: got[k] for k in ("read", "checkpoint")} if plain else repr(got)[:300],
                "calls": len(calls)}
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(folder, ignore_errors=True)


def _bytes_read_by_grader():
    """The grader's measurements (trusted ranks, never the submission), with the kernel's
    per-process count of bytes read (every thread, every library): around one resume, and around
    one load of the checkpoint alone; and the checkpoint's files on disk, for the messages."""
    import os
    import shutil

    import torch.distributed as dist

    def rchar():
        with open("/proc/self/io") as f:
            return int(next(line for line in f if line.startswith("rchar:")).split()[1])
    resume, _, folder, checkpoint_only = _resume_setup()
    before = rchar()
    resume()
    read = rchar() - before
    before = rchar()
    checkpoint_only()
    checkpoint = rchar() - before
    ckpt = f"{folder}/ckpt"
    on_disk = sum(os.path.getsize(f"{ckpt}/{name}") for name in os.listdir(ckpt))
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(folder, ignore_errors=True)
    return {"read": read, "checkpoint": checkpoint, "on_disk": on_disk}


# -- references, computed here ----------------------------------------------------------------------
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


def _raised_value_error(result, what):
    assert "raised" in result, f"{what}: accepted (returned a result); a checkpoint must never load in part"
    assert "ValueError" in result["raised"], (
        f"{what}: raised {result['raised'][0]} ({result['message'][:200]}); expected a ValueError naming the "
        f"problem")


def _returned(result, what):
    assert "value" in result, f"{what}: raised {result['raised'][0]}: {result['message'][:300]}"
    return result["value"]


# -- the graded tests --------------------------------------------------------------------------------
@pytest.mark.points(2)
def test_assemble_puts_pieces_together_and_refuses_gaps_and_overlaps(student):
    """assemble: the pieces put back together; a gap, an overlap, a bad piece raise ValueError"""
    rng = random.Random(0)
    full = torch.arange(50, dtype=torch.float64) * 0.5
    cuts = sorted(rng.sample(range(1, 50), 7))
    pieces = [(lo, hi, full[lo:hi].clone()) for lo, hi in zip([0] + cuts, cuts + [50])]
    rng.shuffle(pieces)
    first = [p for p in pieces if p[0] == 0][0]
    rest = [p for p in pieces if p[0] != 0]
    bad = {
        "a gap (a missing file's part)": pieces[1:],
        "an overlap (two saves mixed)": pieces + [(3, 5, full[3:5].clone())],
        "a truncated piece": [(0, 50, full[:49].clone())],
        "an overlap and a gap whose sizes still add up": [(0, 30, full[:30].clone()), (25, 40, full[25:40].clone()),
                                                          (45, 50, full[45:].clone())],
        "a piece past the parameter's end": [(0, 45, full[:45].clone()),
                                             (45, 55, torch.cat([full[45:], full[:5]]).clone())],
        "a piece starting before element 0": [(-5, 5, torch.cat([full[45:], full[:5]]).clone()), (5, 50, full[5:].clone())],
        "a reversed range": [(5, 0, full[:5].clone())] + rest + [first],
    }
    calls = [(50, pieces)] + [(50, b) for b in bad.values()]
    results = student.run(_results, "assemble", calls)
    got = _returned(results[0], "assemble(50, 8 shuffled pieces)")
    assert torch.is_tensor(got) and torch.equal(got, full), (
        "assemble: the pieces, put back, do not give the parameter")
    for (what, _), result in zip(bad.items(), results[1:]):
        _raised_value_error(result, f"assemble with {what}")


@pytest.mark.points(3)
def test_load_shard_reshards_m_ranks_into_n(student):
    """values: every new rank's shard from pieces saved by another number of ranks"""
    torch.manual_seed(0)
    cases, wants = [], []
    for numels in LAYOUTS:
        params = [torch.randn(n, dtype=torch.float64) for n in numels]
        for old in (1, 3, 4):
            pieces = saved_pieces(params, old)
            rng = random.Random(old)
            for ps in pieces.values():
                rng.shuffle(ps)                                  # any order, as files are listed
            for new in (1, 2, 3, 5):
                for r in range(new):
                    cases.append((numels, pieces, new, r))
                    wants.append((old, expected_shard(params, new, r)))
    results = student.run(_results, "load_shard", cases)
    for (numels, _, new, r), (old, want), result in zip(cases, wants, results):
        what = f"load_shard({numels}, pieces of {old} ranks, world_size={new}, rank={r})"
        got = _returned(result, what)
        assert torch.is_tensor(got) and got.dtype == want.dtype and torch.equal(got, want), (
            f"{what}: got {got.tolist() if torch.is_tensor(got) else got!r}, expected {want.tolist()} "
            f"(the padded flat buffer's slice, padding zero)")


@pytest.mark.points(2)
def test_load_shard_refuses_what_does_not_fit_and_ignores_what_it_does_not_need(student):
    """validation: gaps, overlaps, bad pieces in this rank's shard raise ValueError; others' pieces are not its business"""
    torch.manual_seed(1)
    numels = [13, 37, 5, 1]
    params = [torch.randn(n, dtype=torch.float64) for n in numels]
    pieces = saved_pieces(params, 4)
    # rank 0 of 2 owns elements [0, 28): parameter 0 and elements [0, 15) of parameter 1;
    # rank 1 of 2 owns [28, 56): parameter 1's elements [15, 37), parameters 2 and 3, and padding
    p1 = params[1]
    bad = {   # what, (pieces, rank)
        "a gap in its part": ({**pieces, 1: [p for p in pieces[1] if p[0] != 0]}, 0),
        "an overlap in its part": ({**pieces, 0: pieces[0] + [(2, 4, params[0][2:4].clone())]}, 0),
        "a truncated piece": ({**pieces, 1: [(lo, hi, v[:-1]) if lo == 0 else (lo, hi, v)
                                             for lo, hi, v in pieces[1]]}, 0),
        "a piece of parameter 1 reaching past its 37 elements (its overlap with the shard fits)":
            ({**pieces, 1: [(0, 15, p1[:15].clone()), (15, 30, p1[15:30].clone()),
                            (30, 45, torch.cat([p1[30:], p1[:8]]).clone())]}, 1),
        "an overlap and a gap of the same size in its part (the element counts add up)":
            ({**pieces, 0: [(0, 8, params[0][:8].clone()), (6, 11, params[0][6:11].clone())]}, 0),
        "a piece of parameter 2 starting before its element 0":
            ({**pieces, 2: [(-3, 5, torch.cat([params[2][2:], params[2]]).clone())]}, 1),
    }
    fine = {   # what, (pieces, rank): a part this rank does not own may be missing or broken
        "rank 1, with parameter 0's pieces incomplete": ({**pieces, 0: pieces[0][:1]}, 1),
        "rank 0, with parameter 1's pieces past element 15 missing":
            ({**pieces, 1: [p for p in pieces[1] if p[0] < 15]}, 0),
        "rank 0, with parameter 3's piece broken": ({**pieces, 3: [(0, 2, params[3].repeat(2))]}, 0),
    }
    calls = [(numels, ps, 2, r) for ps, r in list(bad.values()) + list(fine.values())]
    results = student.run(_results, "load_shard", calls)
    for what, result in zip(bad, results):
        _raised_value_error(result, f"load_shard(rank {dict(bad)[what][1]} of 2) with {what}")
    for (what, (_, r)), result in zip(fine.items(), results[len(bad):]):
        got = _returned(result, f"load_shard: {what} (not its part)")
        want = expected_shard(params, 2, r)
        assert torch.is_tensor(got) and torch.equal(got, want), f"load_shard: {what} (not its part): wrong values"


@pytest.mark.points(3)
def test_load_shard_memory(student):
    """memory: no whole parameter, no whole model: about two shards and a piece, measured"""
    torch.manual_seed(2)
    numels = [200_000, 300_000, 100_000]                    # float32: 2.4 MB in all
    params = [torch.randn(n) for n in numels]
    pieces = saved_pieces(params, 16)                       # pieces of at most 37,500 elements
    largest = max(v.numel() for ps in pieces.values() for _, _, v in ps) * 4
    new = 8
    shard_bytes = -(-sum(numels) // new) * 4                # 300 kB
    bound = 2 * shard_bytes + largest + 16384
    for r, got in enumerate(student.run(_load_shard_memory, numels, pieces, new)):
        assert torch.equal(got["shard"], expected_shard(params, new, r)), f"load_shard: rank {r} of {new}: wrong values"
        assert got["peak"] <= bound, (
            f"load_shard for rank {r} of {new} allocated up to {got['peak']} bytes (profiler); its shard is "
            f"{shard_bytes} bytes, the largest piece {largest}: build the shard from the pieces' overlaps "
            f"(at most {bound}), never a whole parameter ({max(numels) * 4} bytes) or the model ({sum(numels) * 4})")


@pytest.fixture(scope="module")
def grader_reads(clusters):
    """The grader's own measurement of the load bytes_read is given, on 2 trusted ranks."""
    import os
    if not os.path.exists("/proc/self/io"):
        pytest.skip("no per-process read counter here to compare with (Linux's /proc/self/io)")
    return clusters(2).run(_bytes_read_by_grader)


def _their_numbers(student):
    theirs = student.on_ranks(2, _bytes_read_by_student)
    for rank, t in enumerate(theirs):
        assert t["calls"] == 1, f"rank {rank}: bytes_read called load() {t['calls']} times; once is the contract"
        assert isinstance(t["got"], dict), (
            f"rank {rank}: bytes_read returned {t['got']}, not {{'read': bytes, 'checkpoint': bytes}}")
    return [t["got"] for t in theirs]


# 2 kB: the same load reads the same bytes on the grader's ranks, to the byte here; the slack is for
# the few hundred bytes a measurement itself may read (/proc/self/io's own text), less than the
# checkpoint's metadata file (about 3 kB), so counting it twice or leaving it out is seen
TOLERANCE = dict(rel=0, abs=2048)


@pytest.mark.points(2)
def test_bytes_read_measured(student, grader_reads):
    """measured: every byte this process reads during one load, whatever reads it, and nothing else"""
    for rank, (t, o) in enumerate(zip(_their_numbers(student), grader_reads)):
        assert t["read"] == pytest.approx(o["read"], **TOLERANCE), (
            f"rank {rank}: bytes_read's 'read' = {t['read']}; the grader measured {o['read']} bytes read by this "
            f"process during the same load, on ranks of its own (the checkpoint's files on disk: {o['on_disk']} "
            f"bytes). Measure what this process read, every thread and every library, during load() and nothing "
            f"else; never a size you compute")


@pytest.mark.points(1)
def test_bytes_read_explained_checkpoint_part(student, grader_reads):
    """explained: how many of those bytes were the checkpoint's, as the grader measures a load of it alone"""
    for rank, (t, o) in enumerate(zip(_their_numbers(student), grader_reads)):
        assert t["checkpoint"] == pytest.approx(o["checkpoint"], **TOLERANCE), (
            f"rank {rank}: bytes_read's 'checkpoint' = {t['checkpoint']}; the grader measured {o['checkpoint']} "
            f"bytes read by this process while it loaded the checkpoint alone, on ranks of its own (its files on "
            f"disk: {o['on_disk']} bytes, saved by 2 ranks). Which of its files does a rank read, and how much "
            f"of each?")

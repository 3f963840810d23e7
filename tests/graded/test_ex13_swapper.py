"""Graded: exercise 13, the double-buffered swapper. The probes run the submission in its own process
on a real file (O_DIRECT where the file system allows it) seen through an EMULATED disk: every read
and every write of a record takes a fixed time, on a read channel and a write channel that work at
the same time (DeepSpeed's two aio handles), so that timings do not depend on this machine's disk
and a buffer reused before its write landed shows up as wrong values. What comes back is plain data:
the parameters, the committed records read back by the probe itself (from the layout the exercise
fixes), the transfers, a census of live tensors, step times. Every verdict is decided here: values
against torch's AdamW on the whole tensor in float64 (computed here), overlap as the median of
paired, alternating-order ratios against the grader's own serial swapper, the memory bound, and the
state a failed step leaves behind."""
import statistics

import pytest
import torch

# The reference implementation of this exercise: a submission that uses it scores 0
# (checked before and while the tests run, by zerolab.grade.references).
REFERENCE_MODULES = ["zerolab.infinity", "zerolab.swap"]

LR, WD = 1e-2, 0.01
FIELDS = ("param", "exp_avg", "exp_avg_sq")


# -- data, the same here and in the probes ---------------------------------------------------------
def _start(numel, dtype):
    return torch.randn(numel, generator=torch.Generator().manual_seed(13), dtype=dtype)


def _grads(numel, steps, dtype):
    g = torch.Generator().manual_seed(1013)
    return [torch.randn(numel, generator=g, dtype=dtype) for _ in range(steps)]


def _reference(numel, steps, dtype):
    """HERE: torch's AdamW (for-loop kernel) on the whole tensor; after each step (params, exp_avg,
    exp_avg_sq)."""
    p = _start(numel, dtype)
    opt = torch.optim.AdamW([p], lr=LR, weight_decay=WD, fused=False)
    out = []
    for g in _grads(numel, steps, dtype):
        p.grad = g.clone()
        opt.step()
        out.append((p.detach().clone(), opt.state[p]["exp_avg"].clone(), opt.state[p]["exp_avg_sq"].clone()))
    return out


# -- what runs in the submission's process ---------------------------------------------------------
class _EmulatedDisk:
    """The exercise's DiskFile seen through an emulated disk: a read (write) of a record waits
    ``read_s`` (``write_s``) on the read (write) channel, then really happens. Logs every transfer;
    ``fail=("write", k)`` makes the k-th write (1-based) raise OSError after its wait."""

    def __init__(self, file, *, read_s=0.0, write_s=0.0, fail=None):
        import threading
        import time
        self.file, self.read_s, self.write_s, self.fail = file, read_s, write_s, fail
        self._r, self._w, self._clock = threading.Lock(), threading.Lock(), time.perf_counter
        self.log, self.count = [], {"read": 0, "write": 0}

    def _do(self, kind, lock, wait, call, buf, offset):
        import time
        with lock:
            time.sleep(wait)
            self.count[kind] += 1
            if self.fail == (kind, self.count[kind]):
                raise OSError(5, f"Input/output error (injected: {kind} {self.count[kind]})")
            result = call(buf, offset)
            self.log.append((kind, buf.data_ptr(), buf.numel(), offset, self._clock()))
            return result

    def read(self, buf, offset):
        return self._do("read", self._r, self.read_s, self.file.read, buf, offset)

    def write(self, buf, offset):
        return self._do("write", self._w, self.write_s, self.file.write, buf, offset)

    def sync(self):
        self.file.sync()
        self.log.append(("sync", 0, 0, 0, self._clock()))

    def __getattr__(self, name):
        return getattr(self.file, name)


def _build(numel, dtype_name, *, chunk, buffers, read_s=0.0, write_s=0.0, compute_s=0.0, fail=None):
    import tempfile
    import time

    from zerolab.grade.helpers import exercise_module
    ex = exercise_module("ex13_swapper")
    dtype = getattr(torch, dtype_name)
    params = _start(numel, dtype)
    opt = ex.SwappedAdam(params, tempfile.mkdtemp(), lr=LR, chunk=chunk, buffers=buffers, weight_decay=WD)
    opt.file = _EmulatedDisk(opt.file, read_s=read_s, write_s=write_s, fail=fail)
    commits, real_commit, real_update = [], opt.commit, opt.update

    def commit(meta):
        real_commit(meta)
        commits.append(time.perf_counter())

    def update(i, record, grad_chunk):
        if compute_s:
            time.sleep(compute_s)                      # emulated compute: the update's share of a step
        return real_update(i, record, grad_chunk)
    opt.commit, opt.update, opt._graded_commits = commit, update, commits
    return opt, params


def _committed(opt, numel, dtype_name, chunk):
    """The committed state read back by the probe itself, from the layout the exercise fixes:
    chunk i's record at (2 i + slot) x record_bytes, fields padded to 4 KiB."""
    import json

    from zerolab.aio import DiskFile, aligned_empty, round_up
    dtype = getattr(torch, dtype_name)
    esize = torch.empty((), dtype=dtype).element_size()
    field = round_up(chunk * esize)
    record = 3 * field
    meta = json.loads((opt.folder / "meta.json").read_text())
    f = DiskFile(opt.folder / "states.bin", direct=False)
    buf = aligned_empty(record)
    out = {k: torch.empty(numel, dtype=dtype) for k in FIELDS}
    try:
        for i, lo in enumerate(range(0, numel, chunk)):
            hi = min(lo + chunk, numel)
            f.read(buf, (2 * i + meta["slots"][i]) * record)
            for k, name in enumerate(FIELDS):
                out[name][lo:hi] = buf[k * field:k * field + (hi - lo) * esize].view(dtype)
    finally:
        f.close()
    return {"steps": meta["steps"], "slots": meta["slots"], **out}


def _probe_values(numel, dtype_name, chunk, buffers, steps):
    """Steps on an emulated disk whose writes are slower than its reads; after each step the params
    and the committed state read back."""
    opt, params = _build(numel, dtype_name, chunk=chunk, buffers=buffers, read_s=0.001, write_s=0.004)
    out = []
    for g in _grads(numel, steps, getattr(torch, dtype_name)):
        opt.step(g)
        out.append({"params": params.clone(), "committed": _committed(opt, numel, dtype_name, chunk)})
    opt.close()
    return out


def _serial_step(opt, grad):
    """The grader's own swapper, one thing at a time: read record i, update it, write it; commit."""
    meta = opt.committed()
    buf = opt.pool.acquire()
    try:
        for i, (lo, hi) in enumerate(opt.chunks):
            opt.file.read(buf, opt.offset(i, meta["slots"][i]))
            rec = opt.record(buf, i)
            opt.update(i, rec, grad[lo:hi])
            opt.params[lo:hi].copy_(rec["param"])
            opt.file.write(buf, opt.offset(i, 1 - meta["slots"][i]))
        opt.file.sync()
        opt.commit({"slots": [1 - s for s in meta["slots"]], "steps": meta["steps"] + 1})
    finally:
        opt.pool.release(buf)


def _probe_overlap(pairs, io_s, compute_s):
    """Paired, alternating-order step times: the submission's step and the serial one, each on its
    own SwappedAdam, on the same emulated disk and emulated compute."""
    import time
    numel, chunk = 6 * 1024, 1024
    theirs, _ = _build(numel, "float64", chunk=chunk, buffers=3, read_s=io_s, write_s=io_s, compute_s=compute_s)
    serial, _ = _build(numel, "float64", chunk=chunk, buffers=3, read_s=io_s, write_s=io_s, compute_s=compute_s)
    grads = _grads(numel, 2 * pairs + 1, torch.float64)
    theirs.step(grads[0])                              # warm-up: threads, imports, page faults
    _serial_step(serial, grads[0])
    times = {"student": [], "serial": []}
    for p in range(pairs):
        order = (("student", theirs.step), ("serial", lambda g: _serial_step(serial, g)))
        for name, step in (order if p % 2 == 0 else order[::-1]):
            t0 = time.perf_counter()
            step(grads[1 + p])
            times[name].append(time.perf_counter() - t0)
    theirs.close()
    serial.close()
    return times


def _probe_memory(steps):
    """A census of live tensors at every update (new storages since the step began), every transfer's
    buffer, and the pool's buffers and high-water mark."""
    import gc

    from zerolab.grade.helpers import live_storages
    numel, chunk = 6 * 4096, 4096
    opt, _ = _build(numel, "float64", chunk=chunk, buffers=3, read_s=0.002, write_s=0.002)
    real_update, state = opt.update, {}

    def censused(i, record, grad_chunk):
        result = real_update(i, record, grad_chunk)
        gc.collect()
        now = live_storages()
        state["peak"] = max(state["peak"], sum(b for key, b in now.items() if key not in state["before"]))
        return result
    opt.update = censused
    per_step = []
    for g in _grads(numel, steps, torch.float64):
        gc.collect()
        state.update(before=live_storages(), peak=0)
        opt.file.log.clear()
        opt.step(g)
        per_step.append({"peak_new_bytes": state["peak"],
                         "transfers": [list(t[:4]) for t in opt.file.log if t[0] in ("read", "write")]})
    out = {"steps": per_step, "pool": [[b.data_ptr(), opt.pool.nbytes] for b in opt.pool.buffers],
           "high_water": opt.pool.high_water, "record_bytes": opt.record_bytes, "chunks": len(opt.chunks)}
    opt.close()
    return out


def _probe_failure(fail, write_s):
    """Step 1 completes (its event order logged); step 2 meets a failing read or write."""
    numel, chunk = 10 * 1024, 1024
    opt, _ = _build(numel, "float64", chunk=chunk, buffers=3, read_s=0.001, write_s=write_s)
    grads = _grads(numel, 2, torch.float64)
    opt.step(grads[0])
    events = [(t[0], t[4]) for t in opt.file.log if t[0] in ("write", "sync")] + \
        [("commit", t) for t in opt._graded_commits]
    opt.file.fail, opt.file.count = fail, {"read": 0, "write": 0}
    try:
        opt.step(grads[1])
        raised = None
    except OSError as exc:
        raised = str(exc)
    state = _committed(opt, numel, "float64", chunk)
    opt.close()
    return {"events": events, "raised": raised, "committed": state}


def _probe_retry(fail):
    """Step 1 completes; step 2 meets a failing read or write; then step 2 is called again with the same
    gradient (the retry) and step 3 runs. The params right after the failure, and at the end the
    params and the committed state read back."""
    numel, chunk = 10 * 1024, 1024
    opt, params = _build(numel, "float64", chunk=chunk, buffers=3, read_s=0.001, write_s=0.001)
    grads = _grads(numel, 3, torch.float64)
    opt.step(grads[0])
    opt.file.fail, opt.file.count = fail, {"read": 0, "write": 0}
    try:
        opt.step(grads[1])
        raised = None
    except OSError as exc:
        raised = str(exc)
    after_failure = params.clone()
    opt.file.fail = None
    opt.step(grads[1])                                 # the retry
    opt.step(grads[2])
    out = {"raised": raised, "after_failure": after_failure, "params": params.clone(),
           "committed": _committed(opt, numel, "float64", chunk)}
    opt.close()
    return out


# -- the verdicts ------------------------------------------------------------------------------------
def _same(got, want, what):
    assert got.dtype == want.dtype and got.shape == want.shape, f"{what}: {got.dtype} {tuple(got.shape)}"
    if not torch.equal(got, want):
        diff = (got - want).abs()
        i = int(diff.argmax())
        raise AssertionError(f"{what}: not bit-identical to torch's AdamW on the whole tensor: {int((diff > 0).sum())} "
                             f"of {diff.numel()} elements differ, the largest at element {i} "
                             f"(got {float(got[i]):.17g}, expected {float(want[i]):.17g})")


@pytest.mark.points(3)
def test_bit_exact_against_adamw(student):
    """values: params and the committed master and moments, bit for bit, float64 and float32, with an
    uneven last chunk, one chunk, and two buffers"""
    for numel, dtype, chunk, buffers in ((10_000, "float64", 1024, 3), (4096, "float64", 1024, 2),
                                         (500, "float64", 1024, 3), (3000, "float32", 1024, 3)):
        steps = 3
        got = student.run(_probe_values, numel, dtype, chunk, buffers, steps)
        want = _reference(numel, steps, getattr(torch, dtype))
        for t, (g, (p, m, v)) in enumerate(zip(got, want)):
            case = f"{numel} {dtype} elements, chunk {chunk}, {buffers} buffers, after step {t + 1}"
            _same(g["params"], p, f"self.params ({case})")
            c = g["committed"]
            assert c["steps"] == t + 1, f"{case}: the committed metadata says steps={c['steps']}"
            _same(c["param"], p, f"the committed master ({case})")
            _same(c["exp_avg"], m, f"the committed exp_avg ({case})")
            _same(c["exp_avg_sq"], v, f"the committed exp_avg_sq ({case})")


@pytest.mark.points(2)
def test_a_failed_step_leaves_the_old_state(student):
    """crash safety: a write or read failing mid-step leaves the committed state of the step before;
    a step's records are synced before the metadata names them"""
    numel = 10 * 1024
    (p1, m1, v1), = _reference(numel, 1, torch.float64)
    for fail, write_s in ((("write", 5), 0.001), (("write", 10), 0.02), (("read", 4), 0.001)):
        got = student.run(_probe_failure, fail, write_s)
        what = f"after the {fail[0]} number {fail[1]} of step 2 failed"
        assert got["raised"] is not None and "injected" in got["raised"], f"{what}: step() did not raise it"
        c = got["committed"]
        assert c["steps"] == 1, f"{what}: the committed metadata says steps={c['steps']}, not 1"
        _same(c["param"], p1, f"the committed master {what}")
        _same(c["exp_avg"], m1, f"the committed exp_avg {what}")
        _same(c["exp_avg_sq"], v1, f"the committed exp_avg_sq {what}")
        events = got["events"]
        commits = [t for kind, t in events if kind == "commit"]
        writes = [t for kind, t in events if kind == "write"]
        syncs = [t for kind, t in events if kind == "sync"]
        assert len(commits) == 1, f"step 1 committed {len(commits)} times: once per step, at its end"
        assert any(max(writes) <= s <= commits[0] for s in syncs), (
            "step 1 committed its metadata without a self.file.sync() after its last write landed: a crash "
            "(or power loss) then could leave the metadata naming records that never reached the disk")


@pytest.mark.points(3)
def test_read_ahead_and_write_behind_overlap(student):
    """overlap: on an emulated disk, the step against the grader's serial swapper, the median of five
    paired, alternating-order ratios"""
    io_s = compute_s = 0.05          # long beside a busy machine's thread wake-ups (a few ms each)
    times = student.run(_probe_overlap, 5, io_s, compute_s)
    floor = 6 * (2 * io_s + compute_s)
    assert min(times["serial"]) >= 0.95 * floor, f"the emulated disk did not slow the serial step: {times['serial']}"
    ratios = sorted(s / b for s, b in zip(times["student"], times["serial"]))
    median = statistics.median(ratios)
    # Read ahead + update + write behind all at once: ~(6 + 2) x 50 ms against 6 x 150 ms, a ratio of
    # ~0.44; reading ahead with a write that blocks the update, or waiting for each read at once: ~0.72.
    assert median <= 0.6, (f"the step takes {median:.2f} x the serial one (ratios {[round(r, 2) for r in ratios]}; "
                           f"fully overlapped ~0.4, one thing at a time 1.0): while chunk i is updated, the "
                           f"read of chunk i + 1 and the write of chunk i - 1 must both be in flight")


@pytest.mark.points(2)
def test_memory_stays_within_the_pool(student):
    """memory: a census at every update, every transfer through a pool buffer, each record read and
    written once"""
    got = student.run(_probe_memory, 1)
    record, n = got["record_bytes"], got["chunks"]
    pool = [(ptr, size) for ptr, size in got["pool"]]
    assert got["high_water"] <= len(pool), f"the pool's high-water mark {got['high_water']} > {len(pool)} buffers"
    for s, step in enumerate(got["steps"], 1):
        assert step["peak_new_bytes"] <= record + 65536, (
            f"step {s}: {step['peak_new_bytes']:,} bytes of new tensors alive during an update, more than one "
            f"record ({record:,}): keep the records in the pool's {len(pool)} buffers, never the whole state")
        outside = [t for t in step["transfers"] if not any(p <= t[1] < p + size for p, size in pool)]
        assert not outside, (f"step {s}: {len(outside)} of {len(step['transfers'])} transfers used a buffer that is "
                             f"not one of self.pool's: acquire each record's buffer from the pool and reuse it")
        reads = [t for t in step["transfers"] if t[0] == "read"]
        writes = [t for t in step["transfers"] if t[0] == "write"]
        assert len(reads) == len(writes) == n and len({t[3] for t in reads}) == len({t[3] for t in writes}) == n, (
            f"step {s}: {len(reads)} record reads and {len(writes)} writes for {n} chunks: read each record "
            f"once and write it once")
        assert all(t[2] == record for t in step["transfers"]), f"step {s}: transfers of other sizes than one record"


@pytest.mark.points(2)
def test_a_failed_step_can_be_retried(student):
    """rollback of memory: after a failed step, params equal the committed state, and calling step()
    again with the same gradient gives what AdamW gives (params, step counters: the bias correction)"""
    numel = 10 * 1024
    ref = _reference(numel, 3, torch.float64)
    for fail in (("write", 5), ("write", 10), ("read", 4)):
        got = student.run(_probe_retry, fail)
        what = f"the {fail[0]} number {fail[1]} of step 2 failed"
        assert got["raised"] is not None and "injected" in got["raised"], f"after {what}: step() did not raise it"
        _same(got["after_failure"], ref[0][0], f"self.params right after {what} (must be step 1's, the committed state)")
        p, m, v = ref[2]
        _same(got["params"], p, f"self.params after {what}, step 2 retried and step 3 run (a step counter or a "
                                f"parameter left advanced by the failed step changes the retry)")
        c = got["committed"]
        assert c["steps"] == 3, f"after {what}, the retry and step 3: the committed metadata says steps={c['steps']}, not 3"
        _same(c["param"], p, f"the committed master after {what}, the retry and step 3")
        _same(c["exp_avg"], m, f"the committed exp_avg after {what}, the retry and step 3")
        _same(c["exp_avg_sq"], v, f"the committed exp_avg_sq after {what}, the retry and step 3")

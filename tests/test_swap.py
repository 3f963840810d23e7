"""The disk tier's pieces, in one process: aligned buffers and their pool, O_DIRECT files and their
errors (zerolab.aio), the chunked optimizer against torch's own on the whole tensor (zerolab.chunked),
and the crash-safe state file (zerolab.swap): a process killed in the middle of a step's writes, or
of the manifest's replacement, leaves a file that opens at the old state or the new one, whole and
checked; a truncated file, another run's file and an altered record are refused by name."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from zerolab import aio
from zerolab.chunked import ChunkedOptimizer, state_fields
from zerolab.swap import MANIFEST, STATES, SwapError, SwapStore, check_folder


# -- zerolab.aio -------------------------------------------------------------------------------
def test_aligned_buffers_and_the_pool():
    for n in (1, 4096, 12345):
        b = aio.aligned_empty(n)
        assert b.numel() == n and b.data_ptr() % aio.ALIGN == 0
    pool = aio.BufferPool(2, 5000)
    assert pool.nbytes == 8192 and pool.total_bytes == 2 * 8192
    a, b = pool.acquire(), pool.acquire()
    assert pool.in_use() == 2 and pool.high_water == 2 and pool.owns(a[100:]) and not pool.owns(torch.empty(3))
    with pytest.raises(RuntimeError, match="all 2 buffers are still in use after 0.1 s"):
        pool.acquire(timeout=0.1)
    threading.Timer(0.1, pool.release, args=(a,)).start()
    assert pool.acquire(timeout=5).data_ptr() == a.data_ptr()       # waits, then gets the one released
    pool.release(b)
    with pytest.raises(ValueError, match="released twice"):
        pool.release(b)
    with pytest.raises(ValueError, match="count=0"):
        aio.BufferPool(0, 10)


def test_disk_file_direct_and_buffered_round_trip(tmp_path):
    ok, why = aio.direct_io_supported(tmp_path)
    assert isinstance(ok, bool) and (ok or why)
    for direct in ([True] if ok else []) + [False]:
        f = aio.DiskFile(tmp_path / f"f{direct}", direct=direct, create=True, size=3 * aio.ALIGN)
        src = aio.aligned_empty(2 * aio.ALIGN)
        src.copy_(torch.arange(src.numel()) % 251)
        f.write(src, aio.ALIGN)
        f.sync()
        back = aio.aligned_empty(2 * aio.ALIGN)
        f.read(back, aio.ALIGN)
        assert torch.equal(back, src) and f.bytes_read == f.bytes_written == 2 * aio.ALIGN
        with pytest.raises(OSError, match="truncated"):
            f.read(back, 2 * aio.ALIGN)                             # only one block left in the file
        if direct:
            with pytest.raises(ValueError, match="O_DIRECT: buffer address .* must be multiples of 4096"):
                f.write(src[1:aio.ALIGN + 1], 0)
        f.close()


def test_auto_says_why_it_falls_back(tmp_path, monkeypatch):
    monkeypatch.setattr(aio, "direct_io_supported", lambda folder: (False, "open(O_DIRECT) refused (test)"))
    f = aio.DiskFile(tmp_path / "x", direct="auto", create=True)
    assert f.direct is False and f.fallback == "buffered I/O: open(O_DIRECT) refused (test)"
    f.close()


def test_atomic_write_leaves_old_or_new(tmp_path):
    path = tmp_path / "m.json"
    aio.atomic_write(path, b"old")
    aio.atomic_write(path, b"new")
    assert path.read_bytes() == b"new" and sorted(p.name for p in tmp_path.iterdir()) == ["m.json"]


@pytest.mark.parametrize("code, raised", [(5, True), (22, False)])   # EIO is raised; EINVAL (no folder fsync) is not
def test_atomic_write_reports_a_failed_folder_fsync(tmp_path, monkeypatch, code, raised):
    path = tmp_path / "manifest.json"
    real = os.fsync

    def fsync(fd):
        if os.path.isdir(f"/proc/self/fd/{fd}"):
            raise OSError(code, os.strerror(code))
        return real(fd)
    monkeypatch.setattr(aio.os, "fsync", fsync)
    if raised:
        with pytest.raises(OSError):
            aio.atomic_write(path, b"new")
    else:
        aio.atomic_write(path, b"new")
    assert path.read_bytes() == b"new"          # the rename happened either way; only its durability is in doubt


# -- zerolab.chunked ---------------------------------------------------------------------------
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_chunked_adamw_is_bit_identical_to_one_step_on_the_whole_tensor(fused, dtype):
    g = torch.Generator().manual_seed(0)
    n, c = 10_007, 4096
    p0 = torch.randn(n, generator=g, dtype=dtype)
    grads = [torch.randn(n, generator=g, dtype=dtype) for _ in range(3)]
    whole = p0.clone()
    ref = torch.optim.AdamW([whole], lr=1e-2, weight_decay=0.1, fused=fused)
    bounds = [(lo, min(lo + c, n)) for lo in range(0, n, c)]
    chunked = ChunkedOptimizer(torch.optim.AdamW, len(bounds), dtype, fused=fused, lr=1e-2, weight_decay=0.1)
    p = p0.clone()
    m, v = torch.full_like(p, float("nan")), torch.full_like(p, float("nan"))   # zeroed at the first step
    for grad in grads:
        whole.grad = grad.clone()
        ref.step()
        for k, (lo, hi) in enumerate(bounds):
            chunked.step_chunk(k, p[lo:hi], {"exp_avg": m[lo:hi], "exp_avg_sq": v[lo:hi]}, grad[lo:hi].clone())
    assert torch.equal(p, whole)
    assert torch.equal(m, ref.state[whole]["exp_avg"]) and torch.equal(v, ref.state[whole]["exp_avg_sq"])
    assert all(chunked.steps_taken(k) == 3 for k in range(len(bounds)))
    assert all(not {"exp_avg", "exp_avg_sq"} & set(s) for s in chunked.optimizer.state.values())   # nothing kept


def test_chunked_refuses_what_it_cannot_stream():
    with pytest.raises(ValueError, match="SGD is not supported: use torch.optim.Adam or AdamW"):
        state_fields(torch.optim.SGD, {})
    with pytest.raises(ValueError, match="amsgrad=True keeps a third per-element state"):
        state_fields(torch.optim.AdamW, {"amsgrad": True})


# -- zerolab.swap ------------------------------------------------------------------------------
FIELDS = ("param", "exp_avg", "exp_avg_sq")


def _store(folder, chunks=((0, 1000), (1000, 2000), (2000, 2500))):
    return SwapStore.create(folder, chunks=list(chunks), chunk_numel=1000, dtype=torch.float32, fields=FIELDS)


def _fill(store, value):
    """Write every record as ``value + record index`` and commit."""
    buf = aio.aligned_empty(store.record_bytes)
    for i in range(len(store.chunks)):
        for t in store.views(buf, i).values():
            t.fill_(value + i)
        store.write(i, buf)
    store.commit()


def _values(store):
    buf = aio.aligned_empty(store.record_bytes)
    out = []
    for i in range(len(store.chunks)):
        store.read(i, buf)
        out.append(sorted({float(x) for t in store.views(buf, i).values() for x in t.unique()}))
    return out


def test_store_layout_generations_and_reopen(tmp_path):
    assert SwapStore.layout([2500, 0, 10], 1000) == [(0, 0, 1000), (0, 1000, 2000), (0, 2000, 2500), (2, 0, 10)]
    s = _store(tmp_path)
    assert s.generation == 0 and s.record_bytes == 3 * 4096 and s.state_bytes == 3 * 3 * 4096
    assert (tmp_path / STATES).stat().st_size == 2 * s.state_bytes          # two slots, allocated in full
    _fill(s, 1.0)
    _fill(s, 10.0)
    assert s.generation == 2 and _values(s) == [[10.0], [11.0], [12.0]]
    run = s.meta["run"]
    s.close()
    again = SwapStore.open(tmp_path, run=run)
    assert again.generation == 2 and _values(again) == [[10.0], [11.0], [12.0]]
    buf = aio.aligned_empty(again.record_bytes)
    again.write(0, buf)
    with pytest.raises(ValueError, match=r"records \[1, 2\] were not written for generation 3"):
        again.commit()
    again.abandon()
    again.close(remove=True)
    assert list(tmp_path.iterdir()) == []


def test_store_refuses_bad_folders_and_files(tmp_path):
    assert "does not exist: create the folder first" in check_folder(tmp_path / "nope")
    (tmp_path / "afile").write_text("x")
    assert "exists and is not a folder" in check_folder(tmp_path / "afile")
    if os.path.isdir("/sys/fs") and check_folder("/sys/fs") is not None:     # sysfs: no new files, even as root
        assert "is not writable" in check_folder("/sys/fs")
    assert "not enough space" in check_folder(tmp_path, need=1 << 62)
    (tmp_path / "a").mkdir()
    s = _store(tmp_path / "a")
    _fill(s, 1.0)
    run = s.meta["run"]
    s.close()
    with pytest.raises(SwapError, match="holds the swap state of run .* not of this run"):
        SwapStore.open(tmp_path / "a", run="another")
    with pytest.raises(SwapError, match="already holds a swap state file"):
        _store(tmp_path / "a")
    data = bytearray((tmp_path / "a" / STATES).read_bytes())
    data[s.offset(0, 1) + 5] ^= 0xFF                              # one byte of record 0, generation 1's slot
    (tmp_path / "a" / STATES).write_bytes(bytes(data))
    with pytest.raises(SwapError, match="record 0 of generation 1 does not match its checksum"):
        SwapStore.open(tmp_path / "a", run=run)
    os.truncate(tmp_path / "a" / STATES, 1000)
    with pytest.raises(SwapError, match="is truncated: 1,000 bytes, the manifest says"):
        SwapStore.open(tmp_path / "a", run=run)
    with pytest.raises(SwapError, match="holds no swap state"):
        SwapStore.open(tmp_path)


def test_full_disk_is_reported_at_creation(tmp_path):
    """A file-size limit stands in for a full disk: the file is allocated in full at creation, so
    the error comes there, naming the size and the fix, and leaves no file behind."""
    code = textwrap.dedent(f"""
        import resource, signal, sys, torch
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (20000, 20000))
        from zerolab.swap import SwapStore, SwapError
        try:
            SwapStore.create({str(tmp_path)!r}, chunks=[(0, 1000)] * 4, chunk_numel=1000, dtype=torch.float32,
                             fields=("param", "exp_avg", "exp_avg_sq"))
        except SwapError as exc:
            print("ERR", exc)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "ERR could not allocate the 98,304-byte swap file" in out.stdout, out.stdout + out.stderr
    assert "free space, or choose another offload_path" in out.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == []


_KILLED = textwrap.dedent("""
    import os, sys, time, torch
    from zerolab import aio
    from zerolab.swap import SwapStore
    folder, where = sys.argv[1], sys.argv[2]
    s = SwapStore.open(folder)
    buf = aio.aligned_empty(s.record_bytes)
    real_replace = os.replace
    def slow_replace(a, b):                      # the manifest's rename: the commit point
        if where == "before-rename":
            print("ready", flush=True); time.sleep(60)
        return real_replace(a, b)
    os.replace = slow_replace
    for i in range(len(s.chunks)):
        for t in s.views(buf, i).values():
            t.fill_(100.0 + i)
        s.write(i, buf)
        if where == "mid-writes" and i == 1:
            print("ready", flush=True); time.sleep(60)
    s.commit()
    print("ready", flush=True); time.sleep(60)
""")


@pytest.mark.parametrize("where, expected", [("mid-writes", "old"), ("before-rename", "old"),
                                             ("after-commit", "new")])
def test_a_process_killed_during_a_step_leaves_the_old_or_the_new_state(tmp_path, where, expected):
    s = _store(tmp_path)
    _fill(s, 1.0)
    s.close()
    proc = subprocess.Popen([sys.executable, "-c", _KILLED, str(tmp_path), where], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    again = SwapStore.open(tmp_path)                             # checks every record's CRC
    want = [[1.0], [2.0], [3.0]] if expected == "old" else [[100.0], [101.0], [102.0]]
    assert _values(again) == want and again.generation == (1 if expected == "old" else 2)
    meta = json.loads((tmp_path / MANIFEST).read_text())
    assert meta["generation"] == again.generation
    again.close()

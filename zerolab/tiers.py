"""Measure the memory tiers of this machine: RAM copy bandwidth, sequential disk reads and writes
(``O_DIRECT`` and buffered, 1 MiB requests), read throughput against queue depth, and the page-cache
trap. These are the ceilings lesson 13 compares every disk-offload number against.

ZeRO-Infinity's argument is made in bandwidths (Rajbhandari et al., arXiv 2104.07857, Sec. 4: what
each model state needs for high efficiency, against one PCIe link's ~12 GB/s and an NVMe's few GB/s),
so the first thing to know about a machine is its own. Disk numbers vary (other jobs, the drive's
own caches, a virtual disk's host): every function repeats its measurement and :func:`summary` gives
the median with the spread; compare medians, never single runs.

The page-cache trap: a buffered write lands in RAM (the page cache) and returns; a buffered read of
the same bytes right after is served from RAM, at memory speed, and says nothing about the disk. To
read from the disk a measurement must bypass the cache (``O_DIRECT``) or drop the file's pages first
(``posix_fadvise(POSIX_FADV_DONTNEED)`` after an ``fsync``; ``echo 3 > /proc/sys/vm/drop_caches``
needs root and drops everyone's). On a virtual machine the host may cache the virtual disk too: what
is measured is what this disk gives, not what the hardware under it could.
"""
import os
import pathlib
import statistics
import threading
import time

import torch

from zerolab.aio import ALIGN, DiskFile, aligned_empty

MIB = 1 << 20


def summary(values):
    """(median, min, max) of a list of measurements."""
    return statistics.median(values), min(values), max(values)


def filesystem(path):
    """{'mount', 'device', 'fstype', 'rotational'} of the file system holding ``path`` (Linux:
    /proc/mounts, longest matching mount point; rotational from /sys/block, None if unknown)."""
    path = os.path.realpath(path)
    best = ("", "?", "?")
    try:
        with open("/proc/mounts") as f:
            for line in f:
                device, mount, fstype = line.split()[:3]
                mount = mount.replace("\\040", " ")
                if (path == mount or path.startswith(mount.rstrip("/") + "/")) and len(mount) > len(best[0]):
                    best = (mount, device, fstype)
    except OSError:
        pass
    rotational = None
    name = os.path.basename(best[1])
    for candidate in (name, name.rstrip("0123456789"), name.split("p")[0]):
        try:
            rotational = open(f"/sys/block/{candidate}/queue/rotational").read().strip() == "1"
            break
        except OSError:
            continue
    return {"mount": best[0], "device": best[1], "fstype": best[2], "rotational": rotational}


RAM_FILESYSTEMS = ("tmpfs", "ramfs", "devtmpfs")


def scratch_folder(candidates):
    """The first of ``candidates`` (folders) that exists, is writable and is on a DISK (not a RAM file
    system such as tmpfs, which would make every "disk" number a memory number): (folder, its
    :func:`filesystem`). ValueError naming each candidate and why not, if none is."""
    import tempfile
    refused = []
    for folder in candidates:
        if folder is None:
            continue
        folder = os.path.abspath(folder)
        fs = filesystem(folder)
        if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            refused.append(f"{folder}: not a writable folder")
        elif fs["fstype"] in RAM_FILESYSTEMS:
            refused.append(f"{folder}: on {fs['fstype']}, which is RAM")
        else:
            return tempfile.mkdtemp(prefix="zerolab-scratch-", dir=folder), fs
    raise ValueError("no folder on a disk to measure: " + "; ".join(refused) + ". Set ZEROLAB_SCRATCH to a "
                     "folder on the local disk")


def memcpy_bandwidth(nbytes=256 * MIB, repeats=5):
    """GB/s of one tensor copy of ``nbytes`` (bytes copied per second: each byte read once and
    written once), one per repeat, after a warm-up copy (page faults)."""
    src, dst = torch.ones(nbytes // 4), torch.empty(nbytes // 4)
    dst.copy_(src)
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        out.append(nbytes / (time.perf_counter() - t0) / 1e9)
    return out


def _data(nbytes):
    buf = aligned_empty(nbytes)
    buf.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)))
    return buf


def write_file(path, nbytes, *, block=MIB, direct=True, data=None):
    """Write ``nbytes`` sequentially in ``block``-byte requests and make them durable (fdatasync,
    included in the time). Returns GB/s."""
    data = _data(block) if data is None else data
    f = DiskFile(path, direct=direct, create=True)
    try:
        t0 = time.perf_counter()
        for off in range(0, nbytes, block):
            f.write(data[:min(block, nbytes - off)], off)
        f.sync()
        return nbytes / (time.perf_counter() - t0) / 1e9
    finally:
        f.close()


def drop_cache(path):
    """Ask the kernel to drop ``path``'s pages from the page cache (after an fsync; no root needed)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def read_file(path, nbytes, *, block=MIB, direct=True, depth=1, cold=True):
    """Read ``nbytes`` of ``path`` in ``block``-byte requests with ``depth`` requests in flight
    (``depth`` threads, each reading every depth-th block: a queue depth, as an aio queue gives one).
    ``cold``: drop the file's pages from the page cache first (buffered reads). Returns GB/s."""
    if cold and not direct:
        drop_cache(path)
    f = DiskFile(path, direct=direct)
    bufs = [aligned_empty(block) for _ in range(depth)]
    blocks = list(range(0, nbytes, block))
    try:
        def worker(j):
            for off in blocks[j::depth]:
                f.read(bufs[j][:min(block, nbytes - off)], off)
        threads = [threading.Thread(target=worker, args=(j,)) for j in range(depth)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return nbytes / (time.perf_counter() - t0) / 1e9
    finally:
        f.close()


def disk_tiers(folder, *, nbytes=256 * MIB, block=MIB, repeats=5, depths=(1, 2, 4, 8)):
    """Every disk measurement of lesson 13 on a scratch file in ``folder`` (removed after):
    {name: [GB/s per repeat]}, names 'write O_DIRECT', 'write buffered', 'read O_DIRECT',
    'read buffered, cold', 'read buffered, right after a buffered write' (the page-cache trap) and
    'read O_DIRECT, queue depth d'. ``O_DIRECT`` rows are left out where the file system refuses it
    (``direct_ok`` False and ``why`` say so). Each repeat takes every measurement once, so that they
    all see the same machine, in alternating order (forward on even repeats, backward on odd ones), so
    that no measurement always runs first or last; the trap's read always follows its own write."""
    from zerolab.aio import direct_io_supported
    path = pathlib.Path(folder) / f".zerolab-tiers-{os.getpid()}"
    ok, why = direct_io_supported(folder)
    data = _data(block)
    out = {}

    def trap():
        f = DiskFile(path, direct=False)            # write through the page cache without syncing, then read at once
        for off in range(0, nbytes, block):
            f.write(data[:min(block, nbytes - off)], off)
        f.close()
        return read_file(path, nbytes, block=block, direct=False, cold=False)

    steps = []
    if ok:
        steps += [("write O_DIRECT", lambda: write_file(path, nbytes, block=block, direct=True, data=data)),
                  ("read O_DIRECT", lambda: read_file(path, nbytes, block=block, direct=True))]
        steps += [(f"read O_DIRECT, queue depth {d}",
                   lambda d=d: read_file(path, nbytes, block=block, direct=True, depth=d)) for d in depths]
    steps += [("write buffered", lambda: write_file(path, nbytes, block=block, direct=False, data=data)),
              ("read buffered, cold", lambda: read_file(path, nbytes, block=block, direct=False)),
              ("read buffered, right after a buffered write", trap)]
    for name, _ in steps:
        out[name] = []
    try:
        write_file(path, nbytes, block=block, direct=ok, data=data)     # the file exists before any read
        for r in range(repeats):
            for name, measure in (steps if r % 2 == 0 else steps[::-1]):
                out[name].append(measure())
    finally:
        path.unlink(missing_ok=True)
    out["direct_ok"], out["why"] = ok, why
    return out


def request_size_sweep(folder, *, nbytes=64 * MIB, sizes=(ALIGN, 16 * 1024, 64 * 1024, 256 * 1024, MIB, 4 * MIB),
                       repeats=3):
    """{request bytes: [GB/s]} of O_DIRECT sequential reads of ``nbytes`` at one request in flight
    (buffered, cold, where O_DIRECT is refused): the per-request cost that makes small I/Os slow."""
    from zerolab.aio import direct_io_supported
    path = pathlib.Path(folder) / f".zerolab-sizes-{os.getpid()}"
    direct = direct_io_supported(folder)[0]
    out = {}
    try:
        write_file(path, nbytes, direct=direct)
        for _ in range(repeats):
            for size in sizes:
                out.setdefault(size, []).append(read_file(path, nbytes, block=size, direct=direct))
    finally:
        path.unlink(missing_ok=True)
    return out


def optimizer_overlap(folder, numel, *, rounds=5, chunk=1 << 18, buffers=4):
    """The disk-offloaded optimizer step against its two parts, in the same run: per round, in
    alternating order, (1) a :class:`zerolab.infinity.DiskOptimizer` step over ``numel`` fp32
    elements (read ahead, update, write behind, commit), (2) the same reads and writes without the
    update (``DiskOptimizer.rewrite``: the disk's share alone), (3) the same chunked AdamW updates on
    records already in RAM (the update's share alone). Returns {"step", "disk", "update": [seconds per
    round], "ratio": [step / max(disk, update) per round], "bytes": per step, "chunks", "spans": the
    last step's read / update / write spans, "direct": O_DIRECT in use}. Round 0 warms up, not counted."""
    import shutil
    import tempfile

    from zerolab.chunked import ChunkedOptimizer
    from zerolab.infinity import DiskOptimizer
    work = tempfile.mkdtemp(dir=folder, prefix=".zerolab-overlap-")
    d = DiskOptimizer(torch.zeros(numel), torch.optim.AdamW, folder=work, swap_chunk=chunk,
                      buffer_count=buffers, lr=1e-3)
    try:
        d.grads[0].normal_(generator=torch.Generator().manual_seed(0))
        alone = ChunkedOptimizer(torch.optim.AdamW, len(d.layout), torch.float32, fused=d.fused, lr=1e-3)
        records = [torch.zeros(3 * chunk) for _ in d.layout]
        shard = torch.zeros(numel)

        def update_alone():
            for k, (_, lo, hi) in enumerate(d.layout):
                r = records[k]
                alone.step_chunk(k, r[:hi - lo], {"exp_avg": r[chunk:chunk + hi - lo],
                                                  "exp_avg_sq": r[2 * chunk:2 * chunk + hi - lo]}, d.grads[0][lo:hi])
                shard[lo:hi].copy_(r[:hi - lo])
        runs = {"step": lambda: d.step(), "disk": d.rewrite, "update": update_alone}
        out = {name: [] for name in runs}
        for r in range(rounds + 1):
            for name in (list(runs) if r % 2 else list(runs)[::-1]):
                t0 = time.perf_counter()
                runs[name]()
                if r:
                    out[name].append(time.perf_counter() - t0)
        d.step()
        out["ratio"] = [s / max(a, b) for s, a, b in zip(out["step"], out["disk"], out["update"])]
        out["bytes"] = d.last_step["bytes_read"] + d.last_step["bytes_written"]
        out["chunks"], out["spans"], out["direct"] = len(d.layout), d.last_step["spans"], d.store.file.direct
        return out
    finally:
        d.close()
        shutil.rmtree(work, ignore_errors=True)

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
    (``direct_ok`` False and ``why`` say so). Each repeat takes every measurement once, in turn, so
    that they all see the same machine."""
    from zerolab.aio import direct_io_supported
    path = pathlib.Path(folder) / f".zerolab-tiers-{os.getpid()}"
    ok, why = direct_io_supported(folder)
    data = _data(block)
    out = {}
    try:
        for _ in range(repeats):
            if ok:
                out.setdefault("write O_DIRECT", []).append(write_file(path, nbytes, block=block, direct=True, data=data))
                out.setdefault("read O_DIRECT", []).append(read_file(path, nbytes, block=block, direct=True))
                for d in depths:
                    out.setdefault(f"read O_DIRECT, queue depth {d}", []).append(
                        read_file(path, nbytes, block=block, direct=True, depth=d))
            out.setdefault("write buffered", []).append(write_file(path, nbytes, block=block, direct=False, data=data))
            out.setdefault("read buffered, cold", []).append(read_file(path, nbytes, block=block, direct=False))
            # the trap: write through the page cache without syncing, then read at once
            f = DiskFile(path, direct=False)
            for off in range(0, nbytes, block):
                f.write(data[:min(block, nbytes - off)], off)
            f.close()
            out.setdefault("read buffered, right after a buffered write", []).append(
                read_file(path, nbytes, block=block, direct=False, cold=False))
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

"""Bandwidth-centric partitioning (Rajbhandari et al., ZeRO-Infinity, arXiv 2104.07857, Sec. 6.1):
how a parameter that lives off the device gets to every rank.

* owner + broadcast (the paper's description, Sec. 6.1, of the original ZeRO design and ZeRO-Offload
  for a parameter owned by one rank): the owner reads the WHOLE parameter from its host memory or
  disk over its own link, then broadcasts it. Every read goes through ONE link, whatever the number
  of ranks. (DeepSpeed's ZeRO-3 as released already splits every parameter across all ranks and
  all-gathers it: ``_partition_param``, ``all_gather_coalesced`` in
  ``deepspeed/runtime/zero/partition_parameters.py``.)
* read 1/N + all-gather (ZeRO-Infinity's): every parameter is split across all data-parallel ranks;
  each reads only its 1/N over its own link, then the ranks all-gather. N links read in parallel, so
  the aggregate read bandwidth grows with N (the paper: each GPU's PCIe link is ~12 GB/s, so 16
  links give ~16x one link's, while GPU-GPU links are far faster than any of them).

On this machine every rank reads the SAME virtual disk: there is one "link", and splitting the reads
can gain little (a deeper queue on one disk, at most). To show the paper's point, :class:`EmulatedLink`
gives each rank a link of its own, a token bucket at a fixed rate: a read of b bytes takes at least
b / rate seconds on it. That is an emulation, labelled as such wherever it is used: the bytes are
real (read from the file), the per-rank bandwidth is imposed.
"""
import threading
import time

import torch
import torch.distributed as dist

from zerolab import comm
from zerolab.aio import DiskFile, aligned_empty, round_up


class EmulatedLink:
    """A token bucket: ``rate`` bytes per second, at most ``burst`` bytes ahead. :meth:`transfer`
    blocks until ``nbytes`` may have crossed the link (EMULATED bandwidth, not a measurement)."""

    def __init__(self, rate, burst=None):
        if rate <= 0:
            raise ValueError(f"EmulatedLink: rate={rate!r} must be > 0 bytes/s")
        self.rate, self.burst = float(rate), float(burst if burst is not None else rate / 100)
        self._tokens, self._t = self.burst, time.perf_counter()
        self._lock = threading.Lock()

    def transfer(self, nbytes):
        with self._lock:
            now = time.perf_counter()
            self._tokens = min(self.burst, self._tokens + (now - self._t) * self.rate)
            self._t = now
            self._tokens -= nbytes
            wait = -self._tokens / self.rate if self._tokens < 0 else 0.0
        if wait > 0:
            time.sleep(wait)


def write_parameter(path, tensor):
    """Write ``tensor`` (1-D) to ``path`` padded to whole 4 KiB blocks, as an offloaded parameter
    sits on disk; returns its byte length (unpadded)."""
    raw = tensor.detach().contiguous().view(torch.uint8).reshape(-1)
    buf = aligned_empty(round_up(raw.numel()))
    buf.zero_()
    buf[:raw.numel()].copy_(raw)
    f = DiskFile(path, direct="auto", create=True)
    try:
        f.write(buf, 0)
        f.sync()
    finally:
        f.close()
    return raw.numel()


BLOCK = 1 << 20          # bytes per read request (DeepSpeed's default aio block_size)


def _read_into(path, buf, lo, nbytes, link, depth=1):
    """Bytes [lo, lo + nbytes) of ``path`` into ``buf`` (aligned, whole 4 KiB blocks; the file is
    padded to whole blocks) in 1 MiB requests, ``depth`` of them in flight (threads); with a ``link``,
    each request also crosses it, so a read takes about the longer of the disk's time and the link's."""
    f = DiskFile(path, direct="auto")
    offsets = list(range(0, round_up(nbytes), BLOCK))

    def worker(j):
        for off in offsets[j::depth]:
            part = buf[off:off + BLOCK]
            f.read(part, lo + off)
            if link is not None:
                link.transfer(min(part.numel(), nbytes - off))
    try:
        threads = [threading.Thread(target=worker, args=(j,)) for j in range(depth)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        f.close()


def owner_broadcast(path, numel, dtype, *, group=None, link=None, depth=1):
    """Rank 0 reads the whole parameter (``numel`` elements of ``dtype`` in ``path``; ``depth``
    requests in flight), then broadcasts it. Returns (the parameter, seconds reading, seconds total,
    bytes this rank read). The destination is allocated and touched before the clock starts."""
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    buf = aligned_empty(round_up(nbytes))
    buf.zero_()
    out = buf[:nbytes].view(dtype)
    dist.barrier(group=group)
    t0 = time.perf_counter()
    read = 0
    if dist.get_rank(group) == 0:
        _read_into(path, buf, 0, nbytes, link, depth)
        read = nbytes
    t_read = time.perf_counter() - t0
    comm.broadcast(out, src=0 if group is None else dist.get_global_rank(group, 0), group=group, tag="owner")
    return out, t_read, time.perf_counter() - t0, read


def sharded_allgather(path, numel, dtype, *, group=None, link=None):
    """Every rank reads its 1/N of the parameter (a slice of whole 4 KiB blocks), then the ranks
    all-gather. Returns (the parameter, seconds reading (this rank), seconds total, bytes read)."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    esize = torch.empty((), dtype=dtype).element_size()
    per = round_up(-(-numel * esize // n))                 # bytes per rank, whole blocks
    full = aligned_empty(per * n)
    full.zero_()
    mine = full[r * per:(r + 1) * per]                     # this rank's slice: aligned, read in place
    lo, hi = r * per, min((r + 1) * per, numel * esize)
    dist.barrier(group=group)
    t0 = time.perf_counter()
    if hi > lo:
        _read_into(path, mine, lo, hi - lo, link)
    t_read = time.perf_counter() - t0
    comm.all_gather(full, mine, group=group, tag="bandwidth-centric")
    return full[:numel * esize].view(dtype), t_read, time.perf_counter() - t0, max(0, hi - lo)

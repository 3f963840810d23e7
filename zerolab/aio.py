"""The disk tier's plumbing: aligned host buffers, a fixed pool of them, files read and written with
``O_DIRECT`` where the file system allows it, and background I/O threads that record when they ran.

ZeRO-Infinity reads and writes NVMe through DeepNVMe, part of its infinity offload engine
(Rajbhandari et al., SC21, arXiv 2104.07857): asynchronous bulk requests, many in flight (a queue
depth), into a pool of pinned host buffers that is allocated once and reused, so that the data never
passes through the operating system's page cache and no buffer is allocated per transfer. DeepSpeed implements it in
``csrc/aio`` (libaio; every swap file is opened ``O_RDONLY | O_DIRECT`` or ``O_WRONLY | O_CREAT |
O_DIRECT``, ``csrc/aio/common/deepspeed_aio_common.cpp``, ``open_file``) with buffers pinned by the
accelerator (``deepspeed/runtime/swap_tensor/utils.py``, ``SwapBufferManager``), configured by
``aio: {block_size: 1048576, queue_depth: 8, intra_op_parallelism: 1, single_submit, overlap_events}``
(``deepspeed/runtime/swap_tensor/constants.py``).

Here, in plain Python: ``os.preadv`` / ``os.pwritev`` (they release the GIL, so a background thread
really overlaps torch's compute) on buffers whose address, length and file offset are multiples of
:data:`ALIGN`, what ``O_DIRECT`` requires. Where a file system refuses ``O_DIRECT`` (some do; others
accept the flag at ``open`` and fail the first transfer), :func:`direct_io_supported` says so and
:class:`DiskFile` falls back to buffered I/O, dropping each file's pages from the page cache after a
synced write (``posix_fadvise(DONTNEED)``), so that a later read comes from the disk, not from RAM,
where the kernel honours the advice. What a buffered read after a write really measures is lesson
13's page-cache trap.
"""
import concurrent.futures
import contextlib
import errno
import os
import pathlib
import threading
import time

import torch

ALIGN = 4096                     # bytes: O_DIRECT's alignment of address, length and offset (a page)


def round_up(n, multiple=ALIGN):
    """The smallest multiple of ``multiple`` that is >= n."""
    return -(-int(n) // multiple) * multiple


def aligned_empty(nbytes, *, align=ALIGN):
    """An uninitialised 1-D uint8 host tensor of ``nbytes`` whose first byte is at an address that
    is a multiple of ``align`` (torch's CPU allocator only promises 64): over-allocate, then slice.
    On a GPU machine DeepSpeed pins these (page-locked, for async DMA); pinning does not change them."""
    if nbytes < 0 or align <= 0 or align & (align - 1):
        raise ValueError(f"aligned_empty: nbytes={nbytes} must be >= 0 and align={align} a power of two")
    raw = torch.empty(nbytes + align, dtype=torch.uint8)
    skip = (-raw.data_ptr()) % align
    return raw[skip:skip + nbytes]


class BufferPool:
    """``count`` aligned host buffers of ``nbytes`` each, allocated once and reused (DeepSpeed's
    ``SwapBufferManager``; the paper's pinned memory management layer). ``acquire()``
    hands one out (waiting while all are busy), ``release(buf)`` returns it. Thread-safe: an I/O
    thread may release a buffer once its write has landed. ``high_water``: most buffers out at once.
    ``timeout``: how long :meth:`acquire` waits by default before it calls the wait a leak."""

    def __init__(self, count, nbytes, *, timeout=60.0):
        if not isinstance(count, int) or isinstance(count, bool) or count < 1:
            raise ValueError(f"BufferPool: count={count!r} must be an int >= 1")
        self.nbytes = round_up(nbytes)
        self.buffers = [aligned_empty(self.nbytes) for _ in range(count)]
        self._free = list(range(count))[::-1]
        self._index = {b.data_ptr(): i for i, b in enumerate(self.buffers)}
        self._cond = threading.Condition()
        self.high_water = 0
        self.timeout = timeout

    @property
    def count(self):
        return len(self.buffers)

    @property
    def total_bytes(self):
        """What the pool holds in memory: count x nbytes (the resident bound of a swapper)."""
        return self.count * self.nbytes

    def in_use(self):
        with self._cond:
            return self.count - len(self._free)

    def acquire(self, timeout=None):
        """A free buffer (waits while all are out). RuntimeError after ``timeout`` seconds (default:
        the pool's): a buffer that is never released (a leak) would otherwise hang the caller forever."""
        timeout = self.timeout if timeout is None else timeout
        with self._cond:
            if not self._cond.wait_for(lambda: self._free, timeout=timeout):
                raise RuntimeError(f"BufferPool: all {self.count} buffers are still in use after {timeout} s: "
                                   f"release each buffer once its data is no longer needed")
            i = self._free.pop()
            self.high_water = max(self.high_water, self.count - len(self._free))
            return self.buffers[i]

    def release(self, buf):
        with self._cond:
            i = self._index.get(buf.data_ptr())
            if i is None or i in self._free:
                raise ValueError("BufferPool.release: not a buffer of this pool, or released twice")
            self._free.append(i)
            self._cond.notify()

    def owns(self, tensor):
        """True if ``tensor``'s memory lies inside one of the pool's buffers."""
        p = tensor.data_ptr()
        return any(b.data_ptr() <= p < b.data_ptr() + self.nbytes for b in self.buffers)


# -- files ---------------------------------------------------------------------------------------
def _why(exc):
    return f"{type(exc).__name__}: {exc.strerror if isinstance(exc, OSError) and exc.strerror else exc}"


def direct_io_supported(folder):
    """(True, "") if files in ``folder`` can be written and read with ``O_DIRECT``, else (False, why).
    Opening is not enough (some file systems accept the flag and refuse the first transfer): this
    writes and reads back one aligned block of a probe file, then removes it."""
    if not hasattr(os, "O_DIRECT"):
        return False, "this operating system has no O_DIRECT"
    probe = pathlib.Path(folder) / f".zerolab-odirect-probe-{os.getpid()}-{threading.get_ident()}"
    buf = aligned_empty(ALIGN)
    buf.fill_(7)
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError as exc:
        return False, f"open(O_DIRECT) refused ({_why(exc)})"
    try:
        os.pwritev(fd, [buf.numpy()], 0)
        back = aligned_empty(ALIGN)
        os.preadv(fd, [back.numpy()], 0)
        if not torch.equal(back, buf):
            return False, "an O_DIRECT read did not return what was written"
        return True, ""
    except OSError as exc:
        return False, f"an O_DIRECT transfer failed ({_why(exc)})"
    finally:
        os.close(fd)
        with contextlib.suppress(OSError):
            probe.unlink()


class DiskFile:
    """One file read and written in place, at byte offsets. ``direct``: True (``O_DIRECT``: every
    transfer's buffer address, length and offset must be multiples of :data:`ALIGN`), False
    (buffered: the page cache in between), or "auto" (``O_DIRECT`` if :func:`direct_io_supported`
    for the file's folder, else buffered; ``self.direct`` and ``self.fallback`` say which and why).
    Counts the bytes it moves (``bytes_read``, ``bytes_written``)."""

    def __init__(self, path, *, direct="auto", create=False, size=None):
        self.path = pathlib.Path(path)
        if direct not in (True, False, "auto"):
            raise ValueError(f"direct={direct!r}: use True (O_DIRECT), False (buffered) or 'auto'")
        self.fallback = ""
        if direct == "auto":
            ok, why = direct_io_supported(self.path.parent)
            direct, self.fallback = ok, ("" if ok else f"buffered I/O: {why}")
        self.direct = bool(direct)
        flags = os.O_RDWR | (os.O_CREAT if create else 0) | (os.O_DIRECT if self.direct else 0)
        self.fd = os.open(self.path, flags, 0o600)
        try:
            if size is not None:
                self.allocate(size)
        except BaseException:
            os.close(self.fd)
            raise
        self.bytes_read = self.bytes_written = 0

    def allocate(self, size):
        """Reserve ``size`` bytes on the disk now (``posix_fallocate``), so that no later write can
        fail for want of space: a full disk (or a file-size limit) is reported here, at once."""
        if hasattr(os, "posix_fallocate"):
            os.posix_fallocate(self.fd, 0, size)
        else:                                                         # macOS: a sparse file
            os.ftruncate(self.fd, size)

    def size(self):
        return os.fstat(self.fd).st_size

    def _check(self, buf, offset):
        if buf.dtype != torch.uint8 or buf.dim() != 1 or not buf.is_contiguous() or buf.device.type != "cpu":
            raise ValueError("DiskFile: transfer a contiguous 1-D uint8 CPU tensor (a view of an aligned buffer)")
        if self.direct and (buf.data_ptr() % ALIGN or buf.numel() % ALIGN or offset % ALIGN):
            raise ValueError(f"DiskFile {self.path.name} is opened with O_DIRECT: buffer address "
                             f"{buf.data_ptr():#x}, length {buf.numel()} and offset {offset} must be multiples "
                             f"of {ALIGN} (take buffers from aio.BufferPool or aio.aligned_empty)")

    def read(self, buf, offset):
        """Fill ``buf`` (uint8) from the file at ``offset``. Raises OSError naming the file if it ends
        first (a truncated file), never returns a partial buffer."""
        self._check(buf, offset)
        view, done = buf.numpy(), 0
        while done < len(view):
            n = os.preadv(self.fd, [view[done:]], offset + done)
            if n == 0:
                raise OSError(f"{self.path}: ends at byte {offset + done} but {offset + len(view)} are needed: "
                              f"the file is truncated")
            done += n
        self.bytes_read += done
        return done

    def write(self, buf, offset):
        """Write all of ``buf`` (uint8) at ``offset`` (not yet durable: see :meth:`sync`)."""
        self._check(buf, offset)
        view, done = buf.numpy(), 0
        while done < len(view):
            done += os.pwritev(self.fd, [view[done:]], offset + done)
        self.bytes_written += done
        return done

    def sync(self):
        """Make every write so far durable (``fdatasync``); buffered: then drop the file's pages from
        the page cache, so that the next read comes from the disk where the kernel honours it."""
        (os.fdatasync if hasattr(os, "fdatasync") else os.fsync)(self.fd)
        if not self.direct and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def close(self):
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def atomic_write(path, data):
    """Write ``data`` (bytes) to ``path`` so that a reader sees either the old file or the whole new
    one, even across a crash: a temporary name, fsync, rename (atomic on POSIX), fsync of the folder.

    An error of the folder's fsync is raised (the rename happened, but may not survive a power loss:
    reporting the write as done would let a caller overwrite what the old file names), except EINVAL,
    which file systems that cannot sync a folder return: there the rename is as durable as they make it."""
    path = pathlib.Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    fd = os.open(path.parent, os.O_RDONLY)       # the rename itself durable
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
    finally:
        os.close(fd)


# -- background I/O ------------------------------------------------------------------------------
class IOWorker:
    """One background thread running submitted I/O calls in order (one queue, like one aio handle
    of DeepSpeed's; its ``PipelinedOptimizerSwapper`` keeps one for reads and one for writes, so that a
    read never waits behind a write). ``submit(fn, *args)`` returns a ``concurrent.futures.Future``.
    ``spans``: (start, end) ``time.perf_counter()`` of every call, for measuring overlap;
    ``busy()``: their total seconds."""

    def __init__(self, name):
        self.name = name
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"zerolab-{name}")
        self.spans = []

    def submit(self, fn, *args):
        def timed():
            t0 = time.perf_counter()
            try:
                return fn(*args)
            finally:
                self.spans.append((t0, time.perf_counter()))
        return self._pool.submit(timed)

    def busy(self):
        return sum(b - a for a, b in self.spans)

    def close(self):
        self._pool.shutdown(wait=True)

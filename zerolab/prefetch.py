"""Overlap-centric design (Rajbhandari et al., ZeRO-Infinity, arXiv 2104.07857, Sec. 6.2): a model
whose weights live on disk, unit by unit, and a prefetcher that learns the order the units run in
on the first step and, from then on, reads the next ``depth`` units from disk on a background thread
while the current one computes.

The paper's dynamic prefetcher traces the sequence of operators as the model runs, keeps track of
where it is in it, and before operator i runs issues the NVMe -> CPU read for operator i+3, the CPU
-> GPU copy for i+2 and the all-gather for i+1, all three in flight at once. DeepSpeed records the
module order in its first step (``ZeRoTraceMode.RECORD`` -> ``COMPLETE``), invalidates the trace
when a later step runs modules in another order, prefetches ``stage3_prefetch_bucket_size`` elements
ahead, and swaps NVMe-resident parameter partitions in further ahead still
(``__prefetch_nvme_param_partitions`` in
``deepspeed/runtime/zero/partitioned_param_coordinator.py``), bounded by its swap buffers.

Here one hop, disk -> RAM, on one process; the units' weights are read into a pool of ``depth + 1``
aligned buffers (the unit computing, and up to ``depth`` read ahead), so memory grows with the depth.
It runs forward passes (inference, or an evaluation): the weights are frozen views into the buffers.
``exposed`` is what prefetching is for: the seconds the forward waited for a unit's weights.
"""
import collections
import os
import pathlib
import secrets
import time

import torch

from zerolab.aio import BufferPool, DiskFile, IOWorker, aligned_empty, round_up


class DiskWeights:
    """The parameters of ``units`` (modules of ``model``, each with its own parameters, run in some
    order by ``model``'s forward) moved to one file in ``folder``: each unit's parameters packed back
    to back, the unit's region padded to whole 4 KiB blocks. The parameters hold no memory until a
    unit is loaded (:meth:`load`), as ZeRO-3's freed units. ``close()`` removes the file."""

    def __init__(self, units, folder, *, direct="auto"):
        self.units = list(units)
        self.params = [[p for p in u.parameters()] for u in self.units]
        if len({id(p) for ps in self.params for p in ps}) != sum(map(len, self.params)):
            raise ValueError("DiskWeights: units share parameters; give each parameter to one unit")
        dtypes = {p.dtype for ps in self.params for p in ps}
        if len(dtypes) != 1:
            raise ValueError(f"DiskWeights: one dtype please, got {sorted(map(str, dtypes))}")
        self.dtype = dtypes.pop()
        self.shapes = [[p.shape for p in ps] for ps in self.params]
        esize = torch.empty((), dtype=self.dtype).element_size()
        self.nbytes = [sum(p.numel() for p in ps) * esize for ps in self.params]
        self.offsets = [sum(round_up(b) for b in self.nbytes[:i]) for i in range(len(self.units))]
        self.region = max(round_up(b) for b in self.nbytes)
        self.path = pathlib.Path(folder) / f"zerolab-weights-{os.getpid()}-{secrets.token_hex(4)}.bin"
        self.file = DiskFile(self.path, direct=direct, create=True,
                             size=self.offsets[-1] + round_up(self.nbytes[-1]))
        buf = aligned_empty(self.region)
        for i, ps in enumerate(self.params):
            buf.zero_()
            flat = buf[:self.nbytes[i]].view(self.dtype)
            off = 0
            for p in ps:
                flat[off:off + p.numel()].copy_(p.detach().reshape(-1))
                off += p.numel()
            self.file.write(buf[:round_up(self.nbytes[i])], self.offsets[i])
            for p in ps:
                p.requires_grad_(False)
                p.data = torch.empty(0, dtype=self.dtype)          # no memory until loaded
        self.file.sync()

    def read(self, i, buf):
        """Unit i's bytes from the file into ``buf`` (an aligned buffer of at least ``region`` bytes)."""
        self.file.read(buf[:round_up(self.nbytes[i])], self.offsets[i])

    def bind(self, i, buf):
        """Point unit i's parameters at their values in ``buf`` (no copy)."""
        flat = buf[:self.nbytes[i]].view(self.dtype)
        off = 0
        for p, shape in zip(self.params[i], self.shapes[i]):
            p.data = flat[off:off + shape.numel()].view(shape)
            off += shape.numel()

    def unbind(self, i):
        for p in self.params[i]:
            p.data = torch.empty(0, dtype=self.dtype)

    def close(self):
        self.file.close()
        self.path.unlink(missing_ok=True)


class TracedPrefetcher:
    """Hooks on each unit of ``weights``: the first forward records the order the units run in (and
    reads each unit when it starts: nothing to prefetch yet); every later forward reads the next
    ``depth`` units of that order ahead, on one background I/O thread, and waits only for what has not
    arrived. A forward that runs the units in another order than the trace drops the trace and
    records again (DeepSpeed invalidates its trace the same way). ``depth=0``: no prefetch.

    Per forward (``begin()`` ... ``end()``, or ``with prefetcher.step():``), ``last``: seconds waited
    for weights (``exposed``), seconds the I/O thread read, the forward's seconds, and the order."""

    def __init__(self, weights, depth=1):
        if not isinstance(depth, int) or isinstance(depth, bool) or depth < 0:
            raise ValueError(f"depth={depth!r}: an int >= 0 (units read ahead)")
        self.weights, self.depth = weights, depth
        self.pool = BufferPool(depth + 1, weights.region)
        self.io = IOWorker("prefetch")
        self.trace, self.recording = None, []
        self.inflight = collections.OrderedDict()      # unit -> (buffer, future), in issue order
        self.loaded = {}                                # unit -> buffer (bound now)
        self.position, self.last, self.exposed = 0, None, 0.0
        self._hooks = []
        for i, u in enumerate(weights.units):
            self._hooks.append(u.register_forward_pre_hook(lambda m, a, i=i: self._before(i)))
            self._hooks.append(u.register_forward_hook(lambda m, a, o, i=i: self._after(i)))

    def step(self):
        prefetcher = self

        class _Step:
            def __enter__(self):
                prefetcher.begin()

            def __exit__(self, *exc):
                prefetcher.end()
        return _Step()

    def begin(self):
        self.recording, self.position, self.exposed = [], 0, 0.0
        self._io0, self._t0 = len(self.io.spans), time.perf_counter()
        self._issue(0)

    def end(self):
        ordered = self.recording
        if self.trace is None or ordered != self.trace:
            self.trace = ordered                        # first forward, or another order: (re)traced
        self._drain()
        self.last = {"exposed": self.exposed, "read": sum(b - a for a, b in self.io.spans[self._io0:]),
                     "seconds": time.perf_counter() - self._t0, "order": list(ordered)}

    def _issue(self, position):
        """Start reading the units at trace positions [position, position + depth) not yet in flight."""
        if self.trace is None or self.depth == 0:
            return
        for j in self.trace[position:position + self.depth]:
            if j not in self.inflight and j not in self.loaded and self.pool.in_use() < self.pool.count:
                buf = self.pool.acquire()
                self.inflight[j] = (buf, self.io.submit(self.weights.read, j, buf))

    def _before(self, i):
        self.recording.append(i)
        t0 = time.perf_counter()
        if i in self.inflight:
            buf, fut = self.inflight.pop(i)
            fut.result()                                # wait only for what has not arrived
        else:
            if self.trace is not None and self.position < len(self.trace) and self.trace[self.position] != i:
                self.trace = None                       # the order changed: stop prefetching this step
                self._drain()
            buf = self.pool.acquire()
            self.io.submit(self.weights.read, i, buf).result()    # a read on demand: all of it exposed
        self.exposed += time.perf_counter() - t0
        self.weights.bind(i, buf)
        self.loaded[i] = buf
        self.position += 1
        self._issue(self.position)                      # the next `depth` units, while i computes

    def _after(self, i):
        self.weights.unbind(i)
        self.pool.release(self.loaded.pop(i))           # freed right after use

    def _drain(self):
        for j, (buf, fut) in list(self.inflight.items()):
            fut.result()
            self.pool.release(buf)
        self.inflight.clear()

    def close(self):
        self._drain()
        for h in self._hooks:
            h.remove()
        self.io.close()

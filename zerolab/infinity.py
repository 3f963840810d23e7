"""ZeRO-Infinity's optimizer offload to disk (Rajbhandari et al., SC21, arXiv 2104.07857): the fp32
master and Adam's moments of each rank's shard live in a file on the local disk ("NVMe"), and the
optimizer step streams them through a small pool of aligned host buffers.

One step on rank r, Ψ/N elements in C chunks of c (12 bytes of state per element, fp32 Adam):

    disk (NVMe)                       host (CPU RAM)                            device
    records: master | m | v           pool of B buffers (B x 12c bytes)
    read record i+1  ------------->   [buffer] (in flight)
                                      [buffer] record i: Adam update with the    gradient shard (host)
                                               gradient chunk, in place          new compute-dtype params
    write record i-1 <-------------   [buffer] (in flight)                  ---> (then all-gather)

Reads, updates and writes of three consecutive chunks run at once (a read thread, the training
thread, a write thread), DeepSpeed's ``pipeline_read`` / ``pipeline_write``
(``PipelinedOptimizerSwapper`` in ``deepspeed/runtime/swap_tensor/pipelined_optimizer_swapper.py``:
a read aio handle and a write aio handle; the next sub group is swapped in while the current one is
stepped). Per step a rank reads 12Ψ/N bytes and writes 12Ψ/N bytes (master, m, v; fp32) and reads
its gradient shard from RAM: a step takes at least max(24Ψ/N / disk bandwidth, update time), and the
overlap is what brings it down to that bound. What stays in RAM is the pool (B records), not the
states: the memory bound of the disk tier. Each step commits atomically (:mod:`zerolab.swap`).

This module adds ``initialize(..., stage=1, 2 or 3, offload="disk", offload_path=FOLDER)``:
:class:`DiskOptimizer` (the streaming optimizer) and :class:`Zero1DiskEngine`,
:class:`Zero2DiskEngine`, :class:`Zero3DiskEngine` (the offload engines of :mod:`zerolab.offload`
with the disk optimizer in place of the host one); at stage 3, ``offload_params=True`` puts the
compute-dtype parameter shards on disk too (:class:`ParamSwap`: each read just before its unit's
all-gather, read ahead beside the gather prefetch). Options (checked once, ``_Disk.OPTIONS``):
``offload_path``, ``swap_chunk``, ``buffer_count``, ``direct_io``, ``offload_params``. DeepSpeed swaps optimizer states to NVMe at stage
3 only (``swap_optimizer`` in ``deepspeed/runtime/zero/stage3.py``); at stages 1 and 2 its
``offload_optimizer: {device: nvme}`` keeps them in CPU memory (``stage_1_and_2.py`` sets
``cpu_offload = True`` for any device other than none). zerolab streams them at every stage.

On this machine "device" and "host" are the same RAM, and the "NVMe" is whatever disk
``offload_path`` is on: the bytes really go to that disk (``O_DIRECT`` where the file system allows
it), the rest of the hierarchy is accounting by role.
"""
import collections
import os
import pathlib
import secrets
import shutil
import time
import weakref

import torch

from zerolab import comm
from zerolab.aio import BufferPool, DiskFile, IOWorker, aligned_empty, round_up
from zerolab.chunked import ChunkedOptimizer, state_fields
from zerolab.engine import Option, Slot, gather_full, is_flag
from zerolab.offload import HOST, _Offload, host_buffer
from zerolab.shard_optim import master_dtype
from zerolab.swap import SwapError, SwapStore, check_folder
from zerolab.zero1 import Zero1Engine
from zerolab.zero2 import Zero2Engine
from zerolab.units import GATHERING, READY
from zerolab.zero3 import Zero3Engine


def _remove_folder(store, workers, folder):
    """Close the workers and the file, delete the folder (an engine's close, or its garbage collection)."""
    for w in workers:
        w.close()
    store.close(remove=True)
    shutil.rmtree(folder, ignore_errors=True)


class DiskOptimizer:
    """The optimizer of a rank's shard(s), its fp32 master and moments in a :class:`zerolab.swap.SwapStore`
    in ``folder`` (created for it), stepped chunk by chunk through a :class:`zerolab.aio.BufferPool` of
    ``buffer_count`` records. Same surface as :class:`zerolab.offload.HostOptimizer` for the engines:
    ``shards`` (this rank's compute-dtype shard(s)), ``grads`` (host gradient shards, views into
    ``grad_flat``), ``to_host``, ``step``, ``zero_grad``, ``optimizer`` (a real torch optimizer for
    schedulers), ``state_tensors``.

    ``swap_chunk``: elements per chunk (DeepSpeed's ``sub_group_size`` plays this role); a chunk never
    spans two shards. ``direct_io``: "auto" (``O_DIRECT`` where the file system allows it), True or
    False (see :class:`zerolab.aio.DiskFile`). ``init``: exact fp32 initial values per shard (bf16
    training), else the shards themselves. ``last_step``: what the last step moved and how long each
    part took (seconds busy reading, updating, writing; spans for a timeline)."""

    def __init__(self, shards, optimizer_class, *, folder, init=None, swap_chunk=1 << 18, buffer_count=4,
                 direct_io="auto", grad_dtype=None, fused=None, **opt_kwargs):
        self.shards = [shards] if torch.is_tensor(shards) else list(shards)
        init = [None] * len(self.shards) if init is None else list(init)
        if not self.shards or any(s.dim() != 1 for s in self.shards) or len({s.dtype for s in self.shards}) != 1 \
                or len(init) != len(self.shards):
            raise ValueError("DiskOptimizer needs 1-D shards of one dtype and one init per shard")
        if not isinstance(buffer_count, int) or buffer_count < 2:
            raise ValueError(f"buffer_count={buffer_count!r}: the swapper needs at least 2 buffers (one being "
                             f"updated, one being read); 3 or more let a write overlap too")
        self.dtype = master_dtype(self.shards[0].dtype)
        fields = state_fields(optimizer_class, opt_kwargs)
        self.layout = SwapStore.layout([s.numel() for s in self.shards], swap_chunk)   # [(shard, lo, hi)]
        self.folder = pathlib.Path(folder)
        self.store = SwapStore.create(self.folder, chunks=[(lo, hi) for _, lo, hi in self.layout],
                                      chunk_numel=swap_chunk, dtype=self.dtype, fields=fields, direct=direct_io)
        self.pool = BufferPool(buffer_count, self.store.record_bytes)
        self.chunked = ChunkedOptimizer(optimizer_class, len(self.layout), self.dtype, fused=fused, **opt_kwargs)
        self.optimizer, self.fused = self.chunked.optimizer, self.chunked.fused
        sizes = [s.numel() for s in self.shards]
        self.grad_flat = host_buffer(sum(sizes), grad_dtype or self.shards[0].dtype, like=self.shards[0])
        self.grads = list(self.grad_flat.split(sizes))          # the host gradient shard(s), in RAM
        self.workspace = None                                   # one chunk of fp32 gradient, when needed
        self._fresh, self._unread = [True] * len(self.shards), False
        self.reader, self.writer = IOWorker("swap-read"), IOWorker("swap-write")
        self.bytes_to_host = self.bytes_to_device = 0
        self.last_step = None
        self.on_chunk = None                                    # instrumentation: called after each chunk
        self.params_on_disk = None                              # stage 3 + offload_params: a ParamSwap
        self._staging = lambda: None                            # a checkpoint's RAM copy (weak)
        self._finalizer = weakref.finalize(self, _remove_folder, self.store, (self.reader, self.writer), self.folder)
        self._write_initial(init)

    # -- what the engines use, as HostOptimizer ------------------------------------------------
    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def delayed(self):
        return False

    @delayed.setter
    def delayed(self, on):
        if on:
            raise ValueError("delayed_update=True is not supported with offload='disk': the update streams "
                             "through the swap buffers within step() (use offload='optimizer' for DPU)")

    def aliased(self, i):
        return False

    def element_bytes(self, i):
        return 0                                   # master and moments are on disk, not per element in RAM

    def pending(self):
        return False

    def wait(self):
        pass

    def flush(self):
        pass

    def _landed(self):
        pass                                       # CPU-only copies are synchronous

    @torch.no_grad()
    def to_host(self, i, grad):
        """Gradient shard i into the host buffer (copy after zero_grad, add after that)."""
        if self._fresh[i]:
            self.grads[i].copy_(grad)
            self._fresh[i] = False
        else:
            self.grads[i].add_(grad.to(HOST))
        self.bytes_to_host += grad.numel() * grad.element_size()
        self._unread = True

    def zero_grad(self):
        self.grad_flat.zero_()
        self._fresh, self._unread = [True] * len(self.shards), False

    # -- the streamed step ---------------------------------------------------------------------
    def _views(self, buf, k):
        return self.store.views(buf, k)

    def publish(self, s, lo, hi, values):
        """New master values of shard s [lo, hi) into the compute-dtype shard (a cast), or, with the
        parameters on disk, into their file (and the shard, if it is in memory now)."""
        if self.params_on_disk is not None:
            self.params_on_disk.store(s, lo, hi, values)
        else:
            self.shards[s][lo:hi].copy_(values)

    def _chunk_grad(self, k, inv_scale):
        s, lo, hi = self.layout[k]
        g = self.grads[s][lo:hi]
        if g.dtype == self.dtype and inv_scale == 1.0:
            return g                               # fp32 (fp64) training: the host shard itself
        if self.workspace is None or self.workspace.numel() < self.store.chunk_numel:
            self.workspace = torch.empty(self.store.chunk_numel, dtype=self.dtype)
        w = self.workspace[:hi - lo].copy_(g)      # upcast (bf16 -> fp32); the host grads stay untouched
        return w.mul_(inv_scale) if inv_scale != 1.0 else w

    def _update(self, k, buf, inv_scale):
        """Chunk k's Adam update in the buffer, then its new values into the compute-dtype shard."""
        s, lo, hi = self.layout[k]
        v = self._views(buf, k)
        self.chunked.step_chunk(k, v["param"], {f: v[f] for f in self.chunked.fields}, self._chunk_grad(k, inv_scale))
        self.publish(s, lo, hi, v["param"])      # the new values into the device shard (then all-gathered)
        self.bytes_to_device += (hi - lo) * self.shards[s].element_size()
        if self.on_chunk is not None:
            self.on_chunk(k)

    @torch.no_grad()
    def step(self, grads=None, *, inv_scale=1.0):
        """One optimizer step over every chunk, double-buffered: while chunk k is updated in the
        training thread, chunk k+1 is read and chunk k-1 written by two I/O threads. Committed
        atomically at the end. If anything fails half way, the disk keeps the previous step's state,
        the compute shards are restored from it, and the error is raised (nothing half-applied)."""
        grads = [] if grads is None else [grads] if torch.is_tensor(grads) else list(grads)
        if grads and [g.shape for g in grads] != [s.shape for s in self.shards]:
            raise ValueError(f"DiskOptimizer.step: gradient shapes {[tuple(g.shape) for g in grads]} "
                             f"for shards {[tuple(s.shape) for s in self.shards]}")
        for i, g in enumerate(grads):
            if g is not self.grads[i]:
                self._fresh[i] = True
                self.to_host(i, g)
        self._stream(lambda k, buf: self._update(k, buf, inv_scale), "disk optimizer step")
        self._unread = False

    @torch.no_grad()
    def rewrite(self):
        """Stream every record through the same pipeline WITHOUT updating it (read, write to the other
        slot, commit: the state is unchanged): the disk's share of a step alone, for measuring how
        much of a real step the I/O explains (``benchmarks/bench_infinity.py``)."""
        self._stream(None, "disk rewrite")

    def _stream(self, update, name):
        """Read every record into a pool buffer (one ahead), ``update(k, buf)`` it, write it behind;
        commit; on failure roll back (:meth:`_rollback`). Fills ``last_step``."""
        n = len(self.layout)
        steps_before = [self.chunked.steps_taken(k) for k in range(n)]
        self.reader.spans.clear()                  # this step's spans only (they would grow forever)
        self.writer.spans.clear()
        read0 = write0 = 0
        bytes0 = (self.store.file.bytes_read, self.store.file.bytes_written)
        reads, writes, held, updates = collections.deque(), [], [], []
        t0 = time.perf_counter()

        def start_read(k):
            buf = self.pool.acquire()              # waits while every buffer is out (back-pressure)
            held.append(buf)
            reads.append((k, buf, self.reader.submit(self.store.read, k, buf)))

        try:
            with comm.span(name, "optimizer"):
                if n:
                    start_read(0)
                for k in range(n):
                    _, buf, fut = reads.popleft()
                    fut.result()                   # record k is in memory (re-raises a failed read)
                    if k + 1 < n:
                        start_read(k + 1)          # read ahead: overlaps the update of k
                    u0 = time.perf_counter()
                    if update is not None:
                        update(k, buf)
                    updates.append((u0, time.perf_counter()))
                    fut = self.writer.submit(self.store.write, k, buf)     # write behind
                    held.remove(buf)
                    fut.add_done_callback(lambda _, b=buf: self.pool.release(b))   # reusable once written
                    writes.append(fut)
                for fut in writes:
                    fut.result()                   # every record of this step has landed
                c0 = time.perf_counter()
                self.store.commit()                # fdatasync + atomic manifest: the new state is current
                commit = time.perf_counter() - c0
        except BaseException:
            self._rollback(reads, writes, held, steps_before)
            raise
        self.last_step = {
            "seconds": time.perf_counter() - t0, "chunks": n,
            "read_s": sum(b - a for a, b in self.reader.spans[read0:]),
            "write_s": sum(b - a for a, b in self.writer.spans[write0:]),
            "update_s": sum(b - a for a, b in updates), "commit_s": commit,
            "bytes_read": self.store.file.bytes_read - bytes0[0],
            "bytes_written": self.store.file.bytes_written - bytes0[1],
            "spans": {"read": [(a - t0, b - t0) for a, b in self.reader.spans[read0:]],
                      "update": [(a - t0, b - t0) for a, b in updates],
                      "write": [(a - t0, b - t0) for a, b in self.writer.spans[write0:]]}}

    def _rollback(self, reads, writes, held, steps_before):
        """A step failed: let the I/O in flight finish, give every buffer back, forget the half-written
        generation, reset the step counters and restore the compute shards from the committed masters."""
        for _, buf, fut in reads:
            try:
                fut.result()
            except BaseException:
                pass
        for fut in writes:
            try:
                fut.result()                       # its callback released its buffer
            except BaseException:
                pass
        for buf in held:
            self.pool.release(buf)
        self.store.abandon()
        for k, steps in enumerate(steps_before):
            self.chunked.set_steps(k, steps)
        self._reload_shards()

    # -- reading the committed state -----------------------------------------------------------
    def _records(self):
        """(k, {field: tensor view}) of every record of the committed state, one buffer at a time."""
        buf = self.pool.acquire()
        try:
            for k in range(len(self.layout)):
                self.store.read(k, buf)
                yield k, self._views(buf, k)
        finally:
            self.pool.release(buf)

    @torch.no_grad()
    def _reload_shards(self):
        for k, v in self._records():
            s, lo, hi = self.layout[k]
            self.publish(s, lo, hi, v["param"])

    @torch.no_grad()
    def master_shard(self, i):
        """A new RAM tensor with the committed fp32 master of shard i (full_state_dict, checkpoints)."""
        out = torch.empty(self.shards[i].numel(), dtype=self.dtype)
        for k, v in self._records():
            s, lo, hi = self.layout[k]
            if s == i:
                out[lo:hi].copy_(v["param"])
        return out

    @torch.no_grad()
    def staged(self):
        """(optimizer, [master per shard]): the committed state copied into RAM, as a torch optimizer
        of the same class and hyperparameters over shard-sized masters, its state filled (a
        checkpoint reads and writes this; :meth:`load_staged` writes it back to the disk). The copy
        is held only weakly here: it lives as long as the caller keeps it."""
        masters = [torch.zeros(s.numel(), dtype=self.dtype) for s in self.shards]
        group = {k: v for k, v in self.optimizer.param_groups[0].items() if k != "params"}
        opt = type(self.optimizer)(masters, lr=group["lr"])
        opt.param_groups[0].update(group)              # every hyperparameter as the engine's (schedules too)
        steps = {self.chunked.steps_taken(k) for k in range(len(self.layout))}
        if len(steps) > 1:
            raise RuntimeError(f"DiskOptimizer: chunks at different step counts {sorted(steps)}")
        state = [{f: torch.zeros_like(m) for f in self.chunked.fields} for m in masters]
        for k, v in self._records():
            s, lo, hi = self.layout[k]
            masters[s][lo:hi].copy_(v["param"])
            for f in self.chunked.fields:
                state[s][f][lo:hi].copy_(v[f])
        step = steps.pop() if steps else 0
        if step:
            for m, st in zip(masters, state):
                opt.state[m] = dict(st, step=torch.tensor(float(step)))
        self._staging = weakref.ref(opt)
        return opt, masters

    @torch.no_grad()
    def load_staged(self):
        """Write the staged copy (changed by a checkpoint load) to the disk as the new state (one
        commit), set the step counters, and put its masters into the compute shards."""
        opt = self._staging()
        if opt is None:
            raise RuntimeError("DiskOptimizer.load_staged: nothing staged (call staged() and keep its result)")
        masters = opt.param_groups[0]["params"]
        steps = {int(opt.state[m]["step"]) if "step" in opt.state.get(m, {}) else 0 for m in masters}
        if len(steps) != 1:
            raise RuntimeError(f"DiskOptimizer.load_staged: shards at different step counts {sorted(steps)}")
        step = steps.pop()
        buf = self.pool.acquire()
        try:
            for k, (s, lo, hi) in enumerate(self.layout):
                buf.zero_()
                v = self._views(buf, k)
                v["param"].copy_(masters[s][lo:hi])
                for f in self.chunked.fields:
                    if step:
                        v[f].copy_(opt.state[masters[s]][f][lo:hi])
                self.store.write(k, buf)
                self.publish(s, lo, hi, v["param"])
            self.store.commit()
        except BaseException:
            self.store.abandon()
            raise
        finally:
            self.pool.release(buf)
        for k in range(len(self.layout)):
            self.chunked.set_steps(k, step)
        self._staging = lambda: None

    @torch.no_grad()
    def _write_initial(self, init):
        """Generation 1: each chunk's master from ``init`` (or the shard), moments zero."""
        buf = self.pool.acquire()
        try:
            for k, (s, lo, hi) in enumerate(self.layout):
                buf.zero_()
                src = self.shards[s] if init[s] is None else init[s]
                self._views(buf, k)["param"].copy_(src.detach().reshape(-1)[lo:hi])
                self.store.write(k, buf)
            self.store.commit()
        finally:
            self.pool.release(buf)

    def state_tensors(self):
        """What this object holds in RAM, by kind: no master, no optimizer state (they are on disk);
        the host gradient shard, the chunk workspace, the swap buffers."""
        return {"master": [], "optimizer": [], "host_grads": [self.grad_flat],
                "workspace": [] if self.workspace is None else [self.workspace],
                "swap_buffers": list(self.pool.buffers)}

    def close(self):
        """Stop the I/O threads and delete the state file and its folder."""
        self._finalizer()


class ParamSwap:
    """Stage 3's parameter shards on disk (ZeRO-Infinity's parameter offload; DeepSpeed's
    ``offload_param: {device: nvme}``, ``AsyncPartitionedParameterSwapper`` in
    ``deepspeed/runtime/swap_tensor/partitioned_param_swapper.py``). Each unit's compute-dtype shard
    has an aligned region in ``params.bin``; in memory it exists only from just before the unit's
    all-gather until the unit is freed (:meth:`load`, :meth:`unload`), read ahead of use by
    :meth:`read_ahead` into a pool of ``buffers`` aligned buffers. The optimizer writes each updated
    chunk straight into the file (:meth:`store`). The file is not crash-safe by itself: the
    parameters are the masters cast, and the masters are (:mod:`zerolab.swap`)."""

    def __init__(self, units, folder, *, chunk, direct="auto", buffers=3):
        self.units = units
        self.dtype = units[0].shard.dtype
        self.esize = units[0].shard.element_size()
        self.nbytes = [u.shard.numel() * self.esize for u in units]
        self.offsets = [sum(round_up(b) for b in self.nbytes[:i]) for i in range(len(units))]
        size = self.offsets[-1] + round_up(self.nbytes[-1])
        why = check_folder(folder, need=size)
        if why:
            raise SwapError(why)
        self.file = DiskFile(pathlib.Path(folder) / "params.bin", direct=direct, create=True, size=size)
        self.pool = BufferPool(buffers, max(round_up(b) for b in self.nbytes))
        self.staging = aligned_empty(round_up(chunk * self.esize))
        self.io = IOWorker("param-read")
        self.inflight = {}                                  # unit index -> (buffer, future)
        buf = self.pool.acquire()
        try:
            for i, u in enumerate(units):
                buf[:self.nbytes[i]].copy_(u.shard.view(torch.uint8))
                self.file.write(buf[:round_up(self.nbytes[i])], self.offsets[i])
                self.unload(i)                              # from now on the file holds it
        finally:
            self.pool.release(buf)
        self.file.sync()

    def resident(self, i):
        return self.units[i].shard.untyped_storage().nbytes() > 0

    def _read(self, i, buf):
        self.file.read(buf[:round_up(self.nbytes[i])], self.offsets[i])

    def read_ahead(self, i):
        """Start reading unit i's shard in the background (if not in memory, not on its way, and a
        buffer is free beyond the one kept for a read on demand: a read ahead that is never used
        cannot block the unit that is needed)."""
        if not self.resident(i) and i not in self.inflight and self.pool.in_use() < self.pool.count - 1:
            buf = self.pool.acquire()
            self.inflight[i] = (buf, self.io.submit(self._read, i, buf))

    def load(self, i):
        """Unit i's shard in memory (before its all-gather): wait for its read ahead, or read it now."""
        if self.resident(i):
            return
        if i in self.inflight:
            buf, fut = self.inflight.pop(i)
            fut.result()
        else:
            buf = self.pool.acquire()
            self._read(i, buf)
        shard = self.units[i].shard
        shard.untyped_storage().resize_(self.nbytes[i])
        shard.view(torch.uint8).copy_(buf[:self.nbytes[i]])
        self.pool.release(buf)

    def unload(self, i):
        self.units[i].shard.untyped_storage().resize_(0)   # the file has the current values

    @torch.no_grad()
    def store(self, i, lo, hi, values):
        """Elements [lo, hi) of unit i's shard, new values (cast to the compute dtype), into the file
        (at a 4 KiB-aligned offset: chunks start at multiples of 4096 / element size elements)."""
        if i in self.inflight:                              # a read ahead of the old values: drop it
            buf, fut = self.inflight.pop(i)
            fut.result()
            self.pool.release(buf)
        n = (hi - lo) * self.esize
        self.staging[:n].view(self.dtype).copy_(values)
        self.file.write(self.staging[:round_up(n)], self.offsets[i] + lo * self.esize)
        if self.resident(i):
            self.units[i].shard[lo:hi].copy_(values)

    @property
    def file_bytes(self):
        return self.file.size()

    def close(self):
        for buf, fut in self.inflight.values():
            fut.result()
            self.pool.release(buf)
        self.inflight.clear()
        self.io.close()
        self.file.close()


class _Disk(_Offload):
    """What offload="disk" adds to every stage's offload engine: the :class:`DiskOptimizer`, its
    options, and the engine methods that read the master (full_state_dict, checkpoints) from disk."""

    OPTIONS = {
        "offload_path": Option(None, "a folder on the fast local disk that exists and is writable (each rank "
                                     "makes its own subfolder in it, removed at close)",
                               lambda v: v is None or isinstance(v, (str, os.PathLike))),
        "swap_chunk": Option(1 << 18, "a positive int: elements per swapped chunk (DeepSpeed's sub_group_size)",
                             lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0),
        "buffer_count": Option(4, "an int >= 2: swap buffers of one chunk each (DeepSpeed's buffer_count, "
                                  "default 4 too)", lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 2),
        "direct_io": Option("auto", "'auto' (O_DIRECT where the file system allows it), True or False",
                            lambda v: v is True or v is False or (isinstance(v, str) and v == "auto")),
        "offload_params": Option(False, "True or False (stage 3: the parameter shards on disk too)", is_flag),
    }
    host_kinds = _Offload.host_kinds + ("swap_buffers",)

    def __init__(self, module, *, offload_path=None, swap_chunk=1 << 18, buffer_count=4, direct_io="auto",
                 offload_params=False, **common):
        self.offload_path, self.swap_chunk, self.buffer_count = pathlib.Path(offload_path), swap_chunk, buffer_count
        self.direct_io, self.offload_params = direct_io, offload_params
        super().__init__(module, **common)

    @classmethod
    def label(cls):
        return f"stage {cls.stage} + disk offload"

    @classmethod
    def check_options(cls, options):
        super().check_options(options)
        if options["offload_path"] is None:
            raise ValueError(f"offload='disk' needs offload_path=<folder on the local disk> ({cls.label()})")
        why = check_folder(options["offload_path"])
        if why:
            raise ValueError(why)
        if options["offload_params"] and cls.stage != 3:
            raise ValueError(f"offload_params=True needs stage 3 ({cls.label()} keeps every parameter whole on "
                             f"every rank; only stage 3 partitions them, so only its shards can live on disk)")
        if options["offload_params"] and options["swap_chunk"] % 2048:
            raise ValueError(f"swap_chunk={options['swap_chunk']} with offload_params=True: use a multiple of "
                             f"2048 (each updated chunk of parameters is written at a 4 KiB-aligned offset)")

    @property
    def offload(self):
        return "disk"

    def _make_shard_optimizer(self, shards, init):
        folder = self.offload_path / f"zerolab-swap-rank{self.rank}-{os.getpid()}-{secrets.token_hex(4)}"
        folder.mkdir()
        try:
            return DiskOptimizer(shards, self.optimizer_class, folder=folder, init=init, swap_chunk=self.swap_chunk,
                                 buffer_count=self.buffer_count, direct_io=self.direct_io,
                                 grad_dtype=self.reduce_dtype, **self.opt_kwargs)
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise

    def disk_optimizers(self):
        return self.host_optimizers()

    def close(self):
        """Delete this rank's swap files (also done when the engine is garbage collected or the
        process exits normally). The engine cannot step afterwards."""
        for d in self.disk_optimizers():
            d.close()

    def disk_report(self):
        """{'folders', 'direct' (O_DIRECT in use), 'fallback' (why not), 'state_bytes' (one generation
        of master + moments), 'file_bytes' (both slots), 'pool_bytes' (the swap buffers in RAM)}."""
        ds = self.disk_optimizers()
        return {"folders": [str(d.folder) for d in ds], "direct": all(d.store.file.direct for d in ds),
                "fallback": "; ".join(sorted({d.store.file.fallback for d in ds if d.store.file.fallback})),
                "state_bytes": sum(d.store.state_bytes for d in ds),
                "file_bytes": sum(d.store.file.size() for d in ds),
                "pool_bytes": sum(d.pool.total_bytes for d in ds)}

    def placement(self):
        """By role, as :meth:`zerolab.engine.Engine.placement`, plus 'disk': one generation of the
        master and moments in the state files (the files hold two, see :mod:`zerolab.swap`)."""
        return dict(super().placement(), disk=self.disk_report()["state_bytes"])

    def state_tensors(self):
        return dict(super().state_tensors(),
                    swap_buffers=[b for d in self.disk_optimizers() for b in d.state_tensors()["swap_buffers"]])

    def _full_params(self):
        out = {}
        for flat, d, i in self.shards():
            full = gather_full(flat, d.master_shard(i), self.group)    # from the disk, one shard at a time
            for p, view in zip(flat.params, flat.views(full)):
                out[id(p)] = view.clone()
        return out

    def param_slots(self):
        """Slots over a RAM copy of the committed state (:meth:`DiskOptimizer.staged`), which a
        checkpoint save reads and a load writes; :meth:`reload_from_masters` then writes it to disk.
        So a save or a load holds this rank's master and moments in RAM while it runs (as lesson 09's
        writer holds its payload): the memory bound of the disk tier is a bound between checkpoints.
        DeepSpeed instead copies its swap folder into the checkpoint (``offloaded_tensors``)."""
        staged, slots = {}, []
        for flat, d, i in self.shards():
            if d not in staged:
                staged[d] = d.staged()
            opt, masters = staged[d]
            lo, hi = flat.shard_range()                # this rank's elements of the flat buffer
            ranges = [(p, max(lo, off) - off, min(hi, off + p.numel()) - off, max(lo, off) - lo)
                      for p, off in zip(flat.params, flat.offsets) if max(lo, off) < min(hi, off + p.numel())]
            slots.append(Slot(opt, masters[i], ranges))
        return slots

    def reload_from_masters(self, *, pending=False):
        if pending:
            raise ValueError(f"{type(self).__name__} has no delayed update: reload_from_masters(pending=True)")
        for d in self.disk_optimizers():
            d.load_staged()
        self._publish()


class Zero1DiskEngine(_Disk, Zero1Engine):
    """ZeRO-1 + the optimizer states on disk (DeepSpeed keeps them in CPU memory at stage 1)."""


class Zero2DiskEngine(_Disk, Zero2Engine):
    """ZeRO-2 + the optimizer states on disk: each bucket's averaged gradient shard goes to the host
    as its reduce-scatter lands; the step streams master and moments from disk."""

    def _new_grad_shards(self, sizes):
        return None, self.shard_optim.grads

    def _keep_grad_shard(self, i, shard):
        self.shard_optim.to_host(i, shard)


class Zero3DiskEngine(_Disk, Zero3Engine):
    """ZeRO-3 + the optimizer states on disk (DeepSpeed's ``offload_optimizer: {device: nvme}`` at
    stage 3, ZeRO-Infinity's optimizer offload); with ``offload_params=True`` the compute-dtype
    parameter shards too (``offload_param: {device: nvme}``, :class:`ParamSwap`): a unit's shard is
    read from disk just before its all-gather, one unit ahead of the gather prefetch, and dropped when
    the unit is freed."""

    def __init__(self, module, **kw):
        self.param_swap = None                    # set before Zero3Engine frees its units in __init__
        super().__init__(module, **kw)
        if self.offload_params:
            self.param_swap = ParamSwap(self.units, self.shard_optim.folder, chunk=self.swap_chunk,
                                        direct=self.direct_io)
            self.shard_optim.params_on_disk = self.param_swap

    def _keep_grad_shard(self, i, shard):
        self.shard_optim.to_host(i, shard)

    def _step_grads(self):
        return self.shard_optim.grads

    def _gather(self, u, async_op=False):
        if self.param_swap is not None and u.state != GATHERING and not (u.state == READY and not u.stale):
            self.param_swap.load(u.index)         # the shard from disk, right before the all-gather
        super()._gather(u, async_op)

    def _free(self, u):
        super()._free(u)
        if self.param_swap is not None and not u.keep:
            self.param_swap.unload(u.index)       # a kept unit keeps its shard: it is re-gathered in place

    def _prefetch(self, order, after):
        if self.param_swap is not None:
            for j in order[after + 1:after + 3]:  # the next unit's shard and the one after: read ahead
                self.param_swap.read_ahead(j)
        super()._prefetch(order, after)

    def disk_report(self):
        out = super().disk_report()
        if self.param_swap is not None:
            out["param_bytes"] = sum(self.param_swap.nbytes)
            out["file_bytes"] += self.param_swap.file_bytes
            out["pool_bytes"] += self.param_swap.pool.total_bytes
        return out

    def placement(self):
        out = super().placement()
        if self.param_swap is not None:
            out["disk"] += sum(self.param_swap.nbytes)
        return out

    def state_tensors(self):
        out = super().state_tensors()
        if self.param_swap is not None:
            out["swap_buffers"] = out["swap_buffers"] + list(self.param_swap.pool.buffers) + [self.param_swap.staging]
        return out

    def close(self):
        if self.param_swap is not None:
            self.param_swap.close()
        super().close()

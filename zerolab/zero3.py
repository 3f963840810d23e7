"""ZeRO stage 3 (P_os+g+p): parameters partitioned too (Rajbhandari et al., arXiv 1910.02054, Sec. 5.3).

Each rank stores only its 1/N shard of the parameters, gradients and optimizer states: (4+K)Ψ/N
bytes. A full parameter exists only while the layer that needs it runs. The model is cut into
*units* (each ``model.blocks[i]`` of TinyGPT, else each top-level child, or a list you give); each
unit is one padded flat buffer (:class:`zerolab.flat.FlatParams`) whose storage is there only when
gathered. Per unit, per step (paper Sec. 7.2.2: 3Ψ per step, 1.5x data parallelism):

    forward:  all-gather (Ψ_u) -> compute -> free            while the NEXT unit's all-gather runs
    backward: all-gather (Ψ_u) -> grads -> reduce-scatter (Ψ_u) to the owners -> free

Parameters of no unit (TinyGPT: embeddings, final norm, the tied head) form the *root* unit. It
is gathered once at the start of forward and kept until its gradients are complete, as FSDP2
keeps its root: freeing it after forward would only re-gather it at once for backward (2Ψ_u, not
3Ψ_u). This is also how tied weights work: ``tok.weight is head.weight`` is one tensor, in one
unit (the root), gathered once, its two gradient contributions summed by autograd before its
gradient hook fires. A weight shared by two default units goes into the root too; shared by two
units you name, it is refused (ValueError). Units of at most ``persist_numel`` elements stay gathered
between steps (DeepSpeed's ``stage3_param_persistence_threshold``): 2Ψ_u per step and Ψ_u
persistent bytes each. How the model is cut: :mod:`zerolab.units`.

Freeing means ``storage.resize_(0)`` of the unit's flat buffer, not ``p.data = empty``: autograd
saves *views* of the weights (``weight.t()`` for a Linear), which would keep the old storage alive
until backward; resizing the one shared storage frees it, and re-gathering into it in backward
makes those saved views valid again (FSDP1's mechanism). Frozen parameters are not sharded (no
grads, no optimizer state): every rank keeps them whole, counted in the memory report.

A model built on the meta device (shapes, no memory) is materialized one unit at a time: each
unit's modules get memory and values (``init_fn``, ``init_seed``: :mod:`zerolab.meta_init`), the
unit is packed and sharded, its full buffer freed, before the next unit: no rank holds the whole
model, as with DeepSpeed's ``zero.Init`` and FSDP2's meta-device initialization.

The gather/free/reduce-scatter/pre-backward primitives are module-level functions (exercise 05)
that the engine calls through ``ops``; pass ``ops=`` to run it on your own.
"""
import contextlib
import sys

import torch
import torch.utils._pytree as pytree

from zerolab import comm, engine
from zerolab.engine import Option, OwnedGrads, ShardedEngine, is_count, is_flag
from zerolab.shard_optim import master_dtype
from zerolab.launch import rank_device
from zerolab.meta_init import Materializer, check_init_options
from zerolab.units import FREE, GATHERING, READY, ForeignUseCheck, Unit, plan_units

PRIMITIVES = ("gather", "free", "reduce_scatter_grads", "register_pre_backward")


# -- the four primitives (exercise 05) ------------------------------------------------------
def gather(unit, group=None, async_op=False):
    """Give ``unit.full`` its storage back and all-gather every rank's ``unit.shard`` into it:
    afterwards the unit's parameters (views into ``unit.full``) hold the full values. Sends
    (N-1)/N x the full buffer's bytes. Returns the async handle (or None)."""
    full = unit.full
    full.untyped_storage().resize_(full.numel() * full.element_size())   # Ψ_u elements again
    tag = f"{unit.name} prefetch" if async_op else unit.name              # the engine's async gathers prefetch
    return comm.all_gather(full, unit.shard, group=group, async_op=async_op, tag=tag)


def free(unit):
    """Release the storage of ``unit.full``: the parameters keep their shapes, hold 0 bytes."""
    unit.full.untyped_storage().resize_(0)


def reduce_scatter_grads(unit, grad_full, group=None, impl="torch"):
    """Sum ``grad_full`` (this rank's full gradient of the unit) over ranks into this rank's own
    slice of it, in place: rank r receives shard r, the slice it owns. Returns the async handle
    (``impl='torch'``) or None (``impl='ring'``, blocking, lesson 00's ring)."""
    own = unit.flat.shard(grad_full)
    return engine.reduce_scatter(own, grad_full, group=group, impl=impl, async_op=True, tag=unit.name)


def register_pre_backward(output, fn):
    """Make ``fn()`` run when backward reaches ``output`` (a unit's forward result: a tensor or
    a nested tuple/list/dict of them), i.e. just before the unit's own backward: a hook on the
    gradient of every output tensor that requires grad. Returns how many hooks were registered."""
    tensors = [t for t in pytree.tree_leaves(output) if torch.is_tensor(t) and t.requires_grad]
    for t in tensors:
        t.register_hook(lambda grad: fn())
    return len(tensors)


def _is_ops(v):
    return v is None or all(callable(getattr(v, name, None)) for name in PRIMITIVES)


class Zero3Engine(ShardedEngine):
    """Stage 3 of ``zerolab.initialize``. Options (keyword arguments of ``initialize``):
    ``units`` (modules to shard one by one), ``prefetch`` (start the next unit's all-gather early,
    default True), ``persist_numel`` (units this small stay gathered, default 0), ``ops`` (an
    object with gather/free/reduce_scatter_grads/register_pre_backward: your exercise 05),
    ``init_fn`` and ``init_seed`` (a model on the meta device: :mod:`zerolab.meta_init`).
    Call the engine, not the module: its hooks gather parameters only inside ``engine(...)``;
    gradient accumulation: repeated ``backward()`` adds each reduce-scattered shard (``no_sync``
    changes nothing at stage 3: keeping full gradients would undo the partitioning).
    While ``engine.timeline`` is set, ``engine.memory_trace`` gets (time, live bytes of gathered
    parameters and full-size gradients, event) after every primitive call."""

    stage = 3
    replicated_params = False
    OPTIONS = {"units": Option(None, "None (each of model.blocks, else each top-level child) or a list of "
                                     "submodules", lambda v: v is None or isinstance(v, (list, tuple))),
               "prefetch": Option(True, "True or False", is_flag),
               "persist_numel": Option(0, "an int >= 0 (units of at most this many elements stay gathered)",
                                       is_count),
               "ops": Option(None, f"None or an object with {', '.join(PRIMITIVES)}", _is_ops),
               "init_fn": Option(None, "None (each module's reset_parameters()) or a callable(module): a meta-"
                                       "device model's initialization", lambda v: v is None or callable(v)),
               "init_seed": Option(None, "None (0) or an int: the seed of a meta-device model's initialization",
                                   lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool)))}

    def __init__(self, module, *, units=None, prefetch=True, persist_numel=0, ops=None, init_fn=None,
                 init_seed=None, **common):
        on_meta = check_init_options(module, init_fn, init_seed)
        super().__init__(module, **common)
        self.prefetch, self.persist_numel = prefetch, persist_numel
        self._ops, self.memory_trace = ops or sys.modules[__name__], []
        trainable = self._prepare()
        plan = plan_units(module, units, trainable, persist_numel=persist_numel)
        meta = Materializer(module, device=rank_device(), seed=init_seed or 0, init_fn=init_fn) if on_meta else None
        mixed = master_dtype(self.compute_dtype) != self.compute_dtype
        self.units, init = [], [] if mixed else None
        for i, (name, m, ps, resident, keep) in enumerate(plan):    # one unit at a time, then freed
            if meta is not None:
                meta.materialize(ps, unit=name)       # a meta model: only this unit's modules exist now
            originals = [p.detach() for p in ps]      # exact values, before any cast
            u = Unit(i, name, m, ps, world_size=self.world_size, rank=self.rank, dtype=self.compute_dtype,
                     resident=resident, keep=keep)
            if mixed:                                 # bf16: the fp32 master shard from the originals
                init.append(u.flat.shard_from(originals, torch.float32))
            del originals                             # only the flat buffer holds the unit now
            self.units.append(u)
            self._free(u)                             # resting state: shards only
        if meta is not None:                          # buffers, frozen parameters: whole on every rank
            meta.finish(module, {id(p) for p in trainable}, group=self.replica_group())
            self._cast_whole()
        self.shard_optim = self._make_shard_optimizer([u.shard for u in self.units], init)
        self.optimizer = self.shard_optim.optimizer
        # This rank's averaged gradient shard per unit (2Ψ/N bytes in bf16): created as the unit's
        # reduce-scatter lands, released by zero_grad() (set_to_none, torch's default; FSDP2 does
        # the same), so between steps a rank holds (2+K)Ψ/N and during backward up to (4+K)Ψ/N.
        self.grad_shards = [None] * len(self.units)
        self._where = {id(p): u for u in self.units for p in u.flat.params}
        for p in trainable:
            p.register_post_accumulate_grad_hook(self._on_grad)
        for u in self.units:
            if not u.resident:
                u.module.register_forward_pre_hook(self._pre_forward_hook(u))
                u.module.register_forward_hook(self._post_forward_hook(u))
        module.register_forward_pre_hook(self._guard)
        self._in_forward, self._in_backward, self._inflight, self._fwd, self._bwd = False, False, [], [], []
        self.phase = "forward"        # what the next gathers serve: "forward", or "backward" once forward ran
        self._predicted = [u.index for u in self.units if not u.resident]   # forward order guess
        self._running, self._uses_checked = [], False    # units whose forward runs; first forward checked

    def replica_group(self):
        """The ranks that must hold the same model: this engine's group (HSDP: all ranks)."""
        return self.group

    @property
    def ops(self):
        """The four primitives; while a timeline records, each call also appends to memory_trace."""
        if self.timeline is None:
            return self._ops
        return engine.traced(self._ops, lambda name, unit: self.memory_trace.append(
            (self.timeline.now(), self._live_bytes(), f"{name} {getattr(unit, 'name', '')}".strip())))

    def _live_bytes(self):
        return sum(t.untyped_storage().nbytes() for u in self.units
                   for t in [u.full, u.grad_full] + [p.grad for p in u.flat.params] if t is not None)

    # -- gather / free -------------------------------------------------------------------------
    def _gather(self, u, async_op=False):
        """Make u READY (or GATHERING, if ``async_op``): wait for its prefetch or gather it now."""
        if u.state == READY and not u.stale:
            return
        if u.state == GATHERING:
            if not async_op:
                u.work.wait()
                u.state, u.work = READY, None
            return
        u.stale = False
        work = self.ops.gather(u, group=self.group, async_op=async_op)
        if async_op:
            u.work, u.state = work, GATHERING
        else:
            if work is not None:
                work.wait()
            u.state = READY

    def _free(self, u):
        if u.state == GATHERING:
            self._gather(u)                      # never free a buffer a collective is writing
        self.ops.free(u)
        u.state = FREE

    def _prefetch(self, order, after):
        """Start the all-gather of the unit at ``order[after + 1]`` unless it is gathered already
        (P_p's prefetch: it runs while the current unit computes). One unit ahead, no more."""
        if self.prefetch and after + 1 < len(order):
            u = self.units[order[after + 1]]
            if not u.started and u.state == FREE:
                self._gather(u, async_op=True)

    # -- forward -------------------------------------------------------------------------------
    def _guard(self, module, args):
        if not self._in_forward:
            raise RuntimeError("ZeRO-3: call the engine (engine(x, y)), not engine.module: only the "
                               "engine gathers the sharded parameters")

    def forward(self, *args, **kwargs):
        self._settle()                           # a forward whose backward never came
        self._fwd, grad, self.phase = [], torch.is_grad_enabled(), "forward"
        for u in self.units:
            u.started, u.launched, u.arrived, u.t_bwd = False, False, set(), None
            if u.resident:
                self._gather(u)                  # root (and small units): once per step
        self._prefetch(self._predicted, -1)
        self._in_forward = True
        check = (contextlib.nullcontext() if self._uses_checked else
                 ForeignUseCheck(self._where, self._running, self.module))
        self._running.clear()
        try:
            with check:
                out = self.module(*engine.cast_floats(args, self.compute_dtype),
                                  **engine.cast_floats(kwargs, self.compute_dtype))
            self._uses_checked = True
        finally:
            self._in_forward, self.phase = False, "backward"   # every later gather serves backward
            self._predicted = self._fwd or self._predicted
            for u in self.units:                 # wrong guesses: a prefetched unit never used
                if not u.resident and u.state != FREE:
                    self._free(u)
        self._bwd = list(dict.fromkeys(reversed(self._fwd)))   # backward runs forward's units reversed
        if grad:
            self._prefetch(self._bwd, -1)        # the first unit backward needs
        else:
            self._settle()
        return out

    def _pre_forward_hook(self, u):
        def hook(module, args):
            if not self._in_forward:
                if self._in_backward:            # recomputed in backward (activation checkpointing) by a
                    self._gather(u)              # checkpoint that spans units: gathered now, kept until its
                return                           # own backward is done. Else the guard on the model raises
            self._fwd.append(u.index)
            self._running.append(u)
            self._gather(u)                      # all-gather right before use (or wait for the prefetch)
            self._prefetch(self._predicted, len(self._fwd) - 1)
            u.t_fwd = comm.clock()
        return hook

    def _post_forward_hook(self, u):
        def hook(module, args, output):
            if not self._in_forward:
                return
            comm.end_span(f"forward {u.name}", "compute", u.t_fwd)
            if u in self._running:
                self._running.remove(u)
            self._free(u)                        # free right after use
            if torch.is_grad_enabled():
                self.ops.register_pre_backward(output, lambda: self._pre_backward(u))
        return hook

    # -- backward ------------------------------------------------------------------------------
    def _pre_backward(self, u):
        if u.started:
            return                               # a unit called twice: gathered once for backward
        u.started = True
        self._gather(u)                          # all-gather again: backward needs the weights
        u.t_bwd = comm.clock()
        self._prefetch(self._bwd, self._bwd.index(u.index) if u.index in self._bwd else -1)

    @torch.no_grad()
    def _on_grad(self, p):
        """Post-accumulate-grad hook: p.grad is final for this backward (autograd has summed every
        use of p, e.g. a module called twice or a tied weight, before it runs)."""
        u = self._where[id(p)]
        if u.launched:
            raise RuntimeError(f"ZeRO-3: a gradient of unit {u.name!r} arrived after the unit was "
                               f"reduce-scattered (one backward per forward, please)")
        if u.state != READY:
            raise RuntimeError(f"ZeRO-3: a gradient of unit {u.name!r} was computed while its parameters "
                               f"were not gathered (a unit's weight used outside the unit's forward?)")
        u.arrived.add(id(p))                     # p.grad stays until the unit is complete
        if len(u.arrived) == len(u.flat.params):
            self._grads_complete(u)

    def _grads_complete(self, u):
        comm.end_span(f"backward {u.name}", "compute", u.t_bwd)
        u.started = u.launched = True
        # Pack the unit's gradients into one flat buffer (Ψ_u, zeros for params without a gradient)
        # only now, at the end of its backward: allocated earlier it would sit beside the unit's
        # activations, at the step's memory peak (FSDP2 packs its reduce-scatter input this way too).
        u.grad_full = u.flat.new_buffer(self.reduce_dtype)   # reduced in the reduce dtype
        for p, view in zip(u.flat.params, u.flat.views(u.grad_full)):
            if p.grad is not None:
                view.copy_(p.grad)
                p.grad = None                    # no full-size gradient survives the unit
        if not u.keep:
            self._free(u)                        # its weights are no longer needed this step
        if self._inflight:
            self._finish_oldest()                # at most two units of full-size grads alive
        work = self.ops.reduce_scatter_grads(u, u.grad_full, group=self.group, impl=self.reduce_impl)
        self._inflight.append((u, work))
        if work is None:
            self._finish_oldest()                # blocking (ring): done, free the grads now

    def _finish_oldest(self):
        u, work = self._inflight.pop(0)
        if work is not None:
            work.wait()
        self._keep_grad_shard(u.index, u.flat.shard(u.grad_full).div_(self.world_size))   # the average
        u.grad_full = None                       # free the unit's full-size gradients

    def _keep_grad_shard(self, i, shard):
        """Keep unit i's averaged gradient shard (zerolab.offload: on the host instead)."""
        if self.grad_shards[i] is None:
            self.grad_shards[i] = shard.clone()  # a view would pin all of grad_full
        else:
            self.grad_shards[i].add_(shard)      # gradient accumulation

    @torch.no_grad()
    def _backward(self, loss):
        self._in_backward = True
        try:
            with torch.enable_grad():
                loss.backward()                  # gathers, reduce-scatters and frees from the hooks
        except RuntimeError as exc:
            if "storage of size 0" in str(exc):
                raise RuntimeError("ZeRO-3: backward used a unit's parameters while they were freed: the "
                                   "pre-backward hook must gather the unit again before its backward "
                                   f"runs (register_pre_backward, gather). torch said: {exc}") from exc
            raise
        finally:
            self._in_backward = False
        for u in self.units:                     # units with unused parameters (or none used):
            if not u.launched:                   # reduce-scattered now, in unit order on every rank
                self._grads_complete(u)
        self._settle()

    def _settle(self):
        """End of a step's communication: wait for every reduce-scatter, free what is not kept."""
        while self._inflight:
            self._finish_oldest()
        for u in self.units:
            if u.state != FREE and not u.keep:
                self._free(u)

    def quiesce(self):
        self._settle()

    # -- step and state ----------------------------------------------------------------------
    def _step(self):
        self._settle()
        self.shard_optim.step(self._step_grads(), inv_scale=self.inv_scale)   # each unit's shard, in place
        self._publish()

    def _step_grads(self):
        return [torch.zeros_like(u.shard) if g is None else g for u, g in zip(self.units, self.grad_shards)]

    def owned_grads(self):
        return OwnedGrads(self._step_grads(), [])

    def _publish(self):
        for u in self.units:
            u.stale = u.state != FREE            # a unit kept gathered is re-gathered at its next use

    def _zero_grad(self):
        self.grad_shards = [None] * len(self.units)

    def no_sync(self):
        return contextlib.nullcontext()         # see the class docstring

    def shards(self):
        return [(u.flat, self.shard_optim, i) for i, u in enumerate(self.units)]   # one per unit

    def state_tensors(self):
        st = self.shard_optim.state_tensors()
        grads = self.grad_shards + [u.grad_full for u in self.units] + [p.grad for p in self.trainable]
        return {"params": [u.shard for u in self.units] + [u.full for u in self.units],   # full: 0 B when free
                "grads": [g for g in grads if g is not None],     # full-size ones during backward only
                "master": st["master"], "optimizer": st["optimizer"], "frozen": self.frozen}

    def padding_bytes(self):
        total = 0
        for i, u in enumerate(self.units):
            grad = 0 if self.grad_shards[i] is None else self.grad_shards[i].element_size()
            per_elem = u.shard.element_size() + grad + self.shard_optim.element_bytes(i)
            total += u.flat.shard_padding() * per_elem
            if u.full.untyped_storage().nbytes():
                total += u.flat.padding * u.full.element_size()
        return total

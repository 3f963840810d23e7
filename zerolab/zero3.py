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
gradient hook fires. A weight shared by two units is refused (ValueError). Units of at most
``persist_numel`` elements stay gathered between steps (DeepSpeed's
``stage3_param_persistence_threshold``): 2Ψ_u per step and Ψ_u persistent bytes each.

Freeing means ``storage.resize_(0)`` of the unit's flat buffer, not ``p.data = empty``: autograd
saves *views* of the weights (``weight.t()`` for a Linear), which would keep the old storage alive
until backward; resizing the one shared storage frees it, and re-gathering into it in backward
makes those saved views valid again (FSDP1's mechanism). Frozen parameters are not sharded (no
grads, no optimizer state): every rank keeps them whole, counted in the memory report.

The gather/free/reduce-scatter/pre-backward primitives are module-level functions (exercise 05)
that the engine calls through ``ops``; pass ``ops=`` to run it on your own.
"""
import contextlib
import sys

import torch
import torch.utils._pytree as pytree

from zerolab import comm
from zerolab.flat import FlatParams
from zerolab.shard_optim import ShardOptimizer, master_dtype
from zerolab.timeline import maybe_span
from zerolab.zero1 import ShardedEngine, default_reduce_impl, gather_full

FREE, GATHERING, READY = "free", "gathering", "ready"
OPTIONS = ("units", "prefetch", "persist_numel", "ops")   # stage-3 options, via initialize(**kwargs)


# -- the four primitives (exercise 05) ------------------------------------------------------
def gather(unit, group=None, async_op=False):
    """Give ``unit.full`` its storage back and all-gather every rank's ``unit.shard`` into it:
    afterwards the unit's parameters (views into ``unit.full``) hold the full values. Sends
    (N-1)/N x the full buffer's bytes. Returns the async handle (or None)."""
    full = unit.full
    full.untyped_storage().resize_(full.numel() * full.element_size())   # Ψ_u elements again
    return comm.all_gather(full, unit.shard, group=group, async_op=async_op)


def free(unit):
    """Release the storage of ``unit.full``: the parameters keep their shapes, hold 0 bytes."""
    unit.full.untyped_storage().resize_(0)


def reduce_scatter_grads(unit, grad_full, group=None, impl="torch"):
    """Sum ``grad_full`` (this rank's full gradient of the unit) over ranks into this rank's own
    slice of it, in place: rank r receives shard r, the slice it owns. Returns the async handle
    (``impl='torch'``) or None (``impl='ring'``, blocking, lesson 00's ring)."""
    own = unit.flat.shard(grad_full)
    return comm.reduce_scatter(own, grad_full, group=group, async_op=impl == "torch", impl=impl)


def register_pre_backward(output, fn):
    """Make ``fn()`` run when backward reaches ``output`` (a unit's forward result: a tensor or
    a nested tuple/list/dict of them), i.e. just before the unit's own backward: a hook on the
    gradient of every output tensor that requires grad. Returns how many hooks were registered."""
    tensors = [t for t in pytree.tree_leaves(output) if torch.is_tensor(t) and t.requires_grad]
    for t in tensors:
        t.register_hook(lambda grad: fn())
    return len(tensors)


class Unit:
    """One unit of ZeRO-3: its flat buffer ``full`` (storage present only while gathered), this
    rank's persistent ``shard`` (compute dtype), and its state during a step."""

    def __init__(self, index, name, module, params, *, world_size, rank, dtype, resident, keep):
        self.index, self.name, self.module = index, name, module
        self.flat = FlatParams(params, world_size, rank, dtype=dtype)   # params become views
        self.full = self.flat.data                          # (padded Ψ_u,) compute dtype
        self.shard = self.flat.shard(self.full).clone()     # (Ψ_u/N,) the only persistent copy
        self.resident, self.keep = resident, keep           # root / small unit; keep: across steps
        self.state, self.work, self.stale = READY, None, False
        self.grad_full, self.arrived, self.started, self.launched = None, set(), False, False
        self.t_fwd = self.t_bwd = None                      # timeline: when its compute began

    @property
    def numel(self):
        return self.flat.numel


def default_units(model):
    """TinyGPT-like models: each of ``model.blocks``; otherwise each top-level child."""
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, torch.nn.ModuleList):
        return list(blocks)
    return [m for m in model.children() if not isinstance(m, (torch.nn.ModuleList, torch.nn.ModuleDict))]


class Zero3Engine(ShardedEngine):
    """Stage 3 of ``zerolab.initialize``. Options (keyword arguments of ``initialize``):
    ``units`` (modules to shard one by one), ``prefetch`` (start the next unit's all-gather early,
    default True), ``persist_numel`` (units this small stay gathered, default 0), ``ops`` (an
    object with gather/free/reduce_scatter_grads/register_pre_backward: your exercise 05).
    Call the engine, not the module: its hooks gather parameters only inside ``engine(...)``;
    gradient accumulation: repeated ``backward()`` adds each reduce-scattered shard (``no_sync``
    changes nothing at stage 3: keeping full gradients would undo the partitioning)."""

    stage = 3
    host_kinds = ("master", "optimizer")   # offload='optimizer': ShardOptimizer keeps them on the host

    def __init__(self, module, **options):
        super().__init__(module, **options)
        extra = {k: self.opt_kwargs.pop(k) for k in OPTIONS if k in self.opt_kwargs}
        self.prefetch = extra.get("prefetch", True)
        self.persist_numel = extra.get("persist_numel", 0)
        self.ops = extra.get("ops") or sys.modules[__name__]
        if self.prefetch not in (True, False):
            raise ValueError(f"prefetch must be True or False, got {self.prefetch!r}")
        if isinstance(self.persist_numel, bool) or not isinstance(self.persist_numel, int) or self.persist_numel < 0:
            raise ValueError(f"persist_numel must be an int >= 0, got {self.persist_numel!r}")
        trainable = self._prepare()
        self.reduce_impl, self.timeline, self.memory_trace = default_reduce_impl(self.group), None, []
        originals = {id(p): p.detach() for p in trainable}      # exact values, before any cast
        self.units = self._build_units(extra.get("units"), trainable)
        # This rank's averaged gradient shard per unit (2Ψ/N bytes in bf16): created as the unit's
        # reduce-scatter lands, released by zero_grad() (set_to_none, torch's default; FSDP2 does
        # the same), so between steps a rank holds (2+K)Ψ/N and during backward up to (4+K)Ψ/N.
        self.grad_shards = [None] * len(self.units)
        init = None
        if master_dtype(self.compute_dtype) != self.compute_dtype:   # bf16: fp32 master from originals
            init = [u.flat.shard_from([originals[id(p)] for p in u.flat.params], torch.float32) for u in self.units]
        self.shard_optim = ShardOptimizer([u.shard for u in self.units], self.optimizer_class, init=init,
                                          device="cpu" if self.offload == "optimizer" else None, **self.opt_kwargs)
        self._where = {id(p): u for u in self.units for p in u.flat.params}
        for p in trainable:
            p.register_post_accumulate_grad_hook(self._on_grad)
        for u in self.units:
            if not u.resident:
                u.module.register_forward_pre_hook(self._pre_forward_hook(u))
                u.module.register_forward_hook(self._post_forward_hook(u))
            self._free(u)                                         # resting state: shards only
        module.register_forward_pre_hook(self._guard)
        self._in_forward, self._inflight, self._fwd, self._bwd = False, [], [], []
        self._predicted = [u.index for u in self.units if not u.resident]   # forward order guess

    def _build_units(self, units, trainable):
        modules = default_units(self.module) if units is None else list(units)
        names = {id(m): n for n, m in self.module.named_modules()}
        owner, chosen = {}, []
        for m in modules:
            if not isinstance(m, torch.nn.Module) or id(m) not in names or m is self.module:
                raise ValueError(f"units must be submodules of the model (not the model itself), got {type(m).__name__}")
            if isinstance(m, (torch.nn.ModuleList, torch.nn.ModuleDict)):
                raise ValueError(f"unit {names[id(m)]!r} is a {type(m).__name__}: its forward never runs; "
                                 f"list its members instead")
            params = [p for p in dict.fromkeys(m.parameters()) if p.requires_grad]
            if not params:
                if units is not None:
                    raise ValueError(f"unit {names[id(m)]!r} has no trainable parameters")
                continue                                          # e.g. a frozen layer: stays whole
            for p in params:
                if id(p) in owner:
                    raise ValueError(
                        f"a parameter of unit {names[id(m)]!r} also belongs to unit {owner[id(p)]!r} (nested "
                        f"units or a weight shared between units). Put modules that share a weight in one "
                        f"unit, or leave them out of `units` (they then go into the root unit)")
                owner[id(p)] = names[id(m)]
            chosen.append((names[id(m)], m, params))
        root = [p for p in trainable if id(p) not in owner]
        if root:
            chosen.insert(0, ("root", None, root))
        if not chosen:
            raise ValueError("no trainable parameters in any unit")
        return [Unit(i, name, m, ps, world_size=self.world_size, rank=self.rank, dtype=self.compute_dtype,
                     resident=m is None or sum(p.numel() for p in ps) <= self.persist_numel,
                     keep=sum(p.numel() for p in ps) <= self.persist_numel)
                for i, (name, m, ps) in enumerate(chosen)]

    # -- gather / free, with the timeline and the live-memory trace ---------------------------
    def _trace(self, event):
        if self.timeline is not None:
            live = sum(t.untyped_storage().nbytes() for u in self.units
                       for t in [u.full, u.grad_full] + [p.grad for p in u.flat.params] if t is not None)
            self.memory_trace.append((self.timeline.now(), live, event))

    def _gather(self, u, async_op=False):
        """Make u READY (or GATHERING, if ``async_op``): wait for its prefetch or gather it now."""
        if u.state == READY and not u.stale:
            return
        if u.state == GATHERING:
            if not async_op:
                with maybe_span(self.timeline, f"wait {u.name}", "wait"):
                    u.work.wait()
                u.state, u.work = READY, None
            return
        u.stale = False
        if async_op:
            u.work, u.state = self.ops.gather(u, group=self.group, async_op=True), GATHERING
            if self.timeline is not None and u.work is not None:
                self.timeline.mark_async(f"gather {u.name}", "comm", u.work)
        else:
            with maybe_span(self.timeline, f"gather {u.name}", "comm"):
                work = self.ops.gather(u, group=self.group, async_op=False)
                if work is not None:
                    work.wait()
            u.state = READY
        self._trace(f"gather {u.name}")

    def _free(self, u):
        if u.state == GATHERING:
            self._gather(u)                      # never free a buffer a collective is writing
        self.ops.free(u)
        u.state = FREE
        self._trace(f"free {u.name}")

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
        self._fwd, grad = [], torch.is_grad_enabled()
        for u in self.units:
            u.started, u.launched, u.arrived, u.t_bwd = False, False, set(), None
            if u.resident:
                self._gather(u)                  # root (and small units): once per step
        self._prefetch(self._predicted, -1)
        self._in_forward = True
        try:
            out = super().forward(*args, **kwargs)
        finally:
            self._in_forward = False
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
                return                           # the guard on the model raises
            self._fwd.append(u.index)
            self._gather(u)                      # all-gather right before use (or wait for the prefetch)
            self._prefetch(self._predicted, len(self._fwd) - 1)
            u.t_fwd = self.timeline.now() if self.timeline is not None else None
        return hook

    def _post_forward_hook(self, u):
        def hook(module, args, output):
            if not self._in_forward:
                return
            if self.timeline is not None:
                self.timeline.record(f"forward {u.name}", "compute", u.t_fwd, self.timeline.now())
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
        u.t_bwd = self.timeline.now() if self.timeline is not None else None
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
        self._trace(f"grad {u.name}")
        if len(u.arrived) == len(u.flat.params):
            self._grads_complete(u)

    def _grads_complete(self, u):
        if self.timeline is not None and u.t_bwd is not None:
            self.timeline.record(f"backward {u.name}", "compute", u.t_bwd, self.timeline.now())
        u.started = u.launched = True
        # Pack the unit's gradients into one flat buffer (Ψ_u, zeros for params without a gradient)
        # only now, at the end of its backward: allocated earlier it would sit beside the unit's
        # activations, at the step's memory peak (FSDP2 packs its reduce-scatter input this way too).
        u.grad_full = u.flat.new_buffer()
        for p, view in zip(u.flat.params, u.flat.views(u.grad_full)):
            if p.grad is not None:
                view.copy_(p.grad)
                p.grad = None                    # no full-size gradient survives the unit
        self._trace(f"packed grads {u.name}")
        if not u.keep:
            self._free(u)                        # its weights are no longer needed this step
        if self._inflight:
            self._finish_oldest()                # at most two units of full-size grads alive
        with maybe_span(self.timeline if self.reduce_impl == "ring" else None, f"reduce-scatter {u.name}", "comm"):
            work = self.ops.reduce_scatter_grads(u, u.grad_full, group=self.group, impl=self.reduce_impl)
        if self.timeline is not None and work is not None:
            self.timeline.mark_async(f"reduce-scatter {u.name}", "comm", work)
        self._inflight.append((u, work))
        if work is None:
            self._finish_oldest()                # blocking (ring): done, free the grads now

    def _finish_oldest(self):
        u, work = self._inflight.pop(0)
        if work is not None:
            work.wait()
        mine = u.flat.shard(u.grad_full).div_(self.world_size)      # the average over ranks
        if self.grad_shards[u.index] is None:
            self.grad_shards[u.index] = mine.clone()                # a view would pin all of grad_full
        else:
            self.grad_shards[u.index].add_(mine)                    # gradient accumulation
        u.grad_full = None                       # free the unit's full-size gradients
        self._trace(f"reduced {u.name}")

    @torch.no_grad()
    def _backward(self, loss):
        if self.reduce_impl not in ("torch", "ring"):
            raise ValueError(f"reduce_impl={self.reduce_impl!r} is not supported: use 'torch' or 'ring'")
        try:
            with torch.enable_grad():
                loss.backward()                  # gathers, reduce-scatters and frees from the hooks
        except RuntimeError as exc:
            if "storage of size 0" in str(exc):
                raise RuntimeError("ZeRO-3: backward used a unit's parameters while they were freed: the "
                                   "pre-backward hook must gather the unit again before its backward "
                                   f"runs (register_pre_backward, gather). torch said: {exc}") from exc
            raise
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

    # -- step and state ----------------------------------------------------------------------
    def _step(self):
        self._settle()
        with maybe_span(self.timeline, "optimizer step", "optimizer"):
            self.shard_optim.step([torch.zeros_like(u.shard) if g is None else g   # updates each
                                   for u, g in zip(self.units, self.grad_shards)])  # shard in place
        for u in self.units:
            u.stale = u.keep                     # kept units: re-gathered at the next forward

    def zero_grad(self):
        self.grad_shards = [None] * len(self.units)

    def no_sync(self):
        return contextlib.nullcontext()         # see the class docstring

    def full_state_dict(self):
        sources = [u.shard if self.shard_optim.aliased(i) else self.shard_optim.master[i]
                   for i, u in enumerate(self.units)]
        return self._full_state([u.flat for u in self.units],
                                [gather_full(u.flat, s, self.group) for u, s in zip(self.units, sources)])

    def shards(self):
        return [(u.flat, self.shard_optim, i) for i, u in enumerate(self.units)]   # one per unit

    def state_tensors(self):
        st = self.shard_optim.state_tensors()
        return {"params": [u.shard for u in self.units] + [u.full for u in self.units],   # full: 0 B when free
                "grads": self.grad_shards + [u.grad_full for u in self.units]       # during backward only
                         + [p.grad for u in self.units for p in u.flat.params],
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

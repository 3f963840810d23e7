"""The machinery under every stage: the :class:`Engine` base class, what the sharded stages share
(:class:`ShardedEngine`), the one place where options are checked, and the reduce-scatter chooser.

The stages are siblings that import only this module and the primitives (``comm``, ``flat``,
``shard_optim``): ``zero0`` (data parallelism), ``zero1``, ``zero2``, ``zero3``; ``offload`` adds
ZeRO-Offload on top of each; :func:`zerolab.initialize` (in :mod:`zerolab.stages`) picks the class
from a static table. Every engine has the same surface, modelled on DeepSpeed's engine::

    loss = engine(x, y)          # forward
    engine.backward(loss)        # gradients (synchronised or sharded, by stage)
    engine.step()                # optimizer step on what this rank owns
    engine.zero_grad()
    engine.optimizer             # a torch.optim.Optimizer: LR schedulers work unchanged
    engine.full_state_dict()     # full parameters on every rank, loadable into the plain model
    engine.memory_report()       # this rank's model-state bytes {kind: {device: bytes}}
    engine.activation_report()   # bytes the last forward saved for backward {device: bytes}
    engine.last_step_comm        # zerolab.comm.CommLog of the last step
    engine.timeline = Timeline() # record compute and communication spans of the next steps

Mixed precision, at every stage (:mod:`zerolab.mixed_precision`): ``loss_scale`` ("dynamic": fp16's
loss scaling, ``torch.amp.GradScaler``'s rule; a step is skipped on EVERY rank when any rank's
gradient shard overflowed), ``reduce_dtype`` (the dtype gradients are reduced in; default the
compute dtype, as FSDP2's ``MixedPrecisionPolicy``) and ``engine.clip_grad_norm_(max_norm)`` (the
global norm from each rank's shard). These options are declared once, in :attr:`Engine.OPTIONS`;
each stage adds its own (``Zero3Engine.OPTIONS``), merged by :func:`engine_options`; combinations
an engine refuses are its :meth:`Engine.check_options` (stage 3's ``mesh``, ``hpz`` and quantized
collectives: :mod:`zerolab.hybrid`).

Checkpoints (:mod:`zerolab.checkpoint`) use only the public methods :meth:`Engine.quiesce`,
:meth:`Engine.param_slots` and :meth:`Engine.reload_from_masters`, so a new stage that provides them
saves and loads without touching the checkpoint code.
"""
import contextlib
import inspect
import math
import warnings
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist

from zerolab import activations, checkpoint, comm, mixed_precision
from zerolab.flat import unique_trainable
from zerolab.launch import rank_device
from zerolab.memory import storage_bytes_by_kind
from zerolab.mixed_precision import LossScaler
from zerolab.ring import ring_reduce_scatter
from zerolab.shard_optim import ShardOptimizer, master_dtype

REDUCE_IMPLS = ("torch", "ring")
PARAM_DTYPES = (None, torch.float32, torch.bfloat16, torch.float16)
REDUCE_DTYPES = (None, torch.float64, torch.float32, torch.bfloat16, torch.float16)
# Optimizers whose update is elementwise, so that running it on a flat shard of the parameters is
# the same math as running it on the whole parameters (what ZeRO's partitioning relies on).
ELEMENTWISE_OPTIMIZERS = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)


# -- options: declared by each engine class, checked here, once ---------------------------------
@dataclass(frozen=True)
class Option:
    """A stage-specific keyword of ``initialize``: its default, a test of a value, and the accepted
    values in words (for the error message)."""
    default: object
    valid: str
    check: object = None          # value -> bool; None accepts anything

    def accepts(self, value):
        return self.check is None or self.check(value)


def is_flag(v):
    return v is True or v is False


def is_count(v):
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def is_loss_scale(v):
    return (v is None or isinstance(v, LossScaler) or (isinstance(v, str) and v == "dynamic")
            or (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0))


def make_scaler(loss_scale, group=None):
    """The engine's :class:`LossScaler` for its ``loss_scale`` option: None (no scaling), "dynamic"
    (GradScaler's defaults), a number (a static scale), or a LossScaler you configured."""
    if loss_scale is None or isinstance(loss_scale, LossScaler):
        return loss_scale
    if loss_scale == "dynamic":
        return LossScaler(group=group)
    return LossScaler(float(loss_scale), dynamic=False, group=group)


def engine_options(engine_class):
    """{name: Option} of ``engine_class``: every engine's (:attr:`Engine.OPTIONS`) and those its
    classes add (e.g. ``Zero3Engine.OPTIONS``), base classes first."""
    options = {}
    for cls in reversed(engine_class.__mro__):
        options.update(vars(cls).get("OPTIONS", {}))
    return options


def _optimizer_arguments(optimizer_class):
    """The keyword arguments ``optimizer_class.__init__`` accepts besides params (and lr)."""
    sig = inspect.signature(optimizer_class.__init__)
    return {name for name, p in sig.parameters.items()
            if name not in ("self", "params", "lr") and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def split_options(engine_class, kwargs, optimizer_class, *, others=()):
    """Split ``initialize``'s extra keywords into the engine's own options (checked, defaults filled
    in) and the optimizer's arguments. Raises ValueError naming an unknown or bad option and the
    valid ones. ``others``: [(label, engine class)] of the other engines, to say where an option of
    another stage belongs."""
    specs = engine_options(engine_class)
    options = {name: spec.default for name, spec in specs.items()}
    opt_kwargs, accepted = {}, _optimizer_arguments(optimizer_class)
    for name, value in kwargs.items():
        spec = specs.get(name)
        if spec is not None:
            if not spec.accepts(value):
                raise ValueError(f"{name}={value!r} is not valid for {engine_class.label()}: {spec.valid}")
            options[name] = value
        elif name in accepted:
            opt_kwargs[name] = value
        else:
            owners = sorted({label for label, cls in others if name in engine_options(cls)})
            where = f"; it is an option of {', '.join(owners)}" if owners else ""
            raise ValueError(f"unknown option {name!r} for {engine_class.label()}{where}. Valid: the engine's "
                             f"options {sorted(specs) or '(none)'} and {optimizer_class.__name__}'s "
                             f"arguments {sorted(accepted)}")
    engine_class.check_options(options)        # combinations of the engine's own options
    return options, opt_kwargs


def check_common(model, *, stage, optimizer, lr, param_dtype, bucket_bytes, reduce_impl, group):
    """ValueError naming the first bad value of the options every stage shares."""
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"optimizer must be a torch.optim.Optimizer class such as torch.optim.AdamW, not an "
                         f"instance ({type(optimizer).__name__}): the engine builds it over what this rank "
                         f"owns; pass its arguments to initialize (lr=..., weight_decay=...)")
    if not (isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer)):
        raise ValueError(f"optimizer must be a torch.optim.Optimizer class, got {optimizer!r}")
    if stage > 0 and not issubclass(optimizer, ELEMENTWISE_OPTIMIZERS):
        names = ", ".join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)
        raise ValueError(f"stage {stage} shards the optimizer over flat parameter slices, which is "
                         f"exact only for elementwise optimizers ({names}); got {optimizer.__name__}")
    closure = inspect.signature(optimizer.step).parameters.get("closure")
    if closure is not None and closure.default is inspect.Parameter.empty:
        raise ValueError(f"{optimizer.__name__} needs a closure in step() (it re-evaluates the loss): the "
                         f"engine steps without one; use an elementwise optimizer such as torch.optim.AdamW")
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr <= 0:
        raise ValueError(f"lr must be a finite positive number, got {lr!r}")
    if param_dtype not in PARAM_DTYPES:
        raise ValueError(f"param_dtype={param_dtype!r} is not supported: None (keep the model's), "
                         f"torch.float32, torch.bfloat16 or torch.float16")
    if bucket_bytes is not None and (isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int)
                                     or bucket_bytes <= 0):
        raise ValueError(f"bucket_bytes must be a positive int or None, got {bucket_bytes!r}")
    if reduce_impl not in (None,) + REDUCE_IMPLS:
        raise ValueError(f"reduce_impl={reduce_impl!r} is not supported: None (the backend's best), "
                         f"'torch' or 'ring'")
    if not dist.is_initialized():
        raise ValueError("no process group: call zerolab.initialize inside zerolab.launch / "
                         "zerolab.Cluster.run, or under torchrun after zerolab.init_from_env()")
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError("the model has no trainable parameters (all requires_grad=False)")
    bad = [n for n, p in model.named_parameters() if not p.dtype.is_floating_point]
    if bad:
        raise ValueError(f"parameters must be floating point; not so: {bad}")
    n, numel = dist.get_world_size(group), sum(p.numel() for p in unique_trainable(model.parameters()))
    if stage > 0 and n > numel:
        warnings.warn(f"world_size={n} is more ranks than the model has trainable elements ({numel}): "
                      f"{n - numel} rank(s) own only zero padding. Sharding cannot save memory here; "
                      f"use fewer ranks or a larger model", UserWarning, stacklevel=3)


# -- collectives the stages share ---------------------------------------------------------------
def default_reduce_impl(group=None):
    """Which reduce-scatter the engines use: torch's on NCCL (a native one), lesson 00's ring from
    send/recv on gloo, where torch emulates reduce-scatter with a full all-reduce (2x the bytes; the
    ring measured faster for large buffers: lesson 04, benchmarks/bench_zero12.py)."""
    return "torch" if dist.get_backend(group) == "nccl" else "ring"


def reduce_scatter(output, input, *, group=None, impl="torch", async_op=False, tag=None):
    """The reduce-scatter chooser: sum over ranks of this rank's slice of ``input`` into ``output``,
    with torch's collective (``impl='torch'``, may be asynchronous: returns its handle) or lesson 00's
    ring (``impl='ring'``, blocking: returns None; (N-1)/N of the bytes on gloo)."""
    if impl == "ring":
        ring_reduce_scatter(output, input, group, tag=tag)
        return None
    if impl != "torch":
        raise ValueError(f"reduce_scatter: impl={impl!r} is not supported: use 'torch' or 'ring'")
    return comm.reduce_scatter(output, input, group=group, async_op=async_op, tag=tag)


def gather_full(flat, shard, group=None):
    """All-gather ``shard`` (this rank's slice, any dtype and device) into a new full buffer laid out
    like ``flat``: how full fp32 parameters are rebuilt from fp32 master shards."""
    full = torch.empty(flat.padded_numel, dtype=shard.dtype, device=flat.device)
    comm.all_gather(full, shard.to(flat.device), group=group)
    return full


class _TracedCalls:
    def __init__(self, obj, after):
        self._obj, self._after = obj, after

    def __getattr__(self, name):
        fn = getattr(self._obj, name)
        if not callable(fn):
            return fn

        def call(*args, **kwargs):
            out = fn(*args, **kwargs)
            self._after(name, args[0] if args else None)
            return out
        return call


def traced(obj, after):
    """``obj`` seen through a proxy whose every function call is followed by ``after(name, first
    argument)``: instrumentation around an algorithm's primitives, outside its lines."""
    return _TracedCalls(obj, after)


@dataclass
class Slot:
    """One tensor an optimizer steps (``master``: the fp32 master, or the parameter itself) and the
    element ranges of parameters it holds: ``ranges`` = [(param, lo, hi, offset)], elements [lo, hi)
    of ``param`` at ``offset`` in ``master``. ``replicated``: every rank holds the same (stage 0)."""
    optimizer: torch.optim.Optimizer
    master: torch.Tensor
    ranges: list
    replicated: bool = False


class OwnedGrads(NamedTuple):
    """The gradients this rank's optimizer step reads, after backward: ``sharded`` (this rank's
    shards: every element of the model's gradient is in exactly one rank's list, padding zeros
    aside) and ``replicated`` (whole, identical on every rank: stage 0's averaged gradients)."""
    sharded: list
    replicated: list


class Engine:
    """What every stage provides. Subclasses implement ``_backward``, ``_step``, ``zero_grad``,
    ``no_sync``, ``state_tensors``, ``_full_params``, ``param_slots``, ``reload_from_masters`` and
    ``owned_grads``, and set ``self.optimizer`` (a torch optimizer over what this rank steps). Their
    ``_step`` multiplies the gradients by ``self.inv_scale`` where they become the master's dtype."""

    stage = None
    offloaded = False             # True for the ZeRO-Offload engines (zerolab.offload)
    # Keywords of initialize that every engine takes (merged with each class's own OPTIONS by
    # engine_options, checked once by split_options).
    OPTIONS = {"loss_scale": Option(None, "None, 'dynamic' (torch.amp.GradScaler's defaults), a positive "
                                          "number (a static scale) or a zerolab.mixed_precision.LossScaler",
                                    is_loss_scale),
               "reduce_dtype": Option(None, "None (the compute dtype), torch.float32, torch.bfloat16, "
                                            "torch.float16 or torch.float64", lambda v: v in REDUCE_DTYPES),
               "activation_checkpointing": Option(
                   None, f"one of {activations.MODES}: recompute each block ('full') or each block's core "
                   f"attention ('selective') in backward instead of keeping its activations (lesson 10)",
                   lambda v: v in activations.MODES),
               "checkpoint_units": Option(
                   None, "None (TinyGPT's blocks, or their core_attention) or a list of submodules to "
                   "checkpoint", lambda v: v is None or isinstance(v, (list, tuple)))}
    host_kinds = ()               # kinds of state that live on the host (offload engines)

    def __init__(self, module, *, optimizer, opt_kwargs, param_dtype, bucket_bytes, reduce_impl=None,
                 group=None, loss_scale=None, reduce_dtype=None, activation_checkpointing=None,
                 checkpoint_units=None):
        self.module = module
        self.optimizer_class = optimizer
        self.opt_kwargs = dict(opt_kwargs)
        self.param_dtype = param_dtype
        self.bucket_bytes = bucket_bytes
        self.group = group
        self._reduce_impl = reduce_impl or default_reduce_impl(group)
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.timeline = None          # a zerolab.timeline.Timeline: spans of every later step
        self.last_step_comm = None
        self.steps = 0                # optimizer steps taken (saved and restored by checkpoints)
        self.optimizer = None
        self._region = None
        self.scaler = make_scaler(loss_scale, group)    # None, or fp16's loss scale (mixed_precision)
        self.reduce_dtype = reduce_dtype                # None here: the stage fills in its compute dtype
        self.last_step_skipped = False
        # Activation checkpointing (lesson 10): the modules whose forward is recomputed in backward.
        self.activation_checkpointing = activation_checkpointing
        self.checkpointed = activations.apply_checkpointing(module, activation_checkpointing, checkpoint_units)
        self._activations = {}        # {device type: bytes} saved by the last forward

    @classmethod
    def label(cls):
        return f"stage {cls.stage}" + (" + offload" if cls.offloaded else "")

    @classmethod
    def check_options(cls, options):
        """Raise ValueError naming a combination of this engine's options (each one valid alone) that
        it does not support; ``options``: {name: value} with defaults filled in. Called once, by
        :func:`split_options`. Every value is fine together here; an engine class may say otherwise."""

    @property
    def reduce_impl(self):
        """'ring' or 'torch': the reduce-scatter this engine uses (initialize's ``reduce_impl``)."""
        return self._reduce_impl

    @property
    def offload(self):
        """'optimizer' for the ZeRO-Offload engines, else None (initialize's ``offload``)."""
        return "optimizer" if self.offloaded else None

    @property
    def param_groups(self):
        """The optimizer's param groups (set 'lr' here, or hand ``engine.optimizer`` to a scheduler)."""
        return self.optimizer.param_groups

    # -- one step; its communication is logged from the first forward to the step ------------
    def _open_step_log(self):
        if self._region is None:
            self._region = comm.log(self.group, timeline=self.timeline)
            self._region.open()

    def _close_step_log(self):
        if self._region is not None:
            self.last_step_comm, self._region = self._region.close(), None

    def __call__(self, *args, **kwargs):
        self._open_step_log()
        with activations.SavedTensors(self.module, per_module=False) as saved:   # keeps nothing; outer hooks run
            out = self.forward(*args, **kwargs)
        self._activations = saved.by_device()
        return out

    def forward(self, *args, **kwargs):
        with comm.span("forward"):
            return self.module(*args, **kwargs)

    def backward(self, loss):
        """Gradients of ``loss`` (times the loss scale, if any: backward is linear, so every gradient
        carries the scale, lifting fp16's small gradients above underflow)."""
        self._open_step_log()
        self._backward(loss if self.scaler is None else self.scaler.scale(loss))

    def step(self):
        """One optimizer step on what this rank owns. With a loss scale: skipped on EVERY rank if any
        rank's gradients hold an inf or NaN (each rank checks its own shard, one all-reduce of a
        flag), and the scale updated as torch.amp.GradScaler does (``self.scaler``)."""
        self._open_step_log()
        overflow = False
        if self.scaler is not None:
            grads = self.owned_grads()
            overflow = mixed_precision.found_inf(grads.sharded + grads.replicated, self.group)
        if not overflow:
            self._step()                  # unscales by self.inv_scale where grads meet the master
            self.steps += 1
        if self.scaler is not None:
            self.scaler.update(overflow)  # overflow: scale x 0.5; growth_interval good steps: x 2
        self.last_step_skipped = overflow
        self._close_step_log()

    @property
    def inv_scale(self):
        """What ``_step`` multiplies the gradients by as they become the master's dtype (fp32): 1 /
        loss scale, or 1. In fp32, not in place in fp16, where grad / 2**16 would underflow."""
        return 1.0 if self.scaler is None else self.scaler.inv_scale

    def clip_grad_norm_(self, max_norm, norm_type=2.0):
        """``torch.nn.utils.clip_grad_norm_`` for this engine, between ``backward`` and ``step``:
        the norm of the whole (averaged, unscaled) gradient from what each rank owns, one all-reduce
        of a float64 scalar, and this rank's gradients scaled by min(1, max_norm / (norm + 1e-6)).
        Returns the norm (float64 0-dim tensor, equal on every rank). A collective."""
        grads = self.owned_grads()
        return mixed_precision.clip_grad_norm_(
            grads.sharded, grads.replicated, max_norm, norm_type=norm_type, group=self.group,
            grad_scale=1.0 if self.scaler is None else self.scaler.scale_value)

    # -- what every stage provides -----------------------------------------------------------
    def _backward(self, loss):
        raise NotImplementedError

    def _step(self):
        raise NotImplementedError

    def zero_grad(self):
        raise NotImplementedError

    def owned_grads(self):
        """:class:`OwnedGrads`: what this rank's step reads, after backward (a view, not a copy:
        clipping scales them in place)."""
        raise NotImplementedError

    def no_sync(self):
        """Context manager for gradient accumulation: backward() inside it accumulates locally and
        skips communication; the first backward() outside it synchronises the sum (torch DDP's idiom)."""
        raise NotImplementedError

    def state_tensors(self):
        """{kind: [tensors]} of what this rank holds, kinds from zerolab.memory.KINDS (+ 'frozen')."""
        raise NotImplementedError

    def _full_params(self):
        """{id(param): full tensor in the master's dtype} for every trainable parameter. A collective."""
        raise NotImplementedError

    def param_slots(self):
        """[Slot] of every tensor this rank's optimizer steps (for checkpoints)."""
        raise NotImplementedError

    def reload_from_masters(self):
        """The masters were changed from outside (a checkpoint load): make the compute parameters
        equal to them on every rank. A collective."""
        raise NotImplementedError

    def quiesce(self):
        """Finish everything still in flight (asynchronous collectives, a delayed host update) so that
        parameters, masters and optimizer state can be read or written. A collective."""

    def padding_bytes(self):
        """Bytes of zero padding included in state_tensors() (flat buffers rounded up to N)."""
        return 0

    # -- what is derived from the above ------------------------------------------------------
    def full_state_dict(self):
        """{name: tensor} of every parameter, full size and identical on every rank: trained ones from
        their master (fp32; fp64 for fp64 models), frozen ones in their own dtype's master dtype. Tied
        names are all there, sharing one tensor (as torch's state_dict): ``model.load_state_dict``
        with strict=True takes it. A collective: every rank calls it."""
        full = self._full_params()
        out = {}
        for name, p in self.module.named_parameters(remove_duplicate=False):
            if id(p) not in full:
                full[id(p)] = p.detach().to(master_dtype(p.dtype)).clone()   # frozen: replicated
            out[name] = full[id(p)]
        return out

    def memory_report(self):
        """This rank's model-state bytes: {kind: {device type: bytes}}, each storage counted once."""
        return storage_bytes_by_kind(self.state_tensors())

    def activation_report(self):
        """{device type: bytes} the last forward saved for backward (activations: each storage once,
        parameters excluded; with checkpointing, only what the checkpoints keep), measured with
        saved-tensor hooks (:class:`zerolab.activations.SavedTensors`). ZeRO partitions none of it."""
        return dict(self._activations)

    def placement(self):
        """{'device': bytes, 'host': bytes} of this rank's model states BY ROLE: what would sit on
        the accelerator and what on the host (``host_kinds``). On a CPU-only machine both are the same
        memory: this is accounting of the design; ``memory_report`` says where tensors really are."""
        out = {"device": 0, "host": 0}
        for kind, per_device in self.memory_report().items():
            out["host" if kind in self.host_kinds else "device"] += sum(per_device.values())
        return out

    # -- checkpoints: zerolab.checkpoint does the work, for every stage -----------------------
    def save_checkpoint(self, path, client_state=None):
        """Write this rank's shard of the training state to the folder ``path`` (every rank must
        call it). See :func:`zerolab.checkpoint.save`."""
        return checkpoint.save(self, path, client_state=client_state)

    def load_checkpoint(self, path):
        """Load a checkpoint written by any number of ranks at any stage; returns its client_state.
        See :func:`zerolab.checkpoint.load`."""
        return checkpoint.load(self, path)


def cast_floats(obj, dtype):
    """``obj`` (a tensor, or a list/tuple/dict of them) with its floating tensors cast to ``dtype``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, (list, tuple)):
        return type(obj)(cast_floats(o, dtype) for o in obj)
    if isinstance(obj, dict):
        return {k: cast_floats(v, dtype) for k, v in obj.items()}
    return obj


class ShardedEngine(Engine):
    """What the ZeRO stages share: the compute dtype and its casts (trainable parameters are packed by
    the subclass; frozen ones and floating buffers are cast here), no_sync, and everything derived from
    ``shards()`` = [(FlatParams, ShardOptimizer, i)]: this rank's shard i of each flat buffer and the
    optimizer stepping it. Frozen parameters are reported under their own kind, 'frozen' (replicated,
    no grads, no optimizer state), so that 'params' + 'grads' + 'master' + 'optimizer' is exactly what
    the ZeRO formulas count.

    Construction hooks, which :mod:`zerolab.offload` overrides: ``_make_shard_optimizer`` (where the
    master and moments live), ``_keep_grad_shard`` / ``_step_grads`` (where a reduced gradient shard
    goes, and where the step reads it)."""

    replicated_params = True      # stages 1-2: every rank holds the full parameters between steps

    def _prepare(self):
        """Returns the trainable parameters (each once) and casts everything else to the compute dtype."""
        self.trainable = unique_trainable(self.module.parameters())
        trainable_ids = {id(p) for p in self.trainable}
        self.frozen = [p for p in dict.fromkeys(self.module.parameters()) if id(p) not in trainable_ids]
        dtypes = {p.dtype for p in self.trainable}
        if self.param_dtype is None and len(dtypes) > 1:
            raise ValueError(f"trainable parameters have several dtypes {sorted(map(str, dtypes))}: "
                             f"pass param_dtype to train them in one")
        self.compute_dtype = self.param_dtype or self.trainable[0].dtype
        self.reduce_dtype = self.reduce_dtype or self.compute_dtype    # gradients are reduced in it
        with torch.no_grad():
            for t in self.frozen + list(self.module.buffers()):
                if t.is_floating_point():
                    t.data = t.data.to(self.compute_dtype)   # frozen: replicated, no grads, no state
        self._sync = True
        return self.trainable

    def _make_shard_optimizer(self, shards, init):
        """The optimizer over this rank's shard(s): fp32 master (``init``: exact initial values, or None)
        and moments beside the shards. zerolab.offload puts them on the host instead."""
        return ShardOptimizer(shards, self.optimizer_class, init=init, **self.opt_kwargs)

    def forward(self, *args, **kwargs):
        with comm.span("forward"):
            return self.module(*cast_floats(args, self.compute_dtype), **cast_floats(kwargs, self.compute_dtype))

    @contextlib.contextmanager
    def no_sync(self):
        self._sync = False
        try:
            yield
        finally:
            self._sync = True

    def shards(self):
        """[(FlatParams, ShardOptimizer, i)]: the flat buffers this rank owns a shard of, with the
        optimizer holding master i of that shard."""
        raise NotImplementedError

    def _full_params(self):
        out = {}
        for flat, shard_optim, i in self.shards():
            if shard_optim.aliased(i) and self.replicated_params:
                full = flat.data                                   # fp32 params are their own master
            else:
                full = gather_full(flat, shard_optim.master[i], self.group)
            for p, view in zip(flat.params, flat.views(full)):
                out[id(p)] = view.clone()
        return out

    def param_slots(self):
        slots = []
        for flat, shard_optim, i in self.shards():
            lo, hi = flat.shard_range()            # this rank's elements of the flat buffer
            ranges = []
            for p, off in zip(flat.params, flat.offsets):
                a, b = max(lo, off), min(hi, off + p.numel())
                if a < b:                          # the shard holds elements [a-off, b-off) of p
                    ranges.append((p, a - off, b - off, a - lo))
            slots.append(Slot(shard_optim.optimizer, shard_optim.master[i], ranges))
        return slots

    def reload_from_masters(self):
        for shard_optim in dict.fromkeys(so for _, so, _ in self.shards()):
            shard_optim.write_back()               # fp32 master -> compute-dtype shard
        self._publish()

    def _publish(self):
        """This rank's shards changed: make the full parameters current (stages 1-2 all-gather them;
        stage 3 re-gathers at the next use)."""
        for flat, _, _ in self.shards():
            comm.all_gather(flat.data, flat.shard(flat.data), group=self.group)


def check_same_model(model, group=None):
    """Raise ValueError on every rank if the model's parameter shapes or values differ between
    ranks (a model built from different seeds would otherwise train silently wrong). The check is
    a few numbers per parameter tensor, reduced with MAX and MIN on the rank's device (NCCL
    reduces only GPU tensors)."""
    with torch.no_grad():
        sig = torch.tensor([float(len(list(model.parameters())))]
                           + [float(sum(p.numel() for p in model.parameters()))]
                           + [float(p.double().sum()) for p in model.parameters()], dtype=torch.float64,
                           device=rank_device())
    n = torch.tensor([sig.numel()], dtype=torch.float64, device=rank_device())
    hi, lo = n.clone(), n.clone()
    dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
    if hi.item() != lo.item():
        raise ValueError(f"the model differs across ranks: rank {dist.get_rank(group)} has "
                         f"{int(n.item()) - 2} parameter tensors, others have a different count")
    mx, mn = sig.clone(), sig.clone()
    dist.all_reduce(mx, op=dist.ReduceOp.MAX, group=group)
    dist.all_reduce(mn, op=dist.ReduceOp.MIN, group=group)
    if not torch.equal(mx, mn):
        names = [n for (n, _), a, b in zip(model.named_parameters(), mx[2:], mn[2:]) if a != b]
        raise ValueError(f"the model differs across ranks (different shapes or initial values; "
                         f"build it from the same seed on every rank): {names[:5] or 'sizes'}")

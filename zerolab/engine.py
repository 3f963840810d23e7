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
import gc
import hashlib
import inspect
import math
import warnings
import weakref
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist

from zerolab import activations, checkpoint, comm, mixed_precision
from zerolab.flat import unique_trainable
from zerolab.launch import rank_device
from zerolab.memory import storage_bytes_by_kind
from zerolab.meta_init import digest, meta_tensors
from zerolab.mixed_precision import LossScaler
from zerolab.ring import ring_reduce_scatter
from zerolab.shard_optim import ShardOptimizer, master_dtype

REDUCE_IMPLS = ("torch", "ring")
PARAM_DTYPES = (None, torch.float32, torch.bfloat16, torch.float16)
REDUCE_DTYPES = (None, torch.float64, torch.float32, torch.bfloat16, torch.float16)
# torch's optimizers whose update is elementwise: each element's new value and state depend on that
# element alone (and on scalars such as the step count that every element of a step shares), so
# running one on a flat shard of the parameters is the same math as running it on the whole
# parameters (what ZeRO's partitioning relies on, Sec. 5.1). Not here: Adafactor (its second moment is
# factored into row and column statistics of each matrix: a flat slice has no rows), Muon (it
# orthogonalises each matrix's momentum, Newton-Schulz on the whole matrix), LBFGS (a closure,
# and a history over the whole parameter vector), SparseAdam (sparse gradients only), and any other
# class (its update is not known to be elementwise); a subclass of one listed is taken at its word.
ELEMENTWISE_OPTIMIZERS = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adadelta,
                          torch.optim.Adagrad, torch.optim.Adamax, torch.optim.ASGD, torch.optim.NAdam,
                          torch.optim.RAdam, torch.optim.RMSprop, torch.optim.Rprop)


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


def wrapped_by(model):
    """What already wrapped ``model``, in words ("zerolab.fully_shard", "a zerolab stage 2 engine"), or
    None. Its hooks (and at stage 3 and in fully_shard its shards) belong to that wrapper: a second
    one would reduce every gradient twice or read freed shards. fully_shard marks the parameters
    it replaced; every wrapper keeps a weak reference to itself on the model, dead once the wrapper
    is gone (a construction that failed leaves nothing alive, after a garbage collection)."""
    for p in model.parameters():
        if p.__dict__.get("_zerolab_sharded") == "fully_shard" or "_zerolab_replaced" in p.__dict__:
            return "zerolab.fully_shard"
    ref = model.__dict__.get("_zerolab_wrapper")
    if ref is None or ref() is None:
        return None
    gc.collect()                           # a half-built wrapper may linger in a reference cycle
    holder = ref()
    if holder is None:
        return None
    return f"a zerolab {holder.label()} engine" if hasattr(holder, "label") else "zerolab.fully_shard"


def check_common(model, *, stage, optimizer, lr, param_dtype, bucket_bytes, reduce_impl, group):
    """ValueError naming the first bad value of the options every stage shares."""
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    holder = wrapped_by(model)
    if holder is not None:
        raise ValueError(f"this model is already wrapped by {holder}: its hooks (and, sharded, its parameters) "
                         f"belong to it, so a second engine would reduce gradients twice or read freed shards. "
                         f"Build a fresh model (or load the full state dict, e.g. engine.full_state_dict(), "
                         f"into one) and pass that")
    on_meta = meta_tensors(model)
    if on_meta and stage != 3:
        raise ValueError(f"the model has tensors on the meta device ({on_meta[:3]}{' ...' if len(on_meta) > 3 else ''}) "
                         f"and stage {stage} keeps every parameter whole on every rank: materialize the model "
                         f"first, the same way on every rank: zerolab.meta_init.materialize(model, seed=..., "
                         f"init_fn=...) (stage 3's values), or model.to_empty(device='cpu') and your own "
                         f"seeded initialization, or model.load_state_dict(state, assign=True); re-tie shared "
                         f"weights after to_empty or assign (both untie them). Stage 3 builds a meta model "
                         f"unit by unit, never whole")
    if isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"optimizer must be a torch.optim.Optimizer class such as torch.optim.AdamW, not an "
                         f"instance ({type(optimizer).__name__}): the engine builds it over what this rank "
                         f"owns; pass its arguments to initialize (lr=..., weight_decay=...)")
    if not (isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer)):
        raise ValueError(f"optimizer must be a torch.optim.Optimizer class, got {optimizer!r}")
    if stage > 0 and not issubclass(optimizer, ELEMENTWISE_OPTIMIZERS):
        names = ", ".join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)
        raise ValueError(f"stage {stage} shards the optimizer over flat parameter slices, which is "
                         f"exact only for an elementwise optimizer; torch's are {names}; got "
                         f"{optimizer.__name__} (use stage 0, or one of those)")
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
    of ``param`` at ``offset`` in ``master``. ``replicated``: every rank holds the same (stage 0).
    ``device``: the compute-dtype tensor (same layout as ``master``) the model reads, when it may lag
    one update behind ``master`` (offload's delayed update: see :attr:`Engine.update_pending`)."""
    optimizer: torch.optim.Optimizer
    master: torch.Tensor
    ranges: list
    replicated: bool = False
    device: torch.Tensor = None


class OwnedGrads(NamedTuple):
    """The gradients this rank's optimizer step reads, after backward: ``sharded`` (this rank's
    shards: every element of the model's gradient is in exactly one rank's list, padding zeros
    aside) and ``replicated`` (whole, identical on every rank: stage 0's averaged gradients)."""
    sharded: list
    replicated: list


class Engine:
    """What every stage provides. Subclasses implement ``_backward``, ``_step``, ``_zero_grad``,
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
                   "checkpoint", lambda v: v is None or isinstance(v, (list, tuple))),
               "broadcast_buffers": Option(
                   True, "True (torch DDP's default: every forward starts from rank 0's floating-point "
                   "buffers, such as BatchNorm's running statistics) or False (each rank keeps its own; "
                   "a checkpoint still saves rank 0's)", is_flag)}
    host_kinds = ()               # kinds of state that live on the host (offload engines)

    def __init__(self, module, *, optimizer, opt_kwargs, param_dtype, bucket_bytes, reduce_impl=None,
                 group=None, loss_scale=None, reduce_dtype=None, activation_checkpointing=None,
                 checkpoint_units=None, broadcast_buffers=True):
        self.module = module
        module.__dict__["_zerolab_wrapper"] = weakref.ref(self)   # wrapped_by(): one wrapper per model
        self.broadcast_buffers = broadcast_buffers
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
        self._has_grads = False       # a backward() since the last zero_grad(): step() has work
        self._warned_no_grads = False
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
        if self.broadcast_buffers and self.world_size > 1:
            self._sync_buffers()
        with activations.SavedTensors(self.module, per_module=False) as saved:   # keeps nothing; outer hooks run
            out = self.forward(*args, **kwargs)
        self._activations = saved.by_device()
        return out

    def _sync_buffers(self):
        """Floating buffers (BatchNorm's running mean and variance) are updated by each rank's own
        forward on its own data, so they drift apart across ranks while a checkpoint saves rank 0's.
        As torch DDP (``broadcast_buffers=True``, its default), every forward starts from rank 0's:
        one broadcast per dtype before it. Averaging them instead would be another consistent rule,
        but not DDP's, and not what a single process on rank 0's data computes. Integer buffers
        (``num_batches_tracked``, counters) advance the same on every rank and are not sent."""
        floating = [b for b in dict.fromkeys(self.module.buffers()) if b.is_floating_point() and b.numel()]
        for dtype in dict.fromkeys(b.dtype for b in floating):
            same = [b for b in floating if b.dtype == dtype]
            flat = torch.cat([b.detach().reshape(-1) for b in same])
            comm.broadcast(flat, src=0 if self.group is None else dist.get_global_rank(self.group, 0),
                           group=self.group, tag="buffers")
            with torch.no_grad():
                for b, part in zip(same, flat.split([b.numel() for b in same])):
                    b.copy_(part.view_as(b))

    def forward(self, *args, **kwargs):
        with comm.span("forward"):
            return self.module(*args, **kwargs)

    def backward(self, loss):
        """Gradients of ``loss`` (times the loss scale, if any: backward is linear, so every gradient
        carries the scale, lifting fp16's small gradients above underflow)."""
        self._open_step_log()
        self._backward(loss if self.scaler is None else self.scaler.scale(loss))
        self._has_grads = True

    def step(self):
        """One optimizer step on what this rank owns. With a loss scale: skipped on EVERY rank if any
        rank's gradients hold an inf or NaN (each rank checks its own shard, one all-reduce of a
        flag), and the scale updated as torch.amp.GradScaler does (``self.scaler``).

        With no ``backward()`` since ``zero_grad()`` (or since the engine was built) there is no
        gradient at all, and the step is SKIPPED, with a warning the first time: nothing moves, the
        optimizer state and ``steps`` stay. That is what torch's optimizers do, since they skip every
        parameter whose ``.grad`` is None; stepping zero gradients instead would still move the
        weights (AdamW's weight decay, momentum). Within a step that had a backward, a parameter that
        got no gradient is stepped with a zero one, as in DeepSpeed (see :mod:`zerolab.zero1`).
        ``step()`` twice without ``zero_grad()`` applies the kept gradients twice, as torch does."""
        self._open_step_log()
        if not self._has_grads:
            if not self._warned_no_grads:
                self._warned_no_grads = True
                warnings.warn("engine.step() with no backward() since zero_grad(): skipped, nothing to "
                              "apply (torch's optimizers skip parameters without gradients)",
                              UserWarning, stacklevel=2)
            self.last_step_skipped = True
            self._close_step_log()
            return
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
        """Drop the gradients (every stage: set to none or zeroed in place, see the stage)."""
        self._zero_grad()
        self._has_grads = False

    def _zero_grad(self):
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

    def reload_from_masters(self, *, pending=False):
        """The masters were changed from outside (a checkpoint load): make the compute parameters
        equal to them on every rank. A collective. ``pending=True`` (engines with a delayed update
        only): the caller has written each slot's ``device`` tensor, one update behind its master;
        publish those and leave the update pending, as right after a delayed ``step()``."""
        raise NotImplementedError

    @property
    def update_pending(self):
        """True while an optimizer update has reached the masters but not yet the parameters the
        model computes with (offload's delayed update, between step() and the next step())."""
        return False

    def quiesce(self):
        """Finish everything still in flight (asynchronous collectives, a delayed host update) so that
        parameters, masters and optimizer state can be read or written. A collective. It never
        changes training: a pending delayed update stays pending (the masters are then one update
        ahead of the parameters, see :attr:`update_pending`; a checkpoint saves both)."""

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


def _guard_torch_clipping():
    """Make ``torch.nn.utils.clip_grad_norm_`` refuse the parameters of a ZeRO engine (stages 1-3)
    and the shards of a :func:`zerolab.fully_shard` model (``_zerolab_sharded == "fully_shard"``).
    Between backward and step each rank holds only part of the averaged gradient there: at stage 1
    ``p.grad`` is this rank's LOCAL (unaveraged) gradient outside its shard, at stages 2-3 ``p.grad``
    is None, so torch's norm differs per rank (stage 1) or is 0 (stages 2-3), and training silently
    diverges from the clipped reference. ``engine.clip_grad_norm_`` is the sharded version (one
    all-reduce of a scalar). Installed once, when the first ZeRO engine is built; other parameters
    (a plain model, stage 0's, which hold the whole averaged gradient) go through unchanged."""
    import torch.nn.utils as nn_utils
    import torch.nn.utils.clip_grad as clip_grad
    original = nn_utils.clip_grad_norm_
    if getattr(original, "_zerolab_guard", False):
        return

    def clip_grad_norm_(parameters, *args, **kwargs):
        params = [parameters] if torch.is_tensor(parameters) else list(parameters)
        sharded = next((getattr(p, "_zerolab_sharded") for p in params if hasattr(p, "_zerolab_sharded")), None)
        if sharded == "fully_shard":
            raise RuntimeError("torch.nn.utils.clip_grad_norm_ on the shards of a zerolab.fully_shard model would "
                               "clip with a wrong norm: each rank holds only its rows of each averaged gradient, "
                               "so the norm (and the clipping) would differ per rank. Call "
                               "zerolab.clip_grad_norm_(model, max_norm) after backward instead: the global norm "
                               "from every rank's shards, equal to torch's on one process")
        if sharded is not None:
            raise RuntimeError(f"torch.nn.utils.clip_grad_norm_ on the parameters of a zerolab {sharded} engine "
                               f"would clip with a wrong norm: each rank holds only its shard of the averaged "
                               f"gradient (p.grad is a local gradient or None). Call engine.clip_grad_norm_("
                               f"max_norm) between engine.backward() and engine.step() instead: the global "
                               f"norm from every rank's shard, equal to torch's on one process")
        return original(params, *args, **kwargs)

    clip_grad_norm_._zerolab_guard = True
    clip_grad_norm_.__wrapped__ = original
    clip_grad_norm_.__doc__ = original.__doc__
    nn_utils.clip_grad_norm_ = clip_grad.clip_grad_norm_ = clip_grad_norm_


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
        for p in self.trainable:                  # torch's clip_grad_norm_ would see a wrong gradient
            p._zerolab_sharded = self.label()
        _guard_torch_clipping()
        trainable_ids = {id(p) for p in self.trainable}
        self.frozen = [p for p in dict.fromkeys(self.module.parameters()) if id(p) not in trainable_ids]
        dtypes = {p.dtype for p in self.trainable}
        if self.param_dtype is None and len(dtypes) > 1:
            raise ValueError(f"trainable parameters have several dtypes {sorted(map(str, dtypes))}: "
                             f"pass param_dtype to train them in one")
        self.compute_dtype = self.param_dtype or self.trainable[0].dtype
        self.reduce_dtype = self.reduce_dtype or self.compute_dtype    # gradients are reduced in it
        self._cast_whole()
        self._sync = True
        return self.trainable

    def _cast_whole(self):
        """Frozen parameters and floating buffers, replicated, no grads, no state: in the compute
        dtype. Those still on the meta device wait (stage 3 casts them once materialized: a value
        is drawn in the model's dtype, then cast, as for a model built whole)."""
        with torch.no_grad():
            for t in self.frozen + list(self.module.buffers()):
                if t.is_floating_point() and not t.is_meta:
                    t.data = t.data.to(self.compute_dtype)

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

    def reload_from_masters(self, *, pending=False):
        if pending:
            raise ValueError(f"{type(self).__name__} has no delayed update: reload_from_masters(pending=True)")
        for shard_optim in dict.fromkeys(so for _, so, _ in self.shards()):
            shard_optim.write_back()               # fp32 master -> compute-dtype shard
        self._publish()

    def _publish(self):
        """This rank's shards changed: make the full parameters current (stages 1-2 all-gather them;
        stage 3 re-gathers at the next use)."""
        for flat, _, _ in self.shards():
            comm.all_gather(flat.data, flat.shard(flat.data), group=self.group)


def _digest(t):
    """A digest of ``t``'s bytes (:func:`zerolab.meta_init.digest`, hex), or 'meta' for a tensor
    without data."""
    return "meta" if t.is_meta else f"{digest([t]):x}"


def model_signature(model):
    """What every rank's copy of the model must agree on, in order: each module's name and class,
    each parameter's name, shape, dtype, requires_grad and a digest of its values (tied names
    included, a tied pair digested once), each buffer's name, shape and dtype. [(what, name, value)]."""
    sig, seen = [], {}
    for name, m in model.named_modules():
        sig.append(("module", name or "(model)", f"{type(m).__module__}.{type(m).__qualname__}"))
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) not in seen:
            seen[id(p)] = _digest(p)
        sig.append(("parameter", name, f"shape {tuple(p.shape)}, {p.dtype}, requires_grad={p.requires_grad}"))
        sig.append(("values of", name, seen[id(p)]))
    for name, b in model.named_buffers():
        sig.append(("buffer", name, f"shape {tuple(b.shape)}, {b.dtype}"))
    return sig


def _ranks(values):
    """'rank 0' / 'ranks [0, 2]' for each distinct value: {value: text}."""
    out = {}
    for r, v in enumerate(values):
        out.setdefault(v, []).append(r)
    return {v: (f"rank {rs[0]}" if len(rs) == 1 else f"ranks {rs}") for v, rs in out.items()}


def check_same_model(model, group=None):
    """Raise ValueError on every rank if the model differs between ranks: module names and classes,
    parameter names, shapes, dtypes and values (a digest of their bytes), buffer names, shapes and
    dtypes (:func:`model_signature`). A model built from different seeds, transposed, in another
    dtype or with other modules would otherwise train silently wrong, or abort the backend. The
    message names the first difference and which ranks hold what. Cost: one all-reduce of two
    int64 (a hash of the whole signature); only when they differ, an all_gather_object of the
    signatures, to say where. Parameters on the meta device are compared without values."""
    sig = model_signature(model)
    h = int.from_bytes(hashlib.blake2b(repr(sig).encode(), digest_size=7).digest(), "big")
    both = torch.tensor([h, -h], dtype=torch.int64, device=rank_device())
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    if both[0].item() == h and -both[1].item() == h:
        return                                          # max == min == h on every rank
    n = dist.get_world_size(group)
    sigs = [None] * n
    dist.all_gather_object(sigs, sig, group=group)
    differing_values = [name for i, (what, name, _) in enumerate(sigs[0])
                        if what == "values of" and any(i >= len(s) or s[i] != sigs[0][i] for s in sigs)]
    for i in range(max(map(len, sigs))):
        entries = [s[i] if i < len(s) else ("end", "", "no more entries") for s in sigs]
        if len(set(entries)) == 1:
            continue
        held = _ranks(entries)
        if len({e[:2] for e in entries}) == 1:          # same entry, different value
            what, name, _ = entries[0]
            where = "; ".join(f"{e[2]} on {held[e]}" for e in dict.fromkeys(entries))
            first = f"{what} {name!r}: {where}"
        else:
            first = "; ".join(f"{e[0]} {e[1]!r} ({e[2]}) on {held[e]}" for e in dict.fromkeys(entries))
        more = f"; parameters whose values differ: {differing_values[:5]}" if differing_values else ""
        raise ValueError(f"the model differs across ranks, first at {first}{more}. Build it the same way "
                         f"on every rank (same code, same seed, same dtype), or load the same weights")
    raise ValueError("the model differs across ranks (hash of its signature), but no entry differs")

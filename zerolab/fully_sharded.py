"""ZeRO-3 in your own training loop: :func:`fully_shard` (FSDP2's idea, the course's code).

``zerolab.initialize(stage=3)`` owns the optimizer. Here the MODULE owns the sharding and you keep
your loop, any elementwise torch optimizer and any LR scheduler::

    model = zerolab.fully_shard(model, param_dtype=torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)    # this rank's shards: 1/N of the state
    loss = model(x, y); loss.backward()                     # gathers, reduce-scatters, frees
    model.finish_gradient_synchronization()                 # every shard's .grad is final
    zerolab.clip_grad_norm_(model, 1.0)                     # optional: one all-reduce of a scalar
    opt.step(); opt.zero_grad()

**Per-parameter dim-0 sharding (FSDP2's layout), not one flat buffer per unit.** Each parameter of
``rows`` rows is cut along dim 0 into N pieces of c = ceil(rows/N) rows, zero rows padding the
last ones; rank r keeps piece r as its own ``nn.Parameter`` of shape (c, ...), in the parameter's
own dtype (fp32: the master). ``model.parameters()`` ARE these shards, so a torch optimizer built
on them holds 1/N of the optimizer state with no wrapper around it, ``p.grad`` has p's shape and
dtype, a frozen parameter simply stays whole, and a full state dict is one all-gather per
parameter. What it costs: a unit's all-gather takes ONE buffer, so its shards are copied into it
(cast to ``param_dtype`` on the way) and the gathered pieces copied out into each parameter; the
gradients likewise into the reduce-scatter buffer (FSDP2's ``all_gather_copy_in`` /
``split_with_sizes_copy`` / ``chunk_cat``). A flat buffer (zerolab.zero3) needs neither copy, but
its shard boundaries cut parameters anywhere, so its shards are not parameters a torch optimizer
could own, and every element must share one dtype.

Units, as FSDP2's ``fully_shard`` calls: ``units`` is the list of modules you would wrap, the model
itself included to shard what no inner unit holds (the *root*); default each of ``model.blocks``
(else each top-level child) and the model. Per unit, per step (paper Sec. 5.3 / 7.2.2, 3Ψ_u)::

    forward:  copy-in shards -> all-gather (Ψ_u) -> copy-out -> compute -> free (reshard_after_forward)
    backward: all-gather again (if freed) -> gradients -> copy-in -> reduce-scatter (Ψ_u) -> own
              rows / N into each shard's .grad -> free

The root is gathered once per step and kept until its gradients are complete (as FSDP2's root).
No prefetch: each all-gather starts when its unit is about to run (FSDP2 overlaps them on CUDA
streams; zerolab's stage-3 engine prefetches one unit ahead). One dtype per unit's all-gather:
``param_dtype``, or the parameters' own if they share one (FSDP2 also gathers mixed dtypes, as
bytes). Trainable parameters in no unit (and 0-dim ones) stay whole: their gradients are
all-reduced (averaged) at the end of backward, identical on every rank. Frozen parameters and
floating buffers stay whole, cast to ``param_dtype``. A weight tied across units belongs to the
smallest unit holding all of its uses (TinyGPT's embedding and head: the root); if none does,
ValueError (:func:`zerolab.units.assign_params`).

**Two rules, enforced.** (1) Build the optimizer AFTER ``fully_shard``: it must hold the shards.
The parameters it replaces become :class:`ReplacedParameter` (no data, recognisable), and an
optimizer built before, which holds them, raises at its first ``step()`` or ``zero_grad()``
naming the fix. FSDP2 has the same rule and no check: its ``fully_shard`` puts new DTensor
parameters on the module (``FSDPParam._init_sharded_param`` -> ``_setattr_on_modules``,
torch/distributed/fsdp/_fully_shard/_fsdp_param.py) and leaves the old ones, whole, to whoever
holds them; they never get a gradient, so such an optimizer's ``step()`` silently does nothing
(tests/test_fully_shard.py runs it). (2) A sharded parameter is whole only inside its unit's
forward and backward; elsewhere it is a :class:`ShardParameter` holding this rank's rows, which
refuses to be used as the whole weight (``F.linear(h, model.c.weight)`` in your code, or a weight
tied by hand across units in the model's forward): RuntimeError naming the parameter, its unit
and the fixes, where it would silently compute with a piece of the weight. FSDP2 gets the same
from DTensor, which refuses to mix with plain tensors.
"""
import weakref
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils._pytree as pytree
from torch._C import _disabled_torch_function_impl

from zerolab import comm, engine, mixed_precision
from zerolab.engine import OwnedGrads, cast_floats, check_same_model
from zerolab.launch import rank_device
from zerolab.meta_init import Materializer, check_init_options, meta_tensors
from zerolab.shard_optim import master_dtype
from zerolab.units import assign_params, check_units, module_name
from zerolab.zero3 import register_pre_backward

DTYPES = (None, torch.float64, torch.float32, torch.bfloat16, torch.float16)


# -- one parameter, cut along dim 0 (exercise 11.1) -----------------------------------------
def rows_per_rank(rows, world_size):
    """c = ceil(rows / N): every rank's piece has c rows (the last ones padded with zero rows)."""
    return -(-rows // world_size)


def shard_dim0(full, rank, world_size):
    """Rank ``rank``'s piece of ``full`` along dim 0: rows [rank*c, (rank+1)*c), padded with zero
    rows to c rows (a new tensor, ``full``'s dtype). Equal shapes on every rank make the all-gather
    one collective of N equal pieces."""
    rows, c = full.shape[0], rows_per_rank(full.shape[0], world_size)
    lo, hi = min(rank * c, rows), min((rank + 1) * c, rows)
    out = full.new_zeros((c,) + tuple(full.shape[1:]))
    out[:hi - lo] = full[lo:hi]                  # rows past the end stay zero: padding
    return out


def unshard_dim0(shard, rows, group=None):
    """The whole parameter from every rank's ``shard``: one all-gather of the N pieces (rank order
    is row order), then the padding rows cut off. Sends (N-1)/N of the padded tensor."""
    n = dist.get_world_size(group)
    full = shard.new_empty((n * shard.shape[0],) + tuple(shard.shape[1:]))
    comm.all_gather(full, shard.contiguous(), group=group, tag="unshard")
    return full[:rows]


# -- the parameters a sharded module shows: shards that refuse whole uses, and the replaced ones ------
# Operations that use a tensor as a whole weight: with a shard they compute silently with 1/N of it.
WHOLE_USES = frozenset({
    "linear", "bilinear", "embedding", "embedding_bag", "conv1d", "conv2d", "conv3d", "conv_transpose1d",
    "conv_transpose2d", "conv_transpose3d", "matmul", "__matmul__", "__rmatmul__", "mm", "bmm", "addmm",
    "addmv", "addbmm", "baddbmm", "mv", "dot", "vdot", "inner", "outer", "einsum", "tensordot", "layer_norm",
    "rms_norm", "group_norm", "batch_norm", "instance_norm", "prelu", "t", "transpose", "permute",
    "multi_head_attention_forward"})
TRANSPOSES = frozenset({"T", "mT", "H", "mH"})       # attributes: p.T is a step towards a whole use


class ShardInfo(NamedTuple):
    name: str            # the parameter's name in the model
    unit: str            # its unit
    module: str          # the module that owns it (whose forward gathers it)
    shape: tuple         # the whole parameter's shape
    rank: int
    world_size: int


def _attribute(func):
    """'grad' for the getter/setter of ``tensor.grad`` as __torch_function__ sees it, else None."""
    if getattr(func, "__name__", "") in ("__get__", "__set__"):
        return getattr(getattr(func, "__self__", None), "__name__", None)
    return None


class ShardParameter(nn.Parameter):
    """A parameter of a :func:`fully_shard` unit at rest: this rank's c = ceil(rows/N) rows. What
    ``model.parameters()`` yields; optimizers, clipping, gradient scalers and state dicts use it
    as any parameter (elementwise, with tensors of its own shape). It refuses a WHOLE use: an
    operation of :data:`WHOLE_USES` (linear, embedding, matmul, a norm...) or ``.T``, or one that
    mixes it with a tensor of another shape and more than one element (``x * w``; a learning rate
    held in a tensor is fine): outside its unit's forward it holds only
    a piece of the weight, so the result would be silently wrong. Results of operations on it are
    plain tensors (as nn.Parameter's)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name, attribute = getattr(func, "__name__", ""), _attribute(func)
        if attribute is not None:
            if attribute in TRANSPOSES:
                _refuse_whole_use(args[0], f".{attribute}")
        elif not name.startswith("_foreach_"):           # torch optimizers' list ops: shard with shard
            shards = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, ShardParameter)]
            if name in WHOLE_USES:
                _refuse_whole_use(shards[0], f"{name}()")
            with torch._C.DisableTorchFunctionSubclass():
                for t in pytree.tree_leaves((args, kwargs)):
                    if isinstance(t, torch.Tensor) and not isinstance(t, ShardParameter) and t.numel() > 1:
                        for shard in shards:
                            if t.shape != shard.shape:
                                _refuse_whole_use(shard, f"{name}() with a tensor of shape {tuple(t.shape)}")
        return _disabled_torch_function_impl(func, types, args, kwargs)


def _refuse_whole_use(shard, what):
    info = shard.__dict__.get("_zerolab_shard")
    if info is None:
        raise RuntimeError(f"fully_shard: a sharded parameter was used whole ({what}) outside its unit's forward")
    with torch._C.DisableTorchFunctionSubclass():
        c = shard.shape[0]
    raise RuntimeError(
        f"fully_shard: parameter {info.name!r} of unit {info.unit!r} was used as a whole weight ({what}) outside "
        f"that unit's forward, where it holds only rank {info.rank}'s shard: {c} of its {info.shape[0]} rows "
        f"(shape {(c,) + tuple(info.shape[1:])} of {tuple(info.shape)}); the result would be silently wrong. "
        f"Fixes: use the weight through its own module ({info.module!r}: calling it gathers the weight); for a "
        f"weight two modules share (a tied embedding and head), tie the modules' parameters before fully_shard "
        f"(model.head.weight = model.emb.weight: a tied weight goes into the smallest unit holding every use), "
        f"or choose units that keep {info.unit!r} with its user (units=[...], the model itself included: the "
        f"root); to read whole weights outside the forward, model.full_state_dict()")


# Reading these from a replaced parameter is harmless; anything else refuses.
_METADATA = frozenset({"size", "dim", "numel", "__len__", "stride", "is_floating_point", "is_complex",
                       "element_size", "__hash__", "__format__", "__reduce_ex__", "__setstate__"})


class ReplacedParameter(nn.Parameter):
    """A parameter :func:`fully_shard` replaced by its shard: no data left (0 elements), and any use
    of it, its ``.grad`` included, raises a RuntimeError naming the fix. An optimizer built before
    ``fully_shard`` holds these (not the shards the module trains): its first ``step()`` or
    ``zero_grad()`` reads their ``.grad`` and raises, where it would silently train nothing."""

    @property
    def grad(self):
        raise RuntimeError(_replaced_message(self, "its .grad was read: an optimizer step or zero_grad?"))

    @grad.setter
    def grad(self, value):
        raise RuntimeError(_replaced_message(self, "its .grad was set"))

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        attribute = _attribute(func)
        if (attribute is None and getattr(func, "__name__", "") not in _METADATA) or \
                attribute in TRANSPOSES | {"data", "real", "imag"}:
            raise RuntimeError(_replaced_message(args[0], f"used in {getattr(func, '__name__', func)}"))
        return _disabled_torch_function_impl(func, types, args, kwargs or {})

    def __repr__(self):
        name, shape = self.__dict__.get("_zerolab_replaced", ("?", ()))
        return f"ReplacedParameter({name!r}, shape {tuple(shape)}: replaced by its shard by zerolab.fully_shard)"


def _replaced_message(p, what):
    name, shape = p.__dict__.get("_zerolab_replaced", ("?", ()))
    return (f"fully_shard: parameter {name!r} (shape {tuple(shape)}) was replaced by this rank's shard when "
            f"fully_shard(model) ran; this old parameter holds no data and gets no gradient ({what}). An "
            f"optimizer built before fully_shard holds the old parameters and would train nothing: build it "
            f"after, from the sharded model: model = zerolab.fully_shard(model); opt = "
            f"torch.optim.AdamW(model.parameters(), ...) (FSDP2's fully_shard has the same rule). To keep "
            f"initial values, copy them before sharding (p.detach().clone()).")


def _replace(p, name):
    """Turn the whole parameter ``p`` (its values now in a shard) into a :class:`ReplacedParameter`:
    the same object (what an optimizer built before holds), its memory released."""
    shape = tuple(p.shape)
    with torch.no_grad():
        p.grad = None
        p.data = torch.empty(0, dtype=p.dtype, device=p.device)
    p.__class__ = ReplacedParameter                  # the same layout (torch.utils.swap_tensors does this)
    p._zerolab_replaced = (name, shape)


class _Sharded:
    """A sharded parameter: ``shard`` (this rank's rows, a :class:`ShardParameter` in the original
    dtype, what ``model.parameters()`` yields) and ``full`` (the compute-dtype parameter the module uses while
    its unit is gathered, a view of the first ``rows`` rows of its padded region of ``unit.full``)."""

    def __init__(self, p, where, rank, world_size, dtype):
        self.where, self.rows, self.n = where, p.shape[0], world_size     # where: [(module, name)]
        self.c = rows_per_rank(self.rows, world_size)
        self.row_numel = p[0].numel()
        self.shard = ShardParameter(shard_dim0(p.detach(), rank, world_size), requires_grad=True)
        self.full = nn.Parameter(torch.empty(0, dtype=dtype, device=p.device))   # data: set by bind
        self.shape = p.shape

    @property
    def shard_numel(self):
        return self.c * self.row_numel

    def bind(self, padded):
        """``padded``: this parameter's region of unit.full (N*c rows). ``.data`` keeps the
        parameter's own version counter: refilling the storage does not trip autograd's checks."""
        self.full.data = padded[:self.rows * self.row_numel].view(self.shape)

    def install(self, which):
        for module, name in self.where:          # every place the module looks it up (tied names)
            module._parameters[name] = which


class _Unit:
    """One unit: its sharded parameters, one compute dtype, and ``full``: the padded gathered
    parameters back to back (storage present only while gathered)."""

    def __init__(self, name, module, params):
        self.name, self.module, self.params = name, module, params
        self.dtype = params[0].full.dtype
        self.shard_numel = sum(s.shard_numel for s in params)          # what this rank keeps
        self.full = torch.zeros(params[0].n * self.shard_numel, dtype=self.dtype, device=params[0].shard.device)
        off = 0
        for s in params:
            s.offset = off                                             # column in the comm layout
            s.bind(self.full[off * s.n:(off + s.shard_numel) * s.n])
            off += s.shard_numel
        self.gathered, self.arrived, self.launched = True, set(), False

    def padded(self, s):
        """Parameter s's region of ``full``: N*c rows, row-major (padding rows at the end)."""
        return self.full[s.offset * s.n:(s.offset + s.shard_numel) * s.n]


class FullyShardedModule(nn.Module):
    """What :func:`fully_shard` returns. ``module``: the wrapped model (its parameters are the
    shards at rest); ``units``; ``replicated``: trainable parameters left whole."""

    def __init__(self, module, *, param_dtype, reduce_dtype, units, reshard_after_forward, group,
                 init_fn=None, init_seed=None):
        super().__init__()
        self.module, self.group, self.reshard_after_forward = module, group, reshard_after_forward
        module.__dict__["_zerolab_wrapper"] = weakref.ref(self)      # engine.wrapped_by(): one wrapper
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype
        self.reduce_impl = engine.default_reduce_impl(group)
        owners, self.replicated, frozen = assign_params(module, units)
        param_names = {}
        for n, p in module.named_parameters(remove_duplicate=False):
            param_names.setdefault(id(p), n)
        meta = Materializer(module, device=rank_device(), seed=init_seed or 0, init_fn=init_fn) \
            if meta_tensors(module) else None
        stray = {id(p) for p in self.replicated if p.dim() > 0 and param_dtype not in (None, p.dtype)}
        if stray:                                # they would compute in their dtype, the rest in param_dtype
            names = [n for n, p in module.named_parameters() if id(p) in stray]
            raise ValueError(f"param_dtype={param_dtype} but {names[:4]} stay whole in their own dtype (in no "
                             f"unit): put them in a unit (add the model itself to units: the root)")
        for unit_module, params in owners.items():      # refused before any parameter is replaced
            dtypes = {p.dtype for p, _ in params}
            if param_dtype is None and len(dtypes) > 1:
                raise ValueError(f"unit {module_name(module, unit_module)!r} has parameters of several "
                                 f"dtypes {sorted(map(str, dtypes))}: pass param_dtype, or split the unit")
        self.units = []
        for unit_module, params in owners.items():                        # one unit at a time
            if meta is not None:              # a meta model: only this unit's modules get memory now
                meta.materialize([p for p, _ in params], unit=module_name(module, unit_module))
            dtype = param_dtype or params[0][0].dtype
            sharded = [_Sharded(p, where, self.rank, self.world_size, dtype) for p, where in params]
            unit_name = module_name(module, unit_module)
            for s, (p, where) in zip(sharded, params):
                s.shard._zerolab_shard = ShardInfo(param_names[id(p)], unit_name, module_name(module, where[0][0]),
                                                   tuple(p.shape), self.rank, self.world_size)
                s.shard._zerolab_sharded = "fully_shard"   # torch's clip_grad_norm_ refuses it (engine's guard)
                s.install(s.shard)                                     # at rest: the shards
                _replace(p, param_names[id(p)])   # what an optimizer built before holds: refuses, names the fix
            self.units.append(_Unit(module_name(module, unit_module), unit_module, sharded))
            self._free(self.units[-1])                                 # at rest: the shards only
            owners[unit_module] = None        # drop the whole parameters: the shards replace them
        params = sharded = None               # the last unit's whole parameters, too
        if meta is not None:                  # whole on every rank: replicated, frozen, buffers
            meta.finish(module, {id(s.shard) for u in self.units for s in u.params}, group=group)
        with torch.no_grad():
            for t in frozen + list(module.buffers()):
                if param_dtype is not None and t.is_floating_point():
                    t.data = t.data.to(param_dtype)                   # whole on every rank
        engine._guard_torch_clipping()    # its norm over the shards would differ per rank: refused
        self._root = next((u for u in self.units if u.module is module), None)
        self._by_full = {id(s.full): u for u in self.units for s in u.params}
        for u in self.units:
            for s in u.params:
                s.full.register_post_accumulate_grad_hook(self._on_grad)
            if u is not self._root:
                u.module.register_forward_pre_hook(self._pre_forward(u))
                u.module.register_forward_hook(self._post_forward(u))
        module.register_forward_pre_hook(self._root_pre_forward)
        module.register_forward_hook(self._root_post_forward)
        self._inflight, self._pending, self._queued = [], False, False

    # -- gather / free (the copies FSDP2's per-parameter layout costs) ---------------------
    @torch.no_grad()
    def _gather(self, u):
        if u.gathered:
            return
        # copy-in: this rank's shards back to back, cast to the compute dtype (Σ c·row elements)
        inp = torch.cat([s.shard.detach().reshape(-1).to(u.dtype) for s in u.params])
        out = torch.empty(self.world_size * u.shard_numel, dtype=u.dtype, device=inp.device)
        comm.all_gather(out, inp, group=self.group, tag=u.name)      # rank-major: rank r's shards
        out = out.view(self.world_size, u.shard_numel)                # row r: rank r's input
        u.full.untyped_storage().resize_(u.full.numel() * u.full.element_size())
        for s in u.params:                       # copy-out: rank r's c rows of s -> rows [r*c, (r+1)*c)
            u.padded(s).view(self.world_size, s.shard_numel).copy_(out[:, s.offset:s.offset + s.shard_numel])
        u.gathered = True

    def _free(self, u):
        u.full.untyped_storage().resize_(0)      # every view (autograd's saved ones too) holds 0 B
        u.gathered = False

    # -- forward ---------------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        if self.param_dtype is not None:         # floating inputs in the compute dtype, as FSDP2
            args, kwargs = cast_floats(args, self.param_dtype), cast_floats(kwargs, self.param_dtype)
        return self.module(*args, **kwargs)

    def _root_pre_forward(self, module, args):
        if self._pending:
            self._settle()                       # a forward whose backward never came
        for u in self.units:
            u.arrived, u.launched = set(), False
        if self._root is not None:
            self._gather(self._root)             # once per step, kept until its backward
            for s in self._root.params:
                s.install(s.full)

    def _root_post_forward(self, module, args, output):
        if self._root is not None:
            for s in self._root.params:
                s.install(s.shard)
        if torch.is_grad_enabled():
            self._pending = True
            register_pre_backward(output, self._pre_backward_root)
        else:
            self._settle()                       # no backward will come: free everything

    def _pre_forward(self, u):
        def hook(module, args):
            self._gather(u)                      # all-gather right before use
            for s in u.params:
                s.install(s.full)
        return hook

    def _post_forward(self, u):
        def hook(module, args, output):
            for s in u.params:
                s.install(s.shard)               # the module shows its shards again
            if self.reshard_after_forward or not torch.is_grad_enabled():
                self._free(u)                    # ZeRO-3; False keeps it until backward (ZeRO-2-like)
            if torch.is_grad_enabled():
                register_pre_backward(output, lambda: self._gather(u))   # gathered again for backward
        return hook

    # -- backward --------------------------------------------------------------------------
    def _pre_backward_root(self):
        if not self._queued:                     # once per backward: finish when autograd is done
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    @torch.no_grad()
    def _on_grad(self, full):
        """Post-accumulate-grad hook of a compute parameter: its gradient is final for this backward
        (autograd summed every use, tied ones included). The unit's last one reduce-scatters it."""
        u = self._by_full[id(full)]
        if u.launched:
            raise RuntimeError(f"fully_shard: a gradient of unit {u.name!r} arrived after the unit was "
                               f"reduce-scattered (a second backward through one forward?)")
        u.arrived.add(id(full))
        if len(u.arrived) == len(u.params):
            self._reduce_scatter(u)

    @torch.no_grad()
    def _reduce_scatter(self, u):
        u.launched = True
        n = self.world_size
        dtype = self.reduce_dtype or u.dtype
        # Its gathered weights are not needed again this step: free them BEFORE the buffer, so that the
        # weights, the gradients and the buffer (Ψ_u each) are never alive together, and finish the
        # reduce-scatter in flight first too. FSDP2's order: post_backward reshards, reclaims the earlier
        # reduce-scatter buffers, then foreach_reduce copies into a new one (torch 2.13,
        # torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py, FSDPParamGroup.post_backward).
        self._free(u)
        if self._inflight:
            self._finish_oldest()                # one unit's buffer alive at a time, as FSDP2's default
                                                 # (reduce_scatter_max_input_buffers = 1)
        # copy-in, rank-major: row r of `buf` holds the rows of every parameter that rank r owns
        buf = torch.empty(n, u.shard_numel, dtype=dtype, device=u.full.device)   # Ψ_u (+ padding)
        for s in u.params:
            g = None if s.full.grad is None else s.full.grad.reshape(-1)   # None: unused, zeros
            for r in range(n):                   # rank r's rows [r*c, r*c + k) of s, then its zero padding
                k = 0 if g is None else max(0, min(s.c, s.rows - r * s.c))
                mine = buf[r, s.offset:s.offset + s.shard_numel]
                if k:
                    mine[:k * s.row_numel].copy_(g[r * s.c * s.row_numel:(r * s.c + k) * s.row_numel])
                mine[k * s.row_numel:].zero_()
            s.full.grad = None                   # no full-size gradient survives the unit
        own = buf[self.rank]                     # in place: rank r receives the sum of its row
        work = engine.reduce_scatter(own, buf.view(-1), group=self.group, impl=self.reduce_impl,
                                     async_op=True, tag=u.name)
        self._inflight.append((u, own, work))
        if work is None:
            self._finish_oldest()                # blocking (the ring on gloo): done, free `buf` now

    def _finish_oldest(self):
        u, own, work = self._inflight.pop(0)
        if work is not None:
            work.wait()
        own.div_(self.world_size)                # the average over ranks
        for s in u.params:                       # copy-out: p.grad has p's shape and dtype
            g = own[s.offset:s.offset + s.shard_numel].view(s.shard.shape)
            if s.shard.grad is None:
                s.shard.grad = g.to(s.shard.dtype, copy=True)   # a copy: a view would pin `buf`
            else:
                s.shard.grad += g                # gradient accumulation: one reduce-scatter per backward

    def _end_of_backward(self):
        self._queued = False
        self.finish_gradient_synchronization()

    @torch.no_grad()
    def finish_gradient_synchronization(self):
        """Make every gradient final: reduce-scatter the units whose gradients never all arrived
        (unused parameters: zeros; same unit order on every rank), wait for every reduce-scatter,
        all-reduce the gradients of the parameters left whole, free what is still gathered. Runs by
        itself at the end of each backward (an autograd callback, as FSDP2's root does), so calling
        it after ``loss.backward()`` is a no-op; call it anyway, as in CS336's FSDP interface."""
        if not self._pending:
            return
        self._pending = False
        for u in self.units:                     # in unit order on every rank
            if not u.launched:
                self._reduce_scatter(u)
        while self._inflight:
            self._finish_oldest()
        self._allreduce_replicated()
        self._settle()

    def _allreduce_replicated(self):
        if not self.replicated:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.replicated]
        flat = torch.cat([g.reshape(-1).to(self.reduce_dtype or g.dtype) for g in grads])
        comm.all_reduce(flat, group=self.group, tag="replicated")   # 2(N-1)/N x their bytes
        flat.div_(self.world_size)
        for p, g in zip(self.replicated, flat.split([g.numel() for g in grads])):
            p.grad = g.view_as(p).to(p.dtype)

    def _settle(self):
        while self._inflight:
            self._finish_oldest()
        for u in self.units:
            if u.gathered:
                self._free(u)
        self._pending = False

    # -- state -------------------------------------------------------------------------------
    def owned_grads(self):
        """:class:`zerolab.engine.OwnedGrads`: every shard's .grad (sharded) and the whole
        parameters' (replicated)."""
        return OwnedGrads([s.shard.grad for u in self.units for s in u.params if s.shard.grad is not None],
                          [p.grad for p in self.replicated if p.grad is not None])

    def full_state_dict(self):
        """The wrapped module's state dict with every parameter whole (one all-gather per sharded
        parameter; padding cut off) in its master dtype: tied names included, loadable with strict
        ``load_state_dict`` into the plain model. A collective: every rank calls it."""
        whole = {}
        for u in self.units:
            for s in u.params:
                whole[id(s.shard)] = unshard_dim0(s.shard.detach(), s.rows, self.group).clone()
        out = {}
        for name, t in self.module.state_dict(keep_vars=True).items():
            t = whole.get(id(t), t)
            out[name] = t.detach().to(master_dtype(t.dtype)).clone() if t.is_floating_point() else t.detach().clone()
        return out

    def padding_bytes(self):
        """Bytes of zero rows in this rank's shards (and their gradients when present)."""
        total = 0
        for u in self.units:
            for s in u.params:
                lo, hi = self.rank * s.c, (self.rank + 1) * s.c
                pad_rows = hi - max(lo, min(hi, s.rows))
                per = s.shard.element_size() + (s.shard.grad.element_size() if s.shard.grad is not None else 0)
                total += pad_rows * s.row_numel * per
        return total


def fully_shard(model, *, param_dtype=None, reduce_dtype=None, units=None, reshard_after_forward=True,
                group=None, init_fn=None, init_seed=None):
    """Shard ``model``'s parameters along dim 0 over ``group`` (see the module docstring) and return
    the :class:`FullyShardedModule` wrapping it. ``param_dtype``: compute dtype (the shards, i.e.
    the masters, keep theirs); ``reduce_dtype``: gradient reduction dtype (default the compute
    dtype); ``units``: modules gathered one at a time (the model itself = the root); every rank
    must call it with the same model (checked). A model built on the meta device is materialized
    one unit at a time, never whole (``init_fn``, ``init_seed``: :mod:`zerolab.meta_init`; FSDP2
    gets there with ``to_empty`` + ``reset_parameters()`` after ``fully_shard``)."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    check_not_sharded(model)
    if not dist.is_initialized():
        raise ValueError("fully_shard needs a process group: zerolab.launch / Cluster, or init_from_env()")
    for name, v in (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype)):
        if v not in DTYPES:
            raise ValueError(f"{name}={v!r} is not supported: None, torch.float32, torch.bfloat16, "
                             f"torch.float16 or torch.float64")
    if reshard_after_forward not in (True, False):
        raise ValueError(f"reshard_after_forward must be True or False, got {reshard_after_forward!r}")
    if units is not None and not isinstance(units, (list, tuple)):
        raise ValueError(f"units must be None or a list of modules, got {type(units).__name__}")
    check_units(model, units, root=True)
    bad = [n for n, p in model.named_parameters() if not p.dtype.is_floating_point]
    if bad:
        raise ValueError(f"parameters must be floating point; not so: {bad}")
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError("the model has no trainable parameters (all requires_grad=False)")
    check_init_options(model, init_fn, init_seed)
    check_same_model(model, group)
    return FullyShardedModule(model, param_dtype=param_dtype, reduce_dtype=reduce_dtype, units=units,
                              reshard_after_forward=reshard_after_forward, group=group, init_fn=init_fn,
                              init_seed=init_seed)


def check_not_sharded(model):
    """ValueError if ``model`` is already sharded (by fully_shard, or by FSDP2 / DTensor), or holds
    parameters fully_shard cannot cut (subclasses of nn.Parameter, lazy ones)."""
    if isinstance(model, FullyShardedModule) or any(isinstance(p, (ShardParameter, ReplacedParameter))
                                                    for p in model.parameters()):
        raise ValueError("this model is already sharded by zerolab.fully_shard (its parameters are this rank's "
                         "shards, or were replaced by them in a call that failed part way): call fully_shard "
                         "once, on a fresh plain model, listing the units in units=[...] "
                         "(the model itself among them for the root). FSDP2's nested calls (fully_shard(block) "
                         "for each block, then fully_shard(model)) are that one call here")
    holder = engine.wrapped_by(model)
    if holder is not None:
        raise ValueError(f"this model is already wrapped by {holder} (its hooks, and at stage 3 its shards, "
                         f"belong to it): build a fresh model (or load engine.full_state_dict() into one) for "
                         f"fully_shard")
    for name, p in model.named_parameters():
        if type(p) is not nn.Parameter:
            raise ValueError(f"parameter {name!r} is a {type(p).__module__}.{type(p).__name__}, not a plain "
                             f"torch.nn.Parameter (a DTensor: the model is already sharded by torch's FSDP2 "
                             f"fully_shard?): zerolab.fully_shard takes a plain model, built as on one device")


def clip_grad_norm_(model, max_norm, norm_type=2.0):
    """``torch.nn.utils.clip_grad_norm_`` for a :func:`fully_shard` model, after backward: the
    global norm from each rank's shard gradients (+ the whole parameters' gradients, counted once),
    one all-reduce of a float64 scalar; every gradient scaled by min(1, max_norm / (norm + 1e-6)).
    Returns the norm (float64, 0-dim, equal on every rank). Engines: ``engine.clip_grad_norm_``."""
    if not isinstance(model, FullyShardedModule):
        raise ValueError(f"zerolab.clip_grad_norm_ takes a zerolab.fully_shard model, got {type(model).__name__} "
                         f"(an engine has engine.clip_grad_norm_(max_norm))")
    model.finish_gradient_synchronization()
    grads = model.owned_grads()
    return mixed_precision.clip_grad_norm_(grads.sharded, grads.replicated, max_norm, norm_type=norm_type,
                                           group=model.group)

"""ZeRO-3's units: how a model is cut into the pieces that are gathered, computed and freed one at a
time (:mod:`zerolab.zero3`). Each unit is one padded flat buffer (:class:`zerolab.flat.FlatParams`)
whose storage exists only while the unit is gathered; this rank keeps only its 1/N shard of it.

FSDP2 calls a unit what ``fully_shard`` is applied to; DeepSpeed gathers per submodule, with
``stage3_param_persistence_threshold`` keeping small ones whole (``persist_numel`` here).
:func:`assign_params` cuts a model into units of separate parameters instead, for
:func:`zerolab.fully_shard` (FSDP2's per-parameter layout). :class:`ForeignUseCheck` enforces the
rule a unit lives by: its parameters exist only while its own forward (or backward) runs.
"""
import torch
import torch.nn as nn
import torch.utils._pytree as pytree

from zerolab.flat import FlatParams

FREE, GATHERING, READY = "free", "gathering", "ready"     # a unit's states during a step


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
        self.t_fwd = self.t_bwd = None                      # when its compute began (timeline only)

    @property
    def numel(self):
        return self.flat.numel


def default_units(model):
    """TinyGPT-like models: each of ``model.blocks``; otherwise each top-level child."""
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, torch.nn.ModuleList):
        return list(blocks)
    return [m for m in model.children() if not isinstance(m, (torch.nn.ModuleList, torch.nn.ModuleDict))]


def build_units(model, units, trainable, *, world_size, rank, dtype, persist_numel):
    """The ZeRO-3 units of ``model`` (:func:`plan_units`), each built: its flat buffer gathered."""
    return [Unit(i, name, m, ps, world_size=world_size, rank=rank, dtype=dtype, resident=resident, keep=keep)
            for i, (name, m, ps, resident, keep) in enumerate(plan_units(model, units, trainable,
                                                                          persist_numel=persist_numel))]


def check_units(model, units, *, root):
    """ValueError naming the first entry of ``units`` that is not a submodule of ``model`` (or
    ``model`` itself, where ``root``: fully_shard's root unit), and what a unit must be."""
    if units is None:
        return
    inside = {id(m) for m in model.modules()}
    params = {id(p): n for n, p in model.named_parameters()}
    must = ("units must be submodules of the model (e.g. model.blocks[0]) or the model itself (the root, "
            "for what no other unit holds)" if root else
            "units must be submodules of the model (e.g. model.blocks[0]); what no unit holds goes into the "
            "root unit by itself")
    for i, u in enumerate(units):
        if isinstance(u, nn.Module) and id(u) in inside and (root or u is not model):
            continue
        if isinstance(u, str):
            what = f"the string {u!r} (a name: pass the module itself, model.get_submodule({u!r}))"
        elif isinstance(u, torch.Tensor):
            what = (f"parameter {params[id(u)]!r}" if id(u) in params else f"a {type(u).__name__}") + \
                   f" of shape {tuple(u.shape)} (a unit is the module holding parameters, not a parameter)"
        elif u is model:
            what = "the model itself"
        elif isinstance(u, nn.Module):
            what = f"a {type(u).__name__} that is not part of this model"
        else:
            what = f"a {type(u).__name__} ({u!r:.60})"
        raise ValueError(f"units[{i}] is {what}: {must}")


def plan_units(model, units, trainable, *, persist_numel):
    """How ``model`` is cut, before any unit is built: [(name, module, params, resident, keep)], one
    per unit in build order. ``units`` (the modules the user named) or :func:`default_units`, then a
    ``root`` unit (first) of every trainable parameter in no unit. A weight shared by two DEFAULT
    units (a tied embedding and head as separate children) goes into the root; shared by two units
    the user named, it is refused (ValueError). Units of at most ``persist_numel`` elements stay
    gathered (``keep``); the root is gathered for the whole step (``resident``). Reads only shapes:
    works on a model on the meta device."""
    check_units(model, units, root=False)
    modules = default_units(model) if units is None else list(units)
    names = {id(m): n for n, m in model.named_modules()}
    owner, chosen = {}, []
    shared = set()
    if units is None:   # a weight shared by two default units (tied embedding and head) -> root
        seen = set()
        for m in modules:
            for p in dict.fromkeys(m.parameters()):
                (shared if id(p) in seen else seen).add(id(p))
    for m in modules:
        if not isinstance(m, torch.nn.Module) or id(m) not in names or m is model:
            raise ValueError(f"units must be submodules of the model (not the model itself), got {type(m).__name__}")
        if isinstance(m, (torch.nn.ModuleList, torch.nn.ModuleDict)):
            raise ValueError(f"unit {names[id(m)]!r} is a {type(m).__name__}: its forward never runs; "
                             f"list its members instead")
        params = [p for p in dict.fromkeys(m.parameters()) if p.requires_grad and id(p) not in shared]
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
    return [(name, m, ps, m is None or sum(p.numel() for p in ps) <= persist_numel,
             sum(p.numel() for p in ps) <= persist_numel) for name, m, ps in chosen]


def module_name(model, module):
    """``module``'s name in ``model`` ('root' for the model itself)."""
    return next((n or "root" for n, m in model.named_modules() if m is module), type(module).__name__)


def assign_params(model, units):
    """Per-parameter units (:func:`zerolab.fully_shard`, FSDP2's rule): ``units`` are the modules
    gathered one at a time, the model itself among them for the root (default: :func:`default_units`
    and the model). Each trainable parameter goes to the SMALLEST unit holding every module that
    uses it (a tied embedding and head: the one holding both); one used across units that no unit
    holds whole is refused (ValueError). Returns ({unit module: [(param, [(module, name) using it])]},
    trainable parameters in no unit or 0-dim (they stay whole), frozen parameters)."""
    modules = default_units(model) + [model] if units is None else list(units)
    within = {id(m): {id(x) for x in m.modules()} for m in modules}
    all_modules = {id(m) for m in model.modules()}
    for m in modules:
        if not isinstance(m, nn.Module) or id(m) not in all_modules:
            raise ValueError(f"units must be the model or its submodules, got {type(m).__name__}")
        if isinstance(m, (nn.ModuleList, nn.ModuleDict)):
            raise ValueError(f"unit {module_name(model, m)!r} is a {type(m).__name__}: its forward never runs; "
                             f"list its members instead")
    where = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                where.setdefault(id(p), (p, []))[1].append((module, name))
    owners, replicated, frozen = {m: [] for m in modules}, [], []
    for p, uses in where.values():
        if not p.requires_grad:
            frozen.append(p)
            continue
        holding = [m for m in modules if all(id(mod) in within[id(m)] for mod, _ in uses)]
        if not holding:
            inside = [m for m in modules if any(id(mod) in within[id(m)] for mod, _ in uses)]
            if inside:
                names = sorted({module_name(model, mod) for mod, _ in uses})
                raise ValueError(f"a parameter is used by {names}, which no single unit holds: put them in "
                                 f"one unit, or add a module holding all of them (e.g. the model) to units")
            replicated.append(p)                               # in no unit: stays whole
        elif p.dim() == 0:
            replicated.append(p)                               # no dim 0 to cut
        else:
            owners[min(holding, key=lambda m: len(within[id(m)]))].append((p, uses))
    return {m: ps for m, ps in owners.items() if ps}, replicated, frozen


# Reading a tensor's metadata is harmless even while its storage is freed.
_METADATA_OPS = {"__get__", "size", "dim", "numel", "__len__", "stride", "is_floating_point", "element_size",
                 "data_ptr", "untyped_storage", "__hash__", "__eq__", "__repr__", "__format__"}


class ForeignUseCheck(torch.overrides.TorchFunctionMode):
    """During a stage-3 engine's FIRST forward (a weight tie is in the model's code, so one forward shows
    it; later forwards pay nothing): a torch operation on a parameter of a sharded unit whose own
    forward is not running raises, naming the unit and the fixes. Such a use (``F.linear(h,
    self.emb.weight)`` in the model's forward with ``emb`` a unit of its own) reads freed storage:
    torch's "setStorage ... out of bounds" error, wrong numbers, or a crash."""

    def __init__(self, where, running, module):
        """``where``: id(parameter) -> its Unit; ``running``: the units whose forward runs now (a
        list the engine keeps up to date); ``module``: the model, for the parameters' names."""
        super().__init__()
        self.where, self.running = where, running
        self.names = {id(p): n for n, p in module.named_parameters()}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") not in _METADATA_OPS:
            for t in pytree.tree_leaves((args, kwargs)):
                if isinstance(t, torch.nn.Parameter):
                    u = self.where.get(id(t))
                    if u is not None and not u.resident and u not in self.running:
                        self._refuse(t, u)
        return func(*args, **kwargs)

    def _refuse(self, p, u):
        where = f"unit {self.running[-1].name!r}" if self.running else "the model's own forward"
        raise RuntimeError(
            f"ZeRO-3: parameter {self.names.get(id(p), '?')!r} of unit {u.name!r} is used outside that unit's "
            f"forward (in {where}): stage 3 gathers a unit's parameters only while its own forward runs, so "
            f"this reads freed memory. Fixes: tie the weights as modules before initialize (e.g. "
            f"model.head.weight = model.{u.name}.weight: a weight shared by two default units goes into the "
            f"root unit, always gathered), or use the weight only through {u.name}'s own forward, or choose "
            f"units that keep {u.name!r} with its user (initialize(..., units=[...]), or a larger persist_numel)")

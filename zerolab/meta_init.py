"""Building a model that no rank ever holds whole: construct it on the meta device (shapes and
dtypes, no memory), then give its tensors memory and values one piece at a time.

    with torch.device("meta"):
        model = models.TinyGPT(...)                     # no memory, no values yet
    engine = zerolab.initialize(model, stage=3, init_fn=model.init_module)

Stage 3 (:mod:`zerolab.zero3`) materializes one unit, packs it into its flat buffer, keeps this
rank's shard and frees the rest before the next unit: the whole model never exists on any rank,
and construction peaks at this rank's shards plus two copies of one unit (its freshly initialized
tensors, then its flat buffer). The production systems:

- DeepSpeed's ``zero.Init`` works at construction time, module by module: each parameter is
  created whole, **broadcast from rank 0** and partitioned (``partition_parameters.Init``,
  ``_zero_init_param``), so any initialization works, at Ψ elements on the wire (2Ψ bytes in
  bf16).
- FSDP2 shards the meta model first; then ``model.to_empty(device=...)`` gives each rank only its
  shards and ``reset_parameters()`` fills them. On CUDA, DTensor's random ops start each shard at
  its own offset of one RNG stream: replicas agree, shards differ, and the values depend on the
  mesh (they are not a single-device initialization's).

Here each rank computes the same values on its own, with no communication: module ``name`` is
initialized by ``init_fn(module)`` (default: the module's own ``reset_parameters()``) under
``torch.manual_seed(module_seed(seed, name))``. A module's values depend on the seed, its name,
the device type and the dtype only, not on how the model is cut into units, the order they are
built in or N, and one process reproduces them: :func:`materialize` does the whole model (the
reference, and the way to give a meta model to stages 0-2). That every rank got the same values
is checked, not assumed: one all-reduce over a digest of each unit (:func:`check_agreement`),
naming the unit that differs.

``init_fn(module)`` initializes the module's OWN parameters and buffers (``recurse=False``) in
place, once per module that owns a meta tensor; it must not write its submodules' tensors
(refused, naming them: a submodule may already be sharded). Tensors are filled with NaN before
it runs, and a floating tensor it leaves unfilled is refused, naming it: a buffer computed in
``__init__`` (a causal mask) is lost on the meta device, and its module's ``reset_parameters`` or
``init_fn`` must recompute it, as with FSDP2. Modules that share a tensor (a tied embedding and
head) are initialized together, in ``model.named_modules()`` order: the later one's values win.
A module that mixes meta and materialized tensors is refused.
"""
import hashlib

import torch
import torch.distributed as dist

from zerolab.launch import rank_device


def meta_tensors(model):
    """Names of ``model``'s parameters and buffers that are on the meta device."""
    return [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]


def module_seed(seed, name):
    """The seed module ``name`` (as in ``model.named_modules()``; '' for the model itself) is
    initialized under: 63 bits of blake2b(f"{seed}/{name}")."""
    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


def digest(tensors):
    """63 bits of blake2b over the bytes of ``tensors``, in order: what :func:`check_agreement`
    compares across ranks. Reads the memory in place (``.numpy()``), which makes a storage
    non-resizable for good: never pass a ZeRO-3 unit's flat buffer (freed by resizing it)."""
    h = hashlib.blake2b(digest_size=8)
    for t in tensors:
        h.update(t.detach().reshape(-1).contiguous().cpu().view(torch.uint8).numpy())
    return int.from_bytes(h.digest(), "big") >> 1


def check_init_options(model, init_fn, init_seed):
    """The meta-device options, checked once for every entry point: returns the names of
    ``model``'s meta tensors (empty: a materialized model), or raises ValueError naming the bad value."""
    if init_fn is not None and not callable(init_fn):
        raise ValueError(f"init_fn must be None or a callable(module), got {init_fn!r}")
    if init_seed is not None and (isinstance(init_seed, bool) or not isinstance(init_seed, int)):
        raise ValueError(f"init_seed must be None or an int, got {init_seed!r}")
    on_meta = meta_tensors(model)
    if not on_meta and (init_fn is not None or init_seed is not None):
        raise ValueError("init_fn / init_seed initialize a model built on the meta device; this model is "
                         "materialized already (its values are used as they are)")
    return on_meta


def _own(m):
    return [(k, t) for k, t in list(m._parameters.items()) + list(m._buffers.items()) if t is not None]


class Materializer:
    """Materializes a meta-device ``model`` a few modules at a time, on ``device``, with the values
    of :func:`module_seed` / ``init_fn`` (see the module docstring). Each module is materialized
    once, all its own tensors together, with every module it shares a tensor with."""

    def __init__(self, model, *, device, seed=0, init_fn=None):
        check_init_options(model, init_fn, seed)
        self.device, self.seed, self.init_fn = torch.device(device), seed or 0, init_fn
        self.modules = [(name, m) for name, m in model.named_modules() if any(t.is_meta for _, t in _own(m))]
        mixed = [name or "(model)" for name, m in self.modules if not all(t.is_meta for _, t in _own(m))]
        if mixed:
            raise ValueError(f"modules {mixed[:5]} hold both meta and materialized tensors: build a module "
                             f"wholly on the meta device, or materialize it wholly before")
        if init_fn is None:                  # refuse before anything is allocated, naming each module
            bad = [f"{name or '(model)'} ({type(m).__name__})" for name, m in self.modules
                   if not callable(getattr(m, "reset_parameters", None))]
            if bad:
                raise ValueError(f"modules {bad[:5]} own parameters or buffers but have no reset_parameters(): "
                                 f"on the meta device their values must come from somewhere. Pass "
                                 f"init_fn=fn, where fn(module) initializes a module's own tensors in place "
                                 f"(e.g. init_fn=model.init_module for zerolab.models.TinyGPT)")
        self.owners = {}                     # id(tensor) -> the modules owning it directly
        for _, m in self.modules:
            for _, t in _own(m):
                self.owners.setdefault(id(t), []).append(m)
        self.done, self.buffers = set(), {}  # materialized modules; id(meta buffer) -> its new tensor
        self.digests = []                    # (unit, digest of its tensors), for finish()

    def materialize(self, tensors, *, unit):
        """Materialize every module that directly owns one of ``tensors``, and every module sharing a
        tensor with those, not done yet, in model order: afterwards none of ``tensors`` is on the
        meta device. Records a digest of ``tensors`` under the name ``unit`` for :meth:`finish`."""
        wanted, todo = set(), [m for t in tensors for m in self.owners.get(id(t), [])]
        while todo:                          # modules connected by shared tensors: one group
            m = todo.pop()
            if id(m) not in wanted and id(m) not in self.done:
                wanted.add(id(m))
                todo += [o for _, t in _own(m) for o in self.owners.get(id(t), [])]
        for name, m in self.modules:
            if id(m) in wanted:
                self._one(name, m)
        self.digests.append((unit, digest(tensors)))

    def rest(self):
        """Materialize every module not done yet (those with only buffers or frozen parameters)."""
        for name, m in self.modules:
            if id(m) not in self.done:
                self._one(name, m)

    def finish(self, model, sharded, group=None):
        """After the units: materialize the rest, whole on every rank, then check that every rank
        built the same values (:func:`check_agreement`): each unit's digest, and each parameter or
        buffer of ``model`` that is not in ``sharded`` (ids of the units' parameters)."""
        self.rest()
        whole = [(n, t) for n, t in list(model.named_parameters()) + list(model.named_buffers())
                 if id(t) not in sharded]
        check_agreement([d for _, d in self.digests] + [digest([t]) for _, t in whole],
                        [n for n, _ in self.digests] + [n for n, _ in whole], group=group)

    def _one(self, name, m):
        label = name or "(model)"
        fresh = set()                                 # ids of the tensors given memory by this call
        for key, p in m._parameters.items():
            if p is not None and p.is_meta:           # shared: a co-owner may have allocated it already
                if type(p) is not torch.nn.Parameter:
                    raise ValueError(f"parameter {key!r} of {label} is a {type(p).__name__}: meta-device "
                                     f"initialization supports plain torch.nn.Parameter")
                new = torch.nn.Parameter(_unfilled(p, self.device), requires_grad=p.requires_grad)
                new.__dict__.update(p.__dict__)       # attributes set on it survive the swap
                try:
                    torch.utils.swap_tensors(p, new)  # the same Parameter object, now with memory
                except RuntimeError as exc:
                    raise ValueError(f"parameter {key!r} of {label} cannot be given memory in place "
                                     f"(torch.utils.swap_tensors: {exc})") from None
                fresh.add(id(p))
        for key, b in m._buffers.items():
            if b is not None and b.is_meta:
                if id(b) not in self.buffers:
                    self.buffers[id(b)] = _unfilled(b, self.device)
                    fresh.add(id(self.buffers[id(b)]))
                m._buffers[key] = self.buffers[id(b)]
        # Integer and boolean tensors given memory here hold zeros, which no check can tell from a real
        # value: the initialization must write them (a version bump, or a new tensor in their place).
        exact = {k: (t, t._version) for k, t in _own(m) if id(t) in fresh and not t.is_floating_point()}
        inner = [(f"{sub}.{k}", t) for sub, child in m.named_modules() if child is not m
                 for k, t in _own(child) if not t.is_meta]
        versions = [t._version for _, t in inner]
        devices = [self.device.index or 0] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            torch.manual_seed(module_seed(self.seed, name))
            if self.init_fn is not None:
                self.init_fn(m)
            else:
                m.reset_parameters()
        touched = [n for (n, t), v in zip(inner, versions) if t._version != v]
        if touched:
            raise ValueError(f"initializing {label} wrote its submodules' tensors {touched[:5]}: init_fn "
                             f"must initialize only the module's own tensors (recurse=False); each "
                             f"submodule gets its own call")
        unwritten = [k for k, t in _own(m) if k in exact and exact[k][0] is t and t._version == exact[k][1]]
        if unwritten:
            raise ValueError(f"{label}: {unwritten} (integer or boolean) were not written by its initialization "
                             f"(reset_parameters or init_fn): on the meta device a value computed in __init__ "
                             f"is lost and would silently be 0. Set them there, even to zeros "
                             f"(self.{unwritten[0]}.zero_() for a counter), or build the module off the meta device")
        unfilled = [k for k, t in _own(m) if t.is_floating_point() and bool(torch.isnan(t).any())]
        if unfilled:
            raise ValueError(f"{label}: {unfilled} still hold NaN after initialization (reset_parameters or "
                             f"init_fn did not fill them): on the meta device a value computed in __init__ "
                             f"is lost; recompute it in reset_parameters or init_fn")
        self.done.add(id(m))


def _unfilled(t, device):
    """Memory for meta tensor ``t``: NaN where floating (an init that skips it is caught), else zeros."""
    return torch.full(t.shape, float("nan") if t.is_floating_point() else 0, dtype=t.dtype, device=device)


def materialize(model, *, seed=0, init_fn=None, device=None):
    """Materialize a whole meta-device ``model`` in place with the values stage 3 builds unit by
    unit (same ``seed``, ``init_fn`` and device type: default this rank's device,
    :func:`zerolab.rank_device`): for stages 0-2, which keep every parameter whole anyway, and as a
    single-process reference. Returns ``model``."""
    m = Materializer(model, device=device or rank_device(), seed=seed, init_fn=init_fn)
    m.rest()
    return model


def check_agreement(digests, names, group=None):
    """ValueError on every rank unless every rank built the same values: ``digests`` (ints from
    :func:`digest`), ``names`` (what each digest covers). One all-reduce of 2 x len(digests) int64."""
    mine = torch.tensor(digests, dtype=torch.int64, device=rank_device())
    both = torch.cat([mine, -mine])
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    hi, lo = both[:len(digests)], -both[len(digests):]
    differ = [n for n, a, b in zip(names, hi.tolist(), lo.tolist()) if a != b]
    if differ:
        raise ValueError(f"ranks initialized different values for {differ[:5]}: init_fn must compute the "
                         f"same values on every rank from torch's global RNG (seeded per module) or from "
                         f"constants; other random sources (numpy, Python's random, a rank-dependent "
                         f"value) differ across ranks, and so do random draws on different device types "
                         f"or GPU models")

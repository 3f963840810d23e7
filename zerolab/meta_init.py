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
  ``_zero_init_param``), so any initialization works, at Ψ bytes on the wire.
- FSDP2 shards the meta model first; then ``model.to_empty(device=...)`` gives each rank only its
  shards and ``reset_parameters()`` fills them (on CUDA, DTensor's random ops keep the sharded
  values consistent with an unsharded initialization).

Here each rank computes the same values on its own, with no communication: module ``name`` is
initialized by ``init_fn(module)`` (default: the module's own ``reset_parameters()``) under
``torch.manual_seed(module_seed(seed, name))``. A module's values depend on the seed and its name
only, not on how the model is cut into units, the order they are built in or N, and one process
reproduces them: :func:`materialize` does the whole model (the reference, and the way to give a
meta model to stages 0-2). That every rank got the same values is checked, not assumed: one
all-reduce over a digest of each unit (:func:`check_agreement`), naming the unit that differs (an
``init_fn`` that is not deterministic).

``init_fn(module)`` initializes the module's OWN parameters and buffers (``recurse=False``) in
place, called once per module that owns any. A weight owned by two modules (a tied embedding and
head) is allocated once and initialized by each: the one later in ``model.named_modules()`` wins.
Buffers computed in a module's ``__init__`` (a causal mask) are lost on the meta device: their
module's ``reset_parameters`` or ``init_fn`` must recompute them, as with FSDP2.
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


class Materializer:
    """Materializes a meta-device ``model`` a few modules at a time, on ``device``, with the values
    of :func:`module_seed` / ``init_fn`` (see the module docstring). Each module is materialized
    once, all its own tensors together."""

    def __init__(self, model, *, device, seed=0, init_fn=None):
        if init_fn is not None and not callable(init_fn):
            raise ValueError(f"init_fn must be a callable(module) or None, got {init_fn!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"init_seed must be an int, got {seed!r}")
        self.device, self.seed, self.init_fn = torch.device(device), seed, init_fn
        self.modules = [(name, m) for name, m in model.named_modules()
                        if any(t is not None for t in list(m._parameters.values()) + list(m._buffers.values()))]
        self.owners = {}                     # id(tensor) -> the modules owning it directly
        for name, m in self.modules:
            for t in list(m._parameters.values()) + list(m._buffers.values()):
                if t is not None:
                    self.owners.setdefault(id(t), []).append(m)
        self.done, self.buffers = set(), {}  # materialized modules; id(meta buffer) -> its new tensor
        if init_fn is None:                  # refuse before anything is allocated, naming each module
            bad = [f"{name or '(model)'} ({type(m).__name__})" for name, m in self.modules
                   if not callable(getattr(m, "reset_parameters", None))]
            if bad:
                raise ValueError(f"modules {bad[:5]} own parameters or buffers but have no reset_parameters(): "
                                 f"on the meta device their values must come from somewhere. Pass "
                                 f"init_fn=fn, where fn(module) initializes a module's own tensors in place "
                                 f"(e.g. init_fn=model.init_module for zerolab.models.TinyGPT)")

    def materialize(self, tensors):
        """Materialize every module that directly owns one of ``tensors`` and is not done yet, in
        model order: afterwards none of ``tensors`` is on the meta device."""
        wanted = {id(m) for t in tensors for m in self.owners.get(id(t), [])}
        for name, m in self.modules:
            if id(m) in wanted and id(m) not in self.done:
                self._one(name, m)

    def rest(self):
        """Materialize every module not done yet (those with only buffers or frozen parameters)."""
        for name, m in self.modules:
            if id(m) not in self.done:
                self._one(name, m)

    def _one(self, name, m):
        for p in m._parameters.values():
            if p is not None and p.is_meta:           # tied: a co-owner may have allocated it already
                new = torch.nn.Parameter(torch.empty_like(p, device=self.device), requires_grad=p.requires_grad)
                new.__dict__.update(p.__dict__)       # attributes set on it survive the swap
                torch.utils.swap_tensors(p, new)      # the same Parameter object, now with memory
        for key, b in m._buffers.items():
            if b is not None and b.is_meta:
                m._buffers[key] = self.buffers.setdefault(id(b), torch.empty_like(b, device=self.device))
        init = self.init_fn or m.reset_parameters
        devices = [self.device.index or 0] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            torch.manual_seed(module_seed(self.seed, name))
            if self.init_fn is not None:
                init(m)
            else:
                init()
        self.done.add(id(m))


def materialize(model, *, seed=0, init_fn=None, device="cpu"):
    """Materialize a whole meta-device ``model`` in place with the values stage 3 builds unit by
    unit (same ``seed`` and ``init_fn``): for stages 0-2, which keep every parameter whole anyway,
    and as a single-process reference. Returns ``model``."""
    m = Materializer(model, device=device, seed=seed, init_fn=init_fn)
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
                         f"value) differ across ranks")

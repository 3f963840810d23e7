"""Stage 3 from a model built on the meta device (zerolab.meta_init, issue 25): the values every rank
builds unit by unit equal a whole model initialized by hand in one process with the documented seed
rule (written out here, not zerolab's function), training from them equals the single-process
float64 reference, construction never holds the whole model (torch's allocator events, measured),
and a non-deterministic init is refused on every rank, naming the unit."""
import hashlib
import math

import pytest
import torch
import torch.distributed as dist

import zerolab
from helpers import assert_params
from reference import reference, run
from zerolab import memory, models

KW = dict(vocab_size=64, d_model=32, n_layers=3, n_heads=2, seq_len=8)
LR = 1e-2
EXACT = dict(atol=1e-10, rtol=1e-10)


def _seed(seed, name):
    """The rule zerolab.meta_init documents: module ``name`` is initialized under 63 bits of
    blake2b(f"{seed}/{name}")."""
    return int.from_bytes(hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest(), "big") >> 1


def _init_gpt(model, m):
    """TinyGPT's initialization of module ``m``'s own tensors, as its docstring states it: torch's
    default, then N(0, 0.02) for matrices, 0.02/sqrt(2 n_layers) for each block's ``out``."""
    if hasattr(m, "reset_parameters"):
        m.reset_parameters()
    scaled = {id(b.out) for b in model.blocks}
    for p in m.parameters(recurse=False):
        if p.dim() >= 2:
            torch.nn.init.normal_(p, std=0.02 / (math.sqrt(2 * len(model.blocks)) if id(m) in scaled else 1))


def by_hand(dtype, seed=0, *, make=None, init=None, **kw):
    """The whole model, one process: built on the meta device (TinyGPT(**kw), or ``make()``),
    ``to_empty`` (which unties the head: tie it again), then each module that owns tensors
    initialized under its seed, in model order (``init(model, module)``, default TinyGPT's rule;
    ``init=False``: each module's reset_parameters)."""
    with torch.device("meta"):
        model = (make() if make is not None else models.TinyGPT(**kw)).to(dtype)
    model.to_empty(device="cpu")
    if make is None:
        model.head.weight = model.tok.weight
    for name, m in model.named_modules():
        if list(m.parameters(recurse=False)) or list(m.buffers(recurse=False)):
            with torch.random.fork_rng(devices=[]), torch.no_grad():
                torch.manual_seed(_seed(seed, name))
                if init is False:
                    m.reset_parameters()
                else:
                    (init or _init_gpt)(model, m)
    return model


def _meta_engine(dtype=torch.float64, unit_names=None, **options):
    with torch.device("meta"):
        model = models.TinyGPT(**KW).to(dtype)
    if unit_names is not None:
        options["units"] = [model.get_submodule(n) for n in unit_names]
    return model, zerolab.initialize(model, stage=3, lr=LR, init_fn=model.init_module, **options)


def _meta_train(steps, dtype=torch.float64, **options):
    model, engine = _meta_engine(dtype, **options)
    tied = model.head.weight is model.tok.weight
    run(engine, "gpt", steps, dtype=options.get("param_dtype") or dtype, model_kw=KW)
    return tied, engine.full_state_dict()


CASES = {   # label: (ranks, steps, options)
    "default units, 3 ranks": (3, 3, {}),
    "blocks and ln_f units, 2 ranks, seed 5": (2, 3, dict(unit_names=["ln_f", "blocks.0", "blocks.1", "blocks.2"],
                                                      init_seed=5)),
    "offload": (2, 3, dict(offload="optimizer")),
    "bf16 mixed precision: fp32 masters from the fp32 init": (2, 0, dict(dtype=torch.float32,
                                                                         param_dtype=torch.bfloat16)),
    "HSDP, mesh (2, 2)": (4, 2, dict(mesh=(2, 2))),
}


@pytest.mark.parametrize("label", sorted(CASES))
def test_meta_model_builds_and_trains_like_the_whole_model(clusters, label):
    n, steps, options = CASES[label]
    dtype = options.get("dtype", torch.float64)
    kw = dict(KW, seed=options.get("init_seed") or 0)
    expected = reference("gpt", n, steps, lr=LR, dtype=dtype, param_dtype=options.get("param_dtype"),
                         builder=lambda d, **k: by_hand(d, **kw), model_kw=KW) if steps else \
        {k: v.detach().clone() for k, v in by_hand(dtype, **kw).named_parameters(remove_duplicate=False)}
    results = clusters(n).run(_meta_train, steps, **options)
    assert all(tied for tied, _ in results), f"{label}: the tied head lost its tie"
    assert_params([state for _, state in results], expected, label, **EXACT)


def _construction(meta):
    kw = dict(KW, n_layers=8, d_model=64)
    with memory.allocation_trace() as trace:
        if meta:
            with torch.device("meta"):
                model = models.TinyGPT(**kw)
            engine = zerolab.initialize(model, stage=3, lr=LR, init_fn=model.init_module)
        else:
            engine = zerolab.initialize(models.build("gpt", seed=0, **kw), stage=3, lr=LR)
    bytes_of = lambda numel: numel * 4
    return (trace["peak"], bytes_of(sum(u.numel for u in engine.units)),
            bytes_of(max(u.flat.padded_numel for u in engine.units)),
            bytes_of(sum(u.shard.numel() for u in engine.units)))


def test_construction_never_holds_the_whole_model(clusters):
    """Every allocation of torch's CPU allocator from building the model to the end of initialize:
    from the meta device the peak is this rank's shards plus two copies of one unit (its fresh
    tensors and its flat buffer), below the whole model; built whole first, it is above."""
    c = clusters(2)
    for rank, (peak, whole, unit, shards) in enumerate(c.run(_construction, True)):
        assert peak <= shards + 2 * unit + 16384, (f"rank {rank}: meta construction peaked at {peak} B; "
                                                   f"shards {shards} B + two units {2 * unit} B")
        assert peak < 0.8 * whole, f"rank {rank}: meta construction peaked at {peak} B, the model is {whole} B"
    for rank, (peak, whole, _, _) in enumerate(c.run(_construction, False)):
        assert peak >= whole, f"rank {rank}: built whole, the peak {peak} B is below the model's {whole} B"


def _rank_dependent_init():
    def init(module):
        module.reset_parameters()
        if isinstance(module, torch.nn.Linear) and module.out_features == 4 * KW["d_model"]:
            module.bias.add_(dist.get_rank())          # blocks' fc: a value that depends on the rank
    with torch.device("meta"):
        model = models.TinyGPT(**KW)
    try:
        zerolab.initialize(model, stage=3, lr=LR, init_fn=init)
    except ValueError as exc:
        return str(exc)
    return "accepted"


def test_an_init_that_differs_across_ranks_is_refused_on_every_rank(clusters):
    for rank, msg in enumerate(clusters(2).run(_rank_dependent_init)):
        assert msg.startswith("ranks initialized different values for ['blocks.0', 'blocks.1', 'blocks.2']"), \
            f"rank {rank}: {msg}"


def _without_reset_parameters():
    class Scale(torch.nn.Module):                      # owns a parameter, has no reset_parameters()
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(5))

        def forward(self, x):
            return x * self.w
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(5, 5), Scale())
    out = {}
    try:
        zerolab.initialize(model, stage=3, lr=LR)
    except ValueError as exc:
        out["default"] = str(exc)
    engine = zerolab.initialize(model, stage=3, lr=LR, init_fn=lambda m: m.reset_parameters()
                                if hasattr(m, "reset_parameters") else torch.nn.init.constant_(m.w, 2.0))
    out["init_fn"] = engine.full_state_dict()["1.w"]
    return out


def test_a_module_without_reset_parameters_needs_init_fn(clusters):
    for out in clusters(2).run(_without_reset_parameters):
        assert "modules ['1 (Scale)'] own parameters or buffers but have no reset_parameters()" in out["default"]
        assert torch.equal(out["init_fn"], torch.full((5,), 2.0))


def test_materialize_gives_stage_3_values_to_stages_0_to_2():
    """zerolab.meta_init.materialize (the whole model, one process) equals the hand-made reference."""
    from zerolab.meta_init import materialize
    with torch.device("meta"):
        model = models.TinyGPT(**KW).to(torch.float64)
    materialize(model, seed=3, init_fn=model.init_module)
    assert model.head.weight is model.tok.weight
    want = by_hand(torch.float64, seed=3, **KW).state_dict()
    got = model.state_dict()
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)


def _fully_shard_meta(meta):
    """fully_shard (FSDP2's per-parameter layout) of a meta model: every parameter's whole value
    after construction, and the construction's allocation peak, as in _construction."""
    kw = dict(KW, n_layers=8, d_model=64)
    with memory.allocation_trace() as trace:
        if meta:
            with torch.device("meta"):
                model = models.TinyGPT(**kw).to(torch.float64)
            sharded = zerolab.fully_shard(model, init_fn=model.init_module, init_seed=2)
        else:
            sharded = zerolab.fully_shard(models.build("gpt", seed=0, dtype=torch.float64, **kw))
    whole = sum(s.rows * s.row_numel for u in sharded.units for s in u.params) * 8
    unit = max(u.full.numel() for u in sharded.units) * 8
    shards = sum(s.shard.numel() for u in sharded.units for s in u.params) * 8
    return trace["peak"], whole, unit, shards, sharded.full_state_dict()


def test_fully_shard_builds_a_meta_model_unit_by_unit(clusters):
    kw = dict(KW, n_layers=8, d_model=64, seed=2)
    want = {k: v.detach() for k, v in by_hand(torch.float64, **kw).named_parameters(remove_duplicate=False)}
    c = clusters(2)
    for rank, (peak, whole, unit, shards, state) in enumerate(c.run(_fully_shard_meta, True)):
        assert_params([state], want, f"rank {rank}, fully_shard of a meta model", exact=True)
        assert peak <= shards + 2 * unit + 16384, f"rank {rank}: peaked at {peak} B (shards {shards}, unit {unit})"
        assert peak < 0.8 * whole, f"rank {rank}: peaked at {peak} B, the model is {whole} B"
    for rank, (peak, whole, *_) in enumerate(c.run(_fully_shard_meta, False)):
        assert peak >= whole, f"rank {rank}: built whole, the peak {peak} B is below the model's {whole} B"


class Net(torch.nn.Module):
    """Buffers (BatchNorm's running statistics and an int64 counter), frozen layers, three units."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(6, 6)
        self.norm = torch.nn.BatchNorm1d(6)
        self.frozen = torch.nn.Linear(6, 6)
        self.frozen.requires_grad_(False)
        self.table = torch.nn.Embedding(4, 6)          # frozen, normal_ init: bf16 draws differ from fp32's
        self.table.requires_grad_(False)
        self.b = torch.nn.Linear(6, 3)

    def forward(self, x, y):
        h = self.frozen(self.norm(self.a(x))) + self.table.weight.sum(0)
        return torch.nn.functional.mse_loss(self.b(h), y)


def _net_bf16():
    with torch.device("meta"):
        model = Net()
    engine = zerolab.initialize(model, stage=3, lr=LR, param_dtype=torch.bfloat16)
    whole = {n: t.clone() for n, t in list(model.named_buffers()) + [(n, p) for n, p in model.named_parameters()
                                                                     if not p.requires_grad]}
    return engine.full_state_dict(), whole


def test_buffers_and_frozen_layers_drawn_in_the_models_dtype_then_cast(clusters):
    """A meta fp32 model at stage 3 with param_dtype=bf16: fp32 masters of the trainable
    parameters, and buffers / frozen parameters drawn in fp32 then cast (as a model built whole)."""
    want = by_hand(torch.float32, make=Net, init=False)
    for rank, (state, whole) in enumerate(clusters(2).run(_net_bf16)):
        trained = {n: p.detach() for n, p in want.named_parameters() if p.requires_grad}
        assert_params([{k: state[k] for k in trained}], trained, f"rank {rank}, fp32 masters", exact=True)
        cast = {n: (t.to(torch.bfloat16) if t.is_floating_point() else t)
                for n, t in list(want.named_buffers()) + [(n, p.detach()) for n, p in want.named_parameters()
                                                          if not p.requires_grad]}
        assert_params([whole], cast, f"rank {rank}, buffers and frozen", exact=True)


def test_materialize_refuses_what_would_be_silently_wrong():
    """One process (zerolab.meta_init.materialize): a module half on the meta device; an init_fn that
    writes a submodule's (possibly sharded) tensors; a buffer the init never fills. A model partly on
    the meta device keeps its materialized modules' values."""
    from zerolab.meta_init import Materializer, materialize
    with torch.device("meta"):
        half = torch.nn.Linear(2, 2)
    half.weight = torch.nn.Parameter(torch.ones(2, 2))
    with pytest.raises(ValueError, match=r"modules \['\(model\)'\] hold both meta and materialized"):
        materialize(half)

    class Parent(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = torch.nn.Parameter(torch.ones(2))
            self.child = torch.nn.Linear(2, 2)
    with torch.device("meta"):
        parent = Parent()
    recursive = lambda m: [torch.nn.init.zeros_(p) for p in m.parameters()]     # recurse=True: wrong
    built = Materializer(parent, device="cpu", init_fn=recursive)
    built.materialize(list(parent.child.parameters()), unit="child")            # the child first (a unit)
    with pytest.raises(ValueError, match=r"initializing \(model\) wrote its submodules' tensors \['child.weight'"):
        built.rest()

    class Masked(torch.nn.Linear):
        def __init__(self):
            super().__init__(2, 2)
            self.register_buffer("mask", torch.ones(2))                        # not in reset_parameters
    with torch.device("meta"):
        masked = Masked()
    with pytest.raises(ValueError, match=r"\(model\): \['mask'\] still hold NaN after initialization"):
        materialize(masked)

    with torch.device("meta"):
        partly = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    partly[0] = torch.nn.Linear(2, 2)
    torch.nn.init.constant_(partly[0].weight, 7.0)
    materialize(partly)
    assert torch.equal(partly[0].weight, torch.full((2, 2), 7.0)) and not partly[1].weight.is_meta

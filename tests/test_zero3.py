"""ZeRO-3 against independent references: one process training on the concatenated global batch
(computed here, in the test process), stage 0 (data parallelism) on the same ranks, and closed-form
byte counts written out below from the model's module sizes (not from the engine's own numbers).
float64 where exactness matters. World sizes 1-4; 3 makes padding real."""
import math

import pytest
import torch
import torch.distributed as dist

from helpers import assert_params
from reference import batch, build, reference, train

STEPS = 2
MICRO = 4
GPT = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=2, seq_len=16)
LR = 1e-2


def _setup(name, **model_kw):
    """What the reference and the engine share: the model's size and the data's, and the lr."""
    return dict(lr=LR, size=MICRO, model_kw=dict(GPT, **model_kw) if name == "gpt" else model_kw or None)


def _build(name, dtype=torch.float64, **kw):
    return build(name, dtype, model_kw=_setup(name, **kw)["model_kw"])


def _data(name, step, rank, micro=0, dtype=torch.float64):
    return batch(name, step, rank, micro, size=MICRO, dtype=dtype, model_kw=_setup(name)["model_kw"])


EXACT = dict(rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_float64_equals_single_process_and_stage0(clusters, world_size):
    for name in ("gpt", "mlp"):      # tied weights; frozen layer + a module called twice
        expected = reference(name, world_size, STEPS, **_setup(name))
        got = clusters(world_size).run(train, name, STEPS, stage=3, **_setup(name))
        assert_params(got, expected, f"{name} stage 3 vs single process", **EXACT)
        dp = clusters(world_size).run(train, name, STEPS, stage=0, **_setup(name))
        assert_params(got, dp[0], f"{name} stage 3 vs stage 0", **EXACT)


@pytest.mark.parametrize("options", [dict(prefetch=False), dict(reduce_impl="torch"),
                                     dict(persist_numel=600), dict(accum=3)])
def test_float64_variants(clusters, options):
    """No prefetch; torch's async reduce-scatter; small units kept whole; gradient accumulation."""
    accum = options.get("accum", 1)
    engine_options = {k: v for k, v in options.items() if k != "accum"}
    for name in ("gpt", "mlp"):
        got = clusters(3).run(train, name, STEPS, stage=3, micro=accum, no_sync=False, **engine_options,
                              **_setup(name))
        assert_params(got, reference(name, 3, STEPS, micro=accum, **_setup(name)), f"{name} {options}", **EXACT)


def test_float32_tight(clusters):
    for name in ("gpt", "mlp"):
        got = clusters(2).run(train, name, STEPS, stage=3, dtype=torch.float32, **_setup(name))
        assert_params(got, reference(name, 2, STEPS, dtype=torch.float32, **_setup(name)), f"{name} float32")


def test_mixed_precision_bf16(clusters):
    # SGD: an update lr x grad is often below bf16's resolution; only an fp32 master keeps it.
    sgd = dict(_setup("gpt"), optimizer=torch.optim.SGD, lr=0.1)
    expected = reference("gpt", 2, STEPS, dtype=torch.float32, **sgd)
    start = _build("gpt", torch.float32).state_dict()
    got = clusters(2).run(train, "gpt", STEPS, stage=3, dtype=torch.float32, param_dtype=torch.bfloat16, **sgd)
    for rank, state in enumerate(got):
        for n, t in expected.items():
            assert state[n].dtype == torch.float32
            moved, err = (t - start[n]).abs().max(), (state[n] - t).abs().max()
            assert err <= 0.05 * moved, f"rank {rank}, {n}: off by {err:.3g}, fp32 moved {moved:.3g}"


# -- bytes: closed forms from the model's own module sizes -----------------------------------------
def _unit_sizes(model, units):
    """Trainable elements per unit: the given modules, then the rest (the root) first."""
    seen, sizes = set(), []
    for m in units:
        ps = [p for p in dict.fromkeys(m.parameters()) if p.requires_grad]
        seen |= {id(p) for p in ps}
        sizes.append(sum(p.numel() for p in ps))
    root = sum(p.numel() for p in dict.fromkeys(model.parameters()) if p.requires_grad and id(p) not in seen)
    return ([root] if root else []) + sizes, bool(root)


def _step_report(name, param_dtype=None, units=None, persist_numel=0, model_kw=None, reduce_impl="ring"):
    from zerolab import initialize
    model = _build(name, torch.float32, **(model_kw or {}))
    kw = {} if units is None else {"units": [model.get_submodule(u) for u in units]}
    engine = initialize(model, stage=3, lr=LR, param_dtype=param_dtype, persist_numel=persist_numel,
                        reduce_impl=reduce_impl, **kw)
    for step in range(2):                 # the second step: optimizer state exists, log is a full step
        x, y = _data(name, step, dist.get_rank(), dtype=torch.float32)
        engine.backward(engine(x, y))
        engine.step()
    log = engine.last_step_comm
    return {"memory": engine.memory_report(), "padding": engine.padding_bytes(), "ops": log.by_op(), "sent": log.sent_bytes,
            "ideal": log.ideal_bytes, "measured": log.measured_bytes,
            "grads": [p.grad for p in model.parameters()],
            "full_bytes": [u.full.untyped_storage().nbytes() for u in engine.units]}


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("name,mixed", [("gpt", False), ("gpt", True), ("mlp", False)])
def test_persistent_model_states_are_4_plus_k_over_n(clusters, world_size, name, mixed):
    n = world_size
    model = _build(name, torch.float32)
    default = list(model.blocks) if name == "gpt" else [model.inp, model.mid, model.out]
    sizes, _ = _unit_sizes(model, default)
    psi = sum(sizes)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    b, k = (2, 12) if mixed else (4, 8)   # bytes per param/grad element; K (fp32 master + Adam m, v)
    shards = [math.ceil(s / n) for s in sizes]
    reports = clusters(n).run(_step_report, name, torch.bfloat16 if mixed else None)
    total_unpadded = 0
    for rank, r in enumerate(reports):
        mem = r["memory"]
        got = sum(sum(d.values()) for d in mem.values())
        want = (b + b + k) * sum(shards) + b * frozen        # (4+K) x ceil(Ψ_u/N) per unit + frozen
        assert got == want, f"rank {rank}: {got} bytes of model states, closed form {want} ({mem})"
        assert mem["params"] == {"cpu": b * sum(shards)} and mem["grads"] == {"cpu": b * sum(shards)}
        pad = sum(max(0, min(s_r, (rank + 1) * s_r - s)) for s, s_r in zip(sizes, shards))
        assert r["padding"] == (b + b + k) * pad, f"rank {rank}: padding {r['padding']}, expected {pad} elements"
        total_unpadded += got - r["padding"] - b * frozen
        assert all(g is None for g in r["grads"]), f"rank {rank}: a full-size .grad survived the step"
        assert not any(r["full_bytes"]), f"rank {rank}: gathered parameters survived the step: {r['full_bytes']}"
    assert total_unpadded == (b + b + k) * psi        # summed over ranks: exactly (4+K)Ψ, 16 bytes/param


def test_small_units_kept_whole_are_counted(clusters):
    model = _build("mlp", torch.float32)
    sizes = [sum(p.numel() for p in m.parameters()) for m in (model.inp, model.mid, model.out)]
    kept = [s for s in sizes if s <= 600]                   # inp (518) and out (190) stay gathered
    assert len(kept) == 2
    for rank, r in enumerate(clusters(3).run(_step_report, "mlp", persist_numel=600)):
        got = r["memory"]["params"]["cpu"]
        want = 4 * sum(math.ceil(s / 3) for s in sizes) + 4 * sum(3 * math.ceil(s / 3) for s in kept)
        assert got == want, f"rank {rank}: params {got} bytes, expected shards + kept full units = {want}"


def _wire(sizes, passes, n, b=4):
    """Bytes one rank sends: each unit's padded flat buffer, (N-1)/N of it per collective."""
    return sum(p * b * n * math.ceil(s / n) for s, p in zip(sizes, passes)) * (n - 1) / n


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_bytes_on_the_wire_3psi(clusters, world_size):
    n = world_size
    # Untied TinyGPT with every layer its own unit: no root, so exactly 3Ψ(N-1)/N.
    names = ["tok", "pos", "blocks.0", "blocks.1", "ln_f", "head"]
    model = _build("gpt", torch.float32, tied=False)
    sizes, has_root = _unit_sizes(model, [model.get_submodule(u) for u in names])
    assert not has_root
    r = clusters(n).run(_step_report, "gpt", units=names, model_kw={"tied": False})[0]
    padded = 4 * sum(n * math.ceil(s / n) for s in sizes)
    assert r["ops"]["all_gather"][:2] == (2 * len(sizes), 2 * padded)   # forward + backward
    assert r["ops"]["reduce_scatter"][:2] == (len(sizes), padded)
    three_psi = 3 * padded * (n - 1) / n
    assert r["sent"] == pytest.approx(three_psi) and r["ideal"] == pytest.approx(three_psi)
    assert three_psi <= r["measured"] < 1.5 * three_psi + 20_000 * 3 * len(sizes), r["measured"]


def test_bytes_with_root_and_module_called_twice(clusters):
    n = 3
    gpt = _build("gpt", torch.float32)
    sizes, _ = _unit_sizes(gpt, list(gpt.blocks))           # root (tied weight once) + 2 blocks
    r = clusters(n).run(_step_report, "gpt")[0]
    # root: gathered ONCE (forward start), kept through backward: 2 passes; blocks: 3 passes.
    calls = r["ops"]["all_gather"][0]
    assert calls == 1 + 2 * 2, f"all-gathers per step: {calls}, expected the root once + 2 per block"
    assert r["sent"] == pytest.approx(_wire(sizes, [2, 3, 3], n))
    mlp = _build("mlp", torch.float32)
    sizes = [sum(p.numel() for p in m.parameters()) for m in (mlp.inp, mlp.mid, mlp.out)]
    r = clusters(n).run(_step_report, "mlp")[0]
    # mid runs twice in forward (gathered and freed twice), once in backward: 4 passes.
    assert r["sent"] == pytest.approx(_wire(sizes, [3, 4, 3], n))
    # gloo's reduce_scatter is an all_reduce underneath: twice the ring's bytes, really sent.
    t = clusters(n).run(_step_report, "mlp", reduce_impl="torch")[0]
    rs = _wire(sizes, [1, 1, 1], n)
    assert t["sent"] == pytest.approx(r["sent"] + rs) and t["ideal"] == pytest.approx(r["ideal"])
    assert t["measured"] >= t["sent"], (t["measured"], t["sent"])


# -- the properties of the cycle --------------------------------------------------------------------
def _materialised_during_step(prefetch):
    """At every unit's forward and backward, which units hold full parameters."""
    from zerolab import initialize
    model = _build("gpt", torch.float32, n_layers=3)
    engine = initialize(model, stage=3, lr=LR, prefetch=prefetch)
    live = lambda: sorted(u.name for u in engine.units if u.full.untyped_storage().nbytes())
    seen = []
    for i, block in enumerate(model.blocks):
        block.register_forward_pre_hook(lambda m, a, i=i: seen.append(("fwd", f"blocks.{i}", live())))
        block.register_forward_hook(lambda m, a, o, i=i: seen.append(("after fwd", f"blocks.{i}", live())))
        block.qkv.weight.register_hook(lambda g, i=i: seen.append(("bwd", f"blocks.{i}", live())))
    x, y = _data("gpt", 0, dist.get_rank(), dtype=torch.float32)
    loss = engine(x, y)
    after_forward = live()
    engine.backward(loss)
    after_backward = live()
    return seen, after_forward, after_backward


@pytest.mark.parametrize("prefetch", [False, True])
def test_gather_right_before_use_and_free_right_after(clusters, prefetch):
    for rank, (seen, after_fwd, after_bwd) in enumerate(clusters(2).run(_materialised_during_step, prefetch)):
        for when, unit, live in seen:
            others = [u for u in live if u not in ("root", unit)]
            if when == "after fwd":
                assert unit not in live, f"rank {rank}: {unit} still gathered after its forward: {live}"
            else:
                assert unit in live, f"rank {rank}: {unit} not gathered at its {when}: {live}"
            # without prefetch nothing else; with prefetch at most the next unit
            assert len(others) <= (1 if prefetch else 0), f"rank {rank}: at {when} of {unit}: {live}"
        assert after_bwd == [], f"rank {rank}: gathered after backward: {after_bwd}"
        assert set(after_fwd) <= {"root", "blocks.2"}, after_fwd   # root; backward's first unit prefetched


def _errors():
    from zerolab import initialize
    out = {}
    cases = {
        "tied across units": lambda m: dict(units=[m.tok, m.head]),
        "nested": lambda m: dict(units=[m.blocks[0], m.blocks[0].qkv]),
        "module list": lambda m: dict(units=[m.blocks]),
        "not a submodule": lambda m: dict(units=[torch.nn.Linear(2, 2)]),
        "prefetch": lambda m: dict(prefetch="yes"),
        "persist": lambda m: dict(persist_numel=-1),
    }
    for what, kw in cases.items():
        model = _build("gpt", torch.float32)
        try:
            initialize(model, stage=3, **kw(model))
            out[what] = None
        except ValueError as exc:
            out[what] = str(exc)
    model = _build("gpt", torch.float32)
    initialize(model, stage=3)
    try:
        model(*_data("gpt", 0, 0, dtype=torch.float32))
        out["module called directly"] = None
    except RuntimeError as exc:
        out["module called directly"] = str(exc)
    return out


def test_clear_errors(clusters):
    msgs = clusters(2).run(_errors)[0]
    assert "also belongs" in msgs["tied across units"] and "root unit" in msgs["tied across units"]
    assert "also belongs" in msgs["nested"]
    assert "ModuleList" in msgs["module list"]
    assert "submodules" in msgs["not a submodule"]
    assert "prefetch" in msgs["prefetch"] and "persist_numel" in msgs["persist"]
    assert "call the engine" in msgs["module called directly"]


def _fsdp2(name):
    """torch's FSDP2 fully_shard(reshard_after_forward=True), each unit wrapped like ours."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    model = _build(name)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    units = list(model.blocks) if name == "gpt" else [model.inp, model.mid, model.out]
    for m in units:
        fully_shard(m, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, reshard_after_forward=True)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    for step in range(STEPS):
        model(*_data(name, step, dist.get_rank())).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.full_tensor() if hasattr(p, "full_tensor") else p.detach() for n, p in model.named_parameters(remove_duplicate=False)}


@pytest.mark.parametrize("name", ["gpt", "mlp"])
def test_float64_equals_fsdp2(clusters, name):
    fsdp2 = clusters(2).run(_fsdp2, name)
    assert_params(fsdp2, reference(name, 2, STEPS, **_setup(name)), f"{name} FSDP2 vs single process", **EXACT)
    assert_params(clusters(2).run(train, name, STEPS, stage=3, **_setup(name)), fsdp2[0], f"{name} stage 3 vs FSDP2",
                  **EXACT)


def _gather_tags(prefetch):
    from zerolab import comm, initialize
    model = _build("gpt", torch.float32, n_layers=3)
    engine = initialize(model, stage=3, lr=LR, prefetch=prefetch)
    x, y = _data("gpt", 0, dist.get_rank(), dtype=torch.float32)
    with comm.log() as log:
        engine.backward(engine(x, y))
    return [(r.tag, r.seconds is None) for r in log.records if r.op == "all_gather"]


@pytest.mark.parametrize("prefetch", [False, True])
def test_prefetched_gathers_are_labelled(clusters, prefetch):
    # a timeline tells a prefetched (asynchronous) all-gather from a blocking one by its tag
    tags = clusters(2).run(_gather_tags, prefetch)[0]
    for tag, is_async in tags:
        assert tag.endswith(" prefetch") == is_async, tags
    assert any(is_async for _, is_async in tags) == prefetch, tags


# -- a tie made in the model's own forward: refused with the unit named, not freed memory read ------
class _ForwardTie(torch.nn.Module):
    """emb's weight reused by hand as the output projection: emb and body are separate units."""

    def __init__(self, tie_as_modules=False):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(16, 8)
        self.body = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 16, bias=False)
        if tie_as_modules:
            self.head.weight = self.emb.weight            # the fix: one tensor, in the root unit
        self.tie_as_modules = tie_as_modules

    def forward(self, x, y):
        h = torch.tanh(self.body(self.emb(x)))
        w = self.head.weight if self.tie_as_modules else self.emb.weight
        return torch.nn.functional.cross_entropy(torch.nn.functional.linear(h, w), y)


def _forward_tie(tie_as_modules):
    import zerolab
    engine = zerolab.initialize(_ForwardTie(tie_as_modules), stage=3, lr=LR)
    x = torch.randint(0, 16, (4,), generator=torch.Generator().manual_seed(dist.get_rank()))
    try:
        engine.backward(engine(x, x))
        engine.step()
        engine.backward(engine(x, x))
    except RuntimeError as exc:
        return str(exc)
    return "trained"


def test_a_tie_made_in_forward_is_refused_naming_the_unit_and_the_fix(clusters):
    """F.linear(h, self.emb.weight) with emb a unit of its own read emb's freed storage (torch's
    'setStorage ... out of bounds', or a crash); now the first forward names the unit and the fix;
    the tie made as modules (head.weight = emb.weight) trains."""
    for msg in clusters(2).run(_forward_tie, False):
        assert "parameter 'emb.weight' of unit 'emb' is used outside that unit's forward" in msg, msg
        assert "model.head.weight = model.emb.weight" in msg and "units=[...]" in msg, msg
    assert clusters(2).run(_forward_tie, True) == ["trained", "trained"]

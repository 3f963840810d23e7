"""Mixed precision at every stage (and with offload) against independent references computed here,
on one process: ``torch.amp.GradScaler`` (skip decisions and scales, with an overflow injected on
ONE rank into a gradient element that another rank owns), ``torch.nn.utils.clip_grad_norm_``
(float64; padding at N = 3; stage 0's replicated gradients), a one-process fp16 loop with fp32
masters and GradScaler (a real overflow), and the bytes of ``reduce_dtype`` from the model's size."""
import math

import pytest
import torch
import torch.distributed as dist

from helpers import assert_params
from helpers import build_small as _build, small_batch as _data, small_global_batch as _global

CONFIGS = [(0, None), (1, None), (2, None), (3, None), (1, "optimizer"), (2, "optimizer"), (3, "optimizer")]
IDS = [f"stage{s}" + ("+offload" if o else "") for s, o in CONFIGS]
EXACT = dict(rtol=1e-10, atol=1e-12)


def _foreign(engine, params):
    """(p, flat index) of a gradient element that this rank does NOT own (stage 0: the first)."""
    owned = set()
    for slot in engine.param_slots():
        if slot.replicated:
            return params[0], 0
        owned.update((id(q), i) for q, lo, hi, _ in slot.ranges for i in range(lo, hi))
    return next((p, i) for p in params for i in range(p.numel()) if (id(p), i) not in owned)


def _poison(grad, index):
    grad = grad.clone()
    grad.view(-1)[index] = math.inf
    return grad


# -- dynamic loss scaling: the skip decisions and scales of torch.amp.GradScaler -------------
SCALER = dict(init_scale=2.0 ** 10, growth_interval=2)
INJECT = (1, 4)            # steps whose gradient overflows on rank 1 only
STEPS = 7


def scaled_run(stage, offload):
    from zerolab import initialize
    from zerolab.mixed_precision import LossScaler
    rank = dist.get_rank()
    model = _build("mlp")
    engine = initialize(model, stage=stage, offload=offload, lr=1e-2, loss_scale=LossScaler(**SCALER))
    step = {"now": 0}
    if rank == 1:                   # rank 1 poisons an element it does not own: only its owner sees it
        p, index = _foreign(engine, [q for q in model.parameters() if q.requires_grad])
        p.register_hook(lambda g: _poison(g, index) if step["now"] in INJECT else None)
    skipped = []
    for step["now"] in range(STEPS):
        engine.backward(engine(*_data("mlp", model, step["now"], rank)))
        engine.step()
        skipped.append(engine.last_step_skipped)
        engine.zero_grad()
    return engine.scaler.history, skipped, engine.steps, engine.full_state_dict()


def grad_scaler_reference(n):
    model = _build("mlp")
    params = [q for q in model.parameters() if q.requires_grad]
    opt, scaler = torch.optim.AdamW(params, lr=1e-2), torch.amp.GradScaler("cpu", **SCALER)
    history = []
    for step in range(STEPS):
        handle = model.inp.weight.register_hook(lambda g: _poison(g, 0)) if step in INJECT else None
        scale = scaler.get_scale()
        scaler.scale(model(*_global("mlp", model, step, n))).backward()
        scaler.step(opt)
        scaler.update()
        history.append((scale, scaler.get_scale() < scale))    # a skip is what lowers the scale
        opt.zero_grad()
        if handle is not None:
            handle.remove()
    return history, {k: v.detach() for k, v in model.named_parameters()}


@pytest.mark.parametrize("stage,offload", CONFIGS, ids=IDS)
def test_loss_scaling_skips_like_grad_scaler(clusters, stage, offload):
    history, expected = grad_scaler_reference(2)
    assert [f for _, f in history] == [s in INJECT for s in range(STEPS)]   # the reference saw them
    results = clusters(2).run(scaled_run, stage, offload)
    for rank, (got, skipped, steps, _) in enumerate(results):
        assert got == history, f"rank {rank}: (scale, overflow) per step {got}, GradScaler {history}"
        assert skipped == [s in INJECT for s in range(STEPS)], f"rank {rank} skipped {skipped}"
        assert steps == STEPS - len(INJECT)
    assert_params([r[3] for r in results], expected, f"stage {stage} {offload} vs GradScaler", **EXACT)


# -- clipping: torch.nn.utils.clip_grad_norm_ on one process, float64 --------------------------
MAX_NORM = 0.2


def clipped_run(name, stage, offload, norm_type, loss_scale):
    from zerolab import initialize
    rank = dist.get_rank()
    model = _build(name)
    engine = initialize(model, stage=stage, offload=offload, optimizer=torch.optim.SGD, lr=0.5,
                        loss_scale=loss_scale)
    norms = []
    for step in range(3):
        engine.backward(engine(*_data(name, model, step, rank)))
        norms.append(engine.clip_grad_norm_(MAX_NORM, norm_type=norm_type).item())
        engine.step()
        engine.zero_grad()
    return norms, engine.full_state_dict()


def clip_reference(name, n, norm_type):
    model = _build(name)
    params = [q for q in model.parameters() if q.requires_grad]
    opt, norms = torch.optim.SGD(params, lr=0.5), []
    for step in range(3):
        model(*_global(name, model, step, n)).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(params, MAX_NORM, norm_type=norm_type).item())
        opt.step()
        opt.zero_grad()
    return norms, {k: v.detach() for k, v in model.named_parameters(remove_duplicate=False)}


@pytest.mark.parametrize("stage,offload", CONFIGS, ids=IDS)
def test_clip_grad_norm_equals_torch(clusters, stage, offload):
    """World size 3 (padding in every flat buffer); gpt: tied weights; mlp: a frozen layer and a
    module used twice. The first step's norm is above MAX_NORM: clipping really acts."""
    for name in ("gpt", "mlp"):
        norms, expected = clip_reference(name, 3, 2.0)
        assert norms[0] > MAX_NORM, norms
        results = clusters(3).run(clipped_run, name, stage, offload, 2.0, None)
        for rank, (got, _) in enumerate(results):
            assert got == pytest.approx(norms, rel=1e-12), f"rank {rank}, {name}: norms {got}, torch {norms}"
        assert_params([r[1] for r in results], expected, f"{name} stage {stage} {offload} clipped", **EXACT)


@pytest.mark.parametrize("stage", [0, 3])
def test_clip_inf_norm_and_with_a_loss_scale(clusters, stage):
    """The inf-norm (MAX of each rank's largest); and with a static loss scale the returned norm is
    the true gradient's (the scale taken out), the update the same."""
    norms, expected = clip_reference("gpt", 3, math.inf)
    results = clusters(3).run(clipped_run, "gpt", stage, None, math.inf, None)
    assert all(r[0] == pytest.approx(norms, rel=1e-12) for r in results), (results[0][0], norms)
    assert_params([r[1] for r in results], expected, f"stage {stage} inf-norm", **EXACT)
    norms, expected = clip_reference("gpt", 3, 2.0)
    results = clusters(3).run(clipped_run, "gpt", stage, None, 2.0, 1024.0)
    assert all(r[0] == pytest.approx(norms, rel=1e-12) for r in results), (results[0][0], norms)
    assert_params([r[1] for r in results], expected, f"stage {stage}, static loss scale 1024", **EXACT)


def test_clip_is_one_all_reduce_of_a_scalar(clusters):
    def run():
        from zerolab import comm, initialize
        model = _build("gpt")
        engine = initialize(model, stage=2, lr=0.1)
        engine.backward(engine(*_data("gpt", model, 0, dist.get_rank())))
        with comm.log() as log:
            engine.clip_grad_norm_(1.0)
        return [(r.op, r.tensor_bytes) for r in log.records]
    assert clusters(2).run(run) == [[("all_reduce", 8)]] * 2


# -- fp16 with a real overflow: one process, fp32 master, GradScaler ----------------------------
def fp16_run(stage):
    from zerolab import initialize
    model = _build("gpt", torch.float32)
    engine = initialize(model, stage=stage, optimizer=torch.optim.SGD, lr=0.5, param_dtype=torch.float16,
                        loss_scale="dynamic")
    for step in range(4):
        engine.backward(engine(*_data("gpt", model, step, dist.get_rank(), torch.float32)))
        engine.step()
        engine.zero_grad()
    return engine.scaler.history, engine.full_state_dict()


def fp16_reference(n):
    master = _build("gpt", torch.float32)
    start = {k: v.detach().clone() for k, v in master.named_parameters(remove_duplicate=False)}
    # SGD: the update is proportional to the gradient (Adam's sign-like first steps would turn fp16
    # rounding of a near-zero gradient into a full lr of difference)
    opt, scaler, history = torch.optim.SGD(master.parameters(), lr=0.5), torch.amp.GradScaler("cpu"), []
    for step in range(4):
        half = _build("gpt", torch.float32)
        half.load_state_dict(master.state_dict())
        half.half()                                           # fp16 compute from the fp32 master
        scale = scaler.get_scale()
        scaler.scale(half(*_global("gpt", half, step, n, torch.float32))).backward()
        for m, h in zip(master.parameters(), half.parameters()):
            m.grad = h.grad.float()
        scaler.step(opt)
        scaler.update()
        history.append((scale, scaler.get_scale() < scale))
        opt.zero_grad()
    return history, start, {k: v.detach() for k, v in master.named_parameters(remove_duplicate=False)}


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_fp16_dynamic_loss_scale_overflows_and_recovers_like_grad_scaler(clusters, stage):
    """GradScaler's default 2**16 overflows at once here (an fp16 loss's gradient 2**16 > 65504):
    the first step is skipped everywhere, the scale halves, training proceeds like the fp16
    one-process loop (to fp16's precision: within 5% of how far the weights moved)."""
    history, start, expected = fp16_reference(2)
    assert history[0] == (2.0 ** 16, True) and not any(f for _, f in history[1:]), history
    results = clusters(2).run(fp16_run, stage)
    for rank, (got, state) in enumerate(results):
        assert [s for s, _ in got] == [s for s, _ in history], f"rank {rank}: scales {got}, GradScaler {history}"
        assert got[0] == (2.0 ** 16, True) and not any(f for _, f in got[1:]), got
        for k, t in expected.items():
            moved, err = (t - start[k]).abs().max(), (state[k] - t).abs().max()
            assert err <= 0.05 * moved, f"rank {rank}, {k}: off by {err:.3g}, the weights moved {moved:.3g}"


# -- reduce_dtype: bytes on the wire and the dtype the step reads -------------------------------
def reduce_run(stage, reduce_dtype):
    from zerolab import initialize
    model = _build("gpt", torch.float32)
    engine = initialize(model, stage=stage, lr=1e-2, param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype,
                        reduce_impl=None if stage == 0 else "ring")
    for step in range(2):
        engine.backward(engine(*_data("gpt", model, step, dist.get_rank(), torch.float32)))
        dtypes = sorted({str(g.dtype) for g in sum(engine.owned_grads(), [])})
        engine.step()
        engine.zero_grad()
    ops = engine.last_step_comm.by_op()
    grads_op = "all_reduce" if stage == 0 else "reduce_scatter"
    return ops[grads_op][1], ops.get("all_gather", (0, 0))[1], dtypes, engine.full_state_dict()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_reduce_dtype_bytes_and_dtype(clusters, stage):
    psi = sum(p.numel() for p in _build("gpt").parameters())     # tied weight once
    bf16, fp32 = clusters(2).run(reduce_run, stage, None), clusters(2).run(reduce_run, stage, torch.float32)
    for (b_red, b_ag, b_dt, _), (f_red, f_ag, f_dt, _) in zip(bf16, fp32):
        assert b_dt == ["torch.bfloat16"] and f_dt == ["torch.float32"], (b_dt, f_dt)
        assert psi * 2 <= b_red <= psi * 2 + 64 * 2, b_red       # Ψ bf16 elements (+ padding) reduced
        assert f_red == 2 * b_red, (f_red, b_red)                 # twice the bytes in fp32
        assert f_ag == b_ag                                       # parameters still travel in bf16
    assert_params([r[3] for r in fp32], bf16[0][3], f"stage {stage} fp32 vs bf16 reduce", rtol=0, atol=5e-2)


def test_bad_options_are_value_errors(clusters):
    def run():
        from zerolab import initialize
        out = []
        for stage in (0, 1, 2, 3):
            for kw in ({"loss_scale": "Dynamic"}, {"loss_scale": -1.0}, {"loss_scale": True},
                       {"reduce_dtype": "bf16"}, {"reduce_dtype": torch.int32}):
                try:
                    initialize(_build("mlp"), stage=stage, **kw)
                    out.append(f"stage {stage} accepted {kw}")
                except ValueError as exc:
                    name = next(iter(kw))
                    if name not in str(exc) or "valid" not in str(exc):
                        out.append(f"stage {stage} {kw}: unhelpful message {exc}")
        return out
    assert clusters(1).run(run) == [[]]


def test_loss_scale_survives_a_checkpoint(clusters, tmp_path):
    def run(path):
        from zerolab import initialize
        from zerolab.mixed_precision import LossScaler
        model = _build("mlp")
        engine = initialize(model, stage=2, lr=1e-2, loss_scale=LossScaler(**SCALER))
        for step in range(3):
            engine.backward(engine(*_data("mlp", model, step, dist.get_rank())))
            engine.step()
            engine.zero_grad()
        saved = engine.scaler.state_dict()
        engine.save_checkpoint(path)
        other = initialize(_build("mlp"), stage=1, lr=1e-2, loss_scale="dynamic")
        other.load_checkpoint(path)
        return saved, other.scaler.state_dict()
    for saved, loaded in clusters(2).run(run, str(tmp_path / "ckpt")):
        assert saved["scale"] == 2.0 ** 11 and loaded["scale"] == saved["scale"], (saved, loaded)
        assert loaded["_growth_tracker"] == saved["_growth_tracker"] == 1


def _torch_clip_on_engine_params(stage, offload):
    from zerolab import initialize
    model = _build("gpt")
    engine = initialize(model, stage=stage, offload=offload, optimizer=torch.optim.SGD, lr=0.5)
    engine.backward(engine(*_data("gpt", model, 0, dist.get_rank())))
    try:
        norm = torch.nn.utils.clip_grad_norm_(engine.module.parameters(), MAX_NORM)
    except RuntimeError as exc:
        return str(exc)
    return float(norm)


@pytest.mark.parametrize("stage,offload", CONFIGS, ids=IDS)
def test_torch_clip_grad_norm_on_sharded_parameters_is_refused(clusters, stage, offload):
    """torch.nn.utils.clip_grad_norm_(engine.module.parameters()) gave a different norm per rank at
    stage 1 and 0.0 at stages 2-3 (grads None), silently: refused there, pointing to the engine's;
    stage 0 holds the whole averaged gradient on every rank, so torch's is right and allowed."""
    norms, _ = clip_reference("gpt", 2, 2.0)
    for rank, got in enumerate(clusters(2).run(_torch_clip_on_engine_params, stage, offload)):
        if stage == 0:
            assert got == pytest.approx(norms[0], rel=1e-12), (rank, got, norms[0])
        else:
            assert "engine.clip_grad_norm_(max_norm)" in got and f"stage {stage}" in got, got


def _bf16_model_without_param_dtype(stage, offload):
    from zerolab import initialize
    model = _build("mlp", torch.bfloat16)
    engine = initialize(model, stage=stage, offload=offload, optimizer=torch.optim.SGD, lr=1e-3)
    engine.backward(engine(*_data("mlp", model, 0, dist.get_rank(), torch.bfloat16)))
    engine.step()
    mem = engine.memory_report()
    return ({p.dtype for p in engine.module.parameters()}, sum(mem["master"].values()),
            {t.dtype for t in engine.full_state_dict().values()})


@pytest.mark.parametrize("stage,offload", CONFIGS, ids=IDS)
def test_a_bf16_model_gets_fp32_masters_at_every_stage(clusters, stage, offload):
    """One precision rule: a model built in bf16 with param_dtype=None computes in bf16 and steps fp32
    masters at every stage (stage 0 used to train in pure bf16, stages 1-3 with masters)."""
    model = _build("mlp", torch.bfloat16)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    for rank, (dtypes, master_bytes, saved) in enumerate(clusters(2).run(_bf16_model_without_param_dtype,
                                                                         stage, offload)):
        assert dtypes == {torch.bfloat16}, (rank, dtypes)
        per_rank = 4 * trainable if stage == 0 else 4 * trainable / 2
        assert per_rank <= master_bytes < per_rank + 4 * 64, (rank, master_bytes, per_rank)   # + padding
        assert saved == {torch.float32}, (rank, saved)

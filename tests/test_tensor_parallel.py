"""zerolab.tensor_parallel on real gloo ranks (lesson 14): tensor and sequence parallelism equal to one
process in float64 (loss and every gradient shard), the collectives and bytes of each layer against
zerolab.cost_parallel's closed forms (logged, and on the kernel's socket counters), the activation
bytes per rank against tp_layer_terms, DTensor's ColwiseParallel/RowwiseParallel on the same MLP,
composition with ZeRO-1/2/3 on a 2 x 2 mesh, and the splits it refuses."""
import contextlib
import os

import pytest
import torch
import torch.distributed as dist

from zerolab import comm, cost, cost_parallel as cp, models

GPT = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, seq_len=16)
B = 4


@contextlib.contextmanager
def unchecked():
    """Collectives unchecked (ZEROLAB_CHECK_COLLECTIVES adds an all-reduce per call): for the sockets."""
    old = os.environ.get(comm.CHECK_ENV)
    os.environ[comm.CHECK_ENV] = "0"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(comm.CHECK_ENV, None)
        else:
            os.environ[comm.CHECK_ENV] = old


def tp_run(sequence_parallel, regather, attention, dtype=torch.float64, sockets=False):
    """One forward + backward on every rank of the world; gradient differences from one process,
    the calls, the bytes, what block 1 saved."""
    from zerolab import tensor_parallel as TP
    from zerolab.activations import SavedTensors
    with unchecked() if sockets else contextlib.nullcontext():
        full = models.build("gpt", seed=0, dtype=dtype, attention=attention, **GPT)
        model = TP.TensorParallelGPT(full, None, sequence_parallel=sequence_parallel, regather=regather)
        ref = models.build("gpt", seed=0, dtype=dtype, attention=attention, **GPT)
        x, y = models.batch("gpt", seed=1, batch_size=B, model=ref)
        ports = comm.peer_map() if sockets else None
        region = comm.log(sockets=sockets)
        log = region.open()
        with SavedTensors(model) as saved:
            loss = model(x, y)
        loss.backward()
        dist.barrier()
        region.close()
    ref_loss = ref(x, y)
    ref_loss.backward()
    one = dict(ref.named_parameters(remove_duplicate=False))
    diffs = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        full_name, dim, index = model.shards[name]
        want = one[full_name].grad if index is None else one[full_name].grad.index_select(dim, index)
        assert p.grad.shape == want.shape, name
        diffs[name] = (p.grad - want).abs().max().item() / (want.abs().max().item() or 1)
    return {"loss": abs(loss.item() - ref_loss.item()), "diffs": diffs,
            "ops": [(r.op, r.tensor_bytes, r.sent_bytes) for r in log.records], "sent": log.sent_bytes,
            "measured": sum(log.measured_by_peer(ports).values()) if sockets else None,
            "block": sum(v for n, v in saved.by_module().items() if n.split(".")[:2] == ["blocks", "1"])}


VARIANTS = [(False, True), (True, True), (True, False)]
IDS = ["tp", "sp-regather", "sp-keep-gathered"]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("sp, regather", VARIANTS, ids=IDS)
def test_equal_to_one_process_in_float64(clusters, world, sp, regather):
    for rank, r in enumerate(clusters(world).run(tp_run, sp, regather, "sdpa")):
        assert r["loss"] < 1e-13, f"rank {rank}: loss differs by {r['loss']}"
        worst = max(r["diffs"].items(), key=lambda kv: kv[1])
        assert worst[1] < 1e-12, f"rank {rank}: gradient of {worst[0]} differs (relative {worst[1]:.2e})"


@pytest.mark.parametrize("sp, regather", VARIANTS, ids=IDS)
def test_calls_and_bytes_per_layer_equal_the_formulas(clusters, sp, regather):
    t, L = 4, GPT["n_layers"]
    S = GPT["seq_len"] * B * GPT["d_model"] * 8
    for rank, r in enumerate(clusters(t).run(tp_run, sp, regather, "naive", torch.float64, True)):
        calls = cp.tp_layer_collectives(S, sequence_parallel=sp, regather=regather,
                                        replicated_grad_bytes=GPT["d_model"] * 8 if sp else 0)
        want = sorted([(op, b) for op, b in calls["forward"] + calls["backward"]] * L
                      + ([("all_gather", S), ("all_gather", S)] if sp else []))       # the entry's and exit's
        assert sorted((op, tb) for op, tb, _ in r["ops"]) == want, f"rank {rank}: calls {r['ops']}"
        formula = L * cp.sent_bytes(calls["forward"] + calls["backward"], t) + (2 * (t - 1) / t * S if sp else 0)
        assert r["sent"] == pytest.approx(formula, rel=1e-12), f"rank {rank}: logged {r['sent']}, formula {formula}"
        # the kernel's count: the algorithms' bytes plus gloo's headers and one barrier, never less
        assert formula <= r["measured"] <= 1.25 * formula, f"rank {rank}: sockets {r['measured']}, formula {formula}"


def test_tp_sends_narayanans_8_bsh_per_layer():
    S = 16 * 4 * 32 * 2
    for t in (2, 4, 8):
        assert cp.tp_layer_sent_bytes(S, t) == pytest.approx(8 * (t - 1) / t * S)
        assert cp.tp_layer_sent_bytes(S, t, sequence_parallel=True, regather=False) == pytest.approx(8 * (t - 1) / t * S)
        assert cp.tp_layer_sent_bytes(S, t, sequence_parallel=True) == pytest.approx(10 * (t - 1) / t * S)


@pytest.mark.parametrize("attention", ["naive", "sdpa"])
@pytest.mark.parametrize("sp, regather", VARIANTS, ids=IDS)
def test_activation_bytes_per_rank_equal_tp_layer_terms(clusters, attention, sp, regather):
    t = 4
    s, h, a = GPT["seq_len"], GPT["d_model"], GPT["n_heads"]
    want = cp.tp_activation_bytes_per_layer(s, B, h, a, t, sequence_parallel=sp, regather=regather, dtype_bytes=4,
                                            dropout=False, flash=attention == "sdpa", stats_bytes=4)
    for rank, r in enumerate(clusters(t).run(tp_run, sp, regather, attention, torch.float32)):
        assert r["block"] == want, f"rank {rank}: block 1 saved {r['block']} B, tp_layer_terms {want} B"


def test_paper_closed_forms():
    for s, b, h, a, t in [(2048, 1, 12288, 96, 8), (512, 4, 1024, 16, 2), (16, 4, 32, 4, 4)]:
        tp = cp.tp_activation_bytes_per_layer(s, b, h, a, t)
        sp = cp.tp_activation_bytes_per_layer(s, b, h, a, t, sequence_parallel=True)
        assert tp == pytest.approx(s * b * h * (10 + 24 / t + 5 * a * s / (h * t)))    # Korthikanti Sec. 4.2.1
        assert sp == pytest.approx(s * b * h * (34 + 5 * a * s / h) / t)               # Sec. 4.2.2
        assert cp.tp_activation_bytes_per_layer(s, b, h, a, 1) == pytest.approx(s * b * h * (34 + 5 * a * s / h))


def dtensor_mlp():
    """TinyGPT's first MLP split by zerolab and by DTensor (Colwise/Rowwise): outputs, a weight
    gradient and socket bytes."""
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from zerolab import tensor_parallel as TP

    class MLP(nn.Module):
        def __init__(self, fc, out):
            super().__init__()
            self.fc, self.out = fc, out

        def forward(self, x):
            return self.out(F.gelu(self.fc(x)))

    with unchecked():
        t, r = dist.get_world_size(), dist.get_rank()
        block = models.build("gpt", seed=0, dtype=torch.float64, **GPT).blocks[0]
        h = GPT["d_model"]
        rows = torch.arange(r * 4 * h // t, (r + 1) * 4 * h // t)
        ours = MLP(TP.ColumnParallelLinear(block.fc, rows, None), TP.RowParallelLinear(block.out, rows, None))
        theirs = MLP(nn.Linear(h, 4 * h), nn.Linear(4 * h, h)).double()
        theirs.load_state_dict(MLP(block.fc, block.out).state_dict())
        parallelize_module(theirs, init_device_mesh("cpu", (t,)), {"fc": ColwiseParallel(), "out": RowwiseParallel()})
        x = torch.randn(GPT["seq_len"], B, h, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
        ports, out = comm.peer_map(), {}
        for name, mlp in (("ours", ours), ("theirs", theirs)):
            x_ = x.clone().requires_grad_()
            region = comm.log(sockets=True)
            log = region.open()
            y = mlp(x_)
            y.square().sum().backward()
            dist.barrier()
            region.close()
            g = mlp.fc.weight.grad
            out[name] = {"y": y.detach().clone(), "x_grad": x_.grad, "fc_grad": g.to_local() if hasattr(g, "to_local") else g,
                         "sockets": sum(log.measured_by_peer(ports).values())}
    return out


def test_dtensor_colwise_rowwise_equals_ours(clusters):
    for rank, r in enumerate(clusters(4).run(dtensor_mlp)):
        for key in ("y", "x_grad", "fc_grad"):
            torch.testing.assert_close(r["ours"][key], r["theirs"][key], rtol=1e-12, atol=1e-14)
        assert r["ours"]["sockets"] == r["theirs"]["sockets"], f"rank {rank}: {r['ours']['sockets']} vs {r['theirs']['sockets']}"


def tp_dp(zero, sp):
    import zerolab
    from zerolab import tensor_parallel as TP
    from zerolab.mesh import Mesh
    mesh = Mesh(2, 2)
    full = models.build("gpt", seed=0, dtype=torch.float64, **GPT)
    model = TP.TensorParallelGPT(full, mesh.intra, sequence_parallel=sp)
    engine = zerolab.initialize(model, stage=zero, group=mesh.inter, lr=1e-2)
    x, y = models.batch("gpt", seed=2, batch_size=8, model=full)
    half = slice(4 * mesh.node, 4 * mesh.node + 4)
    with comm.log() as log:
        engine.backward(engine(x[half], y[half]))
        engine.step()
    ref = models.build("gpt", seed=0, dtype=torch.float64, **GPT)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ref(x, y).backward()
    opt.step()
    one, worst = dict(ref.named_parameters(remove_duplicate=False)), 0.0
    for name, value in engine.full_state_dict().items():
        full_name, dim, index = model.shards[name]
        want = one[full_name].detach() if index is None else one[full_name].detach().index_select(dim, index)
        worst = max(worst, (value - want).abs().max().item())
    return worst, mesh.link_bytes(log), sum(p.numel() for p in dict.fromkeys(model.parameters()))


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_tp_times_dp_with_zero_on_a_mesh(clusters, zero):
    for rank, (worst, links, psi_t) in enumerate(clusters(4).run(tp_dp, zero, True)):
        assert worst < 1e-10, f"rank {rank}: ZeRO-{zero} x TP+SP differs from one process by {worst}"
        S = GPT["seq_len"] * 4 * GPT["d_model"] * 8
        intra = GPT["n_layers"] * cp.tp_layer_sent_bytes(S, 2, sequence_parallel=True,
                                                         replicated_grad_bytes=GPT["d_model"] * 8) + S / 2 * 2
        assert links["intra"] == pytest.approx(intra), f"rank {rank}: intra {links['intra']}, formula {intra}"
        if zero < 3:
            assert links["inter"] == pytest.approx(cost.wire_bytes(psi_t, 2, zero, grad_bytes=8, param_bytes=8))


def refused(kind):
    from zerolab import tensor_parallel as TP
    try:
        if kind == "heads":
            TP.TensorParallelGPT(models.build("gpt", n_heads=2, d_model=32), None)
        else:
            model = TP.TensorParallelGPT(models.build("gpt", **dict(GPT, seq_len=18)), None, sequence_parallel=True)
            model(*models.batch("gpt", batch_size=2, model=models.build("gpt", **dict(GPT, seq_len=18))))
    except ValueError as exc:
        return str(exc)
    return None


def test_splits_it_cannot_make_are_refused(clusters):
    got = clusters(4).run(refused, "heads")[0]
    assert got and "n_heads (2)" in got and "divisible by 4" in got, got
    got = clusters(4).run(refused, "seq")[0]
    assert got and "sequence length (18)" in got, got

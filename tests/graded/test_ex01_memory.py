"""Graded: exercise 01, memory anatomy. The theory is checked against the ZeRO paper's worked
example and closed forms (sharded kinds really 1/N); the measured accounting against bytes
computed by hand from layer shapes: tied weights once, frozen layers without grads or state, mixed
dtypes, fp32 masters, views into one flat buffer, and torch DDP's bucket-view gradients on 2 real
ranks, where plain data parallelism must show the full 16 bytes/param on EVERY rank."""
import pytest
import torch
import torch.nn as nn

from zerolab import models
from zerolab.grade.helpers import exercise_module

# The reference implementation of this exercise: a submission that uses it scores 0
# (checked before and while the tests run, by zerolab.grade.references).
REFERENCE_MODULES = ["zerolab.memory", "zerolab.calculator"]
REFERENCE_ALLOWED = ["zerolab.memory.PRECISIONS"]  # bytes per element, a table

PSI, N = 7.5e9, 64


def _ex():
    return exercise_module("ex01_memory")


def _expect(got, expected, what):
    for key, want in expected.items():
        assert key in got, f"{what}: no {key!r} in the result {got}"
        assert got[key] == pytest.approx(want, rel=1e-12, abs=1e-9), (
            f"{what}: {key} = {got[key]!r} bytes, expected {want!r}")


def gpt_numel(vocab=256, d=64, layers=2, seq=32):
    """TinyGPT's unique parameter elements and tensors from its shapes (head tied to tok)."""
    block = 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + 2 * d + (d * 4 * d + 4 * d) + (4 * d * d + d)
    return vocab * d + seq * d + layers * block + 2 * d, 4 + 12 * layers


# ------------------------------------------------------------------------------------------ theory
@pytest.mark.points(2)
def test_paper_worked_example():
    ex = _ex()
    # ZeRO Fig. 1: Ψ = 7.5B, N = 64, mixed-precision Adam: 120, 31.4, 16.6, 1.88 GB (1e9 bytes).
    for stage, gb, exact in [(0, 120.0, 120e9), (1, 31.4, 31.40625e9), (2, 16.6, 16.640625e9),
                             (3, 1.88, 1.875e9)]:
        got = ex.model_state_bytes(PSI, N, stage)
        assert round(got["total"] / 1e9, 2 if stage == 3 else 1) == gb, (
            f"stage {stage}: {got['total'] / 1e9:.4g} GB per rank, the paper says {gb} GB")
        _expect(got, {"total": exact, "host": 0}, f"stage {stage}, Ψ=7.5e9, N=64")


@pytest.mark.points(2)
@pytest.mark.parametrize("mixed", [True, False], ids=["mixed", "fp32"])
def test_each_stage_shards_one_more_kind(mixed):
    ex = _ex()
    b, k = (2, 12) if mixed else (4, 8)
    for psi in (1000, 123_457):                   # 123457 is divisible by none of the N below
        for n in (1, 2, 3, 8):
            p = g = b * psi
            table = {0: (p, g, k * psi), 1: (p, g, k * psi / n), 2: (p, g / n, k * psi / n),
                     3: (p / n, g / n, k * psi / n)}
            for stage, (params, grads, optim) in table.items():
                _expect(ex.model_state_bytes(psi, n, stage, mixed_precision=mixed),
                        {"params": params, "grads": grads, "optimizer": optim,
                         "total": params + grads + optim, "host": 0},
                        f"stage {stage}, Ψ={psi}, N={n}, {'mixed' if mixed else 'fp32'}")
    total = ex.model_state_bytes(1000, 8, 0, mixed_precision=mixed)["total"]
    assert total == 16_000, f"data parallelism holds 16 bytes/param either way, got {total / 1000}"


@pytest.mark.points(2)
def test_offload_moves_the_owned_states_to_the_host():
    ex = _ex()
    # ZeRO-Offload (arXiv 2101.06840): the device keeps 2-byte params (2Ψ on top of stage 2);
    # grad shard + fp32 master + moments, (2 + 12)Ψ/N, live on the host.
    _expect(ex.model_state_bytes(PSI, N, 2, offload=True),
            {"params": 2 * PSI, "grads": 0, "optimizer": 0, "total": 2 * PSI, "host": 14 * PSI / N},
            "stage 2 + offload")
    _expect(ex.model_state_bytes(PSI, N, 3, offload=True),
            {"params": 2 * PSI / N, "grads": 0, "optimizer": 0, "host": 14 * PSI / N}, "stage 3 + offload")
    _expect(ex.model_state_bytes(PSI, N, 1, offload=True),
            {"params": 2 * PSI, "grads": 2 * PSI, "optimizer": 0, "host": 14 * PSI / N}, "stage 1 + offload")
    _expect(ex.model_state_bytes(800, 4, 2, mixed_precision=False, offload=True),
            {"params": 3200, "total": 3200, "host": (4 + 8 + 4) * 200}, "fp32 stage 2 + offload")
    for bad in (dict(stage=0, offload=True), dict(stage=4)):
        with pytest.raises(ValueError):
            ex.model_state_bytes(1000, 4, **{"offload": False, **bad})


# ---------------------------------------------------------------------------------------- measured
@pytest.mark.points(1)
def test_unique_storage_bytes():
    ex = _ex()
    buf = torch.zeros(100)                                        # 400 bytes
    views = [buf[:10], buf[10:50].view(4, 10), buf]
    got = ex.unique_storage_bytes(views + [None, torch.zeros(0)])
    assert got == 400, f"three views of one 400-byte buffer (and an empty tensor) count {got} bytes"
    mixed = [torch.zeros(3, dtype=torch.float64), torch.zeros(3, dtype=torch.bfloat16),
             torch.zeros(3, dtype=torch.int8), torch.zeros(3)]
    got = ex.unique_storage_bytes(mixed + mixed)
    assert got == 3 * (8 + 2 + 1 + 4), f"fp64 + bf16 + int8 + fp32 (3 elements each): got {got}"
    model = models.build("gpt")
    numel, _ = gpt_numel()
    got = ex.unique_storage_bytes(list(model.state_dict().values()))  # lists the tied weight twice
    assert got == 4 * numel, f"TinyGPT's state_dict: {got} bytes, expected {4 * numel} (tied weight once)"


def _step(model, opt, name="gpt"):
    x, y = models.batch(name, model=model, batch_size=4)
    model(x, y).backward()
    opt.step()


@pytest.mark.points(2)
def test_measured_tied_weights_fp32_adam():
    ex = _ex()
    model = models.build("gpt")
    numel, tensors = gpt_numel()
    opt = torch.optim.AdamW(model.parameters())
    _expect(ex.measured_model_states(model, opt), {"params": 4 * numel, "grads": 0, "optimizer": 0},
            "TinyGPT before the first step")
    _step(model, opt)
    # 4 + 4 + 8 = 16 bytes/param, plus Adam's 4-byte `step` counter per parameter tensor.
    _expect(ex.measured_model_states(model, opt),
            {"params": 4 * numel, "grads": 4 * numel, "optimizer": 8 * numel + 4 * tensors},
            "TinyGPT (tied weights) after one AdamW step")


@pytest.mark.points(2)
def test_measured_frozen_params_mixed_dtypes_and_masters():
    ex = _ex()
    mlp = models.build("mlp")
    trainable, frozen = (13 * 37 + 37) + (37 * 37 + 37) + (37 * 5 + 5), 37 * 37 + 37
    opt = torch.optim.Adam(mlp.parameters())
    _step(mlp, opt, "mlp")
    _expect(ex.measured_model_states(mlp, opt),
            {"params": 4 * (trainable + frozen), "grads": 4 * trainable, "optimizer": 8 * trainable + 4 * 6},
            "ToyMLP (a frozen layer: no grad, no Adam state)")

    net = nn.Sequential(nn.Linear(3, 4).double(), nn.Linear(4, 2).half())
    _expect(ex.measured_model_states(net), {"params": 8 * 16 + 2 * 10, "grads": 0, "optimizer": 0},
            "fp64 + fp16 layers")

    model = models.build("gpt", dtype=torch.bfloat16)          # mixed precision by hand
    numel, tensors = gpt_numel()
    masters = [p.detach().float().requires_grad_() for p in model.parameters()]
    opt = torch.optim.AdamW(masters)
    x, y = models.batch("gpt", model=model, batch_size=2)
    model(x, y).backward()
    for m, p in zip(masters, model.parameters()):
        m.grad = p.grad.float()
    opt.step()
    for m in masters:
        m.grad = None
    # 2 + 2 + 12 (fp32 master + m + v) = 16 bytes/param, plus the step counters
    _expect(ex.measured_model_states(model, opt),
            {"params": 2 * numel, "grads": 2 * numel, "optimizer": 12 * numel + 4 * tensors},
            "bf16 TinyGPT with fp32 master copies in AdamW")


@pytest.mark.points(1)
def test_measured_views_into_flat_buffers():
    ex = _ex()
    model = nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 3))      # 42 + 24 = 66 elements
    flat, grads = torch.zeros(68), torch.zeros(68)               # padded to a multiple of 4
    offset = 0
    for p in model.parameters():                                 # params and grads become views
        p.data = flat[offset:offset + p.numel()].view_as(p)
        p.grad = grads[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
    _expect(ex.measured_model_states(model), {"params": 68 * 4, "grads": 68 * 4, "optimizer": 0},
            "params and grads as views into padded flat buffers")


def check_ddp_replicates():
    """On each rank: torch DDP (grads are views into DDP's bucket buffers) + AdamW, one step;
    every rank must hold the full 16 bytes/param: plain data parallelism replicates."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    ex = exercise_module("ex01_memory")
    rank, n = dist.get_rank(), dist.get_world_size()
    model = models.build("gpt")
    numel, tensors = gpt_numel()
    ddp = DDP(model, gradient_as_bucket_view=True, bucket_cap_mb=0.05)
    opt = torch.optim.AdamW(model.parameters())
    x, y = models.batch("gpt", seed=rank, model=model, batch_size=4)
    ddp(x, y).backward()
    opt.step()
    got = ex.measured_model_states(model, opt)
    _expect(got, {"params": 4 * numel, "grads": 4 * numel, "optimizer": 8 * numel + 4 * tensors},
            f"rank {rank}: DDP model states")
    theory = ex.model_state_bytes(numel, n, 0, mixed_precision=False)["total"]
    measured = sum(got.values()) - 4 * tensors
    assert measured == theory == 16 * numel, (
        f"rank {rank}: measured {measured} bytes of model states (without step counters), "
        f"theory for DP {theory}; both must be the full 16 x {numel} on every rank")


@pytest.mark.points(2)
def test_data_parallel_replicates_on_real_ranks(on_ranks):
    on_ranks(2, check_ddp_replicates)

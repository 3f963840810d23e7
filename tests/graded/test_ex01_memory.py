"""Graded: exercise 01, memory anatomy. The peak of a training step, measured while it runs, is
checked against bytes computed by hand from layer shapes: tied weights once, a frozen layer without
grads or state, two micro-batches, bf16 parameters with fp32 masters, and torch DDP's bucket-view
gradients on 2 real ranks, where plain data parallelism must show the full 16 bytes/param on EVERY
rank. Every step ends with zero_grad(set_to_none=True): a measurement taken only after the step
misses the gradients. The theory is checked against the ZeRO paper's worked example and closed
forms (sharded kinds really 1/N)."""
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
    """derived: the ZeRO paper's 120, 31.4, 16.6, 1.88 GB"""
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
    """derived: each stage divides one more kind by N"""
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
    """derived: ZeRO-Offload's split between device and host"""
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
def _hooks_left(model, optimizer):
    left = [n for n, p in model.named_parameters() if getattr(p, "_post_accumulate_grad_hooks", None)]
    if optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks:
        left.append("the optimizer's step hooks")
    return left


@pytest.mark.points(3)
def test_peak_of_a_step_tied_weights_fp32_adam():
    """peak during the step: grads released by zero_grad(set_to_none=True) still count"""
    ex = _ex()
    model = models.build("gpt")
    numel, tensors = gpt_numel()
    opt = torch.optim.AdamW(model.parameters())
    x, y = models.batch("gpt", model=model, batch_size=4)

    def run_step():
        model(x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)            # the gradients are gone when run_step returns

    for attempt in (1, 2):                          # the second step starts with Adam's state
        got = ex.peak_model_states(model, opt, run_step)
        # 4 + 4 + 8 = 16 bytes/param, plus Adam's 4-byte `step` counter per parameter tensor, all held
        # together right after optimizer.step(), before zero_grad.
        _expect(got, {"params": 4 * numel, "grads": 4 * numel, "optimizer": 8 * numel + 4 * tensors,
                      "total": 16 * numel + 4 * tensors}, f"TinyGPT (tied weights), AdamW step {attempt}")
        left = _hooks_left(model, opt)
        assert not left, f"peak_model_states left hooks behind on {left[:4]}"


@pytest.mark.points(3)
def test_peak_with_fp32_masters():
    """peak during the step: bf16 model, fp32 masters in the optimizer (mixed precision by hand)"""
    ex = _ex()
    model = models.build("gpt", dtype=torch.bfloat16)
    numel, tensors = gpt_numel()
    masters = [p.detach().float().requires_grad_() for p in model.parameters()]
    opt = torch.optim.AdamW(masters)
    x, y = models.batch("gpt", model=model, batch_size=2)

    def run_step():
        model(x, y).backward()
        for m, p in zip(masters, model.parameters()):
            m.grad = p.grad.float()
        opt.step()
        for m in masters:
            m.grad = None
        model.zero_grad(set_to_none=True)

    got = ex.peak_model_states(model, opt, run_step)
    # bf16 grads (2) and fp32 master grads (4) together before the step; after it, the fp32 master (4)
    # and two moments (8) too: 2 + 6 + 12 = 20 bytes/param at once, plus the step counters.
    _expect(got, {"params": 2 * numel, "grads": 6 * numel, "optimizer": 12 * numel + 4 * tensors,
                  "total": 20 * numel + 4 * tensors}, "bf16 TinyGPT with fp32 masters in AdamW")


@pytest.mark.points(2)
def test_peak_frozen_layer_two_micro_batches():
    """peak during the step: gradient accumulation (two backward passes), a frozen layer"""
    ex = _ex()
    mlp = models.build("mlp")
    trainable, frozen = (13 * 37 + 37) + (37 * 37 + 37) + (37 * 5 + 5), 37 * 37 + 37
    opt = torch.optim.Adam(mlp.parameters())

    def run_step():
        for seed in (1, 2):                          # two micro-batches, one step
            x, y = models.batch("mlp", seed=seed, batch_size=4)
            mlp(x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    got = ex.peak_model_states(mlp, opt, run_step)
    _expect(got, {"params": 4 * (trainable + frozen), "grads": 4 * trainable, "optimizer": 8 * trainable + 4 * 6,
                  "total": 4 * (trainable + frozen) + 12 * trainable + 4 * 6},
            "ToyMLP (a frozen layer: no grad, no Adam state), two micro-batches")


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

    def run_step():
        ddp(x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)    # the gradients stay views into DDP's buckets

    run_step()                     # DDP rebuilds its buckets after the first iteration: measure the next
    got = ex.peak_model_states(model, opt, run_step)
    _expect(got, {"params": 4 * numel, "grads": 4 * numel, "optimizer": 8 * numel + 4 * tensors,
                  "total": 16 * numel + 4 * tensors}, f"rank {rank}: DDP model states at their peak")
    theory = ex.model_state_bytes(numel, n, 0, mixed_precision=False)["total"]
    assert got["total"] - 4 * tensors == theory == 16 * numel, (
        f"rank {rank}: measured {got['total'] - 4 * tensors} bytes of model states at the peak (without step "
        f"counters), theory for DP {theory}; both must be the full 16 x {numel} on every rank")


@pytest.mark.points(2)
def test_data_parallel_replicates_on_real_ranks(on_ranks):
    """peak during the step on 2 real ranks: DDP holds everything on every rank"""
    on_ranks(2, check_ddp_replicates)

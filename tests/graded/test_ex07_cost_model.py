"""Graded: exercise 07, the cost model. Checked against cases computed by hand, against the bytes
zerolab's real engines send on real ranks (the comm log's ideal ring bytes and the kernel's socket
count), and against the ZeRO papers' headline numbers (arXiv 1910.02054, arXiv 2101.06840)."""
import pytest

from zerolab.grade.helpers import exercise_module

# The reference implementation of this exercise: a submission that uses it scores 0
# (checked before and while the tests run, by zerolab.grade.references).
REFERENCE_MODULES = ["zerolab.cost", "zerolab.calculator", "zerolab.calibrate"]

# Hand-picked hardware: 100 TFLOP/s at 50% -> 50 TFLOP/s; 1 GB/s links with 10 µs per ring step.
HW = dict(peak_flops=100e12, mfu=0.5, bandwidth=1e9, latency=1e-5)


def _close(got, want, what, rel=1e-9):
    assert got == pytest.approx(want, rel=rel), f"{what}: got {got!r}, expected {want!r} (by hand)"


@pytest.mark.points(2)
def test_wire_bytes_by_hand():
    ex = exercise_module("ex07_cost_model")
    psi = 1e9
    # DP on 8 ranks: one all_reduce of 2Ψ bytes = 2 phases x 7/8 x 2e9
    _close(ex.wire_bytes(psi, 8, 0), 2 * 7 / 8 * 2e9, "wire_bytes(Ψ=1e9, N=8, stage 0)")
    _close(ex.wire_bytes(psi, 8, 1), 2 * 7 / 8 * 2e9, "stage 1: reduce-scatter + all-gather = DP's bytes")
    _close(ex.wire_bytes(psi, 8, 2), 2 * 7 / 8 * 2e9, "stage 2: the same 2Ψ as DP")
    _close(ex.wire_bytes(psi, 8, 3), 3 * 7 / 8 * 2e9, "stage 3: 3Ψ, 1.5x DP")
    _close(ex.wire_bytes(psi, 4, 3, word_bytes=4), 3 * 3 / 4 * 4e9, "stage 3, fp32 words, N=4")
    assert ex.wire_bytes(psi, 1, 2) == 0, "one rank sends nothing"


def engine_step_bytes(stage):
    """On each rank: Ψ, and the bytes of one training step of zerolab's engine for ``stage`` (fp32):
    its collectives under the ideal ring (comm log), as logged, and as the sockets carried them."""
    import torch.distributed as dist

    import zerolab
    from zerolab import models
    model = models.build("gpt", seed=0)                       # fp32, Ψ = 118,528: no padding at N = 2, 4
    engine = zerolab.initialize(model, stage=stage, lr=1e-3)
    for step in range(2):
        loss = engine(*models.batch("gpt", seed=10 * step + dist.get_rank(), batch_size=2, model=model))
        engine.backward(loss)
        engine.step()
        engine.zero_grad()
    log = engine.last_step_comm
    psi = sum(p.numel() for p in dict.fromkeys(model.parameters()))
    return psi, log.ideal_bytes, log.sent_bytes, log.measured_bytes


@pytest.mark.points(2)
@pytest.mark.parametrize("world_size", [2, 4])
def test_wire_bytes_match_real_engines(on_ranks, world_size):
    ex = exercise_module("ex07_cost_model")
    ex.wire_bytes(1000, world_size, 0)          # a stub fails here, before any rank starts
    for stage in (0, 1, 2):
        for rank, (psi, ideal, sent, measured) in enumerate(on_ranks(world_size, engine_step_bytes, stage)):
            predicted = ex.wire_bytes(psi, world_size, stage, word_bytes=4)
            assert predicted == pytest.approx(ideal, rel=1e-9), (
                f"rank {rank}, stage {stage}, N={world_size}: wire_bytes predicts {predicted:.0f} bytes per "
                f"step; the engine's collectives under the ideal ring send {ideal:.0f}")
            if measured is not None:              # what the sockets really carried (gloo on Linux)
                assert abs(measured - sent) <= 0.1 * sent, f"rank {rank}: socket bytes {measured} vs logged {sent}"


@pytest.mark.points(3)
def test_step_time_by_hand():
    ex = exercise_module("ex07_cost_model")
    psi, n, tokens = 0.5e9, 4, 1000          # S = 2 bytes x 0.5e9 = 1 GB per collective
    compute = 6 * psi * tokens / 50e12                       # 0.06 s
    phase = 3 * 1e-5 + 3 / 4 * 1e9 / 1e9                     # (N-1)·α + (N-1)/N·S/B = 0.75003 s
    for stage, phases in [(0, 2), (1, 2), (2, 2), (3, 3)]:
        _close(ex.step_time(psi, n, stage, tokens_per_rank=tokens, overlap=False, **HW),
               compute + phases * phase, f"step_time(stage {stage}, overlap=False)")
        _close(ex.step_time(psi, n, stage, tokens_per_rank=tokens, overlap=True, **HW),
               max(compute, phases * phase), f"step_time(stage {stage}, overlap=True)")
    # compute-bound: 1e6 tokens -> 60 s of compute hides 1.5 s of all_reduce
    _close(ex.step_time(psi, n, 0, tokens_per_rank=1e6, **HW), 60.0, "compute-bound step, overlapped")
    _close(ex.step_time(psi, 1, 3, tokens_per_rank=tokens, overlap=False, **HW), compute,
           "one rank: no communication at all")


@pytest.mark.points(2)
def test_largest_model_zero_paper():
    ex = exercise_module("ex07_cost_model")
    # ZeRO Table 2 / Fig. 1: 32 GB V100s, N = 64, model states only: 2B, 7.6B, 14.4B, 128B
    for stage, paper in enumerate([2.0e9, 7.6e9, 14.4e9, 128e9]):
        got = ex.largest_model(64, stage, 32e9)
        assert got == pytest.approx(paper, rel=0.01), (
            f"largest_model(N=64, stage {stage}, 32 GB) = {got / 1e9:.2f}B; the ZeRO paper: {paper / 1e9:g}B")
    got = ex.largest_model(1024, 3, 32e9)
    assert got >= 1e12, f"stage 3 on 1024 x 32 GB: {got / 1e12:.2f}T; the paper: a trillion parameters fit"


@pytest.mark.points(2)
def test_largest_model_zero_offload():
    ex = exercise_module("ex07_cost_model")
    # ZeRO-Offload: one 32 GB V100, 13B with offload vs ~1.4B without. Model states alone: 2 bytes
    # per parameter stay on the device (32 GB / 2 = 16B) against 16 (2B).
    _close(ex.largest_model(1, 2, 32e9, offload=True), 16e9, "one GPU, stage 2 + offload, no reserve")
    _close(ex.largest_model(1, 0, 32e9), 2e9, "one GPU, no offload, no reserve")
    reserve = 32e9 - 2 * 13e9                 # activations and buffers, as the 13B headline implies
    _close(ex.largest_model(1, 2, 32e9, offload=True, reserved_bytes=reserve), 13e9, "13B with offload")
    without = ex.largest_model(1, 0, 32e9, reserved_bytes=reserve)
    assert without == pytest.approx(1.4e9, rel=0.2), f"without offload {without / 1e9:.2f}B; the paper: ~1.4B"
    _close(ex.largest_model(4, 1, 32e9, offload=True), 32e9 / 4, "stage 1 + offload keeps 2Ψ params + 2Ψ grads")
    _close(ex.largest_model(4, 3, 32e9, offload=True), 32e9 / (2 / 4), "stage 3 + offload keeps 2Ψ/N")

"""Graded: exercise 07, the cost model. The step time is checked phase by phase against cases
computed by hand (communication-bound, in between and compute-bound; with and without prefetch; one
rank), the largest model against the ZeRO papers' headline numbers (arXiv 1910.02054,
arXiv 2101.06840)."""
import pytest

# The reference implementation of this exercise: a submission that uses it scores 0
# (checked before and while the tests run, by zerolab.grade.references).
REFERENCE_MODULES = ["zerolab.cost", "zerolab.calculator", "zerolab.calibrate"]

# Hand-picked hardware: 100 TFLOP/s at 50% -> 50 TFLOP/s; 1 GB/s links with 10 µs per ring step.
HW = dict(peak_flops=100e12, mfu=0.5, bandwidth=1e9, latency=1e-5)


def _close(got, want, what, rel=1e-9):
    assert got == pytest.approx(want, rel=rel), f"{what}: got {got!r}, expected {want!r} (by hand)"


def _phase(n, s):
    """One ring phase on S bytes with HW's links, by hand."""
    return (n - 1) * HW["latency"] + (n - 1) / n * s / HW["bandwidth"]


@pytest.mark.points(3)
def test_step_time_phase_by_phase(student):
    """the cost model: each collective hides only under the phase it runs in"""
    ex = student.module("ex07_cost_model")
    psi, n = 0.5e9, 4                                        # S = 2 bytes x 0.5e9 = 1 GB per collective
    ph = _phase(n, 1e9)                                      # 0.75003 s
    for tokens in (1000, 20_000, 1_000_000):                 # comm-bound, in between, compute-bound
        f, b = 2 * psi * tokens / 50e12, 4 * psi * tokens / 50e12
        cases = {
            0: max(b, 2 * ph) + f,                           # all-reduce under backward
            1: f + b + 2 * ph,                               # nothing hides
            2: f + max(b, ph) + ph,                          # reduce-scatter under backward, gather after
            3: max(f, ph) + max(b, 2 * ph),                  # gathers hide under their phases
        }
        for stage, want in cases.items():
            got = ex.step_time(psi, n, stage, tokens_per_rank=tokens, **HW)
            _close(got, want, f"ex.step_time(stage {stage}, {tokens} tokens per rank)")
        _close(ex.step_time(psi, n, 3, tokens_per_rank=tokens, prefetch=False, **HW), f + ph + max(b, 2 * ph),
               f"ex.step_time(stage 3, {tokens} tokens, prefetch=False): the forward gathers wait in front of each unit")
    _close(ex.step_time(psi, 8, 2, tokens_per_rank=1000, word_bytes=4, **HW),
           2 * psi * 1000 / 50e12 + max(4 * psi * 1000 / 50e12, _phase(8, 2e9)) + _phase(8, 2e9),
           "stage 2, fp32 words, N = 8")
    for stage in range(4):
        _close(ex.step_time(psi, 1, stage, tokens_per_rank=1000, **HW), 6 * psi * 1000 / 50e12,
               f"one rank, stage {stage}: compute only")


@pytest.mark.points(2)
def test_largest_model_zero_paper(student):
    """derived: the ZeRO paper's largest models on 64 and 1024 V100s"""
    ex = student.module("ex07_cost_model")
    # ZeRO Table 2 / Fig. 1: 32 GB V100s, N = 64, model states only: 2B, 7.6B, 14.4B, 128B
    for stage, paper in enumerate([2.0e9, 7.6e9, 14.4e9, 128e9]):
        got = ex.largest_model(64, stage, 32e9)
        assert got == pytest.approx(paper, rel=0.01), (
            f"ex.largest_model(N=64, stage {stage}, 32 GB) = {got / 1e9:.2f}B; the ZeRO paper: {paper / 1e9:g}B")
    got = ex.largest_model(1024, 3, 32e9)
    assert got >= 1e12, f"stage 3 on 1024 x 32 GB: {got / 1e12:.2f}T; the paper: a trillion parameters fit"


@pytest.mark.points(2)
def test_largest_model_zero_offload(student):
    """derived: ZeRO-Offload's 13B on one V100, and what stays on the device"""
    ex = student.module("ex07_cost_model")
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

"""zerolab.cost_parallel, the cost model's tensor/pipeline terms (accounting, no ranks): each term by
hand, the step of a 3-D layout by hand on a small case, and the placement it predicts at scale."""
import math

import pytest

from zerolab import cost, cost_parallel as cp

SHAPE = dict(layers=96, hidden=12288, heads=96)
PSI = 12 * 96 * 12288 ** 2


def test_zero_bytes_under_pipeline_by_hand():
    psi, d, m = 1000, 4, 8
    phase = 3 / 4 * psi * 2
    assert cp.zero_bytes_under_pipeline(psi, d, m, 1) == 2 * phase      # one reduce-scatter, one all-gather
    assert cp.zero_bytes_under_pipeline(psi, d, m, 2) == (m + 1) * phase  # a reduce-scatter per micro-batch
    assert cp.zero_bytes_under_pipeline(psi, d, m, 3) == 3 * m * phase    # two gathers and a reduction each
    with pytest.raises(ValueError, match="zero_stage=4"):
        cp.zero_bytes_under_pipeline(psi, d, m, 4)


def test_p2p_bytes_by_hand():
    assert cp.p2p_bytes(100, 4, 8) == {"first": 800, "middle": 1600, "last": 800}
    assert cp.p2p_bytes(100, 1, 8) == {"first": 0, "middle": 1600, "last": 0}


def test_a_step_by_hand():
    """t = 2, p = 2, d = 2 on one 8-GPU node of a toy profile, ZeRO-1: every term computed here."""
    hw = cost.Hardware("toy", 80e9, 100e12, 0.5, 10e9, 1e-5, 10e9, 1e9)
    links = cost.TwoLinks("toy node", 8, 100e9, 1e-6, 8, 10e9, 5e-6)
    shape = dict(layers=4, hidden=1024, heads=8)
    psi, s, b, B = 12 * 4 * 1024 ** 2, 512, 1, 16
    got = cp.parallel_step_time(psi, shape, t=2, p=2, d=2, global_batch=B, seq_len=s, micro_batch=b, hw=hw,
                                links=links, zero_stage=1)
    m = B // (2 * b)
    rate = 100e12 * 0.5
    attn = 4 * 4 * s * 1024 / 4                                          # the core attention, per GPU
    c_f = (2 * psi / 4 + attn) * s * b / rate
    c_b = (4 * psi / 4 + 2 * attn) * s * b / rate
    act = s * b * 1024 * 2
    gather = (2 - 1) * 1e-6 + (2 - 1) / 2 * act / 100e9                  # one all-gather on NVSwitch, t = 2
    slot_tp = 4 / 2 * 8 * gather                 # L/p layers x (2 gathers + 2 scatters) per pass, 2 passes
    slot_tp += max(0.0, 4 / 2 * 2 * gather - 2 * psi / 4 * s * b / rate)  # the re-gather beside dgrad
    slot_p2p = 2 * (1e-6 + act / 2 / 100e9)                              # the whole job in one node
    slot = c_f + c_b + slot_tp + slot_p2p
    grads = psi / 4 * 2
    rs = (2 - 1) * 1e-6 + (2 - 1) / 2 * grads / 100e9
    dp = max(0.0, rs - c_b) + rs                                         # ZeRO-1: the reduce-scatter hides
    assert got["m"] == m                                                 # under the last backward, not the
    assert got["total"] == pytest.approx((m + 2 - 1) * slot + dp, rel=1e-12)   # all-gather after the update
    assert got["bubble"] == pytest.approx(slot, rel=1e-12)
    assert got["dp_bytes"] == cp.zero_bytes_under_pipeline(psi / 4, 2, m, 1)


@pytest.mark.parametrize("zero_stage", [0, 1, 2, 3])
@pytest.mark.parametrize("recompute", [None, "selective", "full"])
def test_data_parallel_alone_is_lesson_07b_step(zero_stage, recompute):
    """t = p = 1 is cost.step_time's data-parallel step: the same phases, overlap rule and units."""
    for d, b in ((8, 1), (64, 4)):
        got = cp.parallel_step_time(PSI, SHAPE, t=1, p=1, d=d, global_batch=1024, seq_len=2048, micro_batch=b,
                                    hw=cost.H100_80GB, links=cost.DGX_H100, zero_stage=zero_stage, recompute=recompute)
        link = cp._dp_link(cost.H100_80GB, cost.DGX_H100, 1, d)
        want = cost.step_time(PSI, d, zero_stage, tokens_per_rank=1024 // d * 2048, hw=link, recompute=recompute,
                              micro_batches=1024 // (d * b), units=96 if zero_stage == 3 else None,
                              attention=cost.attention_flops(layers=96, hidden=12288, seq_len=2048))
        assert got["total"] == pytest.approx(want["total"], rel=1e-12)


def test_zero2_and_zero3_pay_per_micro_batch_under_a_pipeline():
    """ZeRO-1's data-parallel traffic is once per step; ZeRO-2 reduce-scatters, ZeRO-3 also gathers, per
    micro-batch: with the batch per replica doubled (twice the micro-batches) their bytes double."""
    kw = dict(t=8, p=4, d=8, seq_len=2048, micro_batch=1, hw=cost.H100_80GB, links=cost.DGX_H100)
    for zero, grows in ((1, False), (2, True), (3, True)):
        small, big = (cp.parallel_step_time(PSI, SHAPE, global_batch=B, zero_stage=zero, **kw) for B in (256, 512))
        assert big["m"] == 2 * small["m"]
        ratio = big["dp_bytes"] / small["dp_bytes"]
        assert (ratio > 1.5) == grows, (zero, ratio)


def test_memory_first_stage_by_hand():
    s, b, h, a = 2048, 1, 12288, 96
    got = cp.parallel_memory(PSI, SHAPE, t=8, p=8, d=4, seq_len=s, micro_batch=b, attention="paper")
    assert got["states"] == pytest.approx((4 + 12 / 4) * PSI / 64)         # ZeRO-1 over d = 4
    assert got["activations"] == pytest.approx(96 * s * b * h * (34 + 5 * a * s / h) / 8)
    fused = cp.parallel_memory(PSI, SHAPE, t=8, p=8, d=4, seq_len=s, micro_batch=b)
    assert fused["activations"] == pytest.approx(96 * (32 * s * b * h + 4 * a * s * b) / 8)   # flash, no dropout
    few = cp.parallel_memory(PSI, SHAPE, t=8, p=8, d=4, seq_len=s, micro_batch=b, micro_batches=2)
    assert few["activations"] == pytest.approx(fused["activations"] * 2 / 8)  # 2 of 8 micro-batches in flight
    full = cp.parallel_memory(PSI, SHAPE, t=8, p=8, d=4, seq_len=s, micro_batch=b, recompute="full")
    layer = 32 * s * b * h + 4 * a * s * b
    assert full["activations"] == pytest.approx((96 * 2 * s * b * h + layer - 2 * s * b * h) / 8)
    z3 = cp.parallel_memory(PSI, SHAPE, t=8, p=8, d=4, seq_len=s, micro_batch=b, zero_stage=3)
    assert z3["states"] == pytest.approx(16 * PSI / 64 / 4)


def test_best_layouts_search_every_option_under_one_model():
    rows = cp.best_layouts(PSI, SHAPE, 64, global_batch=1024, seq_len=2048, hw=cost.H100_80GB, links=cost.DGX_H100)
    assert all(r["d"] <= 1024 for r in rows), "a layout with more replicas than sequences"
    assert any(r["t"] == 1 and r["p"] == 1 for r in rows), "data parallelism alone is a row of the same table"
    fits = [r for r in rows if r["fits"]]
    assert [r["ranked"] for r in fits] == sorted(r["ranked"] for r in fits)
    for r in fits[:3]:      # the option kept is the fastest that fits among its layout's (ZeRO-3: lesson 07b's rule)
        for zero in cp.ZERO_STAGES:
            for mode in (None, "selective", "full"):
                mem = cp.parallel_memory(PSI, SHAPE, t=r["t"], p=r["p"], d=r["d"], seq_len=2048,
                                         micro_batch=r["micro_batch"], micro_batches=r["m"], zero_stage=zero,
                                         recompute=mode)
                if mem["total"] <= cost.H100_80GB.device_memory and zero < 3:
                    other = cp.parallel_step_time(PSI, SHAPE, t=r["t"], p=r["p"], d=r["d"], global_batch=1024,
                                                  seq_len=2048, micro_batch=r["micro_batch"], hw=cost.H100_80GB,
                                                  links=cost.DGX_H100, zero_stage=zero, recompute=mode)
                    assert r["ranked"] <= other["total"] + 1e-9
    assert cp.ASSUMPTIONS and all(len(a) == 3 for a in cp.ASSUMPTIONS)


def test_layouts_and_bad_input():
    assert sorted(cp.layouts(8)) == sorted([(1, 1, 8), (1, 2, 4), (1, 4, 2), (1, 8, 1), (2, 1, 4), (2, 2, 2),
                                            (2, 4, 1), (4, 1, 2), (4, 2, 1), (8, 1, 1)])
    with pytest.raises(ValueError, match="global_batch=10"):
        cp.parallel_step_time(PSI, SHAPE, t=8, p=8, d=4, global_batch=10, seq_len=2048, micro_batch=1,
                              hw=cost.H100_80GB, links=cost.DGX_H100)
    with pytest.raises(ValueError, match="zero_stage=4"):
        cp.parallel_step_time(PSI, SHAPE, t=8, p=8, d=4, global_batch=1024, seq_len=2048, micro_batch=1,
                              hw=cost.H100_80GB, links=cost.DGX_H100, zero_stage=4)
    with pytest.raises(ValueError, match="recompute='some'"):
        cp.parallel_memory(PSI, SHAPE, t=8, p=8, d=4, seq_len=2048, micro_batch=1, recompute="some")
    with pytest.raises(ValueError, match="p=0"):
        cp.parallel_memory(PSI, SHAPE, t=8, p=0, d=4, seq_len=2048, micro_batch=1)
    with pytest.raises(ValueError, match="t=0"):
        cp.tp_layer_terms(16, 1, 32, 4, 0)
    assert math.isclose(cp.bubble_fraction(2, 1), 0.5)

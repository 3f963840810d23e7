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
    """t = 2, p = 2, d = 2 on one 8-GPU node of a toy profile: every term computed here."""
    hw = cost.Hardware("toy", 80e9, 100e12, 0.5, 10e9, 1e-5, 10e9, 1e9)
    links = cost.TwoLinks("toy node", 8, 100e9, 1e-6, 8, 10e9, 5e-6)
    shape = dict(layers=4, hidden=1024, heads=8)
    psi, s, b, B = 12 * 4 * 1024 ** 2, 512, 1, 16
    got = cp.parallel_step_time(psi, shape, t=2, p=2, d=2, global_batch=B, seq_len=s, micro_batch=b, hw=hw, links=links)
    m = B // (2 * b)
    rate = 100e12 * 0.5
    slot_compute = 6 * psi / 4 * s * b / rate
    act = s * b * 1024 * 2
    ar = 2 * ((2 - 1) * 1e-6 + (2 - 1) / 2 * act / 100e9)                # one all-reduce on NVSwitch, t = 2
    slot_tp = 4 / 2 * 4 * ar                                             # L/p layers x 4 all-reduces
    slot_p2p = 2 * (1e-6 + act / 2 / 100e9)                              # the whole job in one node
    slot = slot_compute + slot_tp + slot_p2p
    grads = psi / 4 * 2
    dp = 2 * ((2 - 1) * 1e-6 + (2 - 1) / 2 * grads / 100e9)             # ZeRO-1: reduce-scatter + all-gather
    assert got["m"] == m
    assert got["total"] == pytest.approx((m + 2 - 1) * slot + dp, rel=1e-12)
    assert got["bubble"] == pytest.approx(slot, rel=1e-12)


def test_memory_first_stage_by_hand():
    got = cp.parallel_memory(PSI, SHAPE, t=8, p=8, d=4, seq_len=2048, micro_batch=1)
    assert got["states"] == pytest.approx((4 + 12 / 4) * PSI / 64)         # ZeRO-1 over d = 4
    assert got["activations"] == pytest.approx(96 * 2048 * 12288 * (34 + 5 * 96 * 2048 / 12288) / 8)


def test_placement_at_scale_keeps_tensor_parallelism_in_the_node():
    for n in (64, 512, 4096):
        rows = cp.best_layouts(PSI, SHAPE, n, global_batch=1024, seq_len=2048, hw=cost.H100_80GB, links=cost.DGX_H100)
        fits = [r for r in rows if r["fits"]]
        assert fits[0]["t"] <= 8 and fits[0]["p"] > 1, fits[0]
        assert all(r["d"] <= 1024 for r in rows), "a layout with more replicas than sequences"
        cross = [r for r in fits if r["t"] > 8]
        assert cross and cross[0]["time"]["total"] > fits[0]["time"]["total"]


def test_layouts_and_bad_input():
    assert sorted(cp.layouts(8)) == sorted([(1, 1, 8), (1, 2, 4), (1, 4, 2), (1, 8, 1), (2, 1, 4), (2, 2, 2),
                                            (2, 4, 1), (4, 1, 2), (4, 2, 1), (8, 1, 1)])
    with pytest.raises(ValueError, match="global_batch=10"):
        cp.parallel_step_time(PSI, SHAPE, t=8, p=8, d=4, global_batch=10, seq_len=2048, micro_batch=1,
                              hw=cost.H100_80GB, links=cost.DGX_H100)
    with pytest.raises(ValueError, match="t=0"):
        cp.tp_layer_terms(16, 1, 32, 4, 0)
    assert math.isclose(cp.bubble_fraction(2, 1), 0.5)

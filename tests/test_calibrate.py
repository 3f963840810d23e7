"""The cost-model calibration (zerolab.calibrate, benchmarks/bench_cost.py): the alpha-beta fit and the
profile arithmetic against numbers worked by hand, and one quick end-to-end run of the script on CPU
ranks that must write a valid profile and a predicted-vs-measured table. No timing assertions."""
import dataclasses
import json
import math

import pytest

from zerolab import calibrate, cost


def _fake_ranks(world_size, t_small, t_large, fwd_bwd=0.5, adam=0.01, host_adam=0.002, copy=0.004):
    """per-rank results as zerolab.calibrate.measure returns them, with chosen probe times."""
    info = {"psi": 1_000_000, "tokens": 100, "adam_numel": 2_000_000, "copy_bytes": 40_000_000}
    times = {"fwd_bwd": [fwd_bwd] * 3, "adam": [adam] * 3, "host_adam": [host_adam] * 3, "copy": [copy] * 3}
    for op, factor in (("all_reduce", 1), ("all_gather", 0.5), ("reduce_scatter", 0.75)):
        times[f"{op} 1000"], times[f"{op} 1001000"] = [factor * t_small] * 3, [factor * t_large] * 3
    return [{"times": times, "phases": {}, "schedule": {}, "psi": {}, "info": info, "errors": {}}
            for _ in range(world_size)]


def test_alpha_beta_fit_by_hand():
    # N = 2: t(S) = 2·α + S/B. Choose α = 50 µs, B = 1 GB/s: t(1000) = 100 µs + 1 µs, t(1001000) = 100 µs + 1001 µs
    hw, raw = calibrate.fit_hardware(_fake_ranks(2, 101e-6, 1101e-6), 2)
    assert hw.link_bandwidth == pytest.approx(1e9)
    assert hw.link_latency == pytest.approx(50e-6)
    # 6·Ψ·tokens / time = 6e8 / 0.5 s; Adam 2e6 params / 10 ms; fused 2e6 / 2 ms; copy 40 MB / 4 ms
    assert hw.peak_flops * hw.mfu == pytest.approx(1.2e9)
    assert hw.device_adam_params_per_s == pytest.approx(2e8)
    assert hw.host_adam_params_per_s == pytest.approx(1e9)
    assert hw.host_link_bandwidth == pytest.approx(1e10)
    # one-phase collectives: t(S) = α + S/(2B) at N = 2. all_gather at half the all_reduce's times is the
    # same link; reduce_scatter at 3/4 of them: 75.75 µs and 825.75 µs -> B = 0.5e6 / 750e-6, α = 75 µs
    links = calibrate.fit_links(raw, 2, hw)
    assert links["all_gather"].link_bandwidth == pytest.approx(1e9)
    assert links["all_gather"].link_latency == pytest.approx(50e-6)
    assert links["reduce_scatter"].link_bandwidth == pytest.approx(0.5e6 / 750e-6)
    assert links["reduce_scatter"].link_latency == pytest.approx(75e-6)
    assert links["all_reduce"].link_bandwidth == pytest.approx(hw.link_bandwidth)
    # N = 4: t(S) = 6·α + 1.5·S/B
    hw4, _ = calibrate.fit_hardware(_fake_ranks(4, 6 * 20e-6 + 1.5 * 1000 / 2e9, 6 * 20e-6 + 1.5 * 1001000 / 2e9), 4)
    assert hw4.link_bandwidth == pytest.approx(2e9)
    assert hw4.link_latency == pytest.approx(20e-6)


def test_slowest_rank_per_round_then_median():
    per_rank = [{"times": {"x": [1.0, 5.0, 2.0]}}, {"times": {"x": [3.0, 1.0, 2.5]}}]
    assert calibrate.slowest_median(per_rank, "x") == 3.0     # rounds' maxima 3, 5, 2.5 -> median 3


def test_predict_adds_the_terms_by_hand():
    hw = cost.Hardware("hand", 0.0, peak_flops=1e9, mfu=1.0, link_bandwidth=1e9, link_latency=1e-4,
                       host_link_bandwidth=2e9, host_adam_params_per_s=1e7, device_adam_params_per_s=1e6)
    psi, n = 1000, 2
    # stage 1, fp32: compute 6·1000·100/1e9 = 0.6 ms; reduce-scatter + all-gather of 4000 B on 2 ranks,
    # each 1 step of 100 µs + 2000 B / 1 GB/s = 102 µs; update Ψ/N = 500 params / 1e6 = 0.5 ms
    t = calibrate.predict(psi, "1", n, hw, tokens=100)
    assert t["total"] == pytest.approx(0.6e-3 + 2 * 102e-6 + 0.5e-3)
    # the engine's schedule instead: three calls of 2000 B each pay their own latency
    t = calibrate.predict(psi, "1", n, hw, tokens=100, schedule=[("reduce_scatter", 2000)] * 3)
    assert t["comm"] == pytest.approx(3 * (100e-6 + 1000 / 1e9))
    # ... and on their own link: 10 µs, 0.5 GB/s
    slow = dataclasses.replace(hw, link_bandwidth=0.5e9, link_latency=1e-5)
    t = calibrate.predict(psi, "1", n, hw, tokens=100, schedule=[("reduce_scatter", 2000), ("all_gather", 2000)],
                          links={"reduce_scatter": slow})
    assert t["comm"] == pytest.approx((1e-5 + 1000 / 0.5e9) + (100e-6 + 1000 / 1e9))
    # offload: no device update; 4 B + 4 B per owned param over 2 GB/s, and 500 params at 1e7/s on the host
    t = calibrate.predict(psi, "2+offload", n, hw, tokens=100)
    assert t["update"] == 0 and t["offload"] == pytest.approx(8 * 500 / 2e9 + 500 / 1e7)
    # per phase, with an engine's schedule by phase: stage 3 gathers in forward, again in backward with its
    # reduce-scatters; compute splits 2:4 (0.2 ms forward, 0.4 ms backward); the step is the update alone
    sched = {"forward": [("all_gather", 2000)] * 2, "backward": [("all_gather", 2000), ("reduce_scatter", 2000)],
             "step": []}
    t = calibrate.predict(psi, "3", n, hw, tokens=100, schedule=sched)
    one = 100e-6 + 1000 / 1e9
    assert t["forward"] == pytest.approx(0.2e-3 + 2 * one)
    assert t["backward"] == pytest.approx(0.4e-3 + 2 * one)
    assert t["step"] == pytest.approx(0.5e-3)


def test_phases_on_the_groups_timeline():
    per_rank = [{"phases": {"2": [(1.0, 2.0, 3.0), (5.0, 1.0, 1.0), (1.0, 1.0, 1.0)]}},
                {"phases": {"2": [(2.0, 1.0, 1.0), (1.0, 4.0, 2.0), (3.0, 1.0, 1.0)]}}]
    # each rank's phase ends, from its step's start: round 1 (1, 3, 6) and (2, 3, 4); round 2 (5, 6, 7) and
    # (1, 5, 7); round 3 (1, 2, 3) and (3, 4, 5). A phase ends when its last rank ends it: (2, 3, 6), (5, 6, 7),
    # (3, 4, 5), so the phases last (2, 1, 3), (5, 1, 1), (3, 1, 1) -> medians 3, 1, 1. The slowest rank's
    # time phase by phase, (2, 2, 3), (5, 4, 2), (3, 1, 1), would count rank 1's late forward in round 1 twice:
    # medians 3, 2, 2, and round 2's phases would add up to 11 for a step of 7.
    assert calibrate.slowest_phases(per_rank, "2") == [3.0, 1.0, 1.0]
    steps = [max(map(sum, ranks)) for ranks in zip(*(r["phases"]["2"] for r in per_rank))]
    assert steps == [6.0, 7.0, 5.0]          # each round's phases, on the timeline, add up to its step


def test_caching_allocator_sets_and_restores(monkeypatch):
    import os
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    with calibrate.caching_allocator():
        assert int(os.environ["MALLOC_MMAP_THRESHOLD_"]) == 32 << 20
    assert "MALLOC_MMAP_THRESHOLD_" not in os.environ


def test_bench_cost_runs_and_writes_a_valid_profile(tmp_path):
    from benchmarks import bench_cost
    path = tmp_path / "profile.json"
    text = bench_cost.main((2,), stages=("0", "3", "2+offload"), rounds=1, profile_path=path,
                           model_kwargs=dict(vocab_size=64, d_model=32, n_layers=1, n_heads=2, seq_len=16))
    profile = json.loads(path.read_text())
    hw = calibrate.load_profile(path)[2]
    assert isinstance(hw, cost.Hardware)
    for field in ("peak_flops", "link_bandwidth", "host_link_bandwidth", "host_adam_params_per_s",
                  "device_adam_params_per_s"):
        value = getattr(hw, field)
        assert value > 0 and math.isfinite(value), f"{field} = {value}"
    assert hw.link_latency >= 0
    # Ψ of the probe model: embeddings V·d + T·d, one block 12d² + 13d, final norm 2d (head tied)
    assert profile["raw"]["2"]["psi"] == 64 * 32 + 16 * 32 + (12 * 32 * 32 + 13 * 32) + 2 * 32
    assert not profile["errors"], profile["errors"]
    for stage in ("0", "3", "2+offload"):
        assert f"| 2 | {stage} |" in text, text
    assert "within ±25%" in text and "Per phase:" in text
    assert set(profile["links"]["2"]) == {"all_reduce", "all_gather", "reduce_scatter"}
    # stage 3's row counts its collectives per phase (2 units here: the root and the one block): forward
    # gathers the root, the block, and at its end prefetches the block again for backward; backward
    # reduce-scatters both units; the step launches none
    row3 = next(line for line in text.splitlines() if line.startswith("| 2 | 3 |"))
    assert "| 3 / 2 / 0 |" in row3, row3
    row0 = next(line for line in text.splitlines() if line.startswith("| 2 | 0 |"))
    assert "| 0 / 1 / 0 |" in row0, row0
    # its headline ratios reach make bench's summary table, one row each
    from benchmarks import run_all
    assert len(text.headlines) == 3 and "PER PHASE" in text.headlines[0][0]
    summary = run_all.headlines([text]).splitlines()
    assert summary[2:4] == ["| comparison | ratio | how to read it |", "|---|---:|---|"]
    for what, ratio, reading in text.headlines:
        assert f"| {what} | {ratio} | {reading} |" in summary
        assert float(ratio) > 0 and "within ±25%" in reading


def test_each_miss_is_named_with_the_measured_cause_that_accounts_for_it_or_none():
    from benchmarks import bench_cost

    def profile(fwd_then_bwd):           # ms; the bare forward 12 of a forward + backward of 30 (1.2x a third)
        raw = {"fwd": 12.0, "fwd_bwd": 30.0, "cpu fwd": 12.0, "cpu forward 0": 13.2, "cpu forward 3": 12.0,
               "fwd_then_bwd": fwd_then_bwd, "cpu fwd_then_bwd": 12.0}
        return {"cores": 2, "raw": {"4": raw}}

    def row(stage, forward, step, spread, gathers=()):
        return {"world_size": 4, "stage": stage, "schedule": {"forward": list(gathers)},
                "links": {"forward": 10.0, "step": 5.0}, "phases": [forward, 1.0, step], "spread": [0.0, spread, 0.0]}
    r0, r3 = row("0", 20.0, 3.0, 4.0), row("3", 20.0, 3.0, 2.0, gathers=[("all_gather", 8)])
    misses = [(r0, "forward", -0.5), (r0, "step", 5 / 3 - 1), (r3, "forward", -0.5), (r3, "step", 5 / 3 - 1)]
    # the bare forward's wall time grows 1.5x when the ranks go straight on into their backward (its CPU
    # time does not): 10 ms x 1.2 (split) x 1.5 (sharing) x 1.1 (the engine's CPU) = 19.8 ms against 20
    causes = bench_cost.explain(profile(18.0), [r0, r3], misses)
    assert "together -1%" in causes[4, "0", "forward"] and "1.50x that when the ranks go" in causes[4, "0", "forward"]
    assert "4000.0 ms before the last" in causes[4, "0", "step"]   # (seconds here) the others ended theirs earlier
    assert causes[4, "3", "step"] is None                   # 2 ms apart: less than the 3 ms step
    assert causes[4, "3", "forward"] is None                # a forward with collectives in it: no such factors
    # no waiting: 10 x 1.2 x 1.1 = 13.2 ms is still -34% of 20: not accounted for
    assert bench_cost.explain(profile(12.0), [r0], misses[:1])[4, "0", "forward"] is None

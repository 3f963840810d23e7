"""zerolab.cost: closed-form cases worked by hand, and the papers' headline numbers."""
import dataclasses
import math

import pytest

from zerolab import cost

HW = cost.Hardware("hand", device_memory=10e9, peak_flops=100e12, mfu=0.5, link_bandwidth=1e9,
                   link_latency=1e-5, host_link_bandwidth=2e9, host_adam_params_per_s=1e8)


def test_ring_time_by_hand():
    # all_reduce of 1 GB on 4 ranks: 2 phases x (3 steps x 10 us + 3/4 x 1 GB / 1 GB/s)
    assert cost.ring_time("all_reduce", 1e9, 4, HW) == pytest.approx(2 * (3e-5 + 0.75))
    assert cost.ring_time("all_gather", 1e9, 2, HW) == pytest.approx(1e-5 + 0.5)
    assert cost.ring_time("all_reduce", 1e9, 1, HW) == 0.0


def test_wire_bytes_two_psi_for_dp_and_stages_1_2_three_psi_for_stage_3():
    psi, n = 1e9, 8
    dp = cost.wire_bytes(psi, n, 0)
    assert dp == pytest.approx(2 * 2 * psi * 7 / 8)          # 2Ψ words of 2 bytes, (N-1)/N each
    assert cost.wire_bytes(psi, n, 1) == pytest.approx(dp)
    assert cost.wire_bytes(psi, n, 2) == pytest.approx(dp)
    assert cost.wire_bytes(psi, n, 3) == pytest.approx(1.5 * dp)


def test_compute_offload_and_step_time_by_hand():
    # 1e9 params x 1000 tokens x 6 FLOPs / (100 TFLOP/s x 0.5) = 0.12 s: forward 0.04, backward 0.08
    assert cost.compute_time(1e9, 1000, HW) == pytest.approx(0.12)
    assert cost.compute_phases(1e9, 1000, HW) == pytest.approx({"forward": 0.04, "backward": 0.08})
    # full recomputation runs the forward again inside backward: 8Ψ per token
    assert cost.compute_time(1e9, 1000, HW, recompute=True) == pytest.approx(0.16)
    # N=4: 2.5e8 params per rank; 4 bytes each over 2 GB/s = 0.5 s; Adam 2.5e8 / 1e8 = 2.5 s
    assert cost.offload_time(1e9, 4, HW) == pytest.approx(3.0)
    t = cost.step_time(1e9, 4, 0, tokens_per_rank=1000, hw=HW)
    comm = cost.ring_time("all_reduce", 2e9, 4, HW)           # 3 s: far longer than backward
    # the all-reduce can hide only under BACKWARD (0.08 s), not under the whole step: not max(compute, comm)
    assert t["comm"] == pytest.approx(comm) and t["total"] == pytest.approx(0.04 + 0.08 + (comm - 0.08))
    assert t["exposed_comm"] == pytest.approx(comm - 0.08)
    assert (t["forward"], t["backward"], t["step"]) == pytest.approx((0.04, comm, 0.0))
    t2 = cost.step_time(1e9, 4, 0, tokens_per_rank=1000, hw=HW, overlap=False)
    assert t2["total"] == pytest.approx(0.12 + comm) and t2["exposed_comm"] == pytest.approx(comm)


FAST = cost.Hardware("fast link", 10e9, 100e12, 0.5, 100e9, 0.0, 2e9, 1e8)   # 100 GB/s, no latency


def test_phases_by_hand_every_stage():
    # Ψ = 1e9, N = 4, 10,000 tokens: forward 0.4 s, backward 0.8 s; 2-byte words: a reduce-scatter or
    # an all-gather of 2 GB takes 3/4 x 2 GB / 100 GB/s = 15 ms, an all-reduce 30 ms
    psi, n, tokens, one = 1e9, 4, 10_000, 0.015
    t0 = cost.step_time(psi, n, 0, tokens_per_rank=tokens, hw=FAST)
    assert (t0["forward"], t0["backward"], t0["step"]) == pytest.approx((0.4, 0.8, 0.0))   # all-reduce hidden
    t1 = cost.step_time(psi, n, 1, tokens_per_rank=tokens, hw=FAST)
    # DeepSpeed's order: the reduce-scatter hides under backward, the all-gather AFTER the update does not
    assert (t1["forward"], t1["backward"], t1["step"]) == pytest.approx((0.4, 0.8, one))
    assert t1["exposed_comm"] == pytest.approx(one) and t1["total"] == pytest.approx(1.2 + one)
    # FSDP's order (Megatron's overlap_param_gather): the all-gather moves into the next forward and hides
    t1f = cost.step_time(psi, n, 2, tokens_per_rank=tokens, hw=FAST, gather_order="next_forward")
    assert (t1f["forward"], t1f["step"], t1f["exposed_comm"]) == pytest.approx((0.4, 0.0, 0.0))
    # stage 3: gathers hide with prefetch only; without, every gather is exposed (the reduce-scatter hides)
    t3 = cost.step_time(psi, n, 3, tokens_per_rank=tokens, hw=FAST)
    assert t3["total"] == pytest.approx(1.2) and t3["comm"] == pytest.approx(3 * one)
    t3n = cost.step_time(psi, n, 3, tokens_per_rank=tokens, hw=FAST, prefetch=False)
    assert (t3n["forward"], t3n["backward"]) == pytest.approx((0.4 + one, 0.8 + one))
    # no overlap: everything adds
    t3s = cost.step_time(psi, n, 3, tokens_per_rank=tokens, hw=FAST, overlap=False)
    assert t3s["total"] == pytest.approx(1.2 + 3 * one)


def test_forward_gathers_hide_only_under_forward_compute():
    # a slow link: a 2 GB all-gather takes 1.5 s on 4 ranks at 1 GB/s. Stage 3 with prefetch, 10,000 tokens:
    # forward 0.4 s hides 0.4 s of its gather; backward 0.8 s hides 0.8 s of its gather + reduce-scatter
    t = cost.step_time(1e9, 4, 3, tokens_per_rank=10_000, hw=HW)
    g = cost.ring_time("all_gather", 2e9, 4, HW)
    assert t["phases"]["forward"]["exposed"] == pytest.approx(g - 0.4)
    assert t["phases"]["backward"]["exposed"] == pytest.approx(2 * g - 0.8)
    assert t["total"] == pytest.approx(0.4 + (g - 0.4) + 0.8 + (2 * g - 0.8))


def test_micro_batches_by_hand():
    # 4 micro-batches of 2,500 tokens: the same compute; stage 1 reduces once per step, stage 2 every
    # micro-batch (each one's reduce-scatter hides under that micro-batch's backward), stage 3 gathers too
    psi, n, one = 1e9, 4, 0.015
    slow = cost.Hardware("slow", 10e9, 100e12, 0.5, 1e9, 0.0, 2e9, 1e8)      # 1.5 s per 2 GB gather
    g = 1.5
    t1 = cost.step_time(psi, n, 1, tokens_per_rank=10_000, hw=slow, micro_batches=4)
    assert t1["compute"] == pytest.approx(1.2)
    assert t1["backward"] == pytest.approx(3 * 0.2 + 0.2 + (g - 0.2))       # once, under the last backward
    assert t1["step"] == pytest.approx(g)
    t2 = cost.step_time(psi, n, 2, tokens_per_rank=10_000, hw=slow, micro_batches=4)
    assert t2["backward"] == pytest.approx(4 * (0.2 + (g - 0.2)))          # four reduce-scatters
    assert t2["step"] == pytest.approx(g)                                   # one all-gather per step
    assert t2["comm"] == pytest.approx(5 * g)
    fast2 = cost.step_time(psi, n, 2, tokens_per_rank=10_000, hw=FAST, micro_batches=4)
    assert fast2["backward"] == pytest.approx(0.8) and fast2["comm"] == pytest.approx(5 * one)
    with pytest.raises(ValueError, match="micro_batches"):
        cost.step_time(psi, n, 2, tokens_per_rank=10_000, hw=FAST, micro_batches=0)
    with pytest.raises(ValueError, match="gather_order"):
        cost.step_time(psi, n, 2, tokens_per_rank=10_000, hw=FAST, gather_order="before")


def test_engine_schedule_by_phase():
    # an engine's real calls, per phase: four buckets' reduce-scatters under backward, their gathers after
    sched = {"backward": [("reduce_scatter", 5e8)] * 4, "step": [("all_gather", 5e8)] * 4}
    t = cost.step_time(1e9, 4, 2, tokens_per_rank=10_000, hw=HW, collectives=sched, overlap=False)
    one = cost.ring_time("reduce_scatter", 5e8, 4, HW)
    assert (t["backward"], t["step"]) == pytest.approx((0.8 + 4 * one, 4 * one))
    # a flat list is placed by kind; stage 3's all-gathers need phases
    flat = cost.step_time(1e9, 4, 2, tokens_per_rank=10_000, hw=HW, overlap=False,
                          collectives=[("reduce_scatter", 5e8)] * 4 + [("all_gather", 5e8)] * 4)
    assert flat["step"] == pytest.approx(t["step"]) and flat["backward"] == pytest.approx(t["backward"])
    with pytest.raises(ValueError, match="stage 3"):
        cost.step_time(1e9, 4, 3, tokens_per_rank=10_000, hw=HW, collectives=[("all_gather", 5e8)])
    with pytest.raises(ValueError, match="phase"):
        cost.step_time(1e9, 4, 3, tokens_per_rank=10_000, hw=HW, collectives={"bwd": []})


def test_activation_bytes_by_hand():
    # s=2, b=1, h=4, a=2. The paper's setting (naive attention, dropout): per layer
    # 2*1*4*(34 + 5*2*2/4) = 8 * 39 = 312 bytes
    kw = dict(layers=3, hidden=4, seq_len=2, micro_batch=1, heads=2)
    assert cost.activation_bytes(attention="paper", **kw) == 3 * 312
    # full: each layer's 2-byte input, and during backward one layer's working set (its input once)
    assert cost.activation_bytes(attention="paper", recompute="full", **kw) == 3 * 2 * 2 * 4 + 312 - 16
    # selective drops the s² terms (5·a·s²·b = 40 bytes), and holds one layer's core attention on top
    assert cost.activation_bytes(attention="paper", recompute="selective", **kw) == 3 * 272 + 40
    # fused, no dropout (the default): 32·s·b·h = 256 bytes + the fp32 logsumexp 4·a·s·b = 16 per layer;
    # selective recomputation then saves only the logsumexp
    assert cost.activation_bytes(**kw) == 3 * (256 + 16)
    assert cost.activation_bytes(recompute="selective", **kw) == 3 * 256 + 16
    assert cost.activation_bytes(recompute=True, **kw) == 3 * 16 + 272 - 16
    # at GPT-3's ratio a = h/128 and s = 2048 the paper's layer is 114·sbh: ~3.5x the fused kernel's
    big = dict(layers=1, hidden=12288, seq_len=2048, micro_batch=1, heads=96)
    ratio = cost.activation_bytes(attention="paper", **big) / cost.activation_bytes(**big)
    assert ratio == pytest.approx(114 / 32, rel=0.01)
    with pytest.raises(ValueError, match="attention='flash'"):
        cost.activation_bytes(attention="flash", **kw)
    with pytest.raises(ValueError, match="recompute='partial'"):
        cost.activation_bytes(recompute="partial", **kw)


def test_attention_flops_and_selective_recomputation_by_hand():
    # 2 layers, s = 1000, h = 500: the core attention's forward is 4·L·s·h = 4e6 FLOPs per token
    a = cost.attention_flops(layers=2, hidden=500, seq_len=1000)
    assert a == 4e6
    rate = HW.peak_flops * HW.mfu                               # 5e13
    psi, tokens = 1e9, 1000
    none = cost.compute_phases(psi, tokens, HW, attention=a)
    assert none == pytest.approx({"forward": (2 * psi + a) * tokens / rate,
                                  "backward": (4 * psi + 2 * a) * tokens / rate})
    sel = cost.compute_phases(psi, tokens, HW, recompute="selective", attention=a)
    assert sel["backward"] - none["backward"] == pytest.approx(a * tokens / rate)      # one more attention forward
    full = cost.compute_phases(psi, tokens, HW, recompute="full", attention=a)
    assert full["backward"] - none["backward"] == pytest.approx((2 * psi + a) * tokens / rate)
    full_by_flag = cost.compute_phases(psi, tokens, HW, recompute=True)
    assert full_by_flag == cost.compute_phases(psi, tokens, HW, recompute="full")
    with pytest.raises(ValueError, match="recompute='some'"):
        cost.compute_phases(psi, tokens, HW, recompute="some")


def test_stage3_units_expose_the_first_gathers_and_the_last_reduction():
    # FAST: 2 GB gathers take 15 ms on 4 ranks, no latency. Cut in 10 units, prefetch hides all but the
    # first unit's gather of forward and of backward, and the last unit's reduce-scatter: 3 x 1.5 ms
    psi, n, tokens, one = 1e9, 4, 10_000, 0.015
    t = cost.step_time(psi, n, 3, tokens_per_rank=tokens, hw=FAST, units=10)
    assert t["comm"] == pytest.approx(3 * one)
    assert t["phases"]["forward"]["exposed"] == pytest.approx(one / 10)
    assert t["phases"]["backward"]["exposed"] == pytest.approx(2 * one / 10)
    assert t["total"] == pytest.approx(1.2 + 3 * one / 10)
    # each unit's call pays its own latency: 10 calls of 1/10 the bytes
    lat = dataclasses.replace(FAST, link_latency=1e-4)
    t_lat = cost.step_time(psi, n, 3, tokens_per_rank=tokens, hw=lat, units=10, overlap=False)
    assert t_lat["comm"] == pytest.approx(3 * (one + 10 * 3 * 1e-4))
    # a per-unit overhead of 1 ms per gather: 10 gathers in forward, 10 in backward, never hidden
    t_o = cost.step_time(psi, n, 3, tokens_per_rank=tokens, hw=FAST, units=10, unit_overhead=1e-3)
    assert t_o["total"] - t["total"] == pytest.approx(20e-3)
    # without prefetch nothing changes for the gathers (all exposed anyway); units do not touch stages 0-2
    assert cost.step_time(psi, n, 1, tokens_per_rank=tokens, hw=FAST, units=10) == \
        cost.step_time(psi, n, 1, tokens_per_rank=tokens, hw=FAST)
    with pytest.raises(ValueError, match="units=0"):
        cost.step_time(psi, n, 3, tokens_per_rank=tokens, hw=FAST, units=0)
    with pytest.raises(ValueError, match="unit_overhead"):
        cost.step_time(psi, n, 3, tokens_per_rank=tokens, hw=FAST, unit_overhead=-1.0)


def test_offload_gradient_copy_hides_under_backward():
    # N = 4, Ψ = 1e9: shard 2.5e8 params. Down: 2 B x 2.5e8 / 2 GB/s = 0.25 s; up 0.25 s; Adam 2.5 s.
    # 10,000 tokens: backward 0.8 s hides the copy down (stage 2); the rest (2.75 s) is the step phase
    t = cost.step_time(1e9, 4, 2, tokens_per_rank=10_000, hw=FAST, offload=True)
    assert t["offload"] == pytest.approx(3.0)
    assert (t["forward"], t["backward"]) == pytest.approx((0.4, 0.8))
    assert t["step"] == pytest.approx(0.015 + 0.25 + 2.5)
    # 1,000 tokens: backward 0.08 s hides the 15 ms reduce-scatter (network) and 0.08 s of the 0.25 s
    # copy (the host link: another wire, beside the same compute)
    t = cost.step_time(1e9, 4, 2, tokens_per_rank=1000, hw=FAST, offload=True)
    assert t["backward"] == pytest.approx(0.08 + (0.25 - 0.08))
    # no overlap (CPU ranks): everything adds, the copy in backward
    t = cost.step_time(1e9, 4, 2, tokens_per_rank=10_000, hw=FAST, offload=True, overlap=False)
    assert t["total"] == pytest.approx(1.2 + 2 * 0.015 + 3.0)
    # stage 1 reduces once, at the end of backward: its copy is in the step phase
    t = cost.step_time(1e9, 4, 1, tokens_per_rank=10_000, hw=FAST, offload=True)
    assert t["step"] == pytest.approx(0.015 + 3.0)


def test_zero_paper_largest_models_on_64_v100s():
    # ZeRO (arXiv 1910.02054) Table 2, 32 GB V100s, N_d = 64, model states only:
    # baseline 2B, P_os 7.6B, P_os+g 14.4B, P_os+g+p 128B.
    got = [cost.largest_model(64, s, cost.V100_32GB) / 1e9 for s in range(4)]
    for g, paper in zip(got, [2.0, 7.6, 14.4, 128.0]):
        assert g == pytest.approx(paper, rel=0.01)


def test_zero_paper_trillion_parameters_on_1024_gpus():
    # "ZeRO can train a trillion-parameter model on 1024 GPUs": 16 bytes/param / 1024 ranks.
    assert cost.largest_model(1024, 3, cost.V100_32GB) >= 1e12


def test_zero_offload_single_gpu_headline():
    # ZeRO-Offload (arXiv 2101.06840): 13B on one 32 GB V100 with offload, ~1.4B without.
    # Model states alone bound them at 16B and 2B. One shared reserve for activations and buffers,
    # chosen so that the offloaded case lands on 13B, must also explain the 1.4B within 20%.
    assert cost.largest_model(1, 2, cost.V100_32GB, offload=True) == pytest.approx(16e9)
    assert cost.largest_model(1, 0, cost.V100_32GB) == pytest.approx(2e9)
    reserve = cost.V100_32GB.device_memory - 2 * 13e9
    with_offload = cost.largest_model(1, 2, cost.V100_32GB, offload=True, reserved_bytes=reserve)
    without = cost.largest_model(1, 0, cost.V100_32GB, reserved_bytes=reserve)
    assert with_offload == pytest.approx(13e9)
    assert without == pytest.approx(1.4e9, rel=0.2)


def test_profile_round_trips_through_json():
    assert cost.Hardware.from_json(HW.to_json()) == HW
    assert not math.isinf(cost.largest_model(2, 0, HW))


def test_update_and_comm_time_by_hand():
    hw = cost.Hardware("upd", 10e9, 100e12, 0.5, 1e9, 1e-5, 2e9, 1e8, device_adam_params_per_s=1e9)
    # DP updates all Ψ, ZeRO the owned Ψ/N, offload none on the device
    assert cost.update_time(1e9, 4, 0, hw) == pytest.approx(1.0)
    assert cost.update_time(1e9, 4, 2, hw) == pytest.approx(0.25)
    assert cost.update_time(1e9, 4, 2, hw, offload=True) == 0.0
    assert cost.update_time(1e9, 4, 0, HW) == 0.0                 # default: the device update is free
    # two calls of 1 GB each pay their own latency: 2 x (3 x 10 us + 0.75 s)
    assert cost.comm_time([("all_gather", 1e9)] * 2, 4, hw) == pytest.approx(2 * (3e-5 + 0.75))
    t = cost.step_time(1e9, 4, 1, tokens_per_rank=1000, hw=hw, collectives=[("all_gather", 1e9)] * 2,
                       overlap=False)
    assert t["total"] == pytest.approx(0.12 + 2 * (3e-5 + 0.75) + 0.25)
    assert t["step"] == pytest.approx(2 * (3e-5 + 0.75) + 0.25)  # after the update: the step phase


def test_published_device_adam_is_memory_bound():
    # 28 bytes per parameter at 0.9 TB/s: DP's full update of 7.5B on a V100 takes 0.233 s
    assert cost.update_time(7.5e9, 64, 0, cost.V100_32GB) == pytest.approx(7.5e9 * 28 / 0.9e12)


def test_plan_picks_the_lowest_stage_among_the_fastest_that_fit():
    # everything fits and, with a free device update, stages 0-2 take the same time: DP, the simplest
    assert cost.plan(1_000_000, 8, HW, tokens_per_rank=1000)[0]["stage"] == 0
    # 10 GB devices, Ψ = 1e9 on N = 8: DP needs 16 GB (no), ZeRO-1 4 + 12/8 = 5.5 GB (yes)
    best = cost.plan(1_000_000_000, 8, HW, tokens_per_rank=1000)[0]
    assert (best["stage"], best["offload"], best["fits"]) == (1, False, True)
    # 1e12 on 8: nothing fits; the option needing the least memory comes first (stage 3 + offload: 2Ψ/N)
    best = cost.plan(10 ** 12, 8, HW, tokens_per_rank=1000)[0]
    assert (best["stage"], best["offload"], best["fits"]) == (3, True, False)
    assert best["device_bytes"] == pytest.approx(2 * 10 ** 12 / 8)


SHAPE = {"layers": 10, "hidden": 1000, "heads": 10}


def _act(b, recompute):
    s, h, a, L = 1000, 1000, 10, 10
    per_layer = s * b * h * (34 + 5 * a * s / h)            # 84 MB per sequence per layer
    return L * 2 * s * b * h + per_layer - 2 * s * b * h if recompute else L * per_layer


def test_plan_credits_freed_gradient_memory_to_a_larger_micro_batch():
    # Ψ = 1e8 on N = 8, 8 sequences of 1000 tokens per rank per step, a 2.4 GB device, fast link.
    # Model states: ZeRO-1 4Ψ + 12Ψ/8 = 550 MB, ZeRO-2 2Ψ + 14Ψ/8 = 375 MB, ZeRO-3 200 MB.
    hw = cost.Hardware("small", 2.4e9, 100e12, 0.5, 100e9, 0.0, 2e9, 1e8)
    rows = {(r["stage"], r["offload"]): r for r in
            cost.plan(1e8, 8, hw, tokens_per_rank=8000, shape=SHAPE, seq_len=1000, attention="paper")}
    # 840 MB of activations per sequence: ZeRO-1 fits 2 per micro-batch (1.85 GB left), ZeRO-2 and 3 fit
    # 2 as well (2.025, 2.2 GB) -> all need 4 micro-batches, no recomputation
    assert _act(2, False) <= 2.4e9 - 550e6 < _act(4, False)
    assert rows[(1, False)]["micro_batch"] == 2 and not rows[(1, False)]["recompute"]
    hw2 = dataclasses.replace(hw, device_memory=4.0e9)       # 3.45 / 3.625 / 3.8 GB left
    plan = cost.plan(1e8, 8, hw2, tokens_per_rank=8000, shape=SHAPE, seq_len=1000, attention="paper")
    rows = {(r["stage"], r["offload"]): r for r in plan}
    assert _act(4, False) <= 4.0e9 - 550e6                    # 3.36 GB: ZeRO-1 fits 4 sequences ...
    assert rows[(1, False)]["micro_batch"] == 4 and rows[(2, False)]["micro_batch"] == 4
    hw3 = dataclasses.replace(hw, device_memory=3.8e9)        # ZeRO-1 3.25 GB left: 2; ZeRO-2 3.425 GB: 4
    plan = cost.plan(1e8, 8, hw3, tokens_per_rank=8000, shape=SHAPE, seq_len=1000, attention="paper")
    rows = {(r["stage"], r["offload"]): r for r in plan}
    assert (rows[(1, False)]["micro_batch"], rows[(2, False)]["micro_batch"]) == (2, 4)
    # equally fast within 5% (a fast link hides everything): the larger micro-batch wins, ZeRO-2 over ZeRO-1
    assert rows[(1, False)]["fits"] and abs(rows[(1, False)]["step_s"] / rows[(2, False)]["step_s"] - 1) < 0.05
    assert (plan[0]["stage"], plan[0]["offload"]) == (2, False)
    # DP: 1.6 GB of states leaves 2.2 GB: 2 sequences, and no better than ZeRO-1
    assert rows[(0, False)]["micro_batch"] == 2


def test_plan_recomputes_only_when_needed_selectively_first():
    # the paper's attention: per sequence and layer 84 MB = s·h·(34 + 50), of which 50 MB the s² terms
    hw = cost.Hardware("tight", 1.2e9, 100e12, 0.5, 100e9, 0.0, 2e9, 1e8)
    rows = {(r["stage"], r["offload"]): r for r in
            cost.plan(1e8, 8, hw, tokens_per_rank=1000, shape=SHAPE, seq_len=1000, attention="paper")}
    attn = 4 * 10 * 1000 * 1000                              # the core attention's forward, per token
    # ZeRO-3: 200 MB of states, 1.0 GB left: one sequence (840 MB) fits without recomputation
    r3 = rows[(3, False)]
    assert r3["micro_batch"] == 1 and r3["recompute"] is None
    assert r3["times"]["compute"] == pytest.approx((6 * 1e8 + 3 * attn) * 1000 / 50e12)
    # ZeRO-1: 550 MB of states, 650 MB left: selective recomputation fits (10 x 34 MB + one layer's 50 MB),
    # for one more attention forward, not a whole forward
    r1 = rows[(1, False)]
    assert r1["recompute"] == "selective" and r1["fits"]
    assert r1["activation_bytes"] == pytest.approx(10 * 34e6 + 50e6)
    assert r1["times"]["compute"] == pytest.approx((6 * 1e8 + 4 * attn) * 1000 / 50e12)
    # 250 MB left (0.8 GB device): only full recomputation fits (20 MB + one layer, its input once); 8Ψ
    r1 = {(r["stage"], r["offload"]): r for r in
          cost.plan(1e8, 8, dataclasses.replace(hw, device_memory=0.8e9), tokens_per_rank=1000, shape=SHAPE,
                    seq_len=1000, attention="paper")}[(1, False)]
    assert r1["recompute"] == "full" and r1["activation_bytes"] == pytest.approx(_act(1, True))
    assert r1["times"]["compute"] == pytest.approx((8 * 1e8 + 4 * attn) * 1000 / 50e12)
    # DP: 1.6 GB of states: does not fit at all
    assert not rows[(0, False)]["fits"]
    with pytest.raises(ValueError, match="sequences"):
        cost.plan(1e8, 8, hw, tokens_per_rank=1500, shape=SHAPE, seq_len=1000)
    with pytest.raises(ValueError, match="together"):
        cost.plan(1e8, 8, hw, tokens_per_rank=1000, shape=SHAPE)


def test_gpt_shape_and_assumptions():
    shape = cost.gpt_shape(175e9)                            # GPT-3: 96 layers of 12,288
    assert shape["layers"] == pytest.approx(96, rel=0.01) and shape["hidden"] == pytest.approx(12288, rel=0.01)
    assert 12 * shape["layers"] * shape["hidden"] ** 2 == pytest.approx(175e9, rel=0.02)
    whats = [a[0] for a in cost.PLANNER_ASSUMPTIONS]
    assert {"activations", "recomputation", "compute", "communication", "choice", "not modelled"} <= set(whats)


def test_plan_chooses_stage3_for_memory_not_for_a_predicted_edge():
    # 8 GPUs of 40 GB, a slow link: in DeepSpeed's order stage 1-2's all-gather after the update is
    # exposed, stage 3's prefetched gathers hide: the model predicts stage 3 faster.
    # (DP's 16 GB of states do not fit; ZeRO-1 5.5 GB + 4 sequences of ~2.5 GB of activations do)
    hw = cost.Hardware("edge", 16e9, 100e12, 0.5, 10e9, 0.0, 2e9, 1e8)
    shape = cost.gpt_shape(1e9)
    kw = dict(tokens_per_rank=8192, shape=shape, seq_len=2048)
    speed = cost.plan(int(1e9), 8, hw, stage3="speed", **kw)
    rows = {(r["stage"], r["offload"]): r for r in speed}
    assert rows[(3, False)]["step_s"] < 0.95 * rows[(1, False)]["step_s"]
    assert speed[0]["stage"] == 3
    # the default rule: stages 0-2 fit the same micro-batch without recomputation, so stage 3 does not win
    memory = cost.plan(int(1e9), 8, hw, **kw)
    assert memory[0]["stage"] < 3 and memory[0]["micro_batch"] == rows[(3, False)]["micro_batch"]
    # where only stage 3 fits the micro-batch (a tighter device), stage 3 wins under either rule
    tight = dataclasses.replace(hw, device_memory=12e9)      # ZeRO-2: 3.75 GB of states, ZeRO-3: 2 GB
    best = cost.plan(int(1e9), 8, tight, **kw)[0]
    assert best["stage"] == 3 and best["fits"]
    with pytest.raises(ValueError, match="stage3='fast'"):
        cost.plan(int(1e9), 8, hw, stage3="fast", **kw)


def test_plan_offers_selective_recomputation_where_it_saves_memory():
    # the paper's attention (naive, dropout) on a device where the s² terms decide: selective
    # recomputation fits what no recomputation cannot, at a few percent of compute
    # per sequence and layer: 194·s·h bytes (814 MB) with the paper's attention, 34·s·h without its s²
    # terms (selective), 32·s·h with a fused kernel; 6 GB: no recomputation fits no sequence
    hw = cost.Hardware("sel", 6e9, 100e12, 0.5, 100e9, 0.0, 2e9, 1e8)
    shape = {"layers": 8, "hidden": 1024, "heads": 8}
    rows = {(r["stage"], r["offload"]): r for r in
            cost.plan(1e8, 8, hw, tokens_per_rank=4 * 4096, shape=shape, seq_len=4096, attention="paper")}
    r = rows[(3, False)]
    assert r["recompute"] == "selective" and r["fits"]
    none = cost.step_time(1e8, 8, 3, tokens_per_rank=4 * 4096, hw=hw, micro_batches=r["micro_batches"],
                          attention=cost.attention_flops(seq_len=4096, **{k: shape[k] for k in ("layers", "hidden")}),
                          units=8)
    a = cost.attention_flops(layers=8, hidden=1024, seq_len=4096)           # one more attention forward
    assert r["times"]["compute"] / none["compute"] == pytest.approx((6e8 + 4 * a) / (6e8 + 3 * a))
    # with the fused kernel the same shapes fit without any recomputation
    fused = {(q["stage"], q["offload"]): q for q in
             cost.plan(1e8, 8, hw, tokens_per_rank=4 * 4096, shape=shape, seq_len=4096)}
    assert fused[(3, False)]["recompute"] is None


# -- two links (lesson 12) ---------------------------------------------------------------------------
def test_hybrid_link_bytes_by_hand():
    # bytes per NODE per step (ZeRO++'s "cross-node volume"), M = 2Ψ bytes, 4 nodes of 8
    psi, m, p = 1e9, 4, 8
    n, M = m * p, 2 * psi
    z3 = cost.hybrid_link_bytes(psi, m, p, "zero3")
    # three rings over all N: each leaves the node once (3M (N-1)/N across), p-1 hops stay inside
    assert z3 == {"intra": pytest.approx(3 * M * (n - 1) / n * (p - 1)), "inter": pytest.approx(3 * M * (n - 1) / n)}
    hsdp = cost.hybrid_link_bytes(psi, m, p, "hsdp")
    assert hsdp["intra"] == pytest.approx(p * 3 * M * (p - 1) / p)
    # p GPUs each all-reduce a 1/p shard across nodes: 2(m-1)/m x M per node, a DDP all-reduce's bytes
    assert hsdp["inter"] == pytest.approx(2 * (m - 1) / m * M)
    ddp_per_node = 2 * M * (n - 1) / n
    assert hsdp["inter"] / ddp_per_node == pytest.approx((m - 1) / m * n / (n - 1))
    assert hsdp["inter"] / z3["inter"] == pytest.approx(2 * (m - 1) / m / (3 * (n - 1) / n))
    big = {s: cost.hybrid_link_bytes(psi, 64, 8, s)["inter"] for s in ("zero3", "hsdp")}
    assert big["hsdp"] / big["zero3"] == pytest.approx(2 / 3, rel=0.02)         # the gathers' third saved
    hpz = cost.hybrid_link_bytes(psi, m, p, "hpz")
    assert hpz["inter"] == pytest.approx(2 / 3 * z3["inter"])                 # 3M -> 2M
    zpp = cost.hybrid_link_bytes(psi, m, p, "zero++", block=2048)
    int8, int4 = psi * (1 + 4 / 2048), psi * (0.5 + 4 / 2048)
    assert zpp["inter"] == pytest.approx(int8 * (n - 1) / n + int4 * (m - 1) / m)
    zpp64 = cost.hybrid_link_bytes(psi, 64, p, "zero++", block=2048)["inter"]
    assert zpp64 / M == pytest.approx(0.75, rel=0.01)                           # ZeRO++ Sec. 3: 0.75M
    assert zpp["intra"] == pytest.approx(p * 2 * psi * (p - 1) / p + int8 * (n - 1) / n * (p - 1)
                                         + p * int4 * (p - 1) / p)
    one = cost.hybrid_link_bytes(psi, 1, p, "zero3")                           # one node: nothing crosses
    assert one == {"intra": pytest.approx(3 * M * (p - 1)), "inter": 0.0}


def test_rules_of_thumb_by_hand():
    # F = 5e13 FLOP/s, B = 1e9 B/s, bf16: stage 3 hides from F/B = 50,000 tokens per GPU in both phases
    assert cost.tokens_to_hide(3, HW) == {"forward": 5e4, "backward": 5e4, "exposed_bytes_per_param": 0.0}
    assert cost.tokens_to_hide(0, HW)["backward"] == 5e4
    ds = cost.tokens_to_hide(2, HW)              # DeepSpeed's order: the all-gather never hides
    assert ds == {"forward": 0.0, "backward": 2.5e4, "exposed_bytes_per_param": 2.0}
    assert cost.tokens_to_hide(1, HW, gather_order="next_forward")["forward"] == 5e4
    assert cost.tokens_to_hide(3, HW, word_bytes=4)["forward"] == 1e5
    # the closed form agrees with step_time at the threshold (large N, no latency)
    hw = dataclasses.replace(HW, link_latency=0.0)
    at = cost.step_time(1e9, 10 ** 6, 3, tokens_per_rank=5e4, hw=hw)
    assert at["exposed_comm"] == pytest.approx(0.0, abs=1e-6)
    below = cost.step_time(1e9, 10 ** 6, 3, tokens_per_rank=4e4, hw=hw)
    assert below["exposed_comm"] > 0.1
    # data parallelism alone: a 4M-token critical batch, sequences of 2,048: 4e6 / 5e4 = 80 GPUs
    assert cost.data_parallel_limit(HW, critical_batch_tokens=4e6, seq_len=2048) == pytest.approx(80)
    assert cost.data_parallel_limit(HW, critical_batch_tokens=4e6, seq_len=10 ** 5) == pytest.approx(40)
    assert cost.critical_batch_tokens(1.0) == pytest.approx(2e8)
    assert cost.critical_batch_tokens(2.0) == pytest.approx(2e8 / 2 ** (1 / 0.21))
    with pytest.raises(ValueError, match="loss=0"):
        cost.critical_batch_tokens(0)
    with pytest.raises(ValueError, match="stage=4"):
        cost.tokens_to_hide(4, HW)


def test_hybrid_state_bytes_and_step_time():
    psi, m, p = 1e9, 4, 8
    assert cost.hybrid_state_bytes(psi, m, p, "zero3") == 16 * psi / 32
    assert cost.hybrid_state_bytes(psi, m, p, "hsdp") == 16 * psi / 8
    assert cost.hybrid_state_bytes(psi, m, p, "hpz") == 16 * psi / 32 + 2 * psi / 8
    # a call on its own group and link: (op, bytes, group size, Hardware)
    slow = cost.dataclasses.replace(HW, link_bandwidth=HW.link_bandwidth / 10)
    assert cost.comm_time([("all_gather", 1e9, 2, slow)], 4, HW) == pytest.approx(cost.ring_time("all_gather", 1e9, 2, slow))
    # per-GPU bandwidth by link, by hand: a DGX H100's 8 NICs shared by 8 GPUs (inter), a flat ring
    # per NIC (min(NVSwitch 450, 8 x 50) = 400 GB/s), or one ring through one NIC (50)
    dgx, one = cost.DGX_H100, cost.ONE_NIC_H100
    assert (dgx.bandwidth("intra"), dgx.bandwidth("inter"), dgx.bandwidth("all")) == (450e9, 50e9, 400e9)
    assert dgx.bandwidth("all", flat="one_ring") == 50e9
    assert (one.bandwidth("inter"), one.bandwidth("all")) == (50e9 / 8, 50e9)
    with pytest.raises(ValueError, match="flat='two_rings'"):
        dgx.bandwidth("all", flat="two_rings")

    def times(links, **kw):
        return {s: cost.hybrid_step_time(psi, m, p, s, tokens_per_rank=256, hw=cost.H100_80GB, links=links,
                                         **kw)["total"] for s in cost.SCHEMES}
    # few tokens per rank: communication exposed. On one NIC per node, ZeRO++ beats hpZ beats flat
    # ZeRO-3, and HSDP (its only cross-node call the gradient shard's all-reduce) beats flat ZeRO-3
    low = times(one)
    assert low["zero++"] < low["hpz"] < low["zero3"] and low["hsdp"] < low["zero3"], low
    # rings per NIC make flat ZeRO-3 several times faster than one ring; HSDP has no flat ring
    per_nic, one_ring = times(dgx), times(dgx, flat="one_ring")
    assert one_ring["zero3"] > 4 * per_nic["zero3"] and one_ring["hsdp"] == per_nic["hsdp"]
    with pytest.raises(ValueError, match="scheme='zero4'"):
        cost.hybrid_link_bytes(psi, m, p, "zero4")

"""zerolab.cost: closed-form cases worked by hand, and the papers' headline numbers."""
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
    # 1e9 params x 1000 tokens x 6 FLOPs / (100 TFLOP/s x 0.5) = 0.12 s
    assert cost.compute_time(1e9, 1000, HW) == pytest.approx(0.12)
    # N=4: 2.5e8 params per rank; 4 bytes each over 2 GB/s = 0.5 s; Adam 2.5e8 / 1e8 = 2.5 s
    assert cost.offload_time(1e9, 4, HW) == pytest.approx(3.0)
    t = cost.step_time(1e9, 4, 0, tokens_per_rank=1000, hw=HW)
    comm = cost.ring_time("all_reduce", 2e9, 4, HW)
    assert t["comm"] == pytest.approx(comm) and t["total"] == pytest.approx(max(0.12, comm))
    t2 = cost.step_time(1e9, 4, 0, tokens_per_rank=1000, hw=HW, overlap=False)
    assert t2["total"] == pytest.approx(0.12 + comm)


def test_activation_bytes_by_hand():
    # s=2, b=1, h=4, a=2: per layer 2*1*4*(34 + 5*2*2/4) = 8 * 39 = 312 bytes
    assert cost.activation_bytes(layers=3, hidden=4, seq_len=2, micro_batch=1, heads=2) == 3 * 312
    assert cost.activation_bytes(layers=3, hidden=4, seq_len=2, micro_batch=1, heads=2,
                                 checkpointing=True) == 3 * 2 * 2 * 4 + 312


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

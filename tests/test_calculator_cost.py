"""calculator.at_scale / describe_at_scale ("what would this cost at N GPUs") against closed forms
worked by hand, with the published profiles' numbers written out here; and the widget's at-scale
output following its controls. Fast: no ranks."""
import html

import pytest

from zerolab import calculator

PSI, N = 7.5e9, 64           # the ZeRO paper's worked example (arXiv 1910.02054, Fig. 1)
V100 = dict(memory=32e9, peak=125e12, mfu=0.30, link=12.5e9, alpha=10e-6, pcie=12e9, host_adam=1.0e9,
            device_adam=0.9e12 / 28)          # cost.V100_32GB, written out


def _text(s):
    return " ".join(s.split())    # the text is wrapped at 100 columns: compare words, not lines


def test_memory_fits_or_not_on_64_v100s():
    r1 = calculator.at_scale(PSI, N, 1, hardware="V100 32GB")
    assert r1["device_bytes"] == pytest.approx(4 * PSI + 12 * PSI / N)     # 31.4 GB
    assert r1["device_bytes"] / 1e9 == pytest.approx(31.4, abs=0.01)
    assert r1["device_memory"] == V100["memory"] and r1["fits"]
    r0 = calculator.at_scale(PSI, N, 0, hardware="V100 32GB")
    assert r0["device_bytes"] == pytest.approx(16 * PSI) and not r0["fits"]  # 120 GB > 32 GB
    # a reserve for activations can tip it: 31.4 GB + 1 GB > 32 GB
    assert not calculator.at_scale(PSI, N, 1, hardware="V100 32GB", reserved_bytes=1e9)["fits"]


def test_bytes_sent_per_step_ring():
    ring = (N - 1) / N
    for stage in (0, 1, 2):   # all-reduce = reduce-scatter + all-gather: 2Ψ elements of 2 bytes
        r = calculator.at_scale(PSI, N, stage, hardware="V100 32GB")
        assert r["wire_bytes"] == pytest.approx(2 * PSI * 2 * ring)
    r3 = calculator.at_scale(PSI, N, 3, hardware="V100 32GB")
    assert r3["wire_bytes"] == pytest.approx(3 * PSI * 2 * ring)          # 1.5x: gather twice
    fp32 = calculator.at_scale(PSI, N, 2, hardware="V100 32GB", precision="fp32")
    assert fp32["wire_bytes"] == pytest.approx(2 * PSI * 4 * ring)        # 4-byte elements
    assert r3["host_link_bytes"] == 0


def test_step_time_split_by_hand():
    tokens = 2048
    r = calculator.at_scale(PSI, N, 1, hardware="V100 32GB", tokens_per_gpu=tokens)
    t = r["times"]
    compute = 6 * PSI * tokens / (V100["peak"] * V100["mfu"])               # 6Ψ FLOPs per token
    assert t["compute"] == pytest.approx(compute) == 2.4576       # 9.216e13 FLOPs / 37.5 TFLOP/s
    # reduce-scatter of 2Ψ bytes then all-gather of 2Ψ bytes, each (N-1)(α + S/N/B)
    comm = 2 * ((N - 1) * V100["alpha"] + (N - 1) / N * 2 * PSI / V100["link"])
    assert t["comm"] == pytest.approx(comm)
    update = PSI / N / V100["device_adam"]                                  # owned Ψ/N only
    assert t["update"] == pytest.approx(update) and t["offload"] == 0
    # phase by phase: the reduce-scatter (half of comm) hides under backward (4/6 of compute), the
    # all-gather runs after the update (DeepSpeed) and adds in full: not max(compute, comm)
    assert comm / 2 < compute * 4 / 6
    assert t["exposed_comm"] == pytest.approx(comm / 2)
    assert t["total"] == pytest.approx(compute + comm / 2 + update)
    assert t["total"] > max(compute, comm) + update
    assert r["total_no_overlap"] == pytest.approx(compute + comm + update)
    assert r["bound"] == "compute"
    # few tokens per GPU: communication dominates
    few = calculator.at_scale(PSI, N, 1, hardware="V100 32GB", tokens_per_gpu=256)
    assert few["bound"] == "communication"
    # data parallelism updates all Ψ on every GPU
    dp = calculator.at_scale(PSI, N, 0, hardware="V100 32GB", tokens_per_gpu=tokens)["times"]
    assert dp["update"] == pytest.approx(PSI / V100["device_adam"])


def test_offload_by_hand():
    # ZeRO-Offload's headline setting: one V100, stage 2 + offload, 13B parameters
    psi = 13e9
    r = calculator.at_scale(psi, 1, 2, hardware="V100 32GB", tokens_per_gpu=1024, offload=True)
    assert r["device_bytes"] == pytest.approx(2 * psi) and r["fits"]        # fp16 params only: 26 GB
    assert r["host_link_bytes"] == pytest.approx(4 * psi)                   # 2Ψ grads down, 2Ψ params up
    host = 4 * psi / V100["pcie"] + psi / V100["host_adam"]
    assert r["times"]["offload"] == pytest.approx(host) and r["times"]["update"] == 0
    assert r["bound"] == "host offload"
    assert r["largest_params"] == pytest.approx(V100["memory"] / 2)         # 16B bound by 2 bytes/param


def test_largest_model_per_stage():
    per_param = {0: 16, 1: 4 + 12 / N, 2: 2 + 14 / N, 3: 16 / N}            # bytes per parameter
    for stage, b in per_param.items():
        r = calculator.at_scale(PSI, N, stage, hardware="V100 32GB")
        assert r["largest_params"] == pytest.approx(V100["memory"] / b)
    # the paper's Table 2 (32 GB, N = 64): 2B, 7.6B, 14.4B, 128B
    a100 = calculator.at_scale(PSI, N, 3, hardware="A100 80GB")
    assert a100["largest_params"] == pytest.approx(80e9 * N / 16)


def test_describe_states_the_numbers_and_sources():
    r = calculator.at_scale(PSI, N, 1, hardware="V100 32GB", tokens_per_gpu=2048)
    text = _text(calculator.describe_at_scale(r))
    for expected in ("ZeRO-1", "7.5B", "N = 64", "31.4 GB", "fit in 32 GB", "29.5 GB",
                     "compute 2.46 s", "1.18 s of it exposed", "forward 819 ms", "backward 1.64 s",
                     "optimizer step 1.19 s", "= 3.64 s", "7.64B", "125 TFLOP/s", "MFU 0.3", "12.5 GB/s",
                     "V100 datasheet", "ZeRO paper", "zerolab/cost.py"):
        assert expected in text, (expected, text)
    r0 = calculator.at_scale(PSI, N, 0, hardware="V100 32GB")
    assert "do NOT fit" in calculator.describe_at_scale(r0)
    serial = calculator.at_scale(PSI, N, 1, hardware="V100 32GB", overlap=False)
    assert "not overlapped" in calculator.describe_at_scale(serial)
    assert serial["times"]["total"] == pytest.approx(serial["total_no_overlap"])


def test_validation():
    with pytest.raises(ValueError, match="B200"):
        calculator.at_scale(PSI, N, 1, hardware="B200")
    with pytest.raises(ValueError, match="tokens_per_gpu"):
        calculator.at_scale(PSI, N, 1, tokens_per_gpu=0)
    with pytest.raises(ValueError, match="fp8"):
        calculator.at_scale(PSI, N, 1, precision="fp8")
    with pytest.raises(ValueError, match="stage"):
        calculator.at_scale(PSI, N, 0, offload=True)     # offload needs a sharded optimizer
    from zerolab import cost
    own = cost.Hardware("mine", 10e9, 1e12, 0.5, 1e9, 1e-5, 1e9, 1e8)   # a calibrated profile works too
    assert calculator.at_scale(1e9, 4, 3, hardware=own)["largest_params"] == pytest.approx(10e9 * 4 / 16)


def test_widget_at_scale_output_follows_the_controls():
    pytest.importorskip("ipywidgets")
    w = calculator.MemoryCalculator(num_params=PSI, world_size=N, stage=1, hardware="A100 80GB")
    first = _text(w.cost_message.value)
    assert "A100 80GB" in first and "fit in 80 GB" in first and "N = 64" in first
    w.controls["hardware"].value = "V100 32GB"            # what a user's click does
    assert w.controls["device_gb"].value == 32             # the chart's capacity line follows
    assert "fit in 32 GB" in w.message.value
    v100 = _text(w.cost_message.value)
    assert v100 != first and "V100 32GB" in v100 and "125 TFLOP/s" in v100
    w.controls["world_size"].value = 16                    # 4Ψ + 12Ψ/16 = 35.6 GB: no longer fits
    assert _text(w.cost_message.value) != v100 and "do NOT fit in 32 GB" in _text(w.cost_message.value)
    w.controls["hardware"].value = "H100 80GB"             # same memory as A100: still redrawn
    assert "989 TFLOP/s" in _text(w.cost_message.value)
    before = w.cost_message.value
    w.controls["tokens_per_gpu"].value = 512
    assert w.cost_message.value != before
    w.controls["optimizer"].value = "sgd"                  # the cost model is Adam's
    assert "Adam" in w.cost_message.value and "TFLOP/s" not in w.cost_message.value
    w.controls["optimizer"].value = "adam"
    w.controls["offload"].value = True
    w.controls["stage"].value = 0                          # invalid: both outputs say so
    assert "stage 0" in w.message.value and "Not a valid setting" in w.cost_message.value


def test_widget_says_when_the_typed_device_memory_differs_from_the_gpu():
    pytest.importorskip("ipywidgets")
    w = calculator.MemoryCalculator(num_params=PSI, world_size=N, stage=1, hardware="V100 32GB")
    assert "typed in 'device GB'" not in html.unescape(w.cost_message.value)
    w.controls["device_gb"].value = 16                     # typed by hand: the chart uses 16 GB
    text = _text(html.unescape(w.cost_message.value))
    assert "uses the V100 32GB's 32 GB" in text and "the 16 GB typed in 'device GB'" in text, text

"""zerolab.memory and zerolab.calculator against independent references: the ZeRO paper's numbers
and closed forms written out here, and bytes hand-computed from layer shapes."""
import pytest
import torch
import torch.nn as nn

from zerolab import calculator, memory, models
from zerolab.flat import FlatParams

# ------------------------------------------------------------------------------------------ theory
PSI, N = 7.5e9, 64


def test_paper_worked_example():
    # ZeRO (arXiv 1910.02054) Fig. 1: 7.5B params, N = 64, mixed-precision Adam (K = 12).
    totals = [memory.model_state_bytes(PSI, N, s)["total"] for s in range(4)]
    assert [round(t / 1e9, 1) for t in totals[:3]] == [120.0, 31.4, 16.6]
    assert round(totals[3] / 1e9, 2) == 1.88
    assert totals == [120_000_000_000, 31_406_250_000, 16_640_625_000, 1_875_000_000]  # exact


@pytest.mark.parametrize("mixed", [True, False])
def test_data_parallel_is_16_bytes_per_param(mixed):
    got = memory.model_state_bytes(1000, 8, 0, mixed_precision=mixed)
    b = 2 if mixed else 4
    assert got == {"params": b * 1000, "grads": b * 1000, "optimizer": (16 - 2 * b) * 1000,
                   "total": 16_000, "host": 0}


@pytest.mark.parametrize("psi", [1, 7, 1000, 123_457, 7.5e9])
@pytest.mark.parametrize("n", [1, 2, 3, 64])
@pytest.mark.parametrize("k", [12, 8, 4])
def test_stage_totals_match_closed_forms(psi, n, k):
    # Sec. 5.1: DP (2+2+K)Ψ; P_os 4Ψ + KΨ/N; P_os+g 2Ψ + (2+K)Ψ/N; P_os+g+p (4+K)Ψ/N.
    expected = [(4 + k) * psi, 4 * psi + k * psi / n, 2 * psi + (2 + k) * psi / n, (4 + k) * psi / n]
    for stage, want in enumerate(expected):
        got = memory.model_state_bytes(psi, n, stage, k=k)
        assert got["total"] == pytest.approx(want, rel=1e-12)
        assert got["total"] == got["params"] + got["grads"] + got["optimizer"]
        assert got["host"] == 0


def test_offload_split():
    # ZeRO-Offload (arXiv 2101.06840): device keeps 2-byte params (2Ψ on top of stage 2);
    # grad shard + fp32 master + moments ((2 + 12)Ψ/N) live on the host.
    s2 = memory.model_state_bytes(PSI, N, 2, offload=True)
    assert s2 == {"params": 2 * PSI, "grads": 0, "optimizer": 0, "total": 2 * PSI,
                  "host": 14 * PSI / N}
    s3 = memory.model_state_bytes(PSI, N, 3, offload=True)
    assert (s3["total"], s3["host"]) == (2 * PSI / N, 14 * PSI / N)
    s1 = memory.model_state_bytes(PSI, N, 1, offload=True)   # stage 1 keeps full grads on device
    assert (s1["params"], s1["grads"], s1["optimizer"], s1["host"]) == (2 * PSI, 2 * PSI, 0, 14 * PSI / N)
    place = memory.model_state_placement(1000, 4, 2, mixed_precision=False, offload=True)
    assert place == {"device": {"params": 4000, "grads": 0, "optimizer": 0},
                     "host": {"params": 0, "grads": 1000, "optimizer": 3000}}  # (8 + 4 copy) x 250


def test_padding():
    # 1001 elements on 4 ranks: shards of ceil(1001/4) = 251, full flat buffers of 1004.
    assert memory.model_state_bytes(1001, 4, 3, padded=True) == {
        "params": 502, "grads": 502, "optimizer": 3012, "total": 4016, "host": 0}
    assert memory.model_state_bytes(1001, 4, 1, padded=True)["params"] == 2008
    assert memory.model_state_bytes(1001, 4, 0, padded=True)["params"] == 2002  # DP: no flat buffer
    assert memory.model_state_bytes(1001, 4, 3)["params"] == 500.5


@pytest.mark.parametrize("bad, match", [
    (dict(stage=4), "stage"), (dict(stage=True), "stage"), (dict(world_size=0), "world_size"),
    (dict(num_params=1.5), "num_params"), (dict(stage=0, offload=True), "stage 0"),
    (dict(k=-1), "k"), (dict(mixed_precision="yes"), "mixed_precision")])
def test_validation(bad, match):
    args = dict(num_params=10, world_size=2, stage=1) | bad
    with pytest.raises(ValueError, match=match):
        memory.model_state_bytes(**args)


def test_optimizer_k():
    assert memory.optimizer_k("adam") == 12 and memory.optimizer_k("adam", mixed_precision=False) == 8
    assert memory.optimizer_k("sgd") == 4 and memory.optimizer_k("sgd", mixed_precision=False) == 0
    with pytest.raises(ValueError, match="lion"):
        memory.optimizer_k("lion")


# ---------------------------------------------------------------------------------------- measured
def gpt_numel(vocab=256, d=64, layers=2, seq=32):
    """TinyGPT's parameter count from its shapes (the head shares the embedding's weight)."""
    block = 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + 2 * d + (d * 4 * d + 4 * d) + (4 * d * d + d)
    return vocab * d + seq * d + layers * block + 2 * d, 4 + 12 * layers  # (elements, tensors)


def one_step(model, opt, name="gpt"):
    x, y = models.batch(name, model=model, batch_size=4)
    model(x, y).backward()
    opt.step()


def test_tinygpt_tied_weights_fp32_adam_16_bytes():
    model = models.build("gpt")
    numel, tensors = gpt_numel()
    naive = sum(t.numel() for t in model.state_dict().values())
    assert naive == numel + 256 * 64                      # state_dict lists the tied weight twice
    opt = torch.optim.AdamW(model.parameters())
    assert memory.model_states(model, opt) == {"params": {"cpu": 4 * numel}, "grads": {}, "optimizer": {}}
    one_step(model, opt)
    # Adam: m and v (8 bytes/param) plus one 4-byte float `step` counter per parameter tensor.
    assert memory.model_states(model, opt) == {
        "params": {"cpu": 4 * numel}, "grads": {"cpu": 4 * numel},
        "optimizer": {"cpu": 8 * numel + 4 * tensors}}


def test_frozen_params_have_no_grads_and_no_state():
    model = models.build("mlp")
    trainable = (13 * 37 + 37) + (37 * 37 + 37) + (37 * 5 + 5)
    frozen = 37 * 37 + 37
    opt = torch.optim.Adam(model.parameters())           # frozen params given, but never stepped
    one_step(model, opt, "mlp")
    assert memory.model_states(model, opt) == {
        "params": {"cpu": 4 * (trainable + frozen)}, "grads": {"cpu": 4 * trainable},
        "optimizer": {"cpu": 8 * trainable + 4 * 6}}


def test_mixed_dtypes_and_master_copies():
    model = models.build("gpt", dtype=torch.bfloat16)
    numel, tensors = gpt_numel()
    masters = [p.detach().float().requires_grad_() for p in model.parameters()]
    opt = torch.optim.AdamW(masters)
    x, y = models.batch("gpt", model=model, batch_size=2)
    model(x, y).backward()
    for m, p in zip(masters, model.parameters()):
        m.grad = p.grad.float()
    opt.step()
    got = memory.model_states(model, opt)
    # bf16 params + bf16 grads + fp32 master grads (transient) ; master + m + v + step counters
    assert got == {"params": {"cpu": 2 * numel}, "grads": {"cpu": 2 * numel + 4 * numel},
                   "optimizer": {"cpu": 12 * numel + 4 * tensors}}
    for m in masters:
        m.grad = None                                     # what a real engine frees after the step
    assert memory.model_states(model, opt)["grads"] == {"cpu": 2 * numel}

    net = nn.Sequential(nn.Linear(3, 4).double(), nn.Linear(4, 2).half())
    assert memory.model_states(net)["params"] == {"cpu": 8 * (12 + 4) + 2 * (8 + 2)}


def test_views_into_flat_buffers_count_once():
    model = models.build("mlp")
    trainable = [p for p in model.parameters() if p.requires_grad]
    flat = FlatParams(trainable, world_size=4, rank=0)    # padded to a multiple of 4
    padded = flat.padded_numel
    assert padded % 4 == 0 and padded > flat.numel
    grad_buffer = torch.zeros(padded)
    for p, g in zip(trainable, flat.views(grad_buffer)):
        p.grad = g
    got = memory.model_states(model)
    frozen = 37 * 37 + 37
    assert got == {"params": {"cpu": 4 * (padded + frozen)}, "grads": {"cpu": 4 * padded}, "optimizer": {}}
    # one storage under two kinds: the first kind gets it
    t = torch.zeros(10)
    assert memory.storage_bytes_by_kind({"a": [t[:5]], "b": [t[5:], torch.zeros(0)]}) == {"a": {"cpu": 40}, "b": {}}
    assert memory.storage_bytes_by_kind({"a": [torch.zeros(3, device="meta")]}) == {"a": {}}


def check_ddp_replicates():
    """Each rank: torch DDP (grads are views into bucket buffers) + AdamW, one step."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    model = models.build("gpt")
    ddp = DDP(model, gradient_as_bucket_view=True, bucket_cap_mb=0.05)
    opt = torch.optim.AdamW(model.parameters())
    x, y = models.batch("gpt", seed=dist.get_rank(), model=model, batch_size=4)
    ddp(x, y).backward()
    opt.step()
    dp = memory.model_states(model, opt)
    # torch's ZeRO-1: each rank's local AdamW holds the state of its own whole parameters
    from torch.distributed.optim import ZeroRedundancyOptimizer
    zero = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW)
    ddp(x, y).backward()
    zero.step()
    return dp, memory.model_states(model, zero)["optimizer"]["cpu"]


def test_data_parallel_replicates_on_real_ranks(clusters):
    numel, tensors = gpt_numel()
    expected = {"params": {"cpu": 4 * numel}, "grads": {"cpu": 4 * numel},
                "optimizer": {"cpu": 8 * numel + 4 * tensors}}
    (dp0, zero0), (dp1, zero1) = clusters(2).run(check_ddp_replicates)
    assert dp0 == dp1 == expected                       # every rank holds everything
    assert zero0 + zero1 == 8 * numel + 4 * tensors     # ZeRO-1: each state on exactly one rank
    assert 0 < zero0 < 8 * numel and 0 < zero1 < 8 * numel


def test_activation_bytes_by_layer():
    net = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2))
    x = torch.randn(4, 3)
    # Linear 0 saves its input (4x3); tanh saves its output (4x5); Linear 2 saves that same
    # output as its input (counted once, for layer 1) and its weight (a parameter: excluded).
    assert memory.activation_bytes(net, x) == {"0": 4 * 3 * 4, "1": 4 * 5 * 4, "2": 0}

    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Sequential(nn.Linear(6, 6), nn.Sigmoid()) for _ in range(2))

        def forward(self, x):
            x = x * 2                                     # mul by a constant saves nothing
            for layer in self.layers:
                x = layer(x)
            return torch.exp(x).sum()                     # exp saves its output, outside layers

    x = torch.randn(3, 6)
    got = memory.activation_bytes(Stack(), x)
    # layers.0 saves 2x (its Linear's input) and its sigmoid's output; layers.1's Linear saves that
    # same output (already counted) and its own sigmoid's output.
    assert got == {"layers.0": 2 * 3 * 6 * 4, "layers.1": 3 * 6 * 4, memory.OUTSIDE_LAYERS: 3 * 6 * 4}
    mlp = models.build("mlp")
    acts = memory.activation_bytes(mlp, *models.batch("mlp", batch_size=8))
    # inp saves its input x (8x13); the four tanh run in ToyMLP.forward, outside any layer, and
    # save their outputs (4 x 8x37); the Linear layers after them save those same tensors as
    # inputs (already counted), the frozen one not even that (no weight grad to compute); the
    # MSE loss saves prediction and target (2 x 8x5).
    assert acts == {"inp": 8 * 13 * 4, memory.OUTSIDE_LAYERS: (4 * 8 * 37 + 2 * 8 * 5) * 4,
                    "frozen": 0, "mid": 0, "out": 0}


def test_activation_bytes_tinygpt_layers():
    model = models.build("gpt")
    acts = memory.activation_bytes(model, *models.batch("gpt", model=model, batch_size=2))
    assert list(acts)[:4] == ["tok", "pos", "blocks.0", "blocks.1"]
    assert acts["blocks.0"] == acts["blocks.1"] > 0      # identical blocks save identical bytes
    # the embedding saves its int64 indices: a (2, 32) view of the (2, 33) token tensor that
    # batch() slices inputs and targets from; the whole storage stays alive, so it counts
    assert acts["tok"] == 2 * 33 * 8


def test_peak_memory_covers_a_live_tensor():
    psutil = pytest.importorskip("psutil")
    big = torch.ones(64 * 2**20 // 4)                     # 64 MiB, touched
    rss_now = psutil.Process().memory_info().rss
    peak = memory.peak_memory()
    assert peak["cpu"] >= rss_now >= big.nbytes
    assert "cuda" in peak or not (torch.cuda.is_available() and torch.cuda.is_initialized())


# ------------------------------------------------------------------------------------- calculator
def test_calculate_sgd_and_fp32():
    r = calculator.calculate(1000, 4, 1, precision="mixed", optimizer="sgd")   # K = 4: fp32 master
    assert r["device"] == {"params": 2000, "grads": 2000, "optimizer": 1000} and r["k"] == 4
    r = calculator.calculate(1000, 4, 2, precision="fp32", optimizer="sgd-momentum", offload=True)
    assert r["device"] == {"params": 4000, "grads": 0, "optimizer": 0}
    assert r["host"] == {"params": 0, "grads": 1000, "optimizer": 2000} and r["host_total"] == 3000
    assert [calculator.params_label(v) for v in (7.5e9, 1e6, 1.2e12, 125e6, 12)] == [
        "7.5B", "1M", "1.2T", "125M", "12"]
    for bad in (dict(precision="fp8"), dict(optimizer="lion")):
        with pytest.raises(ValueError, match="fp8|lion"):
            calculator.calculate(1000, 4, 1, **bad)


def _bar_heights(ax):
    return [round(p.get_height(), 6) for p in ax.patches]


def test_plot_draws_the_numbers():
    from matplotlib.figure import Figure
    ax = Figure().add_subplot()
    results = {s: calculator.calculate(PSI, N, s) for s in (0, 3)}
    drawn = calculator.plot_per_rank(results, ax, device_gb=80)
    assert list(drawn.values()) == [15e9, 15e9, 90e9, 2.34375e8, 2.34375e8, 1.40625e9]
    assert _bar_heights(ax) == [round(v / 1e9, 6) for v in drawn.values()]     # GB bars
    assert "fit" in calculator.describe(results[3], device_gb=80)
    assert "do NOT fit" in calculator.describe(results[0], device_gb=80)


def test_widget_callback_updates_the_figure():
    pytest.importorskip("ipywidgets")
    w = calculator.MemoryCalculator(num_params=1e9, world_size=8, stage=3)
    first_png, first_fig = w.image.value, w.figure
    # DP reference bars, then ZeRO-3 on 8 ranks: 2/8, 2/8, 12/8 GB
    assert _bar_heights(w.figure.axes[0]) == [2, 2, 12, 0.25, 0.25, 1.5]
    w.controls["world_size"].value = 4                    # what a user's click does
    assert w.figure is not first_fig and w.image.value != first_png
    assert _bar_heights(w.figure.axes[0]) == [2, 2, 12, 0.5, 0.5, 3]
    assert "device 4 GB" in w.message.value
    w.controls["offload"].value = True                    # host bars appear (hatched)
    heights = _bar_heights(w.figure.axes[0])                # DP device; ZeRO-3 device, host
    assert heights == [2, 2, 12, 0.5, 0, 0, 0, 0.5, 3]
    w.controls["stage"].value = 0                         # invalid: offload needs stage >= 1
    assert "stage 0" in w.message.value and not w.figure.axes[0].patches
    assert w._repr_mimebundle_()["text/plain"].startswith("MemoryCalculator")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_accounting_and_peak():
    model = nn.Sequential(nn.Linear(64, 64).cuda(), nn.Linear(64, 8))   # one layer on each device
    assert memory.model_states(model)["params"] == {"cuda": (64 * 64 + 64) * 4, "cpu": (64 * 8 + 8) * 4}
    torch.cuda.reset_peak_memory_stats()
    big = torch.ones(2**20, device="cuda")                # 4 MiB of live tensor
    assert memory.peak_memory()["cuda"] >= big.nbytes


def test_tensor_census_counts_live_storages_by_device_and_dtype():
    import gc
    gc.collect()
    before = memory.live_tensors()
    a = torch.zeros(1000)                                   # 4,000 B fp32
    view = a[10:20]                                         # a view: the same storage, not counted again
    b = torch.zeros(500, dtype=torch.bfloat16)              # 1,000 B bf16
    freed = torch.zeros(300)
    freed.untyped_storage().resize_(0)                      # ZeRO-3's free: 0 bytes, not counted
    lin = nn.Linear(10, 10, bias=False)                     # 400 B of weight ...
    lin(torch.ones(2, 10)).sum().backward()                 # ... and a 400 B gradient autograd created
    census = memory.tensor_census(exclude=before)
    assert census[("cpu", "bfloat16")] == 1000
    assert census[("cpu", "float32")] == 4000 + 400 + 400
    del view, freed
    # a baseline excludes what existed before: nothing new, nothing counted
    gc.collect()
    assert memory.tensor_census(exclude=memory.live_tensors()) == {}
    # parameters that are views into one flat buffer (ZeRO's layout) count once, at the buffer's size
    gc.collect()
    base = memory.live_tensors()
    params = [nn.Parameter(torch.zeros(6)), nn.Parameter(torch.zeros(6))]
    flat = FlatParams(params, 4, 0)                          # 12 elements, padded to 12: 48 B
    gc.collect()
    assert memory.tensor_census(exclude=base) == {("cpu", "float32"): flat.data.untyped_storage().nbytes()}
    del a, b, lin, flat, params


def test_allocation_trace_counts_this_threads_frees_only():
    """What the trace can and cannot see, pinned so that a torch release that changes it fails here:
    a tensor allocated and freed on this thread is counted and freed; one allocated here but freed on
    another thread (as gloo's worker thread can free a collective's buffers) stays counted as live to
    the end, and only the census (live_tensor_bytes) shows that it is gone."""
    import gc
    import threading
    gc.collect()
    base = memory.live_tensor_bytes().get("cpu", 0)
    with memory.allocation_trace() as trace:
        kept = torch.ones(250_000)                        # 1 MB, alive at the end
        here = torch.ones(500_000)                        # 2 MB, freed on this thread
        del here
        box = [torch.ones(1_000_000)]                     # 4 MB, freed on another thread
        freer = threading.Thread(target=box.clear)
        freer.start()
        freer.join()
    assert trace["peak"] >= 1_000_000 + 4_000_000
    assert trace["end"] == 1_000_000 + 4_000_000          # the other thread's free was not seen
    assert memory.live_tensor_bytes().get("cpu", 0) - base == 1_000_000   # the census finds 1 MB
    del kept

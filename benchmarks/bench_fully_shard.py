"""python -m benchmarks.bench_fully_shard [--world-sizes 2] [--steps 8]

``zerolab.fully_shard`` (per-parameter dim-0 shards, your own loop and torch optimizer) against
PyTorch's FSDP2 ``fully_shard`` on the same job: the same TinyGPT, each block a unit and the model
the root, the same gloo group, data and AdamW; fp32 and bf16 compute (``param_dtype`` /
``MixedPrecisionPolicy(param_dtype=bf16)``, fp32 shards and fp32 gradient reduction in both).
zerolab's engine at stage 3 (one flat buffer per unit, its own sharded AdamW) beside them.

* step time: ``--steps`` steps, the configurations interleaved step by step in rotating order so
  that machine load hits all of them alike (the first step of each is a warm-up, not counted); the
  ratio to FSDP2 is a paired median (one ratio per step) with its middle half;
* peak memory: the most CPU tensor bytes live at once on rank 0 over building the model and two
  steps (``zerolab.memory.allocation_trace``), in separate runs (the profiler slows steps down),
  ``protocol.MIN_ROUNDS`` of them per configuration in rotating order: a peak moves by several MB from one
  run to the next, FSDP2's too, so the ratio is a paired median with its middle half;
* after the step and ``zero_grad()``: a census of every live tensor on rank 0
  (``zerolab.memory.live_tensor_bytes``); theory 12Ψ/N (fp32 shards 4 + Adam's moments 8);
* freed unseen: the profiler sees frees on the rank's own thread only, and gloo's worker thread can
  free a collective's buffers; the trace's bytes still live at the end minus the census's growth is
  how much it missed, an upper bound on how far each peak overcounts.

Goal of the course: zerolab.fully_shard no slower than FSDP2.
"""
import argparse
import gc
import statistics
import time

import torch
import torch.distributed as dist

from benchmarks import Section, protocol
from zerolab import Cluster, models

MODEL = dict(vocab_size=256, d_model=256, n_layers=4, n_heads=4, seq_len=64)
BATCH = 8
CONFIGS = ("zerolab.fully_shard", "FSDP2 fully_shard", "zerolab stage 3 (flat units)")


def _build(config, param_dtype):
    """(model, step function) of one configuration on this rank."""
    import zerolab
    model = models.build("gpt", seed=0, **MODEL)
    if config == "zerolab stage 3 (flat units)":
        engine = zerolab.initialize(model, stage=3, lr=1e-3, param_dtype=param_dtype,
                                    reduce_dtype=None if param_dtype is None else torch.float32)

        def engine_step(x, y):
            engine.backward(engine(x, y))
            engine.step()
            engine.zero_grad()
        return model, engine_step
    if config == "FSDP2 fully_shard":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=None if param_dtype is None else torch.float32)
        for block in model.blocks:                         # the same units as zerolab's default
            fully_shard(block, mesh=mesh, mp_policy=mp)
        sharded = fully_shard(model, mesh=mesh, mp_policy=mp)
    else:
        sharded = zerolab.fully_shard(model, param_dtype=param_dtype,
                                      reduce_dtype=None if param_dtype is None else torch.float32)
    # foreach=False on both sides: torch's AdamW picks its foreach kernels (faster, with temporaries
    # the size of all the shards) for plain tensors but its for-loop for FSDP2's DTensors; one
    # implementation for both compares the sharding, not the optimizer's kernels (measured here:
    # that choice alone moves zerolab's peak by ~20%).
    opt = torch.optim.AdamW(sharded.parameters(), lr=1e-3, foreach=False)

    def step(x, y):
        sharded(x, y).backward()
        if config == "zerolab.fully_shard":
            sharded.finish_gradient_synchronization()    # a no-op here: backward already finished
        opt.step()
        opt.zero_grad()
    return model, step


def _data(model, i):
    return models.batch("gpt", seed=100 * i + dist.get_rank(), batch_size=BATCH, model=model)


def _times(param_dtype, steps):
    built = {c: _build(c, param_dtype) for c in CONFIGS}
    times = {c: [] for c in CONFIGS}
    for i in range(steps + 1):
        for c in protocol.order(list(built), i):       # the order rotates from step to step
            model, step = built[c]
            x, y = _data(model, i)
            dist.barrier()
            t0 = time.perf_counter()
            step(x, y)
            times[c].append(time.perf_counter() - t0)
    return {c: t[1:] for c, t in times.items()}           # step 0 warms up; the rest pair step by step


def _memory(config, param_dtype):
    from zerolab.memory import allocation_trace, live_tensor_bytes
    dist.barrier()
    gc.collect()      # what an earlier run left to the collector is freed now, not inside this trace
    before = live_tensor_bytes().get("cpu", 0)
    with allocation_trace() as trace:
        model, step = _build(config, param_dtype)
        for i in range(2):
            step(*_data(model, i))
        gc.collect()  # cyclic garbage freed inside the trace, so that what it did not see is only other threads' frees
    after = live_tensor_bytes().get("cpu", 0) - before
    return trace["peak"], after, trace["end"] - after    # the last: frees the trace did not see


def _measure(steps):
    out = {}
    for label, param_dtype in (("fp32", None), ("bf16", torch.bfloat16)):
        times = _times(param_dtype, steps)
        # a peak moves from run to run (FSDP2's too): paired rounds, not one; {config: [(peak, live, unseen)]}
        memory = protocol.values({c: lambda r, c=c: _memory(c, param_dtype) for c in CONFIGS})
        out[label] = (times, memory)
    return out


def _peak_headline(what, ratio, peaks, unseen):
    """The peak ratio's headline. Each trace overcounts by up to what it did not see freed (gloo's worker
    thread frees some of a collective's buffers): the side that peaks higher is higher for sure only if
    the difference is larger than its own overcount; otherwise it is no difference these traces can show."""
    z, f = "zerolab.fully_shard", "FSDP2 fully_shard"
    gap = abs(statistics.median(peaks[z]) - statistics.median(peaks[f]))
    bias = unseen[z] if statistics.median(peaks[z]) >= statistics.median(peaks[f]) else unseen[f]
    note = (f"the traces overcount by up to what they did not see freed: {unseen[z] / 1e6:.1f} MB (zerolab) and "
            f"{unseen[f] / 1e6:.1f} MB (FSDP2) by the end, medians")
    if gap < bias:
        return what, str(ratio), (f"no difference these traces can show: the peaks differ by {gap / 1e6:.1f} MB; "
                                  + note)
    return protocol.headline(what, ratio, below="zerolab peaks lower", above="FSDP2 peaks lower", note=note)


def main(world_sizes=(2,), steps=8):
    rows = ["| ranks | compute | configuration | step (ms), median | / FSDP2, paired | peak memory (MB), median (range) | "
            "/ FSDP2, paired | freed unseen by the trace (MB), median | live after step, zero_grad (MB) |",
            "|---:|---|---|---:|---:|---:|---:|---:|---:|"]
    headlines = []
    psi = sum(p.numel() for p in models.build("gpt", seed=0, **MODEL).parameters())
    for n in world_sizes:
        with Cluster(n, timeout=900) as cluster:
            measured = cluster.run(_measure, steps)[0]
        for label, (times, memory) in measured.items():
            peaks = {c: [peak for peak, _, _ in memory[c]] for c in CONFIGS}
            unseen = {c: statistics.median(u for _, _, u in memory[c]) for c in CONFIGS}
            paired = {c: protocol.Ratio.of(peaks[c], peaks["FSDP2 fully_shard"]) for c in CONFIGS}
            steps_paired = {c: protocol.Ratio.of(times[c], times["FSDP2 fully_shard"]) for c in CONFIGS}
            headlines += [protocol.headline(f"zerolab.fully_shard / torch FSDP2 fully_shard, step time, {label}, "
                                            f"{n} ranks", steps_paired["zerolab.fully_shard"],
                                            below="zerolab is faster", above="FSDP2 is faster"),
                          _peak_headline(f"zerolab.fully_shard / torch FSDP2 fully_shard, peak memory, {label}, "
                                         f"{n} ranks", paired["zerolab.fully_shard"], peaks, unseen)]
            for c in CONFIGS:
                live = statistics.median(lv for _, lv, _ in memory[c])
                rows.append(f"| {n} | {label} | {c} | {statistics.median(times[c]) * 1e3:.0f} | {steps_paired[c]} | "
                            f"{statistics.median(peaks[c]) / 1e6:.1f} ({min(peaks[c]) / 1e6:.1f}-"
                            f"{max(peaks[c]) / 1e6:.1f}) | {paired[c]} | {unseen[c] / 1e6:.1f} | {live / 1e6:.2f} |")
    head = (f"### fully_shard vs FSDP2 (TinyGPT {MODEL}, Ψ = {psi / 1e6:.2f} M parameters, batch {BATCH} per "
            f"rank, AdamW, fp32 shards; bf16: param_dtype bf16, gradients reduced in fp32; rank 0). "
            f"Live after step and zero_grad, theory: 12Ψ/N = {12 * psi / 2 / 1e6:.2f} MB at N = 2 (stage 3 in bf16 "
            f"also keeps its bf16 parameter shard: 14Ψ/N). The peak is torch's profiler's, which sees the frees of "
            f"the rank's own thread only: a collective's buffers that gloo's worker thread frees stay counted to "
            f"the end (zerolab.memory.allocation_trace). 'Freed unseen' is how much that was by the end of the "
            f"run: the trace's live bytes minus the census's (live_tensor_bytes); each peak overcounts by up to "
            f"it, so a peak ratio is a memory difference only where it is larger than that\n\n")
    return Section(head + "\n".join(rows) + "\n", headlines)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[2])
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    print(main(tuple(args.world_sizes), args.steps))

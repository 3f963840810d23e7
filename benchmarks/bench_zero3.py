"""python -m benchmarks.bench_zero3 [--world-sizes 2 4] [--steps 8]

zerolab's ZeRO-3 engine against PyTorch's FSDP2 ``fully_shard(reshard_after_forward=True)`` (the
same idea: per-block all-gather in forward and backward, reduce-scatter of gradients) on the same
TinyGPT, the same gloo group and the same data, in one run; data parallelism (stage 0) beside them.

* step time: ``--steps`` steps, the configurations interleaved step by step in rotating order so
  that machine load hits all of them alike (the first step of each is a warm-up and not counted);
  the ratio to FSDP2 is a paired median (one ratio per step) with its middle half;
* peak memory: the most CPU tensor bytes live at once on rank 0, from before the model is built
  through two training steps (``zerolab.memory.allocation_trace``: torch's profiler, every
  allocation and free; the CPU analogue of ``torch.cuda.max_memory_allocated``), measured in
  separate runs because the profiler slows the steps down, ``protocol.MIN_ROUNDS`` per configuration in
  rotating order (a peak moves from run to run): a paired median with its middle half;
* model states: what is still live after the step (parameters, gradients, optimizer states; FSDP2
  and stage 3 hold 1/N of them).

Target of the course: ZeRO-3 within 1.2x FSDP2's step time at equal or lower peak memory.
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
CONFIGS = ("stage 0 (DP)", "zerolab stage 3", "zerolab stage 3, no prefetch", "FSDP2 fully_shard")


def _build(config):
    """A model and a step function for one configuration, on this rank."""
    from zerolab import initialize
    model = models.build("gpt", seed=0, **MODEL)
    if config == "FSDP2 fully_shard":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in model.blocks:                        # the same units as zerolab's default
            fully_shard(block, mesh=mesh, reshard_after_forward=True)
        fully_shard(model, mesh=mesh, reshard_after_forward=True)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def step(x, y):
            model(x, y).backward()
            opt.step()
            opt.zero_grad()
        return model, step
    engine = initialize(model, stage=0 if config.startswith("stage 0") else 3, lr=1e-3,
                        **({} if config.startswith("stage 0") else {"prefetch": "no prefetch" not in config}))

    def step(x, y):
        engine.backward(engine(x, y))
        engine.step()
        engine.zero_grad()
    return model, step


def _data(model, i):
    return models.batch("gpt", seed=100 * i + dist.get_rank(), batch_size=BATCH, model=model)


def _times(configs, steps):
    built = {c: _build(c) for c in configs}
    times = {c: [] for c in configs}
    for i in range(steps + 1):
        for c in protocol.order(list(built), i):       # the order rotates from step to step
            model, step = built[c]
            x, y = _data(model, i)
            dist.barrier()
            t0 = time.perf_counter()
            step(x, y)
            times[c].append(time.perf_counter() - t0)
    return {c: t[1:] for c, t in times.items()}           # step 0 warms up; the rest pair step by step


def _peak(config):
    from zerolab.memory import allocation_trace
    dist.barrier()
    gc.collect()      # what an earlier run left to the collector is freed now, not inside this trace
    with allocation_trace() as trace:
        model, step = _build(config)
        for i in range(2):
            step(*_data(model, i))
    return trace["peak"], trace["end"]


def _measure(configs, steps):
    times = _times(configs, steps)
    # a peak moves from run to run (FSDP2's too): paired rounds, not one; {config: [(peak, end)]}
    memory = protocol.values({c: lambda r, c=c: _peak(c) for c in configs})
    psi = sum(p.numel() for p in models.build("gpt", seed=0, **MODEL).parameters())
    return times, memory, psi


def main(world_sizes=(2,), steps=8):
    rows = ["| ranks | configuration | step (ms), median | / FSDP2, paired | peak memory (MB), median (range) | "
            "/ FSDP2, paired | model states after step (MB) |",
            "|---:|---|---:|---:|---:|---:|---:|"]
    psi, headlines = None, []
    for n in world_sizes:
        with Cluster(n, timeout=600) as cluster:
            times, memory, psi = cluster.run(_measure, CONFIGS, steps)[0]
        peaks = {c: [peak for peak, _ in memory[c]] for c in CONFIGS}
        step_ratio = {c: protocol.Ratio.of(times[c], times["FSDP2 fully_shard"]) for c in CONFIGS}
        peak_ratio = {c: protocol.Ratio.of(peaks[c], peaks["FSDP2 fully_shard"]) for c in CONFIGS}
        headlines += [protocol.headline(f"zerolab ZeRO-3 / torch FSDP2, step time, {n} ranks",
                                        step_ratio["zerolab stage 3"], below="zerolab is faster",
                                        above="FSDP2 is faster"),
                      protocol.headline(f"zerolab ZeRO-3 / torch FSDP2, peak memory, {n} ranks",
                                        peak_ratio["zerolab stage 3"], below="zerolab peaks lower",
                                        above="FSDP2 peaks lower",
                                        note="both keep 1/N of the model states")]
        for c in CONFIGS:
            end = statistics.median(e for _, e in memory[c])
            rows.append(f"| {n} | {c} | {statistics.median(times[c]) * 1e3:.0f} | {step_ratio[c]} | "
                        f"{statistics.median(peaks[c]) / 1e6:.1f} ({min(peaks[c]) / 1e6:.1f}-{max(peaks[c]) / 1e6:.1f}) | "
                        f"{peak_ratio[c]} | {end / 1e6:.1f} |")
    head = (f"### ZeRO-3 vs FSDP2 (TinyGPT {MODEL}, Ψ = {psi / 1e6:.2f} M fp32 parameters, batch {BATCH} "
            f"per rank, AdamW; rank 0)\n\n")
    return Section(head + "\n".join(rows) + "\n", headlines)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[2])
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    print(main(tuple(args.world_sizes), args.steps))

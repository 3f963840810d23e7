"""python -m benchmarks.bench_activations [--steps 8] [--seq-lens 128 512]

Activation checkpointing (lesson 10, ``zerolab.initialize(..., activation_checkpointing=...)``) on 2
ranks at stage 2, TinyGPT with naive attention (which stores the (B, heads, T, T) probabilities) and
with torch's fused scaled_dot_product_attention (which does not), at two sequence lengths:

* activation bytes: what the last forward saved for backward (``engine.activation_report()``,
  saved-tensor hooks), none / selective (each core attention recomputed) / full (each block);
* peak memory: the most CPU tensor bytes live at once on rank 0 during two steps, from before the
  model is built (``zerolab.memory.allocation_trace``, torch's profiler), in a separate run;
* step time: the slowest rank's, the configurations of one sequence length and attention paired step
  by step in rotating order after a warm-up round (benchmarks/protocol.py): each ratio to none is the
  median of the per-round ratios with their middle half.

Theory (Korthikanti et al., arXiv 2205.05198): full recomputation runs one more forward of every block
(+1/3 of a step's block FLOPs), selective only the core attention's; full keeps each block's input.
"""
import argparse

import torch.distributed as dist

from benchmarks import Section, protocol
from zerolab import Cluster, models

MODEL = dict(vocab_size=256, d_model=128, n_layers=4, n_heads=4)
BATCH = 4
MODES = (None, "selective", "full")
ATTENTIONS = ("naive", "sdpa")


def _build(seq_len, attention, mode):
    from zerolab import initialize
    model = models.build("gpt", seed=0, seq_len=seq_len, attention=attention, **MODEL)
    engine = initialize(model, stage=2, lr=1e-3, activation_checkpointing=mode)

    def step(i):
        x, y = models.batch("gpt", seed=100 * i + dist.get_rank(), batch_size=BATCH, model=model)
        engine.backward(engine(x, y))
        engine.step()
        engine.zero_grad()
    return engine, step


def _times(seq_len, attention, steps):
    """Per mode: the slowest rank's step time in each of ``steps`` paired rounds (the order rotating,
    after a warm-up round: benchmarks/protocol.py), and the activation bytes of its last forward."""
    built = {mode: _build(seq_len, attention, mode) for mode in MODES}
    times = protocol.rounds({mode: step for mode, (_, step) in built.items()}, timed=steps,
                            clock=protocol.slowest_rank())
    saved = {mode: sum(engine.activation_report().values()) for mode, (engine, _) in built.items()}
    return times, saved


def _peak(seq_len, attention, mode):
    from zerolab.memory import allocation_trace
    with allocation_trace() as trace:
        _, step = _build(seq_len, attention, mode)
        for i in range(2):
            step(i)
    return trace["peak"]


def _measure(seq_lens, steps):
    out = {}
    for s in seq_lens:
        for attention in ATTENTIONS:
            times, saved = _times(s, attention, steps)
            peaks = {}
            for mode in MODES:
                dist.barrier()
                peaks[mode] = _peak(s, attention, mode)
            out[s, attention] = times, saved, peaks
    return out


def _name(mode):
    return mode or "none"


def main(seq_lens=(128, 512), steps=8):
    with Cluster(2, timeout=900) as cluster:
        results = cluster.run(_measure, seq_lens, steps)[0]
    rows = ["| seq len | attention | checkpointing | activation bytes (MB) | / none | peak memory (MB) | / none "
            "| step (ms, median) | / none, paired |", "|---:|---|---|---:|---:|---:|---:|---:|---:|"]
    for (s, attention), (times, saved, peaks) in results.items():
        for mode in MODES:
            paired = "1.00" if mode is None else str(protocol.ratio(times, mode, None))
            rows.append(f"| {s} | {attention} | {_name(mode)} | {saved[mode] / 1e6:.2f} | "
                        f"{saved[mode] / saved[None]:.2f} | {peaks[mode] / 1e6:.1f} | {peaks[mode] / peaks[None]:.2f} | "
                        f"{protocol.median(times[mode]) * 1e3:.0f} | {paired} |")
    s = max(seq_lens)
    times, saved, peaks = results[s, "naive"]
    headlines = [(f"full checkpointing / none, activation bytes, seq {s}, naive attention",
                  f"{saved['full'] / saved[None]:.2f}", "below 1: what full recomputation saves"),
                 protocol.headline(f"full checkpointing / none, step time, seq {s}, naive attention",
                                   protocol.ratio(times, "full", None), below="full checkpointing faster",
                                   above="the price of recomputing", note="theory: about 4/3 of the blocks' compute"),
                 (f"selective / none, activation bytes, seq {s}, naive attention",
                  f"{saved['selective'] / saved[None]:.2f}", "below 1: the attention probabilities are gone"),
                 protocol.headline(f"selective / none, step time, seq {s}, naive attention",
                                   protocol.ratio(times, "selective", None), below="selective faster",
                                   above="the price of recomputing",
                                   note="theory: near 1, only the core attention is recomputed")]
    head = (f"### Activation checkpointing (TinyGPT {MODEL}, batch {BATCH} per rank, 2 ranks, stage 2, fp32; "
            f"rank 0)\n\nActivation bytes: saved for backward by the last forward (saved-tensor hooks). Peak "
            f"memory: all tensors, model states included (torch's profiler). With sdpa (a fused kernel) "
            f"there are no attention probabilities to drop: selective recomputation saves only the "
            f"kernel's logsumexp. Step time: the slowest rank's, {steps} paired rounds per sequence length and "
            f"attention.\n\n")
    return Section(head + "\n".join(rows) + "\n\n" + protocol.PROTOCOL_NOTE + "\n", headlines)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[128, 512])
    args = ap.parse_args()
    print(main(tuple(args.seq_lens), args.steps))

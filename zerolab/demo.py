"""The instructor demo: every stage side by side on real ranks, measured against the theory.

    zerolab demo                          # 2 ranks, TinyGPT, stages 0 1 2 3 and 2+offload
    zerolab demo --world-size 4 --d-model 128 --steps 8 --out demo-output

Trains the same model from the same seed on the same data with each stage and prints one table:
per-rank model-state bytes measured vs theory (ZeRO, arXiv 1910.02054), bytes on the wire per step
(ideal ring vs what this rank's sockets really carried), step time (median), and the final loss,
which is the same for every stage: ZeRO changes where the states live, not the math.
Figures (memory bars, comm bars, per-rank timeline of one step) are saved to ``--out``.
"""
import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

import zerolab
from zerolab import cost, models
from zerolab.memory import model_state_bytes
from zerolab.stages import parse_stage
from zerolab.timeline import Timeline, maybe_span

DEFAULT_STAGES = ("0", "1", "2", "3", "2+offload")


def _setup(spec, model_kwargs, lr, param_dtype):
    stage, offload = parse_stage(spec)
    model = models.build("gpt", seed=0, **model_kwargs)
    engine = zerolab.initialize(model, stage=stage, offload=offload, lr=lr, param_dtype=param_dtype)
    zerolab.rank_state().update(engine=engine, model=model, times=[], losses=[], timeline=None)
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def _step(step, batch_size, last):
    """One training step on this rank's slice of the global batch; a timeline of the last one."""
    st = zerolab.rank_state()
    engine, model = st["engine"], st["model"]
    rank, n = dist.get_rank(), dist.get_world_size()
    x, y = models.batch("gpt", seed=step * n + rank, batch_size=batch_size, model=model)
    dist.barrier()
    tl = Timeline() if last else None
    t0 = time.perf_counter()
    with maybe_span(tl, "forward", "forward"):
        loss = engine(x, y)
    with maybe_span(tl, "backward", "backward + gradient comm"):
        engine.backward(loss)
    with maybe_span(tl, "optimizer step", "optimizer step + param comm"):
        engine.step()
    if last:
        # after the step, before zero_grad: params, grads and optimizer states all exist, the
        # moment ZeRO's per-rank formulas describe
        st["placement"] = engine.placement()
        st["padding"] = engine.padding_bytes()
    engine.zero_grad()
    st["times"].append(time.perf_counter() - t0)
    mean = loss.detach().float().clone()
    dist.all_reduce(mean)
    st["losses"].append(mean.item() / n)
    if tl is not None:
        st["timeline"] = tl.collect()


PHASE_COLORS = {"forward": "tab:blue", "backward + gradient comm": "tab:orange",
                "optimizer step + param comm": "tab:green"}


def _report():
    st = zerolab.rank_state()
    engine = st.pop("engine")
    log = engine.last_step_comm
    times = st["times"][1:] or st["times"]  # the first step warms up allocations and connections
    # stage 3's units: (padded elements, gathered once per step?) -- the root unit (embeddings, final
    # norm, tied head) stays gathered from forward to backward, the blocks are gathered twice
    units = [(u.flat.padded_numel, bool(u.resident)) for u in getattr(engine, "units", [])]
    return {"state_bytes": st["placement"]["device"], "host_bytes": st["placement"]["host"],
            "units": units,
            "padding": st["padding"],
            "ideal_bytes": log.ideal_bytes, "sent_bytes": log.sent_bytes, "measured_bytes": log.measured_bytes,
            "schedule": [(r.op, r.tensor_bytes) for r in log.records       # the step's collectives,
                         if r.op in ("all_reduce", "reduce_scatter", "all_gather")],  # for zerolab.cost
            "step_s": statistics.median(times), "loss": st["losses"][-1], "timeline": st["timeline"]}


def compare(cluster, *, stages=DEFAULT_STAGES, steps=5, batch_size=4, lr=1e-3, param_dtype=None,
            progress=True, **model_kwargs):
    """Train every stage on ``cluster``; returns one dict of measurements and theory per stage."""
    from tqdm.auto import tqdm
    n = cluster.world_size
    mixed = param_dtype not in (None, torch.float32)
    word = 2 if mixed else 4
    results = {}
    bar = tqdm(total=len(stages) * steps, desc="training", disable=not progress, file=sys.stderr)
    for spec in stages:
        stage, offload = parse_stage(spec)
        psi = cluster.run(_setup, spec, model_kwargs, lr, param_dtype)[0]
        for step in range(steps):
            bar.set_postfix_str(f"stage {spec}")
            cluster.run(_step, step, batch_size, step == steps - 1)
            bar.update()
        per_rank = cluster.run(_report)
        theory = model_state_bytes(psi, n, stage, mixed_precision=mixed, offload=offload is not None)
        results[spec] = {
            "psi": psi,
            "state_bytes": max(r["state_bytes"] for r in per_rank),
            "padding": max(r["padding"] for r in per_rank),
            "host_bytes": max(r["host_bytes"] for r in per_rank),
            "theory_bytes": theory["total"], "theory_host": theory["host"],
            "wire_theory": cost.wire_bytes(psi, n, stage, grad_bytes=word, param_bytes=word),
            "wire_logged": max(r["sent_bytes"] for r in per_rank),
            "wire_measured": None if per_rank[0]["measured_bytes"] is None
            else max(r["measured_bytes"] for r in per_rank),
            "step_s": statistics.median(r["step_s"] for r in per_rank),
            # accounting: the ring's bytes of this engine's own schedule (each unit gathered twice,
            # or once if it stays gathered, then reduce-scattered), beside ZeRO's 3Ψ
            "wire_units": sum((2 if once else 3) * numel * word * (n - 1) / n
                              for numel, once in per_rank[0]["units"]) or None,
            "gathered_once": sum(numel for numel, once in per_rank[0]["units"] if once),
            "loss": per_rank[0]["loss"],
            "schedule": per_rank[0]["schedule"],
            "timeline": [r["timeline"] for r in per_rank],
        }
    bar.close()
    return results


def table(results, world_size):
    """The comparison as a fixed-width text table."""
    head = (f"{'stage':<10}{'state MB/rank':>14}{'theory':>9}{'+pad':>7}{'host MB':>9}{'theory':>9}"
            f"{'wire MB/step':>13}{'theory':>9}{'measured':>10}{'step ms':>9}{'final loss':>12}")
    rows = [f"{world_size} ranks, TinyGPT with {next(iter(results.values()))['psi']:,} parameters", head,
            "-" * len(head)]
    for spec, r in results.items():
        measured = "n/a" if r["wire_measured"] is None else f"{r['wire_measured'] / 1e6:.3f}"
        rows.append(f"{spec:<10}{r['state_bytes'] / 1e6:>14.3f}{r['theory_bytes'] / 1e6:>9.3f}"
                    f"{r['padding'] / 1e6:>7.3f}{r['host_bytes'] / 1e6:>9.3f}{r['theory_host'] / 1e6:>9.3f}"
                    f"{r['wire_logged'] / 1e6:>13.3f}"
                    f"{r['wire_theory'] / 1e6:>9.3f}{measured:>10}{r['step_s'] * 1e3:>9.1f}{r['loss']:>12.6f}")
    rows.append("state = params + grads + optimizer states on the compute device (measured, each storage "
                "once); theory = ZeRO's formula; +pad = zero padding of the flat shards.")
    rows.append("host = what offload keeps on the host (gradient shard, fp32 master, Adam moments; "
                "ZeRO-Offload, arXiv 2101.06840; with --bf16 where zerolab.cpu_adam cannot be built (no C "
                "compiler) also a 4Ψ/N fp32 gradient workspace the theory leaves out), by role: on a CPU-only machine both are the same RAM.")
    rows.append("wire = bytes one rank sends per step: as logged by zerolab.comm (gloo's reduce-scatter "
                "counts as the all-reduce it runs), the ideal ring (theory), and the socket count (measured).")
    for spec, r in results.items():
        if r.get("wire_units") and r["gathered_once"]:
            rows.append(f"stage {spec}: the theory is ZeRO's 3Ψ, every parameter gathered twice. zerolab gathers the "
                        f"root unit (embeddings, final norm, tied output layer: {r['gathered_once']:,} elements) once "
                        f"per step and keeps it until its gradients are done: {r['wire_units'] / 1e6:.3f} MB with the "
                        f"root gathered once, {r['wire_units'] / r['wire_theory'] - 1:+.1%} against the theory.")
    return "\n".join(rows)


def figures(results, world_size):
    """[(file name, matplotlib Figure)]: memory bars, comm bars and the per-rank timeline of one
    step for every stage (no backend switch: a notebook shows them inline)."""
    import matplotlib.pyplot as plt
    from zerolab.timeline import plot_timeline
    specs = list(results)
    x = range(len(specs))
    out = []
    for key, theory_key, title, fname in [
            ("state_bytes", "theory_bytes", "Model-state bytes per rank", "memory.png"),
            ("wire_measured", "wire_theory", "Bytes sent per rank per step", "comm.png")]:
        fig, ax = plt.subplots(figsize=(7, 3.5))
        measured = [(results[s][key] or 0) / 1e6 for s in specs]
        ax.bar(x, measured, color="tab:blue", label="measured")
        ax.scatter(x, [results[s][theory_key] / 1e6 for s in specs], color="black", marker="_", s=900,
                   zorder=3, label="theory")
        ax.set_xticks(list(x), [f"stage {s}" for s in specs])
        ax.set_ylabel("MB")
        ax.set_title(f"{title} ({world_size} ranks)")
        ax.legend()
        fig.tight_layout()
        out.append((fname, fig))
    fig, axes = plt.subplots(len(specs), 1, figsize=(9, 1.2 + 1.0 * len(specs) * world_size ** 0.5),
                             sharex=True)
    axes = list(axes) if len(specs) > 1 else [axes]
    shown = set()
    for i, (ax, s) in enumerate(zip(axes, specs)):
        plot_timeline(results[s]["timeline"], ax=ax, title=f"stage {s}: one step", label_spans=False,
                      colors=PHASE_COLORS)
        if i < len(axes) - 1:
            ax.set_xlabel("")                # one time axis for the shared x: the bottom panel's
        legend = ax.get_legend()
        labels = {t.get_text() for t in legend.get_texts()} if legend else set()
        if legend and labels <= shown:
            legend.remove()                  # the same phases in every panel: say it once
        shown |= labels
    fig.tight_layout()
    out.append(("timeline.png", fig))
    return out


def save_figures(results, world_size, out):
    """Memory bars, comm bars and the per-rank timeline of one step for every stage, as PNGs."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    os.makedirs(out, exist_ok=True)
    paths = []
    for fname, fig in figures(results, world_size):
        paths.append(os.path.join(out, fname))
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)
    return paths


def main(argv=None):
    ap = argparse.ArgumentParser(
        prog="zerolab demo", description=__doc__.split("\n\n")[0] + "\n\n" + __doc__.split("\n\n")[2],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world-size", type=int, default=2, metavar="N",
                    help="ranks to start (default 2; CPU ranks with gloo, or nccl with one GPU per rank)")
    ap.add_argument("--stages", nargs="+", default=list(DEFAULT_STAGES), metavar="STAGE",
                    help="what to compare, in order: 0 (data parallelism), 1, 2 or 3, a ZeRO stage with "
                         "CPU offload written as 2+offload (default: " + " ".join(DEFAULT_STAGES) + ")")
    ap.add_argument("--steps", type=int, default=5,
                    help="training steps per stage; step time is the median of all but the first "
                         "(default 5)")
    ap.add_argument("--batch-size", type=int, default=4,
                    help="sequences per rank per step (default 4)")
    ap.add_argument("--d-model", type=int, default=64,
                    help="TinyGPT's width; its parameters grow roughly with its square (default 64)")
    ap.add_argument("--layers", type=int, default=2, help="TinyGPT's blocks (default 2)")
    ap.add_argument("--bf16", action="store_true",
                    help="mixed precision: bf16 parameters and gradients, fp32 master and Adam moments "
                         "(default: fp32 throughout)")
    ap.add_argument("--out", default="demo-output", metavar="FOLDER",
                    help="folder for the figures: memory.png, comm.png, timeline.png (default demo-output)")
    args = ap.parse_args(argv)
    for spec in args.stages:
        try:
            parse_stage(spec)
        except ValueError as exc:
            ap.error(str(exc))
    if args.world_size < 1 or args.steps < 1:
        ap.error("--world-size and --steps must be at least 1")
    device = "one GPU per rank (nccl)" if torch.cuda.device_count() >= args.world_size else "CPU (gloo): no GPU per rank here"
    print(f"zerolab demo: {args.world_size} ranks on {device}", file=sys.stderr)
    with zerolab.Cluster(args.world_size, timeout=300) as cluster:
        results = compare(cluster, stages=args.stages, steps=args.steps, batch_size=args.batch_size,
                          param_dtype=torch.bfloat16 if args.bf16 else None,
                          d_model=args.d_model, n_layers=args.layers)
    print(table(results, args.world_size))
    for path in save_figures(results, args.world_size, args.out):
        print(f"saved {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

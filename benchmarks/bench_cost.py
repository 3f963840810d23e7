"""python -m benchmarks.bench_cost [--world-sizes 2 3 4] [--rounds 9] [--profile benchmarks/profile_cpu.json]

Calibrate zerolab.cost on this machine, then check its predictions against zerolab's own measured
times, phase by phase (forward, backward, optimizer step) and per step (issue 13: a cost model students
can trust because it met measurements first; issue 19: per phase, not only per step).

Per world size N (2, 3, 4), on N real ranks (zerolab.calibrate.measure): this machine's profile
(gloo bus bandwidth and latency from all_reduce of two sizes, and the same for all_gather and the
ring reduce-scatter the ZeRO engines use; effective FLOP/s of the model's forward + backward while N
ranks share the cores; AdamW parameters per second, default and fused kernel; copy bandwidth) and a
training step of every stage, interleaved round by round so that load from anything else hits all
of them alike. The profile is written to ``--profile`` (JSON, one zerolab.cost.Hardware per N, plus
the per-collective links); each stage is then predicted from the profile alone with
zerolab.cost.step_time (no overlap: CPU ranks share their cores), phase by phase with the collectives
the engine launched in each phase, and set beside its measured medians.
Ranks run with a caching malloc (zerolab.calibrate.caching_allocator; ``--system-malloc`` to turn it
off): like the CUDA caching allocator, it stops freed buffers from being page-faulted back every step.
"""
import argparse
import contextlib
import datetime
import json
import os
import pathlib
import statistics
import sys
import time

import torch

import zerolab
from benchmarks import Section
from zerolab import calibrate

HERE = pathlib.Path(__file__).resolve().parent
DEFAULT_PROFILE = HERE / "profile_cpu.json"
TARGET = 0.25        # issue 13: within 25% for every stage at every measured size


def run(world_sizes=(2, 3, 4), *, stages=calibrate.STAGES, rounds=5, model_kwargs=None,
        batch_size=calibrate.BATCH, system_malloc=False, progress=None):
    """Measure and predict at every world size. Returns (profile dict, rows)."""
    model_kwargs = dict(calibrate.MODEL if model_kwargs is None else model_kwargs)
    profile = {"made_by": "python -m benchmarks.bench_cost", "date": datetime.date.today().isoformat(),
               "torch": torch.__version__, "cores": len(os.sched_getaffinity(0)),
               "malloc": "system" if system_malloc else "caching", "model": model_kwargs,
               "batch_per_rank": batch_size, "world_sizes": {}, "raw": {}, "errors": {}}
    rows, load0 = [], os.getloadavg()[0]
    for n in world_sizes:
        t0 = time.time()
        with contextlib.nullcontext() if system_malloc else calibrate.caching_allocator():
            cluster = zerolab.Cluster(n, timeout=900)           # ranks read malloc's settings here
        with cluster:
            per_rank = cluster.run(calibrate.measure, stages, model_kwargs, batch_size, rounds)
        hw, links, raw, stage_rows = calibrate.compare(per_rank, n)
        profile["world_sizes"][str(n)] = json.loads(hw.to_json())
        profile.setdefault("links", {})[str(n)] = {op: {"link_bandwidth": h.link_bandwidth,
                                                        "link_latency": h.link_latency} for op, h in links.items()}
        profile["raw"][str(n)] = raw
        profile["errors"].update(per_rank[0]["errors"])
        rows += stage_rows
        if progress:
            progress(f"  {n} ranks: {time.time() - t0:.0f} s")
    profile["load"] = (load0, os.getloadavg()[0])
    return profile, rows


PHASE_NAMES = ("forward", "backward", "step")


def phase_misses(rows, key="links"):
    """[(row, phase, error)] of every phase predicted outside ±TARGET, and how many phases there were."""
    misses = []
    for r in rows:
        for i, phase in enumerate(PHASE_NAMES):
            err = r[key][phase] / r["phases"][i] - 1
            if abs(err) > TARGET:
                misses.append((r, phase, err))
    return misses, 3 * len(rows)


def _share(profile, n):
    """The forward's measured share of forward + backward at ``n`` ranks (the fwd and fwd_bwd probes,
    the same model and batch, the slowest rank's median), where the cost model assumes 2/6."""
    raw = profile["raw"][str(n)]
    return raw["fwd"] / raw["fwd_bwd"]


def split_corrected(profile, rows):
    """phase_misses with the measured forward share in place of the model's 1/3: the same profile and
    predictions, compute moved between forward and backward by (share - 1/3) x the measured forward +
    backward. Returns (misses, phases): what the 2:4 split alone accounts for."""
    moved = []
    for r in rows:
        raw = profile["raw"][str(r["world_size"])]
        delta = (_share(profile, r["world_size"]) - 1 / 3) * raw["fwd_bwd"]
        links = dict(r["links"], forward=r["links"]["forward"] + delta, backward=r["links"]["backward"] - delta)
        moved.append(dict(r, links=links))
    return phase_misses(moved)


def _shares(profile):
    return ", ".join(f"{_share(profile, n):.2f} at N = {n}" for n in profile["world_sizes"])


def _corrected(profile, rows):
    misses, phases = split_corrected(profile, rows)
    before = phases - len(phase_misses(rows)[0])
    after = phases - len(misses)
    verdict = ("the same count as with 1/3: the split is not what the forward misses come from"
               if after == before else f"against {before} with 1/3"
               + (": the split is not what the forward misses come from" if after < before else ""))
    return (f"{after} of {phases} phases are within ±{TARGET:.0%}, {verdict}"
            + (" (outside: " + ", ".join(f"N={r['world_size']} stage {r['stage']} {p} ({e:+.0%})"
                                          for r, p, e in misses) + ")" if misses else ""))


def _cores_evidence(profile, rows):
    """Per N: stage 0's forward (no collective in it) over the forward alone (the ranks wait at a barrier
    after it), and the forward followed at once by the backward (as in a step) over the forward alone, in
    wall time and in CPU time (the same model and batch in the same rounds, the slowest rank's median).
    Returns (text, whether at every N above the cores the forward took longer for about the same CPU time:
    wall at least 1.1x, CPU at most 1.1x and 0.1 below the wall)."""
    parts, waiting = [], []
    for r in rows:
        if r["stage"] != "0":
            continue
        n = r["world_size"]
        raw = profile["raw"][str(n)]
        wall, cpu = raw["fwd_then_bwd"] / raw["fwd"], raw["cpu fwd_then_bwd"] / raw["cpu fwd"]
        parts.append(f"N = {n}: stage 0's forward {r['phases'][0] / raw['fwd']:.2f}, the forward followed by the "
                     f"backward {wall:.2f} in wall time and {cpu:.2f} in CPU time")
        if n > profile["cores"]:
            waiting.append(wall >= 1.1 and cpu <= 1.1 and wall - cpu >= 0.1)
    return "; ".join(parts), bool(waiting) and all(waiting)


def forward_factors(profile, r):
    """Three measured factors between the model's forward and stage ``r``'s measured one (same rounds):
    split, the bare forward alone over the model's 1/3 of forward + backward; sharing, the bare forward
    followed at once by every rank's backward (as in a step) over the bare forward alone, in wall time;
    work, the engine's forward over that bare forward in CPU time, both measured with the ranks going on
    into their backward (what the engine adds: its wrapper, the census of saved activations). Their
    product times the model's forward is the bare forward's wall time in a step scaled by the engine's
    CPU time: a check that the probes reproduce the step's forward, not a test of the cost model."""
    raw = profile["raw"][str(r["world_size"])]
    split = 3 * raw["fwd"] / raw["fwd_bwd"]
    sharing = raw["fwd_then_bwd"] / raw["fwd"]
    work = raw[f"cpu forward {r['stage']}"] / raw["cpu fwd_then_bwd"]
    return split, sharing, work


def explain(profile, rows, misses):
    """Each phase outside ±TARGET with the measured cause that accounts for it, or None: {miss: cause}.

    * a forward with no collective in it (stages 0-2, offload): accounted for when the prediction times
      the three :func:`forward_factors` comes within ±TARGET of the measured forward;
    * a step predicted too long: on the group's timeline the step phase holds the update of the rank
      that ended its backward last; when the others ended theirs earlier by more than the phase lasts
      (the median spread), that rank updated with the cores to itself, where the profile's AdamW rate was
      measured with every rank updating at once, so the prediction is too long by construction."""
    causes = {}
    for r, phase, err in misses:
        key, cause = (r["world_size"], r["stage"], phase), None
        if phase == "forward" and not r["schedule"]["forward"]:
            split, sharing, work = forward_factors(profile, r)
            corrected = r["links"]["forward"] * split * sharing * work / r["phases"][0] - 1
            if abs(corrected) <= TARGET:
                cause = (f"the bare forward {split:.2f}x the model's third, {sharing:.2f}x that when the ranks go "
                         f"straight on into their backward, the engine's {work:.2f}x its CPU time: together "
                         f"{corrected:+.0%}")
        elif phase == "step" and err > 0 and r["spread"][1] >= r["phases"][2]:
            cause = (f"the other ranks ended their backward up to {r['spread'][1] * 1e3:.1f} ms before the last, "
                     f"more than the {r['phases'][2] * 1e3:.1f} ms its update lasts: it updated with the cores to "
                     f"itself, the profile's rate is for every rank at once")
        causes[key] = cause
    return causes


def table(profile, rows):
    """Markdown: the profile, then predicted vs measured per world size and stage, in total and per phase."""
    out = ["### Cost model calibrated on this machine: predicted vs measured, per phase and per step", "",
           f"TinyGPT {profile['model']}, {profile['batch_per_rank']} sequences per rank, fp32 AdamW, gloo, "
           f"{profile['malloc']} malloc. Profile (`benchmarks/profile_cpu.json`), all N ranks measuring at once:", "",
           "| N | bus GB/s, µs per ring step: all_reduce | all_gather | reduce_scatter (ring) | model GFLOP/s per "
           "rank | forward alone / forward + backward (the model: 1/3) | AdamW Mparams/s (device / host kernel) "
           "| copy GB/s |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for n, hw in profile["world_sizes"].items():
        link = lambda d: f"{d['link_bandwidth'] / 1e9:.2f}, {d['link_latency'] * 1e6:.0f}"
        ops = profile["links"][n]
        out.append(f"| {n} | {link(hw)} | {link(ops['all_gather'])} | {link(ops['reduce_scatter'])} | "
                   f"{hw['peak_flops'] / 1e9:.1f} | {_share(profile, n):.2f} | "
                   f"{hw['device_adam_params_per_s'] / 1e6:.0f} / "
                   f"{hw['host_adam_params_per_s'] / 1e6:.0f} | "
                   f"{hw['host_link_bandwidth'] / 1e9:.1f} |")
    out += ["", "Per phase (the collectives each phase really launched, each on its own fitted link): measured ms "
            "/ predicted ms (error), measured on the group's timeline: a phase ends when its last rank ends it, so that in each round "
            "the three add up to the slowest rank's step; their medians, shown, need not "
            "(zerolab.calibrate.slowest_phases). Forward = `engine(x, y)`, backward = `engine.backward(loss)` (gradient "
            "reductions, stage 3's second gathers), step = `engine.step()` (the update, stage 1-2's all-gather, "
            "offload's host work).", "",
            "| N | stage | collectives (fwd / bwd / step) | forward | backward | step | whole step, each collective's "
            "link | whole step, all_reduce's link |", "|---:|---|---:|---:|---:|---:|---:|---:|"]
    step_misses = {"ours": [], "links": []}
    for r in rows:
        m = r["measured"]
        for key in step_misses:
            if abs(r[key]["total"] / m - 1) > TARGET:
                step_misses[key].append(f"N={r['world_size']} stage {r['stage']} ({r[key]['total'] / m - 1:+.0%})")
        calls = " / ".join(str(len(r["schedule"][p])) for p in PHASE_NAMES) if "schedule" in r else str(r["calls"])
        cells = [f"{mp * 1e3:.1f} / {r['links'][p] * 1e3:.1f} ({r['links'][p] / mp - 1:+.0%})"
                 for p, mp in zip(PHASE_NAMES, r["phases"])]
        out.append(f"| {r['world_size']} | {r['stage']} | {calls} | {' | '.join(cells)} | "
                   f"{m * 1e3:.1f} / {r['links']['total'] * 1e3:.1f} ({r['links']['total'] / m - 1:+.0%}) | "
                   f"{r['ours']['total'] * 1e3:.1f} ({r['ours']['total'] / m - 1:+.0%}) |")
    misses, phases = phase_misses(rows)
    evidence, cores_wait = _cores_evidence(profile, rows)
    summary = lambda key: (f"{len(rows) - len(step_misses[key])} of {len(rows)} within ±{TARGET:.0%}"
                           + (f" (outside: {', '.join(step_misses[key])})" if step_misses[key] else ""))
    causes = explain(profile, rows, misses)
    unexplained = sum(c is None for c in causes.values())

    def outside(r, p, e):
        cause = causes[r["world_size"], r["stage"], p]
        return f"N={r['world_size']} stage {r['stage']} {p} ({e:+.0%}: {cause or 'no measured cause'})"
    out += ["", f"**Per phase: {phases - len(misses)} of {phases} within ±{TARGET:.0%}"
            + (f"; of the {len(misses)} outside, {len(misses) - unexplained} with a measured cause**"
               " (" + ", ".join(outside(*m) for m in misses) + ")" if misses else "**")
            + f". Whole steps: {summary('links')} with each collective on its own fitted link; "
            f"{summary('ours')} with every collective on the all_reduce's link (the one-link model).",
            "", "Predicted = zerolab.cost.step_time from the profile alone, no overlap (on CPU ranks communication "
            "and compute share the cores), each phase with the collectives the engine launched in it (one per "
            "bucket or unit). Forward and backward compute are 2/6 and 4/6 of the measured forward + backward "
            "(2Ψ and 4Ψ FLOPs per token). "
            f"Load average (1 min) on this {profile['cores']}-core machine: {profile['load'][0]:.1f} at the start, "
            f"{profile['load'][1]:.1f} at the end.", "",
            "Where it misses, and why: (1) gloo's all_gather and the ring "
            "reduce-scatter each cost more than half an all_reduce of the same buffer, which the one-link model "
            "assumes (the per-op links remove most of this); (2) work the model does not count: copying "
            "gradients into buckets, dividing by N, Python hooks, stage 3's gather/free bookkeeping; stage 2's "
            "backward (fresh full-size gradients from autograd, copied into a bucket in its hooks) measured "
            "10-15% slower than stage 1's (gradients accumulated into one flat buffer) even with communication off; "
            "(3) the 2:4 split: the model gives the forward 2/6 of the compute (2Ψ of 6Ψ FLOPs per token); a "
            "forward alone, measured in the same rounds on the same model and batch (the table above), takes "
            f"{_shares(profile)} of the forward + backward. With the measured shares in its place (the same "
            f"profile, compute moved from backward to forward) {_corrected(profile, rows)}. What is left "
            "is between the probe and the step, measured in the same rounds on the same model and batch, "
            "against the bare forward alone (each rank then waits at a barrier): " + evidence + ". " + (
                f"With more ranks than cores (N > {profile['cores']}), the ranks that finish their forward first "
                "go on with their backward on the cores the others' forward needs: the forward takes longer "
                "for about the same CPU time, so the extra is time spent waiting for a core, not more work"
                if cores_wait else "These numbers do not show the forward waiting for a core (more ranks than "
                "cores, a longer forward for about the same CPU time)") + ". "
            "A forward with no collective in it, outside ±25%, counts as accounted for when the prediction "
            "times three measured factors (the split; the bare forward's wall time when the ranks go straight "
            "on into their backward, against alone; the engine's CPU time in its forward against the bare "
            "forward's, both so measured) comes within ±25% of it; the product is the probes' reproduction of "
            "the step's forward, which says what the model leaves out, not that the model is right. The model "
            "gives every rank a device of its own and cannot say in which phase a rank waits" + (
                "; whole steps, where the waits add up, are within ±25% here" if not step_misses["links"] else
                "") + ". The same sharing shows in the optimizer step: on the group's timeline it holds the "
            "update of the rank that ended its backward last, and when the others ended theirs earlier by more "
            "than that update lasts, it ran with the cores to itself, while the profile's AdamW rate was "
            "measured with every rank updating at once; "
            "(4) load: with more runnable processes than cores, every "
            "collective waits for the rank the scheduler left out, and a step has several collectives where a "
            "probe has one, so the misses grow with the load average; N = 3 on 2 cores is the worst case, two ranks "
            "time-sharing one core while the third has one to itself, and every collective waits for the pair."]
    if profile["errors"]:
        out.append("Not measured: " + "; ".join(f"{k}: {v}" for k, v in profile["errors"].items()))
    return "\n".join(out) + "\n"


def main(world_sizes=(2, 3, 4), *, rounds=9, profile_path=DEFAULT_PROFILE, **kwargs):
    """Calibrate, write the profile, return the markdown table (for benchmarks/run_all.py)."""
    profile, rows = run(world_sizes, rounds=rounds, progress=lambda s: print(s, file=sys.stderr, flush=True),
                        **kwargs)
    if profile_path is not None:
        pathlib.Path(profile_path).write_text(json.dumps(profile, indent=2) + "\n")
    headlines = []
    misses, phases = phase_misses(rows)
    errors = [r["links"][p] / r["phases"][i] - 1 for r in rows for i, p in enumerate(PHASE_NAMES)]
    sizes = ", ".join(map(str, sorted({r["world_size"] for r in rows})))
    headlines.append((f"cost model, predicted / measured time PER PHASE (forward, backward, step), each collective's "
                      f"link, median of {phases} phases", f"{1 + statistics.median(errors):.2f}",
                      f"{phases - len(misses)} of {phases} within ±{TARGET:.0%} (stages 0-3 and offload at N = {sizes})"))
    for key, name in (("ours", "one link (all_reduce's)"), ("links", "each collective's own link")):
        errors = [r[key]["total"] / r["measured"] - 1 for r in rows]
        within = sum(abs(e) <= TARGET for e in errors)
        headlines.append((f"cost model, predicted / measured step time, {name}, median of {len(rows)} cases",
                          f"{1 + statistics.median(errors):.2f}",
                          f"{within} of {len(rows)} within ±{TARGET:.0%} (stages 0-3 and offload at N = {sizes})"))
    return Section(table(profile, rows), headlines)


def cli(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_cost", description=__doc__.split("\n\n")[1])
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[2, 3, 4])
    ap.add_argument("--stages", nargs="+", default=list(calibrate.STAGES))
    ap.add_argument("--rounds", type=int, default=9, help="timed rounds (every probe + one step of every stage)")
    ap.add_argument("--d-model", type=int, default=calibrate.MODEL["d_model"])
    ap.add_argument("--layers", type=int, default=calibrate.MODEL["n_layers"])
    ap.add_argument("--batch-size", type=int, default=calibrate.BATCH, help="sequences per rank per step")
    ap.add_argument("--system-malloc", action="store_true", help="ranks use glibc malloc's defaults")
    ap.add_argument("--profile", default=str(DEFAULT_PROFILE), help="where to write the profile (JSON)")
    args = ap.parse_args(argv)
    print(main(args.world_sizes, stages=args.stages, rounds=args.rounds, profile_path=args.profile,
               model_kwargs=dict(calibrate.MODEL, d_model=args.d_model, n_layers=args.layers),
               batch_size=args.batch_size, system_malloc=args.system_malloc))


if __name__ == "__main__":
    cli()

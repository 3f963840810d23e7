"""python -m benchmarks.bench_infinity [--mparams 4] [--repeats 5] [--rounds 15] [--world-size 2] [--folder DIR]

ZeRO-Infinity's optimizer offload to disk (arXiv 2104.07857), measured on this machine in one run:

1. The ceilings: RAM copy bandwidth; sequential reads and writes of the disk the swap files go on
   (``--folder``, default this checkout's folder), ``O_DIRECT`` where the file system allows it, 1 MiB
   requests. Medians of ``--repeats`` runs with their range: disk numbers vary up to 2x.
2. The disk optimizer step alone (one process): Adam over ``--mparams`` million fp32 elements whose
   master and moments (12 bytes each) live in a swap file, streamed through 4 aligned buffers; beside
   it, in the same run and in alternating order (``--rounds`` rounds), its two parts alone: the disk's share (the same
   reads and writes, no update: ``DiskOptimizer.rewrite``) and the update's (the same chunked AdamW on
   records already in RAM). The overlap target: step <= 1.25 x max(disk alone, update alone). The
   bytes moved per step are read from the file's counters (24 bytes per element).
3. One training step of TinyGPT on ``--world-size`` ranks at stages 2 and 3, fp32: the states in RAM
   with the optimizer on the "device", offloaded to RAM ("host", ZeRO-Offload) and offloaded to disk
   (ZeRO-Infinity's optimizer offload), the same fused AdamW kernel everywhere, in alternating order;
   with each rank's resident optimizer bytes (a census of live tensors) and the disk's bytes per step.
   On this CPU-only machine "device" and "host" are one memory: the offload rows measure the extra
   copies and the disk, not PCIe.
"""
import argparse
import os
import pathlib
import shutil
import statistics
import tempfile
import time

import torch

from benchmarks import Section

HERE = pathlib.Path(__file__).resolve().parent
MODEL = dict(vocab_size=2048, d_model=192, n_layers=3, n_heads=6, seq_len=64)
CHUNK = 1 << 18                      # elements per swapped record field: 1 MiB of fp32
ENGINE_CHUNK = 1 << 15               # TinyGPT's shards are ~1M elements: records of 128 KiB per field


def _med(xs):
    m, lo, hi = statistics.median(xs), min(xs), max(xs)
    return m, lo, hi


def _fmt(xs, scale=1.0, digits=2):
    m, lo, hi = _med([x * scale for x in xs])
    return f"{m:.{digits}f} ({lo:.{digits}f}-{hi:.{digits}f})"


def ceilings(folder, repeats):
    from zerolab import tiers
    out = tiers.disk_tiers(folder, nbytes=256 << 20, repeats=repeats, depths=(1, 4))
    out["memcpy"] = tiers.memcpy_bandwidth(256 << 20, repeats=repeats)
    out["fs"] = tiers.filesystem(folder)
    return out


def optimizer_alone(folder, mparams, repeats):
    """zerolab.tiers.optimizer_overlap on whole chunks of ~mparams million fp32 elements."""
    from zerolab import tiers
    numel = max(1, round(mparams * 1e6 / CHUNK)) * CHUNK          # whole chunks: no padding in the count
    return tiers.optimizer_overlap(folder, numel, rounds=repeats, chunk=CHUNK)


def _engine_steps(folder, steps):
    import gc

    import torch.distributed as dist

    import zerolab
    from zerolab import memory, models
    rank = dist.get_rank()
    out = {}
    contenders = [(stage, off) for stage in (2, 3) for off in (None, "optimizer", "disk")]
    engines = {}
    for stage, off in contenders:
        gc.collect()
        before = memory.live_tensors()
        kw = {"fused": True} if off is None else {}
        if off == "disk":
            kw.update(offload_path=folder, swap_chunk=ENGINE_CHUNK)
        engine = zerolab.initialize(models.build("gpt", seed=0, **MODEL), stage=stage, lr=1e-3, offload=off, **kw)
        x, y = models.batch("gpt", seed=rank, batch_size=4, model=engine.module)
        engine.backward(engine(x, y))
        engine.step()
        engine.zero_grad()
        gc.collect()
        report = engine.memory_report()
        resident = sum(sum(report.get(k, {}).values()) for k in ("master", "optimizer", "swap_buffers", "workspace"))
        engines[stage, off] = (engine, x, y, resident)
    for r in range(steps):                          # one step per contender per round, order alternating
        for key in (contenders if r % 2 == 0 else contenders[::-1]):
            engine, x, y, resident = engines[key]
            dist.barrier()
            t0 = time.perf_counter()
            engine.backward(engine(x, y))
            engine.step()
            engine.zero_grad()
            t = time.perf_counter() - t0
            entry = out.setdefault(f"{key[0]}|{key[1]}", {"times": [], "resident": resident, "disk": 0})
            entry["times"].append(t)
            if key[1] == "disk":
                d = engine.disk_optimizers()[0]
                entry["disk"] = d.last_step["bytes_read"] + d.last_step["bytes_written"]
    for key, (engine, *_rest) in engines.items():
        if key[1] == "disk":
            engine.close()
    return out


def engine_steps(folder, world_size, steps):
    from zerolab import Cluster
    work = tempfile.mkdtemp(dir=folder, prefix=".bench-infinity-")
    try:
        with Cluster(world_size, timeout=600) as cluster:
            per_rank = cluster.run(_engine_steps, work, steps)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out = {}
    for key in per_rank[0]:
        stage, off = key.split("|")
        times = [max(r[key]["times"][i] for r in per_rank) for i in range(steps)]   # the slowest rank
        out[int(stage), None if off == "None" else off] = {"times": times, "resident": per_rank[0][key]["resident"],
                                                           "disk": per_rank[0][key]["disk"]}
    return out


def main(argv=()):
    """``argv``: the command line's arguments (None: sys.argv's); the default, none, is what
    ``benchmarks.run_all`` runs, whatever its own command line holds."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mparams", type=float, default=4.0)
    ap.add_argument("--repeats", type=int, default=5, help="runs of each ceiling")
    ap.add_argument("--rounds", type=int, default=15, help="rounds of the step against its two parts")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--folder", default=str(HERE.parent))
    args = ap.parse_args(argv)
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))

    ceil = ceilings(args.folder, args.repeats)
    times = optimizer_alone(args.folder, args.mparams, args.rounds)
    moved, chunks, pool = times["bytes"], times["chunks"], 4 * 3 * CHUNK * 4
    ratios = times["ratio"]                     # each round's three runs side by side, then the median
    ratio = _med(ratios)[0]
    eng = engine_steps(args.folder, args.world_size, args.steps)

    fs = ceil["fs"]
    rows = ["## ZeRO-Infinity: the optimizer states on disk (bench_infinity)\n",
            f"Swap folder on `{fs['device']}` ({fs['fstype']}); O_DIRECT "
            f"{'in use' if ceil['direct_ok'] else 'refused: ' + ceil['why'] + ' (buffered I/O, the page cache dropped after each sync)'}."
            f" Medians of {args.repeats} runs of each ceiling, {args.rounds} rounds of the optimizer step "
            f"(range in brackets).\n",
            "### 1. The ceilings (GB/s)\n", "| tier | GB/s |", "|---|---:|",
            f"| RAM: tensor copy (bytes copied per second) | {_fmt(ceil['memcpy'])} |"]
    for name in ("write O_DIRECT", "read O_DIRECT", "read O_DIRECT, queue depth 4", "write buffered",
                 "read buffered, cold", "read buffered, right after a buffered write"):
        if name in ceil:
            rows.append(f"| disk: {name}, 1 MiB requests | {_fmt(ceil[name])} |")
    disk_ceiling = _med(ceil["read O_DIRECT" if ceil["direct_ok"] else "read buffered, cold"])[0]
    numel = chunks * CHUNK
    rows += ["", f"### 2. The disk optimizer step alone: {numel:,} fp32 elements, {chunks} chunks of "
                 f"{CHUNK:,}, a pool of 4 records ({pool / 2**20:.0f} MiB)\n",
             "| what | seconds | GB/s of the step's bytes |", "|---|---:|---:|"]
    for name, label in (("step", "the step (read ahead, update, write behind, commit)"),
                        ("disk", "the disk's share alone (same reads and writes, no update)"),
                        ("update", "the update alone (same chunks, records in RAM)")):
        rows.append(f"| {label} | {_fmt(times[name], digits=3)} | "
                    f"{moved / _med(times[name])[0] / 1e9:.2f} |" if name != "update" else
                    f"| {label} | {_fmt(times[name], digits=3)} | - |")
    rows += ["", f"Bytes per step: {moved:,} ({moved / numel:.0f} per element: master, m and v read "
                 f"and written, 12 + 12). Step / max(disk alone, update alone), per round, median: **{ratio:.2f}** (range "
                 f"{min(ratios):.2f}-{max(ratios):.2f}; target <= 1.25: the reads, the update and the writes overlap). Lower bound from the ceiling: "
                 f"{moved / (disk_ceiling * 1e9):.3f} s at the measured sequential read bandwidth.\n",
             f"### 3. One training step, TinyGPT ({', '.join(f'{k}={v}' for k, v in MODEL.items())}), fp32, "
             f"{args.world_size} ranks, fused AdamW everywhere, the slowest rank; disk offload with "
             f"swap_chunk={ENGINE_CHUNK:,} and 4 buffers\n",
             "| engine | step ms | optimizer bytes in RAM per rank (memory_report: master, moments, swap buffers, "
             "workspace) | disk bytes per step per rank |", "|---|---:|---:|---:|"]
    order = {None: 0, "optimizer": 1, "disk": 2}
    for (stage, off), e in sorted(eng.items(), key=lambda kv: (kv[0][0], order[kv[0][1]])):
        label = f"stage {stage}" + {None: "", "optimizer": " + offload (RAM)", "disk": " + offload (disk)"}[off]
        rows.append(f"| {label} | {_fmt(e['times'], 1e3, 0)} | {e['resident']:,} | {e['disk']:,} |")
    heads = [("disk optimizer step / max(disk alone, update alone)", f"{ratio:.2f}",
              "<= 1.25: reads, update and writes overlap (ZeRO-Infinity's pipelined swapper)")]
    for stage in (2, 3):
        base = _med(eng[stage, None]["times"])[0]
        heads.append((f"stage {stage} + disk offload / stage {stage} step time",
                      f"{_med(eng[stage, 'disk']['times'])[0] / base:.2f}",
                      "> 1 on a CPU-only machine: the disk's reads and writes are extra work; the gain is memory"))
    return Section("\n".join(rows) + "\n", headlines=heads)


if __name__ == "__main__":
    print(main(None))

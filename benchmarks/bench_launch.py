"""python -m benchmarks.bench_launch

What it costs to get ranks: cold start of a Cluster to its first all_reduce, and the overhead
of one Cluster.run (send a function, run it on every rank, collect results) for 2 and 4 ranks.
Target from the course design: per-run overhead under 50 ms.
"""
import statistics
import time

import torch
import torch.distributed as dist

from benchmarks import Section
from zerolab import Cluster

TARGET = 0.05       # seconds: the course design's per-run overhead target


def _first_all_reduce():
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def _noop():
    return None


def measure(world_size, runs=50):
    t0 = time.perf_counter()
    with Cluster(world_size) as cluster:
        cluster.run(_first_all_reduce)
        cold = time.perf_counter() - t0
        times = []
        for _ in range(runs):
            t = time.perf_counter()
            cluster.run(_noop)
            times.append(time.perf_counter() - t)
    return cold, statistics.median(times)


def main():
    rows = ["| ranks | cold start to first all_reduce (s) | per-run overhead, median (ms) | target |",
            "|---:|---:|---:|---|"]
    headlines = []
    for n in (2, 4):
        cold, per_run = measure(n)
        rows.append(f"| {n} | {cold:.2f} | {per_run * 1e3:.2f} | < 50 ms: "
                    f"{'met' if per_run < TARGET else 'MISSED'} |")
        headlines.append((f"Cluster.run overhead / the 50 ms target, {n} ranks", f"{per_run / TARGET:.3f}",
                          f"{per_run * 1e3:.2f} ms per run on persistent ranks; a cold start costs {cold:.1f} s"))
    return Section("### Launch overhead\n\n" + "\n".join(rows) + "\n", headlines)


if __name__ == "__main__":
    print(main())

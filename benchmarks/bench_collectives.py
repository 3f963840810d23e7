"""python -m benchmarks.bench_collectives

gloo's collectives against zerolab's ring versions built from send/recv, on the same ranks and
buffers, in one run. Reports median time, bus bandwidth (ideal ring bytes per rank / time), and
the ring/gloo time ratio. Of note: gloo's reduce_scatter is emulated with a full all_reduce
(2x the ideal bytes), so a plain ring reduce-scatter can beat it.
"""
import statistics
import time

import torch
import torch.distributed as dist

from benchmarks import Section
from zerolab import Cluster, comm, ring

SIZES_MB = (1, 16, 64)


def _time(fn, repeats):
    times = []
    for _ in range(repeats + 1):
        dist.barrier()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times[1:])


def _measure(sizes_mb, repeats):
    n = dist.get_world_size()
    out = []
    for mb in sizes_mb:
        numel = mb * 2**20 // 4 // n * n
        big, small = torch.ones(numel), torch.ones(numel // n)
        S = numel * 4
        pairs = {
            "all_reduce": (lambda: comm.all_reduce(big), lambda: ring.ring_all_reduce(big), 2 * (n - 1) / n * S),
            "reduce_scatter": (lambda: comm.reduce_scatter(small, big), lambda: ring.ring_reduce_scatter(small, big),
                               (n - 1) / n * S),
            "all_gather": (lambda: comm.all_gather(big, small), lambda: ring.ring_all_gather(big, small),
                           (n - 1) / n * S),
        }
        for op, (gloo_fn, ring_fn, ideal) in pairs.items():
            tg, tr = _time(gloo_fn, repeats), _time(ring_fn, repeats)
            out.append((op, mb, tg, tr, ideal))
    return out


def main(sizes_mb=SIZES_MB, repeats=5):
    rows = ["| ranks | op | MB | gloo (ms) | ring from send/recv (ms) | ring / gloo | gloo bus GB/s | ring bus GB/s |",
            "|---:|---|---:|---:|---:|---:|---:|---:|"]
    headlines = []
    for n in (2, 4):
        with Cluster(n, timeout=300) as cluster:
            result = cluster.run(_measure, sizes_mb, repeats)[0]
        for op, mb, tg, tr, ideal in result:
            rows.append(f"| {n} | {op} | {mb} | {tg * 1e3:.1f} | {tr * 1e3:.1f} | {tr / tg:.2f} | "
                        f"{ideal / tg / 1e9:.2f} | {ideal / tr / 1e9:.2f} |")
            if op in ("all_reduce", "reduce_scatter") and mb == max(sizes_mb):
                reading = ("gloo's reduce_scatter runs a whole all_reduce (2x the bytes): below 1 means the "
                           "ring's ideal bytes win" if op == "reduce_scatter" else "gloo's own all_reduce is "
                           "well optimised: about 1 means a plain ring matches it")
                headlines.append((f"ring {op} from send/recv / gloo's, {n} ranks, {mb} MB", f"{tr / tg:.2f}",
                                  reading))
    return Section("### Collectives: gloo vs ring built from send/recv\n\n" + "\n".join(rows) + "\n", headlines)


if __name__ == "__main__":
    print(main())

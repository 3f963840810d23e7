"""python -m benchmarks.bench_hybrid [--steps 6]

Stage 3 beyond one flat group (lesson 12) on 4 gloo ranks arranged as 2 "nodes" x 2 "devices":
flat ZeRO-3, HSDP (``mesh=(2, 2)``), hpZ, qwZ, qwZ + qgZ (int4, hpZ's layout) and ZeRO++ (all three)
on the same TinyGPT and data, in one run.

* inter- and intra-node bytes of one step, summed over the 4 ranks: logged under the algorithms
  (each record's peers, ``Mesh.link_bytes``) and measured on the sockets (the kernel's per-socket
  counters, ``Mesh.measured_link_bytes``); on this machine every "link" is loopback TCP, so the
  numbers say what WOULD cross each kind of wire;
* step time: median over ``--steps`` steps, the configurations interleaved step by step (the first
  step of each is a warm-up). On one CPU host the links all run at the same speed, and quantizing
  costs CPU time: step times here show the schemes' compute and call overheads, not what they save
  on a real network (lesson 12's cost model does that accounting).
"""
import argparse
import statistics
import time

import torch
import torch.distributed as dist

from benchmarks import Section
from zerolab import Cluster, comm, models

MODEL = dict(vocab_size=256, d_model=128, n_layers=4, n_heads=4, seq_len=64)
BATCH = 8
BLOCK = 256
CONFIGS = {"ZeRO-3 (flat)": {},
           "HSDP": dict(mesh=(2, 2)),
           "hpZ": dict(mesh=(2, 2), hpz=True),
           "qwZ": dict(quantize_weights=True, quantize_block=BLOCK),
           "qgZ int4 (hpZ layout)": dict(mesh=(2, 2), hpz=True, quantize_gradients="int4", quantize_block=BLOCK),
           "ZeRO++ (hpZ + qwZ + qgZ)": dict(mesh=(2, 2), hpz=True, quantize_weights=True,
                                            quantize_gradients="int4", quantize_block=BLOCK)}


def _measure(steps):
    from zerolab import initialize
    from zerolab.mesh import Mesh
    flat_mesh = Mesh(2, 2)                              # splits the flat engines' bytes per link
    engines = {}
    for name, options in CONFIGS.items():
        engines[name] = initialize(models.build("gpt", seed=0, **MODEL), stage=3, lr=1e-3, **options)
    times = {name: [] for name in CONFIGS}
    links = {}
    for i in range(steps + 1):
        for name, engine in engines.items():
            x, y = models.batch("gpt", seed=100 * i + dist.get_rank(), batch_size=BATCH, model=engine.module)
            dist.barrier()
            last = i == steps
            region = comm.log(sockets=True) if last else None
            log = region.open() if last else None
            t0 = time.perf_counter()
            engine.backward(engine(x, y))
            engine.step()
            engine.zero_grad()
            times[name].append(time.perf_counter() - t0)
            if last:
                dist.barrier()
                region.close()
                mesh = engine.mesh or flat_mesh
                links[name] = (mesh.link_bytes(log), mesh.measured_link_bytes(log))
    return {name: statistics.median(t[1:]) for name, t in times.items()}, links


def main(steps=6):
    with Cluster(4, timeout=600) as cluster:
        results = cluster.run(_measure, steps)
    times = {name: statistics.median(r[0][name] for r in results) for name in CONFIGS}
    total = {name: {kind: {link: sum(r[1][name][k][link] for r in results) for link in ("intra", "inter")}
                    for k, kind in enumerate(("logged", "measured"))} for name in CONFIGS}
    ref = "ZeRO-3 (flat)"
    rows = ["| configuration | inter-node MB logged | measured | / flat | intra-node MB logged | measured | "
            "step (ms) | / flat |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name in CONFIGS:
        lg, ms = total[name]["logged"], total[name]["measured"]
        rows.append(f"| {name} | {lg['inter'] / 1e6:.3f} | {ms['inter'] / 1e6:.3f} | "
                    f"{lg['inter'] / total[ref]['logged']['inter']:.3f} | {lg['intra'] / 1e6:.3f} | "
                    f"{ms['intra'] / 1e6:.3f} | {times[name] * 1e3:.0f} | {times[name] / times[ref]:.2f} |")
    headlines = [(f"{name} / flat ZeRO-3, inter-node bytes per step (4 ranks as 2x2)",
                  f"{total[name]['logged']['inter'] / total[ref]['logged']['inter']:.3f}",
                  "below 1: fewer bytes on the slow links") for name in CONFIGS if name != ref]
    head = (f"### Hybrid stage 3 and ZeRO++ on a 2 x 2 mesh (TinyGPT {MODEL}, batch {BATCH} per rank, "
            f"fp32, AdamW; bytes summed over the 4 ranks for one step; block {BLOCK})\n\n")
    return Section(head + "\n".join(rows) + "\n", headlines)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    print(main(ap.parse_args().steps))

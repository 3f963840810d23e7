"""python -m benchmarks.bench_offload [--steps 4] [--world-size 2] [--adam-mparams 33.5]

CPU offload (ZeRO-Offload, arXiv 2101.06840), measured on this machine in one run:

1. The host optimizer: AdamW on one fp32 tensor of Ψ parameters in torch's three CPU implementations
   (for-loop, foreach, fused) and zerolab's HostOptimizer step (bf16 gradient shard in, upcast, fused
   AdamW, bf16 params out), in Mparams/s and effective GB/s against a measured memory-bandwidth
   ceiling (a large tensor copy, and an in-place add, which has no hidden write-allocate reads).
   Adam is memory-bound: per parameter it reads p, g, m, v and writes p, m, v, 7 x 4 = 28 bytes in
   fp32, so bandwidth / 28 B is the speed limit of any CPU Adam.
2. One training step, fp32 (bf16 matmuls are ~10x slower than fp32 on CPUs without bf16 units, as
   here), the same TinyGPT, data and gloo group: zerolab stage 2 with the optimizer on the "device"
   (for-loop and fused AdamW), stage 2 + offload (host fused / for-loop AdamW), stage 2 + offload +
   delayed parameter update, and torch FSDP2 ``fully_shard`` with and without ``CPUOffloadPolicy``.
   CPUOffloadPolicy offloads the sharded PARAMETERS too (copied host-to-device before every
   all-gather): that is ZeRO-3 + offload, not ZeRO-Offload, which keeps the 2-byte params on the
   device. On this CPU-only machine "device" and "host" are the same memory: the offload rows
   measure the extra copies and the host kernel, not PCIe. Contenders take turns in blocks of 2
   consecutive steps (a delayed update overlaps the next step; a block ends only when its last host
   update is done); the table reports the median step.
"""
import argparse
import statistics
import time

import torch
import torch.distributed as dist

from benchmarks import Section
from zerolab import Cluster, models

MODEL = dict(vocab_size=2048, d_model=192, n_layers=3, n_heads=6, seq_len=64)
BATCH = 4
BLOCK = 2             # consecutive steps per timed block
COPY_BYTES = 2**28


def copy_and_adam(numel, repeats=6):
    """Seconds per call, best of ``repeats`` rounds (load from other work only ever slows a run, so the
    minimum is the machine's capability), interleaved round by round so that all see the same machine:
    a 256 MiB tensor copy and a 256 MiB in-place add (the bandwidth ceiling), AdamW on ``numel`` fp32 params in torch's three CPU
    implementations, and HostOptimizer.step (bf16 gradient shard in, upcast, fused AdamW, bf16 out)."""
    from zerolab.offload import HostOptimizer
    src, dst = torch.ones(COPY_BYTES // 4), torch.empty(COPY_BYTES // 4)
    calls = {"copy": lambda: dst.copy_(src), "in-place": lambda: src.add_(0.0)}
    for name, kw in (("for-loop", {"foreach": False}), ("foreach", {"foreach": True}), ("fused", {"fused": True})):
        p = torch.zeros(numel, requires_grad=True)
        p.grad = torch.full((numel,), 1e-3)
        calls[f"torch.optim.AdamW {name}"] = torch.optim.AdamW([p], lr=1e-3, **kw).step
    host = HostOptimizer(torch.zeros(numel, dtype=torch.bfloat16), torch.optim.AdamW, lr=1e-3)
    host.grads[0].fill_(1e-3)
    calls["zerolab HostOptimizer.step (bf16 in/out, fused)"] = host.step
    best = {}
    for r in range(repeats + 1):                     # round 0 warms up: allocations, lazy state, page faults
        for name, fn in calls.items():
            t0 = time.perf_counter()
            fn()
            if r:
                best[name] = min(best.get(name, float("inf")), time.perf_counter() - t0)
    return best


def _contenders():
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    import zerolab.engine
    out = {}
    for label, offload, kw, delayed in (
            ("stage 2, AdamW for-loop", None, {}, False),
            ("stage 2, AdamW fused", None, {"fused": True}, False),
            ("stage 2 + offload, host AdamW fused", "optimizer", {}, False),
            ("stage 2 + offload, host AdamW for-loop", "optimizer", {"fused": False}, False),
            ("stage 2 + offload + delayed update (DPU)", "optimizer", {}, True)):
        engine = zerolab.initialize(models.build("gpt", seed=0, **MODEL), stage=2, lr=1e-3,
                                           offload=offload, **kw)
        if delayed:
            engine.delayed_update = True

        def step(x, y, engine=engine):
            engine.backward(engine(x, y))
            engine.step()
            engine.zero_grad()

        def done(engine=engine):                             # a delayed host update ends the block
            for h in engine.host_optimizers() if engine.offload else []:
                h.wait()
        out[label] = (step, done, engine)

    for label, policy in (("torch FSDP2 fully_shard, AdamW fused", None),
                          ("torch FSDP2 + CPUOffloadPolicy (params too: ZeRO-3 + offload)", "cpu")):
        model = models.build("gpt", seed=0, **MODEL)
        kw = {}
        if policy:   # pinned host memory needs a GPU; without one it is plain memory
            kw["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
        for block in model.blocks:
            fully_shard(block, **kw)
        fully_shard(model, **kw)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)

        def step(x, y, model=model, opt=opt):
            model(x, y).backward()
            opt.step()
            opt.zero_grad()
        out[label] = (step, lambda: None, None)
    return out


def _measure(steps):
    contenders = _contenders()
    rank = dist.get_rank()
    times = {name: [] for name in contenders}
    for s in range(steps + 1):                              # block 0 warms up
        batches = [models.batch("gpt", seed=100 * (s * BLOCK + k) + rank, batch_size=BATCH,
                                vocab_size=MODEL["vocab_size"], seq_len=MODEL["seq_len"]) for k in range(BLOCK)]
        for name, (step, done, _) in contenders.items():
            dist.barrier()
            t0 = time.perf_counter()
            for x, y in batches:
                step(x, y)
            done()
            dist.barrier()
            times[name].append((time.perf_counter() - t0) / BLOCK)
    rows = {}
    for name, (_, _, engine) in contenders.items():
        placement = engine.placement() if engine is not None else None
        rows[name] = (statistics.median(times[name][1:]), placement)
    return rows


def main(steps=4, world_size=2, adam_mparams=33.5):
    numel = int(adam_mparams * 1e6)
    speeds = copy_and_adam(numel)
    # Read + write bytes. A copy's stores may also read the destination first (write-allocate), which
    # this count does not see; an in-place add reads and writes the same lines. The faster is the ceiling.
    copy_bw, inplace_bw = (2 * COPY_BYTES / speeds.pop(k) for k in ("copy", "in-place"))
    bw = max(copy_bw, inplace_bw)
    base = speeds["torch.optim.AdamW for-loop"]
    lines = [f"### CPU AdamW on {numel / 1e6:.1f}M fp32 parameters ({torch.get_num_threads()} threads, best of 6)\n",
             f"Memory-bandwidth ceiling, {COPY_BYTES // 2**20} MiB, read + write bytes: tensor copy "
             f"{copy_bw / 1e9:.1f} GB/s, in-place add {inplace_bw / 1e9:.1f} GB/s; the ceiling **{bw / 1e9:.1f} GB/s** "
             f"= at most {bw / 28 / 1e6:.0f} Mparams/s for any Adam (28 B/param).\n",
             "| implementation | ms / step | Mparams/s | effective GB/s (28 B/param) | % of ceiling | speed-up vs for-loop |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, t in speeds.items():
        lines.append(f"| {name} | {t * 1e3:.0f} | {numel / t / 1e6:.0f} | {28 * numel / t / 1e9:.1f} | "
                     f"{100 * 28 * numel / t / bw:.0f}% | {base / t:.1f}x |")
    lines.append("\nBest of 6 interleaved rounds each; above 100% would mean the ceiling's best round was "
                 "still slowed by other load on the machine.")
    psi = sum(p.numel() for p in dict.fromkeys(models.build("gpt", seed=0, **MODEL).parameters()))
    lines += ["", f"### One training step with and without offload (TinyGPT {psi / 1e6:.2f}M params, fp32, AdamW, "
              f"batch {BATCH} x {MODEL['seq_len']} per rank, {world_size} ranks, gloo)\n",
              "| contender | step (ms) | / stage 2 fused | device MB / rank | host MB / rank |", "|---|---:|---:|---:|---:|"]
    with Cluster(world_size, timeout=600) as cluster:
        rows = cluster.run(_measure, steps)[0]
    ref = rows["stage 2, AdamW fused"][0]
    for name, (t, pl) in rows.items():
        dev, host = ("—", "—") if pl is None else (f"{pl['device'] / 1e6:.1f}", f"{pl['host'] / 1e6:.1f}")
        lines.append(f"| {name} | {t * 1e3:.0f} | {t / ref:.2f} | {dev} | {host} |")
    lines.append("\nDevice / host MB: zerolab's placement by role (what would sit on the accelerator vs in "
                 "host memory); on this machine both are the same RAM.")
    host = speeds["zerolab HostOptimizer.step (bf16 in/out, fused)"]
    off, dev = rows["stage 2 + offload, host AdamW fused"], rows["stage 2, AdamW fused"]
    fsdp_off = rows["torch FSDP2 + CPUOffloadPolicy (params too: ZeRO-3 + offload)"][0]
    fsdp = rows["torch FSDP2 fully_shard, AdamW fused"][0]
    headlines = [
        ("CPU AdamW: fused / for-loop, speed", f"{base / speeds['torch.optim.AdamW fused']:.1f}",
         "ZeRO-Offload's point: a vectorised host Adam is several times faster (paper: > 5x)"),
        ("zerolab HostOptimizer: effective bandwidth / memory-bandwidth ceiling", f"{28 * numel / host / bw:.2f}",
         "Adam is memory-bound; 1.0 would be as fast as any CPU Adam can be"),
        (f"stage 2 + offload / stage 2, step time, {world_size} ranks", f"{off[0] / ref:.2f}",
         f"device model states {off[1]['device'] / dev[1]['device']:.2f}x; on a CPU-only machine the "
         "'host link' is a memory copy"),
        (f"FSDP2 + CPUOffloadPolicy / FSDP2, step time, {world_size} ranks", f"{fsdp_off / fsdp:.2f}",
         "torch's offload (parameters too), measured beside zerolab's"),
    ]
    return Section("\n".join(lines) + "\n", headlines)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4, help="timed blocks of 2 steps per contender")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--adam-mparams", type=float, default=33.5, help="parameters for the CPU Adam table, millions")
    args = ap.parse_args()
    print(main(args.steps, args.world_size, args.adam_mparams))

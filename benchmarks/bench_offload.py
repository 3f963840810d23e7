"""python -m benchmarks.bench_offload [--steps 7] [--world-size 2] [--adam-mparams 33.5] [--adam-rounds 9]

CPU offload (ZeRO-Offload, arXiv 2101.06840), measured on this machine in one run:

1. The host optimizer: AdamW on one fp32 tensor of Ψ parameters in torch's three CPU implementations
   (for-loop, foreach, fused) and zerolab's HostOptimizer step on Ψ bf16 parameters (bf16 gradient
   shard in, bf16 parameters out; its default kernel, zerolab.cpu_adam's one pass, and torch's fused
   kernel with the two casts around it), in Mparams/s and effective GB/s against memory ceilings
   measured in the same rounds (benchmarks/ceilings.py: STREAM's copy and triad, and AdamW's own
   traffic without its arithmetic). Adam is memory-bound: per parameter it reads p, g, m, v and
   writes p, m, v, 7 x 4 = 28 bytes in fp32 (in bf16 with the casts folded in: 2 + 12 + 12 + 2 = 28
   too), so the fastest those bytes can move is the speed limit of any CPU Adam. Every ratio is paired
   (benchmarks/protocol.py); a row faster than its ceiling out of the noise fails the benchmark.
2. One training step, fp32 (bf16 matmuls are ~10x slower than fp32 on CPUs without bf16 units, as
   here), the same TinyGPT, data and gloo group: zerolab stage 2 with the optimizer on the "device"
   (for-loop and fused AdamW), stage 2 + offload (host: torch's fused AdamW, the same kernel as the
   device row's; zerolab.cpu_adam's one pass, the default; the for-loop), stage 2 + offload + delayed
   parameter update, and torch FSDP2 ``fully_shard`` with and without ``CPUOffloadPolicy``.
   CPUOffloadPolicy offloads the sharded PARAMETERS too (copied host-to-device before every
   all-gather): that is ZeRO-3 + offload, not ZeRO-Offload, which keeps the 2-byte params on the
   device. On this CPU-only machine "device" and "host" are the same memory: the offload rows
   measure the extra copies and the host kernel, not PCIe. Contenders take turns in blocks of 2
   consecutive steps (a delayed update overlaps the next step; a block ends only when its last host
   update is done), in rotating order, the slowest rank's time (benchmarks/protocol.py); the table
   reports the median step and the paired ratios.
"""
import argparse

import torch
import torch.distributed as dist

from benchmarks import Section, ceilings, protocol
from zerolab import Cluster, models

MODEL = dict(vocab_size=2048, d_model=192, n_layers=3, n_heads=6, seq_len=64)
BATCH = 4
BLOCK = 2             # consecutive steps per timed block
TARGET = 1.1        # HostOptimizer (bf16 in/out) vs torch's fused AdamW on fp32 data of the same size


IMPLEMENTATIONS = ("torch.optim.AdamW for-loop", "torch.optim.AdamW foreach", "torch.optim.AdamW fused",
                   "zerolab HostOptimizer.step (bf16 in/out, one pass: zerolab.cpu_adam)",
                   "zerolab HostOptimizer.step (bf16 in/out, torch's fused AdamW + casts)")
HOST, HOST_TORCH = IMPLEMENTATIONS[3:]


def adam_rounds(numel, timed=7):
    """Seconds per call in each of ``timed`` paired rounds (after a warm-up round: allocations, lazy
    state, page faults), every contender once per round in rotating order: the memory ceilings, AdamW on
    ``numel`` fp32 params in torch's three CPU implementations, and HostOptimizer.step on ``numel`` bf16
    params, its default kernel and torch's. Returns ({name: [s]}, {name: bytes per call})."""
    from zerolab.offload import HostOptimizer
    kernels = ceilings.memory_kernels(numel)
    calls = {name: fn for name, (fn, _) in kernels.items()}
    nbytes = {name: b for name, (_, b) in kernels.items()}
    for name, kw in zip(IMPLEMENTATIONS, ({"foreach": False}, {"foreach": True}, {"fused": True})):
        p = torch.zeros(numel, requires_grad=True)
        p.grad = torch.full((numel,), 1e-3)
        calls[name] = lambda r, step=torch.optim.AdamW([p], lr=1e-3, **kw).step: step()
    for name, kw in ((HOST, {}), (HOST_TORCH, {"fused": True})):
        host = HostOptimizer(torch.zeros(numel, dtype=torch.bfloat16), torch.optim.AdamW, lr=1e-3, **kw)
        host.grads[0].fill_(1e-3)
        if (host.one_pass is not None) != (name == HOST):
            raise RuntimeError(f"{name}: the kernel is not the one named (no C compiler here?)")
        calls[name] = lambda r, host=host: host.step()
    nbytes.update({name: 28 * numel for name in IMPLEMENTATIONS})
    return protocol.rounds(calls, timed=timed), nbytes


def _contenders():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
    from zerolab import rank_device

    import zerolab.engine
    out = {}
    for label, offload, kw, delayed in (
            ("stage 2, AdamW for-loop", None, {}, False),
            ("stage 2, AdamW fused", None, {"fused": True}, False),
            ("stage 2 + offload, host AdamW fused", "optimizer", {"fused": True}, False),
            ("stage 2 + offload, host one-pass AdamW (zerolab.cpu_adam, the default)", "optimizer", {}, False),
            ("stage 2 + offload, host AdamW for-loop", "optimizer", {"fused": False}, False),
            ("stage 2 + offload + delayed update (DPU), host AdamW fused", "optimizer", {"fused": True}, True)):
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
        # the ranks' own device: CPU under gloo (named, or FSDP2 would pick a GPU where one is visible)
        kw = {"mesh": init_device_mesh(rank_device().type, (dist.get_world_size(),))}
        if policy:   # pinned host memory needs a GPU; without one it is plain memory
            kw["offload_policy"] = CPUOffloadPolicy(pin_memory=rank_device().type == "cuda")
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

    def block(step, done):
        def run(r):                                         # round r: BLOCK steps on the round's batches
            for k in range(BLOCK):
                step(*models.batch("gpt", seed=100 * (r * BLOCK + k) + rank, batch_size=BATCH,
                                   vocab_size=MODEL["vocab_size"], seq_len=MODEL["seq_len"]))
            done()
        return run
    times = protocol.rounds({name: block(step, done) for name, (step, done, _) in contenders.items()},
                            timed=steps, clock=protocol.slowest_rank())
    placement = {name: engine.placement() if engine is not None else None
                 for name, (_, _, engine) in contenders.items()}
    return {name: [t / BLOCK for t in ts] for name, ts in times.items()}, placement


def main(steps=7, world_size=2, adam_mparams=33.5, adam_rounds_=9):
    numel = int(adam_mparams * 1e6)
    times, nbytes = adam_rounds(numel, adam_rounds_)
    rate = {name: [nbytes[name] / t for t in ts] for name, ts in times.items()}
    ceiling = {name: rate[name] for name in rate if name not in IMPLEMENTATIONS}
    fractions = {name: ceilings.fraction(rate[name], ceiling) for name in IMPLEMENTATIONS}
    med = {name: protocol.median(ts) for name, ts in times.items()}
    lines = [f"### CPU AdamW on {numel / 1e6:.1f}M parameters ({torch.get_num_threads()} threads, "
             f"{adam_rounds_} paired rounds)\n",
             "Memory ceilings, measured in the same rounds (best round; benchmarks/ceilings.py): " +
             ", ".join(f"{name} {max(rate[name]) / 1e9:.1f} GB/s" for name in ceiling) +
             f" (STREAM arrays of {ceilings.stream_numel() * 4 / 2**20:.0f} MiB, counted as STREAM counts them). "
             "The ceiling of each row is the fastest of them in the same round.\n",
             "| implementation | ms / step (median) | Mparams/s | effective GB/s (28 B/param) | fraction of the "
             "ceiling: paired [middle half], best round | step time / torch fused AdamW, paired | speed-up vs for-loop, paired |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for name in IMPLEMENTATIONS:
        vs_fused = protocol.ratio(times, name, "torch.optim.AdamW fused")
        speedup = protocol.ratio(times, "torch.optim.AdamW for-loop", name)
        lines.append(f"| {name} | {med[name] * 1e3:.1f} | {numel / med[name] / 1e6:.0f} | "
                     f"{28 * numel / med[name] / 1e9:.1f} | {fractions[name]} | {vs_fused} | {speedup} |")
    lines.append("\nRatios: median [middle half] over the rounds. " + protocol.PROTOCOL_NOTE + " The bf16 rows run on "
                 "bf16 gradient and parameter shards of the same count (a 2-byte gradient read and a 2-byte "
                 "parameter written instead of a 4-byte gradient read: 28 B per parameter either way, with the "
                 "casts folded into the update's pass; 40 B with the casts as separate passes).")
    lines.append(ceilings.warning(ceilings.check(fractions)))   # fails loudly: a row above its ceiling
    psi = sum(p.numel() for p in dict.fromkeys(models.build("gpt", seed=0, **MODEL).parameters()))
    lines += ["", f"### One training step with and without offload (TinyGPT {psi / 1e6:.2f}M params, fp32, AdamW, "
              f"batch {BATCH} x {MODEL['seq_len']} per rank, {world_size} ranks, gloo)\n",
              "| contender | step (ms, median) | / stage 2 fused, paired | device MB / rank | host MB / rank |",
              "|---|---:|---:|---:|---:|"]
    with Cluster(world_size, timeout=900) as cluster:
        steps_t, placement = cluster.run(_measure, steps)[0]
    ref = "stage 2, AdamW fused"
    for name, ts in steps_t.items():
        pl = placement[name]
        dev, host = ("—", "—") if pl is None else (f"{pl['device'] / 1e6:.1f}", f"{pl['host'] / 1e6:.1f}")
        lines.append(f"| {name} | {protocol.median(ts) * 1e3:.0f} | {protocol.ratio(steps_t, name, ref)} | {dev} | {host} |")
    lines.append("\nDevice / host MB: zerolab's placement by role (what would sit on the accelerator vs in "
                 "host memory); on this machine both are the same RAM. " + protocol.PROTOCOL_NOTE)
    off = "stage 2 + offload, host AdamW fused"
    fsdp_off, fsdp = "torch FSDP2 + CPUOffloadPolicy (params too: ZeRO-3 + offload)", "torch FSDP2 fully_shard, AdamW fused"
    headlines = [
        protocol.headline("CPU AdamW: for-loop / fused, step time (the fused kernel's speed-up)",
                          protocol.ratio(times, "torch.optim.AdamW for-loop", "torch.optim.AdamW fused"),
                          below="the for-loop faster", above="the fused kernel faster",
                          note="ZeRO-Offload's point: a vectorised host Adam is several times faster (paper: > 5x)"),
        protocol.headline(f"zerolab HostOptimizer.step (bf16 in/out, one pass) / torch fused AdamW (fp32), step time, "
                          f"{numel / 1e6:.1f}M params", protocol.ratio(times, HOST, "torch.optim.AdamW fused"),
                          reference=TARGET, below=f"within the target <= {TARGET}", above=f"misses the target <= {TARGET}",
                          note=f"with the casts as separate passes: "
                               f"{protocol.ratio(times, HOST_TORCH, 'torch.optim.AdamW fused')}"),
        protocol.headline("zerolab HostOptimizer.step (one pass): effective bandwidth / its memory ceiling",
                          fractions[HOST], reference=1.0, below="below the ceiling", above="ABOVE THE CEILING",
                          crosses="at the ceiling, out of the noise",
                          note=f"torch's fused AdamW: {fractions['torch.optim.AdamW fused']}; Adam is memory-bound"),
        protocol.headline(f"stage 2 + offload / stage 2, step time, {world_size} ranks", protocol.ratio(steps_t, off, ref),
                          below="offload faster", above="offload slower",
                          note=f"device model states {placement[off]['device'] / placement[ref]['device']:.2f}x; on a "
                               "CPU-only machine the 'host link' is a memory copy"),
        protocol.headline(f"FSDP2 + CPUOffloadPolicy / FSDP2, step time, {world_size} ranks",
                          protocol.ratio(steps_t, fsdp_off, fsdp), below="offload faster", above="offload slower",
                          note="torch's offload (parameters too), measured beside zerolab's"),
    ]
    return Section("\n".join(lines) + "\n", headlines)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=7, help="timed rounds (blocks of 2 steps per contender)")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--adam-mparams", type=float, default=33.5, help="parameters for the CPU Adam table, millions")
    ap.add_argument("--adam-rounds", type=int, default=9, help="timed rounds of the CPU Adam table")
    args = ap.parse_args()
    print(main(args.steps, args.world_size, args.adam_mparams, args.adam_rounds))

"""python -m benchmarks.bench_zero12 [--steps 10] [--world-sizes 2 4]

Step time of ZeRO-1 and ZeRO-2 against data parallelism (zerolab stage 0 and torch DDP), torch's
ZeroRedundancyOptimizer (ZeRO-1 by whole parameter, over DDP) and FSDP2
``fully_shard(reshard_after_forward=False)`` (~ZeRO-2), on the same TinyGPT, data and gloo group,
world sizes 2 and 4. The contenders take turns step by step in rotating order, so load from
anything else on the machine hits them alike; the table reports the median step and the paired
ratio to stage 0 (one ratio per step: median [middle half]).
ZeRO-1/2 run with both reduce-scatters: lesson 00's ring (zerolab's default) and torch's gloo
reduce_scatter (an all_reduce underneath, 2x the bytes). Theory: stages 1 and 2 move the same 2Ψ
per step as data parallelism, so the target is within 1.15x of stage 0.
Also measured: per-rank model-state bytes (zerolab engines) and bytes sent per rank per step.
"""
import argparse
import statistics
import time

import torch
import torch.distributed as dist

from benchmarks import Section, protocol
from zerolab import Cluster, models

MODEL = dict(vocab_size=1024, d_model=192, n_layers=3, n_heads=6, seq_len=64)
BATCH = 8


def _contenders():
    """name -> (one training step function, engine or None); all built from the same seed."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from zerolab import rank_device
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    import zerolab.engine
    out = {}
    for label, stage, impl in (("zerolab stage 0 (DP)", 0, None), ("ZeRO-1, ring reduce-scatter", 1, "ring"),
                               ("ZeRO-1, gloo reduce_scatter", 1, "torch"), ("ZeRO-2, ring reduce-scatter", 2, "ring"),
                               ("ZeRO-2, gloo reduce_scatter", 2, "torch")):
        engine = zerolab.initialize(models.build("gpt", seed=0, **MODEL), stage=stage, lr=1e-3, reduce_impl=impl)

        def step(x, y, engine=engine):
            engine.backward(engine(x, y))
            engine.step()
            engine.zero_grad()
        out[label] = (step, engine)

    def torch_step(model, opt):
        def step(x, y):
            model(x, y).backward()
            opt.step()
            opt.zero_grad()
        return step

    ddp = DDP(models.build("gpt", seed=0, **MODEL))
    out["torch DDP"] = (torch_step(ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-3)), None)
    zro = DDP(models.build("gpt", seed=0, **MODEL))
    out["torch ZeroRedundancyOptimizer + DDP"] = (
        torch_step(zro, ZeroRedundancyOptimizer(zro.parameters(), torch.optim.AdamW, lr=1e-3)), None)
    fsdp = models.build("gpt", seed=0, **MODEL)
    mesh = init_device_mesh(rank_device().type, (dist.get_world_size(),))   # CPU under gloo, named
    for block in fsdp.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=False)
    fully_shard(fsdp, mesh=mesh, reshard_after_forward=False)
    out["torch FSDP2 (reshard_after_forward=False)"] = (
        torch_step(fsdp, torch.optim.AdamW(fsdp.parameters(), lr=1e-3)), None)
    return out


def _measure(steps):
    contenders = _contenders()
    rank = dist.get_rank()
    times = {name: [] for name in contenders}
    for s in range(steps + 1):                    # step 0 warms up (allocations, connections)
        x, y = models.batch("gpt", seed=100 * s + rank, batch_size=BATCH, vocab_size=MODEL["vocab_size"],
                            seq_len=MODEL["seq_len"])
        for name in protocol.order(list(contenders), s):     # the order rotates from step to step
            step = contenders[name][0]
            dist.barrier()
            t0 = time.perf_counter()
            step(x, y)
            dist.barrier()
            times[name].append(time.perf_counter() - t0)
    rows = {}
    for name, (_, engine) in contenders.items():
        mem = sent = None
        if engine is not None:
            rep = engine.memory_report()
            mem = sum(sum(v.values()) for v in rep.values())
            sent = engine.last_step_comm.sent_bytes
        rows[name] = (times[name][1:], mem, sent)       # step 0 warmed up; the rest pair step by step
    return rows


def main(steps=10, world_sizes=(2, 4)):
    psi = sum(p.numel() for p in dict.fromkeys(models.build("gpt", seed=0, **MODEL).parameters()))
    lines = [f"### ZeRO-1 / ZeRO-2 vs data parallelism and torch (TinyGPT {psi / 1e6:.2f}M params, fp32 "
             f"AdamW, batch {BATCH} x {MODEL['seq_len']} per rank, gloo)\n",
             "| ranks | contender | step (ms), median | / stage 0, paired | model states per rank (MB) | "
             "sent per rank per step (MB) |",
             "|---:|---|---:|---:|---:|---:|"]
    headlines = []
    for n in world_sizes:
        with Cluster(n, timeout=600) as cluster:
            rows = cluster.run(_measure, steps)[0]
        base = rows["zerolab stage 0 (DP)"][0]
        vs_base = {name: protocol.Ratio.of(t, base) for name, (t, _, _) in rows.items()}
        for name in ("ZeRO-1, ring reduce-scatter", "ZeRO-2, ring reduce-scatter"):
            mem = rows[name][1]
            headlines.append(protocol.headline(
                f"{name.split(',')[0]} / data parallelism, step time, {n} ranks", vs_base[name], reference=1.15,
                below="within the target <= 1.15", above="above the target 1.15",
                note=f"same 2Ψ on the wire; model states {mem / rows['zerolab stage 0 (DP)'][1]:.2f}x stage 0's"))
        fsdp = rows["torch FSDP2 (reshard_after_forward=False)"][0]
        headlines.append(protocol.headline(
            f"zerolab ZeRO-2 / torch FSDP2 (reshard_after_forward=False), step time, {n} ranks",
            protocol.Ratio.of(rows["ZeRO-2, ring reduce-scatter"][0], fsdp), below="zerolab is faster",
            above="FSDP2 is faster"))
        for name, (t, mem, sent) in rows.items():
            mem_s = f"{mem / 1e6:.1f}" if mem is not None else "—"
            sent_s = f"{sent / 1e6:.1f}" if sent is not None else "—"
            lines.append(f"| {n} | {name} | {statistics.median(t) * 1e3:.0f} | {vs_base[name]} | {mem_s} | {sent_s} |")
    return Section("\n".join(lines) + "\n", headlines)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    args = ap.parse_args()
    print(main(args.steps, tuple(args.world_sizes)))

"""python -m benchmarks.bench_parallel [--steps 7]

Tensor, sequence and pipeline parallelism (lesson 14) on gloo ranks, each beside its formula and,
where torch has one that runs here (torch 2.13, gloo), beside torch's own:

* tensor parallelism on 4 ranks: a tower of MLPs (column- then row-parallel, TinyGPT's MLP shape)
  with zerolab's f/g and with DTensor's ``ColwiseParallel``/``RowwiseParallel``: forward + backward
  time (the slowest rank's, paired step by step in rotating order after a warm-up round:
  benchmarks/protocol.py), bytes on the
  sockets per rank, and the formula 4(t-1)/t x the activation per layer (2 all-reduces);
* TinyGPT split over 4 ranks: tensor parallelism, and sequence parallelism (Megatron-LM's re-gather):
  time, bytes logged and on the sockets, against :func:`zerolab.cost_parallel.tp_layer_sent_bytes`;
* pipeline parallelism on 2 and 4 ranks, equal stages of TinyGPT blocks: zerolab's GPipe and 1F1B
  and torch's ``ScheduleGPipe`` and ``Schedule1F1B``, interleaved: step time, each stage's idle
  fraction from the timeline against (p-1)/(m+p-1) (zerolab's), the activation bytes each stage held
  at its peak (zerolab's and torch's, the same census).

On 2 cores, 4 ranks share the cores: compute that would run side by side on 4 devices runs at half
speed; times on 4 ranks are this machine's, not a cluster's. The 2-stage pipeline has a core per rank.
"""
import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from benchmarks import Section, protocol
from zerolab import Cluster, comm, models

MLP_WIDTH, MLP_LAYERS, TOKENS = 256, 4, (64, 8)        # (s, b)
GPT = dict(vocab_size=256, d_model=128, n_layers=4, n_heads=8, seq_len=64)
GPT_BATCH = 8
PP = dict(vocab_size=8, d_model=128, n_heads=4, seq_len=64, tied=False)
PP_BATCH = 4                                            # sequences per micro-batch


class _Tower(nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, x):
        for fc, out in self.layers:
            x = x + out(F.gelu(fc(x)))
        return x


def _tp_mlp(steps):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from zerolab import tensor_parallel as TP
    t, r = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    full = [(nn.Linear(MLP_WIDTH, 4 * MLP_WIDTH), nn.Linear(4 * MLP_WIDTH, MLP_WIDTH)) for _ in range(MLP_LAYERS)]
    rows = torch.arange(r * 4 * MLP_WIDTH // t, (r + 1) * 4 * MLP_WIDTH // t)
    ours = _Tower([nn.ModuleList([TP.ColumnParallelLinear(fc, rows, None), TP.RowParallelLinear(out, rows, None)])
                   for fc, out in full])
    theirs = _Tower([nn.ModuleList([nn.Linear(MLP_WIDTH, 4 * MLP_WIDTH), nn.Linear(4 * MLP_WIDTH, MLP_WIDTH)])
                     for _ in full])
    for (fc, out), pair in zip(full, theirs.layers):
        pair[0].load_state_dict(fc.state_dict())
        pair[1].load_state_dict(out.state_dict())
    mesh = init_device_mesh("cpu", (t,))
    for pair in theirs.layers:
        parallelize_module(pair, mesh, {"0": ColwiseParallel(), "1": RowwiseParallel()})
    x = torch.randn(*TOKENS, MLP_WIDTH, generator=torch.Generator().manual_seed(1)).requires_grad_()   # f in every layer
    towers = {"zerolab": ours, "DTensor": theirs}

    def step(tower):
        y = tower(x)
        y.square().mean().backward()
        return y.detach()
    times = protocol.rounds({name: (lambda r, tower=tower: step(tower)) for name, tower in towers.items()},
                            timed=steps, clock=protocol.slowest_rank())
    ports, sockets, outs = comm.peer_map(), {}, {}
    for name, tower in towers.items():       # one more step each, its bytes read off the sockets
        dist.barrier()
        region = comm.log(sockets=True)
        log = region.open()
        outs[name] = step(tower)
        dist.barrier()
        region.close()
        sockets[name] = sum(log.measured_by_peer(ports).values())
    return times, sockets, (outs["zerolab"] - outs["DTensor"]).abs().max().item()


def _tp_gpt(steps):
    from zerolab import tensor_parallel as TP
    full = models.build("gpt", seed=0, **GPT)
    variants = {"TP": TP.TensorParallelGPT(full, None),
                "SP": TP.TensorParallelGPT(models.build("gpt", seed=0, **GPT), None, sequence_parallel=True)}
    x, y = models.batch("gpt", seed=1, batch_size=GPT_BATCH, model=full)
    times = protocol.rounds({name: (lambda r, model=model: model(x, y).backward()) for name, model in variants.items()},
                            timed=steps, clock=protocol.slowest_rank())
    ports, bytes_ = comm.peer_map(), {}
    for name, model in variants.items():      # one more step each, its bytes logged and read off the sockets
        dist.barrier()
        region = comm.log(sockets=True)
        log = region.open()
        model(x, y).backward()
        dist.barrier()
        region.close()
        bytes_[name] = (log.sent_bytes, sum(log.measured_by_peer(ports).values()))
    return times, bytes_


def _pipeline(p, m, steps):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from zerolab import pipeline as P
    from zerolab.timeline import Timeline
    group = dist.new_group(list(range(p)))
    if dist.get_rank() >= p:
        return None
    s = dist.get_rank(group)
    full = models.build("gpt", seed=0, n_layers=2 * p, **PP)
    stage = nn.Sequential(*full.blocks[2 * s:2 * s + 2])
    g = torch.Generator().manual_seed(1)
    shape = (PP_BATCH, PP["seq_len"], PP["d_model"])
    xs = [torch.randn(shape, generator=g) for _ in range(m)]
    ys = [torch.randn(shape, generator=g) for _ in range(m)]
    mse = lambda o, t: ((o - t) ** 2).mean()
    out = {k: {"time": [], "idle": [], "peak": 0} for k in ("zerolab gpipe", "zerolab 1f1b", "torch gpipe", "torch 1f1b")}
    torch_stage = PipelineStage(stage, s, p, torch.device("cpu"), group=group)
    scheds = {"torch gpipe": ScheduleGPipe(torch_stage, n_microbatches=m, loss_fn=mse),
              "torch 1f1b": Schedule1F1B(torch_stage, n_microbatches=m, loss_fn=mse)}
    for i in range(steps + 1):                     # a warm-up round, then paired rounds in rotating order
        for name in protocol.order(list(out), i):
            stage.zero_grad()
            dist.barrier(group)
            t0 = time.perf_counter()
            if name.startswith("zerolab"):
                tl = Timeline()
                tl.reset()
                with comm.log(timeline=tl):
                    run = P.train_step(stage, m, name.split()[1], inputs=xs if s == 0 else None,
                                       targets=ys if s == p - 1 else None, loss_fn=mse, shape=shape,
                                       dtype=torch.float32, group=group)
                peak = run.activations.peak
            else:
                sched = scheds[name]
                with P.LiveActivations() as live:
                    if s == 0:
                        sched.step(torch.cat(xs))
                    elif s == p - 1:
                        sched.step(target=torch.cat(ys))
                    else:
                        sched.step()
                peak = live.peak
            elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)    # the step ends with the slowest stage
            if i:
                out[name]["time"].append(elapsed.item())
                if name.startswith("zerolab"):
                    busy = sum(sp.seconds for sp in tl.collect() if sp.category == "compute")
                    out[name]["idle"].append(1 - busy / elapsed.item())
            out[name]["peak"] = peak
    return {k: {"times": v["time"], "time": statistics.median(v["time"]),
                "idle": statistics.median(v["idle"]) if v["idle"] else None, "peak": v["peak"]} for k, v in out.items()}


def main(steps=7):
    from zerolab import cost_parallel as cp
    with Cluster(4, timeout=900) as cluster:
        mlp = cluster.run(_tp_mlp, steps)
        gpt = cluster.run(_tp_gpt, steps)
        pipes = {(p, m): cluster.run(_pipeline, p, m, steps) for p in (2, 4) for m in (4, 8)}
    t = 4
    act = TOKENS[0] * TOKENS[1] * MLP_WIDTH * 4
    rows = ["#### Tensor parallelism: a tower of MLPs, zerolab's f/g vs DTensor (4 ranks)\n",
            "| implementation | forward + backward (ms, slowest rank) | bytes on rank 0's sockets | formula (logged) |",
            "|---|---:|---:|---:|"]
    mlp_times = mlp[0][0]                      # the slowest rank's, the same on every rank
    formula = MLP_LAYERS * 2 * 2 * (t - 1) / t * act
    for k in ("zerolab", "DTensor"):
        rows.append(f"| {k} | {protocol.median(mlp_times[k]) * 1e3:.1f} | {mlp[0][1][k]:,} | {formula:,.0f} |")
    rows.append(f"\nLargest output difference between the two (float32): {max(r[2] for r in mlp):.1e}.\n")
    rows += [f"#### TinyGPT {GPT}, batch {GPT_BATCH}, split over 4 ranks\n",
             "| | forward + backward (ms, slowest rank) | bytes logged (rank 0) | formula | on its sockets |",
             "|---|---:|---:|---:|---:|"]
    s_bytes = GPT["seq_len"] * GPT_BATCH * GPT["d_model"] * 4
    for k in ("TP", "SP"):
        sp = k == "SP"
        f = GPT["n_layers"] * cp.tp_layer_sent_bytes(s_bytes, t, sequence_parallel=sp,
                                                      replicated_grad_bytes=GPT["d_model"] * 4 if sp else 0)
        f += 2 * (t - 1) / t * s_bytes if sp else 0
        rows.append(f"| {k} | {protocol.median(gpt[0][0][k]) * 1e3:.1f} | {gpt[0][1][k][0]:,.0f} | {f:,.0f} | "
                    f"{gpt[0][1][k][1]:,} |")
    rows += ["\n#### Pipeline parallelism: equal stages of 2 TinyGPT blocks (width 128, float32), micro-batches "
             f"of {PP_BATCH} sequences\n",
             "| p | m | schedule | step (ms) | idle fraction, stage mean (formula) | peak activation MB per stage |",
             "|---:|---:|---|---:|---:|---|"]
    headlines = [protocol.headline("DTensor TP / zerolab TP, forward + backward of an MLP tower (4 ranks)",
                                   protocol.ratio(mlp_times, "DTensor", "zerolab"), below="DTensor faster here",
                                   above="DTensor slower here", note="the same collectives"),
                 ("SP / TP bytes per rank, TinyGPT on 4 ranks (Megatron's re-gather)",
                  f"{gpt[0][1]['SP'][0] / gpt[0][1]['TP'][0]:.2f}", "g/g-bar alone would be 1 plus the edges; the re-gather adds 2(t-1)/t sbh per layer")]
    for (p, m), ranks in pipes.items():
        ranks = [r for r in ranks if r is not None]
        for name in ranks[0]:
            idle = [r[name]["idle"] for r in ranks]
            idle_text = (f"{statistics.mean(idle):.3f} ({cp.bubble_fraction(p, m):.3f})" if idle[0] is not None else "-")
            peaks = ", ".join(f"{r[name]['peak'] / 1e6:.2f}" for r in ranks)
            rows.append(f"| {p} | {m} | {name} | {ranks[0][name]['time'] * 1e3:.0f} | {idle_text} | {peaks} |")
        headlines.append(protocol.headline(
            f"torch Schedule1F1B / zerolab 1F1B step time, p = {p}, m = {m}",
            protocol.Ratio.of(ranks[0]["torch 1f1b"]["times"], ranks[0]["zerolab 1f1b"]["times"]),
            below="torch's faster here", above="torch's slower here", note="the same schedule"))
    head = ("### Tensor, sequence and pipeline parallelism (lesson 14), gloo; times are the slowest rank's, medians "
            f"over {steps} paired rounds in rotating order after a warm-up round (benchmarks/protocol.py)\n\n")
    return Section(head + "\n".join(rows) + "\n\n" + protocol.PROTOCOL_NOTE + "\n", headlines)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=7)
    print(main(ap.parse_args().steps))

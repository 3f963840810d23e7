"""Calibrate the cost model on this machine: measure a hardware profile on real ranks, then predict
zerolab's own step times with :mod:`zerolab.cost` and set them beside the measured ones.

A model earns trust at 64-4096 GPUs only if it first predicts what we CAN run (issue 13). Per world
size N, with all N ranks measuring at the same time (on a few shared cores N ranks slow each other
down, and that is part of this machine's profile):

* link: gloo all_reduce of two sizes; solving the ring's alpha-beta model
  t(S) = 2(N-1)·α + 2(N-1)/N·S/B (:func:`zerolab.cost.ring_time`) for both gives B and α. The same
  for the two halves the ZeRO engines launch instead, each of one phase, t(S) = (N-1)·α + (N-1)/N·S/B:
  gloo's all_gather and the ring reduce-scatter from send/recv (``zerolab.ring``, the engines' choice on gloo); on
  gloo they do NOT run at half an all_reduce's time each, and :func:`fit_links` says by how much;
* compute: the model's forward + backward alone; effective FLOP/s = 6·Ψ·tokens / time (MFU folded in).
  Not used to predict, the forward alone, in wall and CPU time, twice: with the ranks waiting at a
  barrier after it, and with every rank going straight on into its backward as in a step (:func:`_forward`);
* optimizer: torch AdamW on one flat fp32 tensor, as :class:`zerolab.shard_optim.ShardOptimizer` runs
  it on the device (torch's default kernel), and as :mod:`zerolab.offload` runs it on the host (its
  fused CPU kernel when there is one, the paper's "CPU-Adam");
* host link: a tensor copy (on a CPU-only machine "device" and "host" are the same memory).

:func:`measure` runs those probes AND one training step of every stage in rounds, one after the
other, so that load from anything else on the machine hits all of them alike; medians over rounds
of the slowest rank, for the step and for each of its phases (forward, backward, optimizer step) on
the group's timeline (:func:`slowest_phases`), with the engine's forward in CPU time too.
:func:`predict` then costs each stage with :func:`zerolab.cost.step_time`, phase by phase: with
the paper's schedule (2Ψ or 3Ψ, one collective per phase) or with the collectives the engine really
launched in each phase of one step (one per bucket or unit, each paying its latency), on the
all_reduce's link or on each collective's own. Overlap is off: on CPU ranks, communication competes
with compute for the same cores; nothing hides it.
"""
import contextlib
import json
import os
import statistics
import time

# The calibration workload: big enough that compute, communication and the optimizer each take
# milliseconds (a prediction, not a statement about Python overhead), small enough for a laptop.
MODEL = dict(vocab_size=256, d_model=256, n_layers=4, n_heads=4, seq_len=64)
BATCH = 2                    # sequences per rank per step
STAGES = ("0", "1", "2", "3", "2+offload")
SIZES = (1 << 16, 1 << 23)   # all_reduce sizes in bytes: the small pins α, the large B
ADAM_NUMEL = 1 << 21         # fp32 elements of the AdamW probe
COPY_NUMEL = 1 << 22         # fp32 elements of the copy probe


@contextlib.contextmanager
def caching_allocator():
    """Ranks started inside inherit a glibc malloc that keeps freed memory for reuse.

    By default glibc hands large freed blocks (above ~128 KiB, adaptively up to 32 MiB) back to the
    operating system, and every re-allocation page-faults them in again, zeroed. Stages 2 and 3
    re-allocate full-size gradient buckets and gathered units every step; on machines where page
    faults are slow (virtual machines, sandboxes) that alone can cost more than the step's compute.
    GPUs never pay it: PyTorch's CUDA caching allocator keeps freed blocks. Setting
    MALLOC_MMAP_THRESHOLD_ (its maximum, 32 MiB) and MALLOC_TRIM_THRESHOLD_ is the CPU analogue, so the
    measured steps show the algorithm, which is what the cost model describes. Set before the ranks
    start (a process reads them once); restored on exit."""
    wanted = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 32)}
    saved = {k: os.environ.get(k) for k in wanted}
    os.environ.update(wanted)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# -- on the ranks --------------------------------------------------------------------------------
def _timed(fn):
    import torch.distributed as dist
    dist.barrier()                              # all ranks start together, as in a training step
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _probes(model_kwargs, batch_size, sizes, adam_numel, copy_numel):
    """The profile's measurements as no-argument functions, and what they need to be read."""
    import torch
    import torch.distributed as dist

    from zerolab import comm, engine, models
    impl = engine.default_reduce_impl()                       # what the engines use
    n = dist.get_world_size()
    probes = {}
    for nbytes in sizes:                                      # link: two points of t(S) per op
        buf = torch.ones(max(n, nbytes // 4 // n * n))
        part = torch.ones(buf.numel() // n)
        probes[f"all_reduce {buf.numel() * 4}"] = lambda buf=buf: comm.all_reduce(buf)
        probes[f"all_gather {buf.numel() * 4}"] = lambda buf=buf, part=part: comm.all_gather(buf, part)
        probes[f"reduce_scatter {buf.numel() * 4}"] = \
            lambda buf=buf, part=part: engine.reduce_scatter(part, buf, impl=impl)
    model = models.build("gpt", seed=0, **model_kwargs)      # compute: forward + backward alone
    x, y = models.batch("gpt", seed=dist.get_rank(), batch_size=batch_size, model=model)

    def fwd_bwd():
        model(x, y).backward()
        model.zero_grad(set_to_none=True)
    probes["fwd_bwd"] = fwd_bwd
    from zerolab.offload import host_optimizer
    for name, fused in (("adam", False), ("host_adam", None)):   # optimizer: AdamW on one flat shard,
        p = torch.zeros(adam_numel, requires_grad=True)          # the device's kernel and the host's
        p.grad = torch.randn(adam_numel)
        probes[name] = host_optimizer([p], torch.optim.AdamW, fused=fused, lr=1e-3)[0].step
    src, dst = torch.ones(copy_numel), torch.empty(copy_numel)
    probes["copy"] = lambda: dst.copy_(src)                  # host link: a copy
    info = {"psi": sum(q.numel() for q in dict.fromkeys(model.parameters())), "tokens": x.numel(),
            "adam_numel": adam_numel, "copy_bytes": copy_numel * 4}
    return probes, (model, x, y), info


def _forward(model, x, y, *, then_backward):
    """The forward alone, timed from a barrier: (wall seconds, this process's CPU seconds). Not used to
    predict; two questions about the model's compute. Alone (the graph dropped, the rank then waits at
    the next barrier), its share of forward + backward is the 2:4 split the model assumes. Followed at
    once by the backward (``then_backward``, not timed), as in a training step: the ranks that finish
    their forward first start their backward while the others are still in theirs, and where ranks
    outnumber cores they take cores the others' forward needs. CPU seconds tell waiting for a core from
    doing more work."""
    import torch.distributed as dist
    dist.barrier()
    c0, t0 = time.process_time(), time.perf_counter()
    loss = model(x, y)                   # the graph is built as in training
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    if then_backward:
        loss.backward()
        model.zero_grad(set_to_none=True)
    return wall, cpu


def _phase_schedule(engine, model, step, batch_size):
    """One training step with a comm log per phase: {"forward", "backward", "step": [(op, bytes)]},
    the collectives the engine really launched in each (one per bucket or unit)."""
    import torch.distributed as dist

    from zerolab import comm, models
    rank, n = dist.get_rank(), dist.get_world_size()
    x, y = models.batch("gpt", seed=step * n + rank, batch_size=batch_size, model=model)
    logs = {}
    with comm.log() as logs["forward"]:
        loss = engine(x, y)
    with comm.log() as logs["backward"]:
        engine.backward(loss)
    with comm.log() as logs["step"]:
        engine.step()
    engine.zero_grad()
    return {phase: [(rec.op, rec.tensor_bytes) for rec in log.records
                    if rec.op in ("all_reduce", "reduce_scatter", "all_gather")] for phase, log in logs.items()}


def _train_step(engine, model, step, batch_size):
    """One training step on this rank's batch: (seconds, forward, backward, optimizer step, the
    forward's CPU seconds in this process)."""
    import torch.distributed as dist

    from zerolab import models
    rank, n = dist.get_rank(), dist.get_world_size()
    x, y = models.batch("gpt", seed=step * n + rank, batch_size=batch_size, model=model)
    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    loss = engine(x, y)
    t1, c1 = time.perf_counter(), time.process_time()
    engine.backward(loss)
    t2 = time.perf_counter()
    engine.step()
    t3 = time.perf_counter()
    engine.zero_grad()
    return t3 - t0, t1 - t0, t2 - t1, t3 - t2, c1 - c0


def measure(stages=STAGES, model_kwargs=None, batch_size=BATCH, rounds=6, *, sizes=SIZES,
            adam_numel=ADAM_NUMEL, copy_numel=COPY_NUMEL):
    """Run on every rank (``cluster.run(measure, ...)``). Each round runs every probe once, then
    one training step of every stage, in turn; round 0 warms up and is dropped.
    Returns {"times": {name: [s per round]}, "phases": {stage: [(fwd, bwd, step)]},
    "schedule": {stage: {phase: [(op, bytes)]}} (one more step, logged phase by phase), "psi": {stage: Ψ},
    "info": {...}, "errors": {stage: msg}}."""
    import zerolab
    from zerolab import models
    from zerolab.stages import parse_stage
    model_kwargs = dict(MODEL if model_kwargs is None else model_kwargs)
    probes, (probe_model, x, y), info = _probes(model_kwargs, batch_size, sizes, adam_numel, copy_numel)
    engines, errors = {}, {}
    for spec in stages:
        stage, offload = parse_stage(spec)
        model = models.build("gpt", seed=0, **model_kwargs)
        try:
            engines[spec] = (zerolab.initialize(model, stage=stage, offload=offload, lr=1e-3), model)
        except (ValueError, NotImplementedError) as exc:   # raised alike on every rank
            errors[spec] = f"{type(exc).__name__}: {exc}"
    forwards = {"fwd": False, "fwd_then_bwd": True}
    times = {name: [] for name in list(probes) + list(forwards) + [f"cpu {f}" for f in forwards] + list(engines)
             + [f"cpu forward {spec}" for spec in engines]}
    phases = {spec: [] for spec in engines}
    for r in range(rounds + 1):
        for name, fn in probes.items():
            t = _timed(fn)
            if r:
                times[name].append(t)
        for name, then_backward in forwards.items():
            wall, cpu = _forward(probe_model, x, y, then_backward=then_backward)
            if r:
                times[name].append(wall)
                times[f"cpu {name}"].append(cpu)
        for spec, (engine, model) in engines.items():
            t = _train_step(engine, model, r, batch_size)
            if r:
                times[spec].append(t[0])
                phases[spec].append(t[1:4])
                times[f"cpu forward {spec}"].append(t[4])
    schedule = {spec: _phase_schedule(engine, model, rounds + 1, batch_size)
                for spec, (engine, model) in engines.items()}
    psi = {spec: sum(p.numel() for p in dict.fromkeys(model.parameters())) for spec, (_, model) in engines.items()}
    return {"times": times, "phases": phases, "schedule": schedule, "psi": psi, "info": info, "errors": errors}


# -- in the parent --------------------------------------------------------------------------------
def slowest_median(per_rank, name):
    """Median over rounds of the SLOWEST rank's time in each round (a step, or a probe started on
    all ranks at once, is over when its last rank is done)."""
    return statistics.median(max(ts) for ts in zip(*(r["times"][name] for r in per_rank)))


PHASES = {"all_reduce": 2, "reduce_scatter": 1, "all_gather": 1}


def _alpha_beta(raw, op, n):
    """(bandwidth, latency) solving t(S) = phases·((N-1)·α + (N-1)/N·S/B) at the two probed sizes."""
    (s1, t1), (s2, t2) = sorted((int(k.split()[1]), v) for k, v in raw.items() if k.split()[0] == op)
    bus = PHASES[op] * (n - 1) / n
    bandwidth = bus * (s2 - s1) / max(t2 - t1, 1e-9)
    return bandwidth, max(0.0, (t1 - bus * s1 / bandwidth) / (PHASES[op] * (n - 1)))


def fit_hardware(per_rank, world_size):
    """(zerolab.cost.Hardware, raw medians) from :func:`measure`'s per-rank results; the link is the
    all_reduce's."""
    from zerolab import cost
    n, info = world_size, per_rank[0]["info"]
    raw = {name: slowest_median(per_rank, name) for name in per_rank[0]["times"]
           if name in ("fwd_bwd", "fwd", "fwd_then_bwd", "adam", "host_adam", "copy")
           or name.split()[0] in PHASES or name.startswith("cpu ")}
    bandwidth, latency = _alpha_beta(raw, "all_reduce", n)   # two sizes, two unknowns
    flops = 6 * info["psi"] * info["tokens"] / raw["fwd_bwd"]      # effective, MFU folded in
    hw = cost.Hardware(name=f"this machine, {n} ranks at once (gloo, CPU)", device_memory=0.0,
                       peak_flops=flops, mfu=1.0, link_bandwidth=bandwidth, link_latency=latency,
                       host_link_bandwidth=info["copy_bytes"] / raw["copy"],
                       host_adam_params_per_s=info["adam_numel"] / raw["host_adam"],
                       device_adam_params_per_s=info["adam_numel"] / raw["adam"])
    return hw, dict(raw, **info)


def fit_links(raw, world_size, hw):
    """{op: Hardware}: ``hw`` with each collective's own fitted link (for zerolab.cost's ``links``)."""
    import dataclasses
    out = {}
    for op in PHASES:
        bandwidth, latency = _alpha_beta(raw, op, world_size)
        out[op] = dataclasses.replace(hw, link_bandwidth=bandwidth, link_latency=latency)
    return out


def predict(num_params, spec, world_size, hw, *, tokens, schedule=None, links=None, word_bytes=4):
    """zerolab.cost.step_time for stage ``spec`` ('0'..'3', '2+offload'), no overlap (CPU ranks share
    their cores); with ``schedule`` ({phase: [(op, bytes)]}) the engine's real collectives in the phase
    they ran in instead of the paper's one per phase, with ``links`` ({op: Hardware}) each collective on
    its own measured link. Per phase: "forward", "backward", "step" of the result."""
    from zerolab import cost
    from zerolab.stages import parse_stage
    stage, offload = parse_stage(spec)
    return cost.step_time(num_params, world_size, stage, tokens_per_rank=tokens, hw=hw,
                          offload=offload is not None, overlap=False, grad_bytes=word_bytes,
                          param_bytes=word_bytes, collectives=schedule, links=links)


def _phase_ends(per_rank, spec):
    """Per round: for forward, backward and step, each rank's end of that phase (its clock started at the
    barrier before the step), from the per-rank (f, b, s) durations: [[rank ends] x 3] per round."""
    for ranks in zip(*(r["phases"][spec] for r in per_rank)):    # per round: one (f, b, s) per rank
        yield [[sum(rank[:i + 1]) for rank in ranks] for i in range(3)]


def slowest_phases(per_rank, spec):
    """(forward, backward, step) seconds on the group's timeline, as the cost model lays a step out:
    per round, a phase is over when its LAST rank is done with it (each rank's clock started at the
    barrier before the step) and lasts from the end of the phase before; then the median over rounds.
    In each round the three add up to the slowest rank's step (:func:`slowest_median`). (The slowest
    rank's time in each phase, taken phase by phase, does not: a rank that finished its forward early
    waits in its backward's collective for the late one, and the late rank's delay counts twice.)"""
    per_round = []
    for ends in _phase_ends(per_rank, spec):
        last = [max(e) for e in ends]
        per_round.append((last[0], last[1] - last[0], last[2] - last[1]))
    return [statistics.median(r[i] for r in per_round) for i in range(3)]


def end_spread(per_rank, spec):
    """(forward, backward, step): how far apart the ranks end each phase (the last rank's end minus the
    first's, each rank's clock started at the barrier before the step), the median over rounds. A rank
    that ends its backward this much before the last one has started its step before the step phase on
    the group's timeline (:func:`slowest_phases`) begins."""
    per_round = [[max(e) - min(e) for e in ends] for ends in _phase_ends(per_rank, spec)]
    return [statistics.median(r[i] for r in per_round) for i in range(3)]


def compare(per_rank, world_size):
    """Fit the profile and predict every measured stage: (Hardware, links, raw, rows), one row per
    stage: {"stage", "psi", "measured", "phases", "spread", "calls", "paper", "ours", "links"} (seconds):
    "phases" the measured (forward, backward, step), "spread" how far apart the ranks end each;
    "paper" the paper's schedule on the all_reduce's link, "ours" the engine's collectives on the
    all_reduce's link, "links" the engine's collectives each on its own link (each a
    zerolab.cost.step_time result, per phase and in total)."""
    hw, raw = fit_hardware(per_rank, world_size)
    links = fit_links(raw, world_size, hw)
    r0, rows = per_rank[0], []
    for spec, schedule in r0["schedule"].items():
        psi, kw = r0["psi"][spec], dict(tokens=raw["tokens"])
        rows.append({"world_size": world_size, "stage": spec, "psi": psi,
                     "measured": slowest_median(per_rank, spec), "phases": slowest_phases(per_rank, spec),
                     "spread": end_spread(per_rank, spec),
                     "calls": sum(len(c) for c in schedule.values()), "schedule": schedule,
                     "paper": predict(psi, spec, world_size, hw, **kw),
                     "ours": predict(psi, spec, world_size, hw, schedule=schedule, **kw),
                     "links": predict(psi, spec, world_size, hw, schedule=schedule, links=links, **kw)})
    return hw, links, raw, rows


def load_profile(path):
    """{world size: zerolab.cost.Hardware} from a profile written by ``benchmarks/bench_cost.py``."""
    from zerolab import cost
    data = json.loads(open(path).read())
    return {int(n): cost.Hardware(**hw) for n, hw in data["world_sizes"].items()}

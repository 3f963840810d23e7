"""zerolab.pipeline on real gloo ranks (lesson 14): GPipe and 1F1B equal to one process in float64,
the micro-batches in flight and the activation bytes held against cost_parallel's bounds, the
point-to-point bytes, the bubble of each schedule's order against (p-1)/(m+p-1), torch's
pipelining schedules on the same stages, pipeline x data parallelism with ZeRO-1/2 (the data-parallel
bytes per step against zero_bytes_under_pipeline), and what it refuses."""
import pytest
import torch
import torch.distributed as dist

from zerolab import comm, cost_parallel as cp, models
from zerolab import pipeline as P

GPT = dict(vocab_size=64, d_model=32, n_layers=4, n_heads=4, seq_len=16, tied=False)
MB = 2


def step(schedule, m):
    p, s = dist.get_world_size(), dist.get_rank()
    full = models.build("gpt", seed=0, dtype=torch.float64, **GPT)
    stage = P.Stage(full, p, s)
    x, y = models.batch("gpt", seed=1, batch_size=m * MB, model=full)
    xs, ys = [c.clone() for c in x.chunk(m)], [c.clone() for c in y.chunk(m)]
    with comm.log() as log:
        run = P.train_step(stage, m, schedule, inputs=xs, targets=ys, shape=(MB, GPT["seq_len"], GPT["d_model"]),
                           dtype=torch.float64)
    ref = models.build("gpt", seed=0, dtype=torch.float64, **GPT)
    losses = [P.gpt_loss(ref(a), b) for a, b in zip(xs, ys)]
    (sum(losses) / m).backward()
    one = dict(ref.named_parameters())
    worst = max((q.grad - one[stage.full_names[n]].grad).abs().max().item() for n, q in stage.named_parameters())
    sent = {}
    for r in log.records:
        for peer, b in (r.peers or {}).items():
            sent[peer] = sent.get(peer, 0) + b
    return {"grad": worst, "losses": run.finish(), "want_losses": [float(v) for v in losses], "order": run.order,
            "peak": run.peak_in_flight, "peak_bytes": run.activations.peak, "one": run.activation_trace[0],
            "sent": sent, "live_after": run.activations.live}


@pytest.mark.parametrize("schedule", P.SCHEDULES)
@pytest.mark.parametrize("world, m", [(2, 1), (2, 5), (4, 2), (4, 8)])
def test_equal_to_one_process_and_memory_and_bytes(clusters, schedule, world, m):
    act = MB * GPT["seq_len"] * GPT["d_model"] * 8
    for s, r in enumerate(clusters(world).run(step, schedule, m)):
        assert r["grad"] < 1e-14, f"stage {s}: gradients differ from one process by {r['grad']}"
        if s == world - 1:
            assert r["losses"] == pytest.approx(r["want_losses"], rel=1e-13)
        bound = cp.in_flight(world, m, s, schedule)
        assert r["peak"] == bound, f"stage {s}: {r['peak']} micro-batches in flight, bound {bound}"
        assert r["peak_bytes"] == bound * r["one"], f"stage {s}: {r['peak_bytes']} B held, {bound} x {r['one']}"
        assert r["live_after"] == 0, f"stage {s}: {r['live_after']} B of activations left after the step"
        want = {q: m * act for q in (s - 1, s + 1) if 0 <= q < world}
        assert r["sent"] == want, f"stage {s}: sent {r['sent']}, expected {want}"
        per_stage = cp.p2p_bytes(act, world, m)
        assert sum(r["sent"].values()) == per_stage["first" if s == 0 else "last" if s == world - 1 else "middle"]


@pytest.mark.parametrize("schedule", P.SCHEDULES)
@pytest.mark.parametrize("p, m", [(1, 3), (2, 1), (2, 4), (3, 5), (4, 2), (4, 8), (8, 32)])
def test_each_schedule_order_has_the_formula_bubble(schedule, p, m):
    for fwd, bwd in ((1.0, 2.0), (1.0, 1.0)):
        got = P.simulate(P.orders(schedule, p, m), forward=fwd, backward=bwd)
        assert got["end"] == pytest.approx((m + p - 1) * (fwd + bwd))
        assert got["bubble"] == pytest.approx([cp.bubble_fraction(p, m)] * p)


def test_the_simulation_refuses_an_order_that_waits_forever():
    with pytest.raises(ValueError, match="wait forever"):
        P.simulate([[("F", 0), ("B", 0)], [("B", 0), ("F", 0)]])


def test_bubble_and_bounds_by_hand():
    assert cp.bubble_fraction(4, 8) == pytest.approx(3 / 11)
    assert cp.bubble_fraction(4, 8, interleave=2) == pytest.approx(3 / 19)
    assert [cp.in_flight(4, 8, s, "1f1b") for s in range(4)] == [4, 3, 2, 1]
    assert [cp.in_flight(4, 2, s, "1f1b") for s in range(4)] == [2, 2, 2, 1]
    assert cp.in_flight(4, 8, 3, "gpipe") == 8
    with pytest.raises(ValueError, match="gpipe"):
        cp.in_flight(4, 8, 0, "interleaved")
    with pytest.raises(ValueError, match="ints >= 1"):
        cp.bubble_fraction(0, 4)


def torch_schedule(kind, m):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
    p, s = dist.get_world_size(), dist.get_rank()
    full = models.build("gpt", seed=0, dtype=torch.float64, **GPT)
    stage = P.Stage(full, p, s)
    x, y = models.batch("gpt", seed=1, batch_size=m * MB, model=full)
    sched = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[kind](
        PipelineStage(stage, s, p, torch.device("cpu")), n_microbatches=m, loss_fn=P.gpt_loss)
    with P.LiveActivations() as live:
        if s == 0:
            sched.step(x)
        elif s == p - 1:
            sched.step(target=y)
        else:
            sched.step()
    theirs = {n: q.grad.clone() for n, q in stage.named_parameters()}
    stage.zero_grad(set_to_none=True)
    run = P.train_step(stage, m, kind, inputs=list(x.chunk(m)), targets=list(y.chunk(m)),
                       shape=(MB, GPT["seq_len"], GPT["d_model"]), dtype=torch.float64)
    ours = {n: q.grad for n, q in stage.named_parameters()}
    return max((theirs[n] - ours[n]).abs().max().item() for n in ours), live.peak, run.activations.peak


@pytest.mark.parametrize("kind", P.SCHEDULES)
def test_torch_pipelining_schedules_agree(clusters, kind):
    """torch 2.13's ScheduleGPipe / Schedule1F1B on gloo: the same gradients, and (given the same
    micro-batch views of one batch) the same activation bytes held at the peak on every stage."""
    for s, (diff, theirs, ours) in enumerate(clusters(4).run(torch_schedule, kind, 8)):
        assert diff < 1e-14, f"stage {s}: gradients differ from torch's by {diff}"
        assert theirs == ours, f"stage {s}: torch held {theirs} B at its peak, zerolab {ours} B"


def pp_dp(zero, m):
    import zerolab
    from zerolab.mesh import Mesh
    mesh = Mesh(2, 2)
    full = models.build("gpt", seed=0, dtype=torch.float64, **GPT)
    stage = P.Stage(full, 2, mesh.node)
    engine = zerolab.initialize(stage, stage=zero, group=mesh.intra, lr=1e-2)
    x, y = models.batch("gpt", seed=3, batch_size=4 * m, model=full)
    mine = slice(2 * m * mesh.local, 2 * m * (mesh.local + 1))
    xs, ys = [c.clone() for c in x[mine].chunk(m)], [c.clone() for c in y[mine].chunk(m)]

    def backward(scalar, last):
        if zero == 1 and not last:
            with engine.no_sync():
                engine.backward(scalar)
        else:
            engine.backward(scalar)

    with comm.log() as log:
        P.train_step(stage, m, "1f1b", inputs=xs if mesh.node == 0 else None, targets=ys if mesh.node == 1 else None,
                     shape=(2, GPT["seq_len"], GPT["d_model"]), dtype=torch.float64, group=mesh.inter, call=engine,
                     backward_fn=backward)
        engine.step()
    ref = models.build("gpt", seed=0, dtype=torch.float64, **GPT)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ref(x, y).backward()
    opt.step()
    one = dict(ref.named_parameters())
    worst = max((v - one[stage.full_names[n]].detach()).abs().max().item() for n, v in engine.full_state_dict().items())
    dp = tuple(dist.get_process_group_ranks(mesh.intra))
    return worst, sum(r.sent_bytes for r in log.records if r.group == dp), sum(q.numel() for q in stage.parameters())


@pytest.mark.parametrize("zero, m", [(1, 2), (1, 4), (2, 2), (2, 4)])
def test_pipeline_times_data_parallel_with_zero(clusters, zero, m):
    for rank, (worst, dp_bytes, psi) in enumerate(clusters(4).run(pp_dp, zero, m)):
        assert worst < 1e-10, f"rank {rank}: differs from one process by {worst}"
        assert dp_bytes == pytest.approx(cp.zero_bytes_under_pipeline(psi, 2, m, zero, word=8)), f"rank {rank}"


def refusals(case):
    full = models.build("gpt", **GPT)
    try:
        if case == "layers":
            P.Stage(full, 3, 0)
        elif case == "tied":
            P.Stage(models.build("gpt", **dict(GPT, tied=True)), 2, 0)
        elif case == "inputs":
            P.StageRun(P.Stage(full, dist.get_world_size(), dist.get_rank()), 2, inputs=None, targets=[None, None],
                       shape=(1,), dtype=torch.float32)
        elif case == "schedule":
            P.train_step(None, 2, "interleaved")
        elif case == "zero3":
            import zerolab
            stage = P.Stage(full, dist.get_world_size(), dist.get_rank())
            alone = [dist.new_group([r]) for r in range(dist.get_world_size())]   # every rank makes every group
            engine = zerolab.initialize(stage, stage=3, group=alone[dist.get_rank()])
            P.StageRun(stage, 2, inputs=[None, None], targets=[None, None], shape=(1,), dtype=torch.float32, call=engine)
    except ValueError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("case, words", [("layers", "divide the model's 4 blocks"), ("tied", "tied=False"),
                                         ("inputs", "stage 0 needs inputs"), ("schedule", "'gpipe', '1f1b'"),
                                         ("zero3", "use stage 1")])
def test_bad_input_is_refused_by_name(clusters, case, words):
    got = clusters(2).run(refusals, case)[0]
    assert got is not None and words in got, got


def emulated(schedule, m, forward_s):
    """Emulated stages (sleeping compute) on every rank, one step; each compute span's length."""
    from zerolab.timeline import Timeline
    p, s = dist.get_world_size(), dist.get_rank()
    shape = (2, 3)
    g = torch.Generator().manual_seed(0)
    xs, ys = [torch.randn(shape, generator=g) for _ in range(m)], [torch.randn(shape, generator=g) for _ in range(m)]
    tl = Timeline()
    dist.barrier()
    tl.reset()
    with comm.log(timeline=tl):
        run = P.train_step(P.EmulatedStage(forward_s, 2 * forward_s), m, schedule, inputs=xs, targets=ys,
                           loss_fn=lambda o, y: ((o - y) ** 2).mean(), shape=shape, dtype=torch.float32)
    spans = [sp for sp in tl.collect() if sp.category == "compute"]
    return [(sp.name, sp.seconds) for sp in spans], run.peak_in_flight


def test_emulated_stages_sleep_their_compute_and_keep_the_schedule(clusters):
    """EmulatedStage: each forward span lasts at least forward_s, each backward 2 x forward_s; the
    schedule's bound on what a stage holds is unchanged (sleeping stands in for compute only)."""
    for s, (spans, peak) in enumerate(clusters(2).run(emulated, "1f1b", 3, 0.01)):
        assert len(spans) == 6
        for name, seconds in spans:
            assert seconds >= (0.01 if name.startswith("F") else 0.02) * 0.99, (s, name, seconds)
        assert peak == cp.in_flight(2, 3, s, "1f1b")
    with pytest.raises(ValueError, match="seconds >= 0"):
        P.EmulatedStage(-1, 0)


def test_plot_schedule_draws_every_span():
    import matplotlib
    matplotlib.use("Agg")
    sim = P.simulate(P.orders("1f1b", 4, 8))
    ax = P.plot_schedule(sim, title="1F1B")
    assert sum(len(c.get_paths()) for c in ax.collections) == 4 * 2 * 8      # a bar per forward and backward
    assert ax.get_xlim() == (0, sim["end"])

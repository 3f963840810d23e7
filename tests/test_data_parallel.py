"""Data parallelism against independent references: one process training on the concatenated
global batch (computed here, in the test process), and torch's DistributedDataParallel on the same
ranks and data. float64 where exactness matters. Also: bytes on the wire, memory, overlap."""
import pytest
import torch
import torch.distributed as dist

from helpers import assert_params
from reference import batch, build, reference, train
from zerolab import RankError, models

STEPS = 3
MICRO = 4          # samples per rank per micro-step
GPT = dict(vocab_size=64, d_model=32, n_layers=1, n_heads=2, seq_len=16)
LR = 1e-2


def _setup(name):
    """What the reference, the engine and the plain loops share: the model's size and the data's, the lr."""
    return dict(lr=LR, size=MICRO, model_kw=GPT if name == "gpt" else None)


def _build(name, dtype):
    return build(name, dtype, model_kw=_setup(name)["model_kw"])


def _data(name, step, rank, micro, dtype):
    return batch(name, step, rank, micro, size=MICRO, dtype=dtype, model_kw=_setup(name)["model_kw"])


def _own_loop(kind, name, dtype=torch.float64, accum=1, bucket_bytes=2048):
    """Train on this rank's micro-batches in a plain torch loop around 'naive' / 'bucketed' (the
    DataParallel wrapper) or 'ddp' (torch's DistributedDataParallel), with no_sync for accumulation."""
    from zerolab.data_parallel import DataParallel
    rank = dist.get_rank()
    model = _build(name, dtype)
    trainable = [p for p in model.parameters() if p.requires_grad]
    if kind == "ddp":
        net = torch.nn.parallel.DistributedDataParallel(model)
    else:
        net = DataParallel(model, bucket_bytes=bucket_bytes if kind == "bucketed" else None)
    opt = torch.optim.AdamW(trainable, lr=LR)
    for step in range(STEPS):
        for k in range(accum):
            x, y = _data(name, step, rank, k, dtype)
            last = k == accum - 1
            ctx = net.no_sync() if not last else torch.enable_grad()
            with ctx:
                loss = net(x, y) / accum
                loss.backward()
                if kind != "ddp":
                    net.finish_gradient_synchronization()
        opt.step()
        opt.zero_grad()          # set_to_none=True: the wrapper must cope with it
    return {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}


def _trained(cluster, kind, name, dtype=torch.float64, accum=1):
    """Every rank's parameters after STEPS steps with ``kind``: a plain loop (:func:`_own_loop`) or
    'engine' (zerolab.initialize, stage 0, in the tests' one engine loop)."""
    if kind == "engine":
        return cluster.run(train, name, STEPS, stage=0, dtype=dtype, micro=accum, no_sync=True, bucket_bytes=2048,
                           **_setup(name))
    return cluster.run(_own_loop, kind, name, dtype, accum)


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_float64_equals_single_process_and_torch_ddp(clusters, world_size, name):
    cluster = clusters(world_size)
    expected = reference(name, world_size, STEPS, **_setup(name))
    ddp = _trained(cluster, "ddp", name)
    assert_params(ddp, expected, "torch DDP vs single process", rtol=1e-10, atol=1e-12)
    for kind in ("naive", "bucketed", "engine"):
        got = _trained(cluster, kind, name)
        assert_params(got, expected, f"{kind} vs single process", rtol=1e-10, atol=1e-12)
        assert_params(got, ddp[0], f"{kind} vs torch DDP", rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_float32_tight(clusters, name):
    expected = reference(name, 2, STEPS, dtype=torch.float32, **_setup(name))
    for kind in ("naive", "bucketed"):
        got = _trained(clusters(2), kind, name, torch.float32)
        assert_params(got, expected, f"{kind} float32 vs single process")   # default fp32 tolerance


@pytest.mark.parametrize("world_size", [2, 4])
def test_gradient_accumulation_no_sync(clusters, world_size):
    for name in ("mlp", "gpt"):
        expected = reference(name, world_size, STEPS, micro=3, **_setup(name))
        for kind in ("naive", "bucketed", "engine"):
            got = _trained(clusters(world_size), kind, name, torch.float64, 3)
            assert_params(got, expected, f"{name} {kind} accum=3", rtol=1e-10, atol=1e-12)


def _one_step_report(name, bucket_bytes):
    """One engine step with a timeline; returns what the step logged and measured."""
    from zerolab import initialize
    from zerolab.timeline import Timeline
    model = _build(name, torch.float32)
    engine = initialize(model, stage=0, lr=LR, bucket_bytes=bucket_bytes)
    engine.timeline = tl = Timeline()
    x, y = _data(name, 0, dist.get_rank(), 0, torch.float32)
    engine.backward(engine(x, y))
    engine.step()
    log = engine.last_step_comm
    spans = tl.collect()
    backward_end = next(s.end for s in spans if s.name == "backward")
    starts = [s.start for s in spans if s.name.startswith("all_reduce bucket")]
    return {"ops": log.by_op(), "sent": log.sent_bytes, "ideal": log.ideal_bytes,
            "measured": log.measured_bytes, "n_buckets": len(engine.ddp.sync.buckets),
            "starts_before_backward_end": [t < backward_end for t in starts],
            "memory": engine.memory_report(), "n_opt_tensors": len(engine.optimizer.state)}


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_bytes_memory_and_overlap(clusters, world_size, name):
    model = _build(name, torch.float32)
    trainable = {id(p): p for p in model.parameters() if p.requires_grad}.values()
    psi = sum(p.numel() for p in trainable)                      # tied weight once, frozen out
    all_params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    for rank, r in enumerate(clusters(world_size).run(_one_step_report, name, 1024)):
        calls, tensor_bytes, _ = r["ops"]["all_reduce"]
        assert set(r["ops"]) == {"all_reduce"}, f"rank {rank}: step used {r['ops']}"
        assert calls == r["n_buckets"] > 1, f"rank {rank}: {calls} all-reduces, {r['n_buckets']} buckets"
        assert tensor_bytes == 4 * psi, f"rank {rank}: all-reduced {tensor_bytes} B, 4 x Ψ = {4 * psi}"
        ring = 2 * (world_size - 1) / world_size * 4 * psi        # 2Ψ(N-1)/N elements x 4 bytes
        assert r["sent"] == pytest.approx(ring) and r["ideal"] == pytest.approx(ring)
        # Real socket bytes: the payload plus gloo's per-message headers, never less than the payload.
        assert ring <= r["measured"] < ring * 1.5 + 20_000 * calls, (rank, r["measured"], ring)
        assert all(r["starts_before_backward_end"]), \
            f"rank {rank}: every bucket must start during backward: {r['starts_before_backward_end']}"
        mem = r["memory"]
        # the ZeRO engines' conventions: trainable params, frozen ones apart, per-element optimizer
        # state only (exp_avg + exp_avg_sq = 8Ψ; Adam's 0-dim step counters are not counted)
        assert mem["params"] == {"cpu": 4 * psi}
        assert mem.get("frozen", {}) == ({"cpu": 4 * (all_params - psi)} if all_params > psi else {})
        assert mem["grads"] == {"cpu": 4 * psi}
        assert mem["optimizer"] == {"cpu": 8 * psi}


def _bf16_result(engine):
    assert all(p.dtype == torch.bfloat16 for p in engine.module.parameters())
    return engine.full_state_dict(), engine.memory_report()


# SGD: an update is lr x grad, often far below bf16's resolution of a weight near 1 (2^-8): only
# the fp32 master keeps it, which is what this test can see.
SGD = dict(_setup("gpt"), optimizer=torch.optim.SGD, lr=0.1)


def test_mixed_precision_bf16(clusters):
    expected = reference("gpt", 2, STEPS, dtype=torch.float32, **SGD)
    start = _build("gpt", torch.float32).state_dict()
    psi = sum(p.numel() for p in _build("gpt", torch.float32).parameters())
    trained = clusters(2).run(train, "gpt", STEPS, stage=0, dtype=torch.float32, param_dtype=torch.bfloat16,
                              finish=_bf16_result, **SGD)
    for rank, (state, mem) in enumerate(trained):
        for n, t in expected.items():   # bf16 compute: close to fp32 training, not equal
            assert state[n].dtype == torch.float32
            # Within 5% of how far fp32 training moved each tensor. LayerNorm weights near 1 move
            # ~6e-5 in 3 steps, far below bf16's spacing there (2^-7): only an fp32 master keeps it.
            moved, err = (t - start[n]).abs().max(), (state[n] - t).abs().max()
            assert err <= 0.05 * moved, f"rank {rank}, {n}: off by {err:.3g}, fp32 moved {moved:.3g}"
        # bf16 params and grads, fp32 master (SGD without momentum keeps no other state)
        assert (mem["params"]["cpu"], mem["grads"]["cpu"], mem["master"]["cpu"]) == (2 * psi, 2 * psi, 4 * psi)
        assert mem["optimizer"] == {}


def _second_backward_raises():
    from zerolab.data_parallel import DataParallel
    model = _build("mlp", torch.float64)
    net = DataParallel(model, bucket_bytes=10**9)          # one bucket: in flight after backward
    x, y = _data("mlp", 0, dist.get_rank(), 0, torch.float64)
    net(x, y).backward()
    try:
        net(x, y).backward()                                # no finish in between
    except RuntimeError as exc:
        message = str(exc)
    else:
        message = None
    net.sync.finish()
    return message


def test_second_backward_into_inflight_bucket_raises(clusters):
    for message in clusters(2).run(_second_backward_raises):
        assert message is not None and "after its bucket 0's all-reduce had started" in message


def _bad_bucket_bytes(value):
    from zerolab.data_parallel import DataParallel
    DataParallel(_build("mlp", torch.float32), bucket_bytes=value)


def test_bad_bucket_bytes_raises_value_error(clusters):
    with pytest.raises(RankError, match=r"bucket_bytes must be a positive int or None .*got -5"):
        clusters(1).run(_bad_bucket_bytes, -5)


def _broadcast_from_rank0():
    from zerolab.data_parallel import DataParallel
    model = models.build("mlp", seed=dist.get_rank())        # different weights on every rank
    model.calls.fill_(7 + dist.get_rank())                     # and a different integer buffer
    DataParallel(model, bucket_bytes=4096)
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_construction_broadcasts_rank0_params_and_buffers(clusters):
    expected = models.build("mlp", seed=0).state_dict()
    expected["calls"] = torch.tensor(7)
    for rank, state in enumerate(clusters(4).run(_broadcast_from_rank0)):
        for k, v in expected.items():
            assert torch.equal(state[k], v), f"rank {rank}: {k} differs from rank 0's"


def _timeline_gather():
    import time as _time

    from zerolab import comm
    from zerolab.timeline import Timeline
    tl = Timeline()
    with tl.span("sleep", "compute"):
        _time.sleep(0.02)
    work = comm.all_reduce(torch.ones(1000), async_op=True)
    tl.mark_async("all_reduce bucket 0", "comm", work)
    work.wait()
    return tl.gather()


def test_timeline_gather_and_plot(clusters):
    import matplotlib
    matplotlib.use("Agg")
    from zerolab.timeline import plot_timeline
    gathered = clusters(2).run(_timeline_gather)
    assert gathered[1] is None and len(gathered[0]) == 2
    for rank, spans in enumerate(gathered[0]):
        assert [s.name for s in spans] == ["sleep", "all_reduce bucket 0"], (rank, spans)
        assert spans[0].seconds >= 0.02 and spans[1].end >= spans[1].start >= spans[0].end
    ax = plot_timeline(gathered[0], title="t")
    assert [t.get_text() for t in ax.get_yticklabels()] == ["rank 1", "rank 0"]


def test_timeline_sub_rows_keep_categories_apart_and_bars_disjoint():
    import matplotlib
    matplotlib.use("Agg")
    from zerolab.timeline import Span, plot_timeline
    spans = [Span("F 0", "compute", 0.0, 0.010), Span("AG 1", "comm", 0.002, 0.005),
             Span("AG 2", "comm", 0.004, 0.008), Span("w 2", "wait", 0.009, 0.010)]
    ax = plot_timeline([spans], sub_rows=["compute", "comm"])
    bars = []                                       # (y bottom, x start, x end) of every bar drawn
    for coll in ax.collections:
        for path in coll.get_paths():
            (x0, y0), (x1, _) = path.vertices.min(axis=0), path.vertices.max(axis=0)
            bars.append((round(y0, 6), x0, x1))
    assert len(bars) == 4
    rows = sorted({y for y, _, _ in bars}, reverse=True)           # top to bottom
    assert len(rows) == 4                                           # compute, comm x 2 (they overlap), wait
    row_of = {(round(x0, 3), round(x1, 3)): rows.index(y) for y, x0, x1 in bars}
    assert row_of[(0.0, 10.0)] == 0 and {row_of[(2.0, 5.0)], row_of[(4.0, 8.0)]} == {1, 2}
    assert row_of[(9.0, 10.0)] == 3
    for y in rows:                                                  # no two bars of one sub-row overlap
        xs = sorted((x0, x1) for yy, x0, x1 in bars if yy == y)
        assert all(a[1] <= b[0] + 1e-9 for a, b in zip(xs, xs[1:])), xs


def _async_reduce_scatter_span():
    import torch
    from zerolab import comm
    from zerolab.timeline import Timeline
    tl = Timeline()
    x, out = torch.ones(4 * 1024), torch.empty(2 * 1024)
    with comm.log(timeline=tl):
        work = comm.reduce_scatter(out, x, async_op=True, tag="bucket 0")   # gloo: a Work without a future
        work.wait()
    return [(s.name, s.category, s.end >= s.start) for s in tl.collect()], out[0].item()


def test_timeline_records_an_async_collective_without_a_future(clusters):
    for spans, value in clusters(2).run(_async_reduce_scatter_span):
        assert ("reduce_scatter bucket 0", "comm", True) in spans, spans
        assert value == 2.0

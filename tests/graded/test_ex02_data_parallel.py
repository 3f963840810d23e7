"""Graded: exercise 02, bucketed data-parallel gradient sync and torch DDP's buckets measured.
Besides the values (the mean over ranks of every rank's gradient, recomputed in one process in
float64): gradients are views into the buckets, frozen parameters are left alone, a tied weight is
reduced once; one all-reduce per bucket, each started asynchronously from inside backward (calls
recorded); the bytes on the wire are the ring's 2(N-1)/N x Ψ; no communication under no_sync and
the accumulated sum synchronised after (two backward passes before a step). The DDP measurement is
compared with the grader's own, through the same hook DDP offers."""
import pytest
import torch
import torch.distributed as dist

from zerolab import comm, models
from zerolab.grade.helpers import assert_close, exercise_module, record_collectives

# The reference implementation of this exercise: a submission that uses it scores 0
# (checked before and while the tests run, by zerolab.grade.references).
REFERENCE_MODULES = ["zerolab.data_parallel", "zerolab.DataParallel", "zerolab.zero0", "zerolab.stages",
                     "zerolab.initialize"]
REFERENCE_ALLOWED = [  # offered by the exercise
    "zerolab.data_parallel.Bucket",
    "zerolab.data_parallel.assign_buckets",
]

GPT = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=2, seq_len=16)


def _model(name, seed=0):
    return models.build(name, seed=seed, dtype=torch.float64, **(GPT if name == "gpt" else {}))


def _batch(name, model, rank, step=0):
    return models.batch(name, seed=100 * step + rank, batch_size=3, model=model, dtype=torch.float64)


def _mean_grads(name, step=0):
    """Independent reference, no communication: the mean over ranks of each rank's gradient,
    every rank's batch recomputed here in one process."""
    model, n = _model(name), dist.get_world_size()
    total = {}
    for r in range(n):
        model.zero_grad()
        model(*_batch(name, model, r, step)).backward()
        for pname, p in model.named_parameters():
            if p.grad is not None:
                total[pname] = total.get(pname, 0) + p.grad / n
    return total


def _check_grads(name, model, expected, what):
    for pname, p in model.named_parameters():
        if not p.requires_grad:
            assert p.grad is None, f"rank {dist.get_rank()}: {what}: frozen {pname} got a gradient"
            continue
        assert p.grad is not None, f"rank {dist.get_rank()}: {what}: {pname}.grad is None"
        assert_close(p.grad, expected[pname], f"{what}: {pname}.grad (mean over ranks)",
                     rtol=1e-10, atol=1e-12)


def check_bucketed_values(name):
    ex = exercise_module("ex02_data_parallel")
    rank = dist.get_rank()
    model = _model(name)
    sync = ex.BucketedAverager(model, bucket_bytes=4096)
    for step in range(2):                                     # the second step reuses the hooks
        model.zero_grad(set_to_none=False)
        model(*_batch(name, model, rank, step)).backward()
        sync.finish()
        _check_grads(name, model, _mean_grads(name, step), f"BucketedAverager on {name}, step {step}")


def check_bucketed_overlap_and_bytes():
    from zerolab.data_parallel import assign_buckets
    from zerolab.flat import unique_trainable
    ex = exercise_module("ex02_data_parallel")
    rank, n = dist.get_rank(), dist.get_world_size()
    model = _model("gpt")                    # tied weights: the embedding is also the output layer
    bucket_bytes = 8192
    buckets = assign_buckets(unique_trainable(model.parameters()), bucket_bytes)
    sync = ex.BucketedAverager(model, bucket_bytes=bucket_bytes)
    views = [n_ for n_, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert not views, f"rank {rank}: after construction {views[:3]} have no .grad: make each a view into its bucket"
    loss = model(*_batch("gpt", model, rank))
    with comm.log() as log, record_collectives() as calls:
        loss.backward()
        sync.finish()
    ops = [c for c in calls if c["op"] == "all_reduce"]
    assert len(ops) == len(buckets) == len(calls), (
        f"rank {rank}: {[c['op'] for c in calls]}: expected one all-reduce per bucket ({len(buckets)} buckets), "
        f"not one per parameter")
    late = [c["seq"] for c in ops if not c["in_backward"]]
    assert not late, (f"rank {rank}: all-reduces {late} of {len(ops)} started AFTER backward returned: each "
                      f"bucket must start from a hook during backward")
    blocking = [c["seq"] for c in ops if not c["async"]]
    assert not blocking, (f"rank {rank}: all-reduces {blocking} were blocking: start them with async_op=True "
                          f"so backward keeps computing while they run")
    assert sorted(c["bytes"] for c in ops) == sorted(sum(p.numel() for p in b) * 8 for b in buckets), (
        f"rank {rank}: all-reduced {sorted(c['bytes'] for c in ops)} bytes; the buckets hold "
        f"{sorted(sum(p.numel() for p in b) * 8 for b in buckets)} (every gradient once, the tied weight once)")
    psi = sum(p.numel() for p in unique_trainable(model.parameters()))
    ring = 2 * (n - 1) / n * 8 * psi
    assert log.sent_bytes == pytest.approx(ring), (f"rank {rank}: sent {log.sent_bytes:.0f} bytes, the ring "
                                                   f"all-reduce sends 2(N-1)/N x Ψ x 8 = {ring:.0f}")


def check_accumulation(name):
    ex = exercise_module("ex02_data_parallel")
    rank, n = dist.get_rank(), dist.get_world_size()
    model = _model(name)
    sync = ex.BucketedAverager(model, bucket_bytes=4096)
    with record_collectives() as local:
        with sync.no_sync():
            model(*_batch(name, model, rank, 0)).backward()       # micro-batch 0: accumulate only
    assert not local, (f"rank {rank}: a backward inside no_sync() started {[c['op'] for c in local]}: under "
                       f"no_sync gradients only accumulate locally")
    with record_collectives() as synced:
        model(*_batch(name, model, rank, 1)).backward()           # micro-batch 1: synchronise the sum
        sync.finish()
    want = len(sync_buckets(model))
    assert len(synced) == want, (f"rank {rank}: the synchronising backward started {len(synced)} collectives; "
                                 f"one all-reduce per bucket ({want}) carries both micro-batches' gradients")
    m0, m1 = _mean_grads(name, 0), _mean_grads(name, 1)
    _check_grads(name, model, {k: m0[k] + m1[k] for k in m0}, f"{name}: two micro-batches (no_sync, then sync)")


def sync_buckets(model):
    from zerolab.data_parallel import assign_buckets
    from zerolab.flat import unique_trainable
    return assign_buckets(unique_trainable(model.parameters()), 4096)


def _ddp_batches(model, rank):
    return [models.batch("gpt", seed=10 * i + rank, batch_size=2, model=model) for i in range(3)]


def measure_ddp(cap):
    """The grader's own measurement: DDP's comm hook sees every bucket it reduces."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    ex = exercise_module("ex02_data_parallel")
    rank = dist.get_rank()
    theirs = ex.ddp_bucket_bytes(models.build("gpt", seed=0), _ddp_batches(models.build("gpt", seed=0), rank), cap)
    model = models.build("gpt", seed=0)
    ddp, seen, ours = DDP(model, bucket_cap_mb=cap), [], []

    def hook(state, bucket):
        seen.append(bucket.buffer().numel() * bucket.buffer().element_size())
        return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda f: f.value()[0])

    ddp.register_comm_hook(None, hook)
    for x, y in _ddp_batches(model, rank):
        seen.clear()
        ddp(x, y).backward()
        ours.append(list(seen))
    return [list(map(int, it)) for it in theirs], ours


@pytest.mark.points(3)
@pytest.mark.parametrize("world_size", [2, 3])
def test_bucketed_gradients_are_averaged(on_ranks, world_size):
    """values: .grad holds the mean over the ranks, two steps, mlp and gpt"""
    for name in ("mlp", "gpt"):
        on_ranks(world_size, check_bucketed_values, name)


@pytest.mark.points(3)
def test_one_async_all_reduce_per_bucket_during_backward(on_ranks):
    """overlap and bytes: one asynchronous all-reduce per bucket, started inside backward"""
    on_ranks(2, check_bucketed_overlap_and_bytes)


@pytest.mark.points(2)
@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_gradient_accumulation_with_no_sync(on_ranks, name):
    """gradient accumulation: no communication under no_sync, one all-reduce per bucket after"""
    on_ranks(2, check_accumulation, name)


@pytest.mark.points(2)
def test_ddp_buckets_measured(on_ranks):
    """measured: the buckets torch's DDP reduces, iteration by iteration"""
    for rank, (theirs, ours) in enumerate(on_ranks(2, measure_ddp, 0.1)):
        assert theirs == ours, (f"rank {rank}: ddp_bucket_bytes = {theirs}; DDP's communication hook saw "
                                f"buckets of {ours} bytes, iteration by iteration")

"""Graded: exercise 02, data-parallel gradient sync. Besides the values, the properties taught:
gradients are AVERAGED (not summed, not left local, not the weights), frozen parameters are left
alone, tied weights are reduced once, buckets start DURING backward and asynchronously, one
all-reduce per bucket, and the bytes on the wire are the ring's 2(N-1)/N x Ψ."""
import time

import pytest
import torch
import torch.distributed as dist

from zerolab import comm, models
from zerolab.grade.helpers import assert_close, exercise_module

# The reference implementation of this exercise: a submission that uses it scores 0
# (checked before and while the tests run, by zerolab.grade.references).
REFERENCE_MODULES = ["zerolab.data_parallel", "zerolab.DataParallel"]
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


def check_broadcast():
    ex = exercise_module("ex02_data_parallel")
    model = models.build("mlp", seed=dist.get_rank())            # different on every rank
    model.calls.fill_(5 + dist.get_rank())
    ex.broadcast_parameters(model)
    expected = models.build("mlp", seed=0).state_dict()
    expected["calls"] = torch.tensor(5)
    for k, v in model.state_dict().items():
        assert_close(v, expected[k], f"{k} after broadcast_parameters (rank 0's value)", rtol=0, atol=0)


def check_naive():
    ex = exercise_module("ex02_data_parallel")
    rank = dist.get_rank()
    for name in ("mlp", "gpt"):
        model = _model(name)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        model(*_batch(name, model, rank)).backward()
        ex.average_gradients(model)
        _check_grads(name, model, _mean_grads(name), f"average_gradients on {name}")
        for k, v in model.state_dict().items():
            assert_close(v, before[k], f"{k}: average_gradients must not change the weights", rtol=0, atol=0)


def check_bucketed_values():
    ex = exercise_module("ex02_data_parallel")
    rank = dist.get_rank()
    for name in ("mlp", "gpt"):
        model = _model(name)
        sync = ex.BucketedAverager(model, bucket_bytes=4096)
        for step in range(2):                                     # the second step reuses the hooks
            model.zero_grad(set_to_none=False)
            model(*_batch(name, model, rank, step)).backward()
            sync.finish()
            _check_grads(name, model, _mean_grads(name, step), f"BucketedAverager on {name}, step {step}")


def check_bucketed_overlap():
    """Record when each all-reduce is called (torch's, whatever wrapper calls it) against the
    moment backward returns."""
    from zerolab.data_parallel import assign_buckets
    from zerolab.flat import unique_trainable
    ex = exercise_module("ex02_data_parallel")
    model = _model("gpt")
    bucket_bytes = 8192
    n_buckets = len(assign_buckets(unique_trainable(model.parameters()), bucket_bytes))
    sync = ex.BucketedAverager(model, bucket_bytes=bucket_bytes)
    calls, real = [], dist.all_reduce

    def spy(tensor, *args, **kwargs):
        calls.append((time.perf_counter(), kwargs.get("async_op", False), tensor.numel()))
        return real(tensor, *args, **kwargs)

    dist.all_reduce = spy
    try:
        model(*_batch("gpt", model, dist.get_rank())).backward()
        backward_end = time.perf_counter()
        sync.finish()
    finally:
        dist.all_reduce = real
    rank = dist.get_rank()
    assert len(calls) == n_buckets, (f"rank {rank}: {len(calls)} all-reduces for {n_buckets} buckets "
                                     f"(one per bucket, not one per parameter)")
    late = [i for i, (t, _, _) in enumerate(calls) if t > backward_end]
    assert not late, (f"rank {rank}: all-reduces {late} of {len(calls)} started AFTER backward "
                      f"returned: each bucket must start from a hook during backward")
    blocking = [i for i, (_, is_async, _) in enumerate(calls) if not is_async]
    assert not blocking, (f"rank {rank}: all-reduces {blocking} were blocking: start them with "
                          f"async_op=True so backward keeps computing while they run")


def check_bucketed_bytes():
    ex = exercise_module("ex02_data_parallel")
    n, rank = dist.get_world_size(), dist.get_rank()
    model = _model("gpt")                    # tied weights: the embedding is also the output layer
    psi = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    sync = ex.BucketedAverager(model, bucket_bytes=4096)
    with comm.log() as log:
        model(*_batch("gpt", model, rank)).backward()
        sync.finish()
    reduced = sum(r.tensor_bytes for r in log.records if r.op == "all_reduce")
    assert reduced == 8 * psi, (f"rank {rank}: all-reduced {reduced} bytes through zerolab.comm; every "
                                f"gradient element once (tied weight once) is Ψ x 8 = {8 * psi}")
    ring = 2 * (n - 1) / n * 8 * psi
    assert log.sent_bytes == pytest.approx(ring), (f"rank {rank}: sent {log.sent_bytes:.0f} bytes, the "
                                                   f"ring all-reduce sends 2(N-1)/N x Ψ x 8 = {ring:.0f}")


@pytest.mark.points(1)
@pytest.mark.parametrize("world_size", [2, 3])
def test_broadcast_parameters(on_ranks, world_size):
    on_ranks(world_size, check_broadcast)


@pytest.mark.points(3)
@pytest.mark.parametrize("world_size", [2, 3])
def test_naive_gradients_are_averaged(on_ranks, world_size):
    on_ranks(world_size, check_naive)


@pytest.mark.points(3)
@pytest.mark.parametrize("world_size", [2, 3])
def test_bucketed_gradients_are_averaged(on_ranks, world_size):
    on_ranks(world_size, check_bucketed_values)


@pytest.mark.points(3)
def test_bucketed_all_reduces_start_during_backward(on_ranks):
    on_ranks(2, check_bucketed_overlap)


@pytest.mark.points(2)
@pytest.mark.parametrize("world_size", [2, 3])
def test_bucketed_bytes_on_the_wire(on_ranks, world_size):
    on_ranks(world_size, check_bucketed_bytes)

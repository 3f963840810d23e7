"""Graded: exercise 04, ZeRO-2 gradient buckets. Properties checked besides the values: every
bucket's reduce-scatter is launched DURING backward (from the hook, not after), and once backward
is finished no full-size gradient is left anywhere (no param.grad, no bucket buffer): only the
1/N gradient shards."""
import gc

import pytest
import torch
import torch.distributed as dist

from zerolab import models
from zerolab.grade.helpers import assert_close, exercise_module, record_collectives

# The reference implementation of this exercise: a submission that uses it scores 0
# (checked before and while the tests run, by zerolab.grade.references).
REFERENCE_MODULES = ["zerolab.zero2"]
REFERENCE_ALLOWED = ["zerolab.zero2.make_buckets"]  # used by the given code

BUCKET_BYTES = 40000  # TinyGPT in float64: about 24 buckets


def _setup():
    ex = exercise_module("ex04_zero2")
    model = models.build("gpt", seed=0, dtype=torch.float64)
    grads = ex.Zero2Gradients(model.parameters(), bucket_bytes=BUCKET_BYTES)
    x, y = models.batch("gpt", seed=dist.get_rank(), batch_size=4, model=model)
    return model, grads, x, y


def check_grad_shards():
    n, rank = dist.get_world_size(), dist.get_rank()
    model, grads, x, y = _setup()
    model(x, y).backward()
    grads.finish()
    # Reference: plain autograd on a copy, gradients averaged with torch's own all_reduce.
    ref = models.build("gpt", seed=0, dtype=torch.float64)
    ref(x, y).backward()
    ref_grad = {}
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        dist.all_reduce(q.grad)
        ref_grad[id(p)] = q.grad / n
    names = {id(p): name for name, p in model.named_parameters()}
    for i, bucket in enumerate(grads.buckets):
        expected = bucket.shard_from([ref_grad[id(p)] for p in bucket.params])
        assert_close(grads.grad_shards[i], expected, f"gradient shard of bucket {i} "
                     f"({', '.join(names[id(p)] for p in bucket.params)[:80]})", rtol=1e-10, atol=1e-13)


def check_during_backward():
    rank = dist.get_rank()
    model, grads, x, y = _setup()
    loss = model(x, y)
    with record_collectives() as in_backward:
        loss.backward()
    with record_collectives() as in_finish:
        grads.finish()
    rs = [c for c in in_backward if c["op"] == "reduce_scatter"]
    assert len(rs) == len(grads.buckets) and all(c["in_backward"] for c in rs), (
        f"rank {rank}: {len(rs)} reduce-scatters launched inside backward (expected one per bucket, "
        f"{len(grads.buckets)}, each from the hook when its bucket's last gradient arrives)")
    started = [c["op"] for c in in_finish]
    assert not started, f"rank {rank}: finish() started collectives {started}: it should only wait"


def _live_storages():
    out = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor):
            st = obj.untyped_storage()
            out[st.data_ptr()] = st.nbytes()
    return out


def check_no_full_gradient():
    rank = dist.get_rank()
    model, grads, x, y = _setup()
    gc.collect()
    before = _live_storages()
    model(x, y).backward()
    grads.finish()
    gc.collect()
    kept = [name for name, p in model.named_parameters() if p.grad is not None]
    assert not kept, f"rank {rank}: after backward these parameters still hold a full .grad: {kept[:5]}"
    new = {ptr: b for ptr, b in _live_storages().items() if ptr not in before}
    smallest = min(b.padded_numel for b in grads.buckets) * 8
    assert sum(new.values()) < smallest, (
        f"rank {rank}: backward + finish() left {sum(new.values())} bytes of new tensors alive "
        f"(sizes {sorted(new.values(), reverse=True)[:5]}); the smallest full-size bucket is {smallest} "
        f"bytes: free the full-size buffers, only the pre-allocated grad_shards may hold gradients")


@pytest.mark.points(2)
@pytest.mark.parametrize("world_size", [2, 3])
def test_grad_shards_equal_the_average(on_ranks, world_size):
    on_ranks(world_size, check_grad_shards)


@pytest.mark.points(2)
@pytest.mark.parametrize("world_size", [2, 3])
def test_reduce_scatter_launched_during_backward(on_ranks, world_size):
    on_ranks(world_size, check_during_backward)


@pytest.mark.points(2)
@pytest.mark.parametrize("world_size", [2, 3])
def test_no_full_gradient_after_backward(on_ranks, world_size):
    on_ranks(world_size, check_no_full_gradient)

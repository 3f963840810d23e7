"""Graded: exercise 05, ZeRO-3's gather / free hooks, plugged into the real engine (``ops=``).
Properties checked besides the trained values: at rest and after each unit's forward no full
parameter is left (only 1/N shards); a unit is gathered right before its forward and its backward
and nowhere else; gradients end up reduce-scattered, each rank holding exactly its own slice."""
import pytest
import torch
import torch.distributed as dist

from zerolab import comm, models
from zerolab.grade.helpers import assert_close, exercise_module

# The reference implementation of this exercise: a submission that uses it scores 0
# (checked before and while the tests run, by zerolab.grade.references).
REFERENCE_MODULES = ["zerolab.zero3"]

GPT = dict(vocab_size=64, d_model=32, n_layers=3, n_heads=2, seq_len=16)


def _build(name="gpt", dtype=torch.float64):
    return models.build(name, seed=0, dtype=dtype, **(GPT if name == "gpt" else {}))


def _engine(model, **kw):
    from zerolab import initialize
    return initialize(model, stage=3, lr=1e-2, ops=exercise_module("ex05_zero3"), **kw)


def _live(engine):
    return sorted(u.name for u in engine.units if u.full.untyped_storage().nbytes())


def check_gather_and_free():
    rank = dist.get_rank()
    model = _build()
    engine = _engine(model)
    assert _live(engine) == [], f"rank {rank}: at rest these units still hold full parameters: {_live(engine)}"
    ex = exercise_module("ex05_zero3")
    ref = dict(_build().named_parameters())
    names = {id(p): n for n, p in model.named_parameters()}
    for u in engine.units:
        work = ex.gather(u, group=None, async_op=False)
        if work is not None:
            work.wait()
        assert u.full.untyped_storage().nbytes() == u.full.numel() * u.full.element_size(), \
            f"rank {rank}: gather({u.name}) left unit.full with {u.full.untyped_storage().nbytes()} bytes"
        for p in u.flat.params:           # the parameters (views into unit.full) are the full values
            assert_close(p.detach(), ref[names[id(p)]].detach(), f"{names[id(p)]} after gather({u.name})")
        ex.free(u)
        assert u.full.untyped_storage().nbytes() == 0, f"rank {rank}: free({u.name}) kept the storage"
        assert all(p.untyped_storage().nbytes() == 0 for p in u.flat.params), \
            f"rank {rank}: after free({u.name}) a parameter still points at memory (rebound instead of freed?)"


def check_just_in_time():
    rank = dist.get_rank()
    model = _build()
    engine = _engine(model, prefetch=False)
    seen = []
    for i, block in enumerate(model.blocks):
        # registered after the engine's hooks: they see the state right after gather / free
        block.register_forward_pre_hook(lambda m, a, i=i: seen.append(("before forward", i, _live(engine))))
        block.register_forward_hook(lambda m, a, o, i=i: seen.append(("after forward", i, _live(engine))))
        block.fc.weight.register_hook(lambda g, i=i: seen.append(("during backward", i, _live(engine))))
    x, y = models.batch("gpt", seed=rank, batch_size=4, model=model)
    engine.backward(engine(x, y))
    for when, i, live in seen:
        want = ["root"] + ([] if when == "after forward" else [f"blocks.{i}"])
        assert live == sorted(want), f"rank {rank}: {when} blocks.{i}, gathered units are {live}, expected {want}"
    assert len(seen) == 3 * len(model.blocks), f"rank {rank}: hooks fired {len(seen)} times"
    assert _live(engine) == [], f"rank {rank}: after backward still gathered: {_live(engine)}"


def check_grads_to_owners():
    n, rank = dist.get_world_size(), dist.get_rank()
    model = _build()
    engine = _engine(model)
    x, y = models.batch("gpt", seed=rank, batch_size=4, model=model)
    loss = engine(x, y)
    with comm.log() as log:
        engine.backward(loss)
    # Reference: plain autograd on the global batch in this process, no engine.
    ref = _build()
    parts = [models.batch("gpt", seed=r, batch_size=4, model=ref) for r in range(n)]
    for xr, yr in parts:
        (ref(xr, yr) / n).backward()
    grads = {n_: p.grad for n_, p in ref.named_parameters()}
    names = {id(p): n_ for n_, p in model.named_parameters()}
    for u in engine.units:
        expected = u.flat.shard_from([grads[names[id(p)]] for p in u.flat.params])
        assert_close(engine.grad_shards[u.index], expected, f"gradient shard of unit {u.name}",
                     rtol=1e-10, atol=1e-13)
    rs = [r.tensor_bytes for r in log.records if r.op == "reduce_scatter"]
    want = sorted(u.flat.padded_numel * 8 for u in engine.units)
    assert sorted(rs) == want, f"rank {rank}: reduce-scatters of {sorted(rs)} bytes, expected one per unit {want}"
    kept = [names[id(p)] for p in model.parameters() if p.grad is not None]
    assert not kept, f"rank {rank}: full-size .grad left on {kept[:4]}"


def check_training(name):
    n, rank = dist.get_world_size(), dist.get_rank()
    model = _build(name)
    engine = _engine(model)
    ref = _build(name)
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    for step in range(2):
        batches = [models.batch(name, seed=100 * step + r, batch_size=4, model=ref, dtype=torch.float64)
                   for r in range(n)]
        engine.backward(engine(*batches[rank]))
        engine.step()
        engine.zero_grad()
        opt.zero_grad()
        ref(torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])).backward()
        opt.step()
    state = engine.full_state_dict()
    for n_, p in ref.named_parameters():
        assert_close(state[n_], p.detach(), f"{name} parameter {n_} after 2 steps", rtol=1e-10, atol=1e-12)


# One world size, 3 (padding is real: no unit divides by 3), so grading starts one set of ranks.
@pytest.mark.points(3)
def test_gather_and_free(on_ranks):
    on_ranks(3, check_gather_and_free)


@pytest.mark.points(3)
def test_gathered_just_in_time(on_ranks):
    on_ranks(3, check_just_in_time)


@pytest.mark.points(3)
def test_gradients_reduce_scattered_to_owners(on_ranks):
    on_ranks(3, check_grads_to_owners)


@pytest.mark.points(2)
@pytest.mark.parametrize("name", ["gpt", "mlp"])
def test_training_equals_one_process(on_ranks, name):
    on_ranks(3, check_training, name)

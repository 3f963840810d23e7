"""Graded: exercise 04, DeepSpeed's ZeRO-2 layout. Properties checked besides the values (against
the mean of every rank's gradient recomputed in this process, float64): each bucket's slices are
reduced to their owners, asynchronously, from inside backward, one reduce per (bucket, owner) and
nothing else on the wire (calls recorded, bytes counted on the sockets); no more than two buckets of
full-size gradients are alive at any moment of backward (a census of live tensors taken after every
gradient hook); gradient accumulation over two backward passes."""
import pytest
import torch
import torch.distributed as dist

from zerolab import comm, models
from zerolab.flat import unique_trainable
from zerolab.grade.helpers import assert_close, exercise_module, live_storages, new_bytes, record_collectives
from zerolab.zero2 import make_buckets

# The reference implementation of this exercise: a submission that uses it scores 0
# (checked before and while the tests run, by zerolab.grade.references).
REFERENCE_MODULES = ["zerolab.zero2", "zerolab.stages", "zerolab.initialize",
                     "zerolab.plots.zero2_layouts"]   # lesson 04's layouts: counts 04.2's pieces
REFERENCE_ALLOWED = ["zerolab.zero2.make_buckets"]  # the buckets of the contract

N = 3                      # padding is real: no bucket boundary falls on a multiple of 3 by design
BUCKET_BYTES = 16000       # float64: 2000 elements; a 4096-element weight gets a bucket of its own
GPT = dict(vocab_size=64, d_model=32, n_layers=4, n_heads=2, seq_len=16)


def _model(name="gpt"):
    return models.build(name, seed=0, dtype=torch.float64, **(GPT if name == "gpt" else {}))


def _batch(name, model, rank, micro=0):
    return models.batch(name, seed=100 * micro + rank, batch_size=3, model=model, dtype=torch.float64)


def _expected_shard(name, micro_batches):
    """This rank's partition of the mean over ranks of the gradients summed over micro-batches,
    recomputed in this process from every rank's batches (no communication)."""
    model, n, rank = _model(name), dist.get_world_size(), dist.get_rank()
    for r in range(n):
        for m in range(micro_batches):
            (model(*_batch(name, model, r, m)) / n).backward()
    flat = torch.cat([p.grad.reshape(-1) for p in unique_trainable(model.parameters())])
    s = -(-flat.numel() // n)
    flat = torch.cat([flat, flat.new_zeros(s * n - flat.numel())])
    return flat[rank * s:(rank + 1) * s]


def _owners(params, world_size):
    """Expected (owner, bytes) of every reduce: each bucket's intersection with each partition."""
    offsets, start = {}, 0
    for p in params:
        offsets[id(p)], start = start, start + p.numel()
    s = -(-start // world_size)
    out = []
    for ps in make_buckets(params[::-1], BUCKET_BYTES, params[0].dtype):
        lo, hi = min(offsets[id(p)] for p in ps), max(offsets[id(p)] + p.numel() for p in ps)
        for q in range(world_size):
            a, z = max(lo, q * s), min(hi, (q + 1) * s)
            if a < z:
                out.append((q, (z - a) * params[0].element_size()))
    return sorted(out)


def check_values(name):
    ex = exercise_module("ex04_zero2")
    model = _model(name)
    grads = ex.Zero2Gradients(model.parameters(), bucket_bytes=BUCKET_BYTES)
    model(*_batch(name, model, dist.get_rank())).backward()
    grads.finish()
    assert_close(grads.grad_shard, _expected_shard(name, 1), f"{name}: grad_shard after one backward",
                 rtol=1e-10, atol=1e-13)
    kept = [n for n, p in model.named_parameters() if p.grad is not None]
    assert not kept, f"rank {dist.get_rank()}: after finish() these parameters still hold a .grad: {kept[:4]}"


def check_accumulation():
    ex = exercise_module("ex04_zero2")
    model = _model()
    grads = ex.Zero2Gradients(model.parameters(), bucket_bytes=BUCKET_BYTES)
    for micro in range(2):                       # two backward passes before the step
        model(*_batch("gpt", model, dist.get_rank(), micro)).backward()
        grads.finish()
    assert_close(grads.grad_shard, _expected_shard("gpt", 2),
                 "grad_shard after two micro-batches (the average of their summed gradients)",
                 rtol=1e-10, atol=1e-13)
    grads.zero_grad()
    model(*_batch("gpt", model, dist.get_rank(), 0)).backward()
    grads.finish()
    assert_close(grads.grad_shard, _expected_shard("gpt", 1), "grad_shard after zero_grad() and one more "
                 "backward", rtol=1e-10, atol=1e-13)


def check_communication():
    ex = exercise_module("ex04_zero2")
    rank, n = dist.get_rank(), dist.get_world_size()
    model = _model()
    grads = ex.Zero2Gradients(model.parameters(), bucket_bytes=BUCKET_BYTES)
    loss = model(*_batch("gpt", model, rank))
    dist.barrier()
    with comm.log() as log, record_collectives() as calls:
        loss.backward()
        grads.finish()
    ops = sorted({c["op"] for c in calls})
    assert ops == ["reduce"], (f"rank {rank}: backward + finish() called {ops}: DeepSpeed's stage 2 uses only "
                               f"reduce (each slice to its owner), no all-reduce, reduce-scatter or broadcast")
    late = [c["seq"] for c in calls if not c["in_backward"]]
    assert not late, (f"rank {rank}: reduces {late} of {len(calls)} were started after backward returned: "
                      f"start each bucket's reduces from inside backward, when its last gradient arrives")
    blocking = [c["seq"] for c in calls if not c["async"]]
    assert not blocking, (f"rank {rank}: reduces {blocking} were blocking (no async_op=True): backward "
                          f"would wait for each one instead of computing the next layers meanwhile")
    got = sorted((c["peer"], c["bytes"]) for c in calls)
    want = _owners(unique_trainable(model.parameters()), n)
    assert got == want, (f"rank {rank}: {len(got)} reduces (owner, bytes) {got[:6]}...; expected one per "
                         f"(bucket, owner), {len(want)}: {want[:6]}...")
    psi_bytes = sum(p.numel() for p in unique_trainable(model.parameters())) * 8
    if log.measured_bytes is not None:        # what the sockets carried: about Ψ, never N x Ψ
        assert log.measured_bytes <= 1.15 * psi_bytes + 65536, (
            f"rank {rank}: the sockets carried {log.measured_bytes} bytes for {psi_bytes} bytes of gradients: "
            f"each element is reduced once, which sends about its bytes once")
    return len(calls)


def _storage(t):
    st = t.untyped_storage()
    return (st.device.type, st.device.index, st.data_ptr())


def check_peak_memory():
    ex = exercise_module("ex04_zero2")
    rank = dist.get_rank()
    model = _model()
    params = unique_trainable(model.parameters())
    hold = []                                 # keeps the census's storages alive: no address reuse
    before = live_storages(hold)              # the model, before the exercise allocates anything
    grads = ex.Zero2Gradients(model.parameters(), bucket_bytes=BUCKET_BYTES)
    constructed = live_storages()
    peak, moments = [0], [0]
    buckets = make_buckets(params[::-1], BUCKET_BYTES, torch.float64)
    largest = max(sum(p.numel() for p in ps) for ps in buckets) * 8
    psi = sum(p.numel() for p in params) * 8
    bound = 2 * largest + max(p.numel() for p in params) * 8 + 1024

    def census(p):                            # runs after the exercise's hooks for p (registered later)
        peak[0] = max(peak[0], new_bytes(baseline, [q.grad for q in params], settle_to=bound, settle_s=0.2))
        moments[0] += 1

    for p in params:
        p.register_post_accumulate_grad_hook(census)
    loss = model(*_batch("gpt", model, rank))
    # Not gradients: the parameters' flat buffer, grad_shard, and what the forward created. Whatever
    # else the exercise allocated, in its constructor or later, counts.
    baseline = dict(before)
    baseline.update({k: v for k, v in live_storages().items() if k not in constructed})
    baseline.update({_storage(grads.flat.data): 0, _storage(grads.grad_shard): 0})
    loss.backward()
    grads.finish()
    after = new_bytes(baseline, [q.grad for q in params], settle_to=1024)
    assert moments[0] == len(params), f"rank {rank}: grader: {moments[0]} gradient hooks ran for {len(params)} params"
    assert peak[0] <= bound, (
        f"rank {rank}: during backward up to {peak[0]} bytes of gradient buffers were alive (all gradients: "
        f"{psi}); two buckets of full-size gradients and the gradient autograd hands over are at most {bound}: "
        f"free a bucket's buffer once its reduces completed, before a third bucket fills")
    assert after <= 1024, (f"rank {rank}: after finish() {after} bytes of gradient buffers are still alive: free "
                           f"every full-size gradient buffer; only grad_shard may hold gradients")


@pytest.mark.points(2)
@pytest.mark.parametrize("name", ["gpt", "mlp"])
def test_grad_shard_is_the_average(on_ranks, name):
    """values: grad_shard is this rank's partition of the averaged gradients"""
    on_ranks(N, check_values, name)


@pytest.mark.points(2)
def test_gradient_accumulation(on_ranks):
    """gradient accumulation: two backward passes add up in grad_shard"""
    on_ranks(N, check_accumulation)


@pytest.mark.points(3)
def test_each_slice_reduced_to_its_owner_during_backward(on_ranks):
    """bytes and overlap: one async reduce per (bucket, owner), from inside backward"""
    on_ranks(N, check_communication)


@pytest.mark.points(3)
def test_at_most_two_buckets_alive_during_backward(on_ranks):
    """memory: at most two buckets of full-size gradients during backward, none after"""
    on_ranks(N, check_peak_memory)


@pytest.mark.points(2)
def test_reduce_calls_derived():
    """derived: reduce calls per backward, by hand and on TinyGPT's buckets"""
    ex = exercise_module("ex04_zero2")
    cases = [([10], 2, 2), ([4, 4], 2, 2), ([3, 5], 2, 3), ([1, 1, 1, 1], 4, 4), ([5, 2], 3, 4),
             ([7], 4, 4), ([2, 2, 2], 3, 3), ([9, 1], 3, 4), ([1], 3, 1)]
    for numels, n, want in cases:
        got = ex.reduce_calls(numels, n)
        assert got == want, f"reduce_calls({numels}, world_size={n}) = {got}; by hand: {want}"
    params = unique_trainable(_model().parameters())
    sizes = [sum(p.numel() for p in ps) for ps in make_buckets(params[::-1], BUCKET_BYTES, torch.float64)]
    for n in (2, 3, 4, 8):
        want = len(_owners(params, n))
        got = ex.reduce_calls(sizes[::-1], n)
        assert got == want, (f"reduce_calls(TinyGPT's {len(sizes)} buckets, {n}) = {got}; the layout has "
                             f"{want} (bucket, owner) pairs")

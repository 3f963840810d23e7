"""Graded: exercise 04, DeepSpeed's ZeRO-2 layout. The submission runs in probes (its own ranks) that
report plain data; every verdict is decided here. Values: ``grad_shard`` against the mean of every
rank's gradients recomputed here (float64), with gradient accumulation and a layer no forward uses.
Bytes: the collectives recorded call by call, one reduce per (bucket, owner) with that piece's bytes,
from inside backward, nothing else (and the sockets' own count). Overlap, as a fact: each bucket's
reduces are still in flight (started, not waited for) when autograd hands over the next gradient.
Memory: a census of the live tensors after every gradient hook, on a model whose buckets are all the
same size, so that a third bucket's buffer cannot hide under the bound. ``group=``: on a subgroup of
3 of 4 ranks while the fourth rank works alone."""
import pytest
import torch
import torch.nn as nn

from zerolab import models
from zerolab.flat import unique_trainable
from zerolab.grade.helpers import exercise_module, live_storages, new_bytes, record_collectives
from zerolab.zero2 import make_buckets

# The reference implementation of this exercise: a submission that uses it scores 0
# (checked before and while the tests run, by zerolab.grade.references).
REFERENCE_MODULES = ["zerolab.zero2", "zerolab.stages", "zerolab.initialize",
                     "zerolab.plots.zero2_layouts"]   # lesson 04's layouts: counts 04.2's pieces
REFERENCE_ALLOWED = ["zerolab.zero2.make_buckets"]  # the buckets of the contract

N = 3                      # padding is real: no bucket boundary falls on a multiple of 3 by design
BUCKET_BYTES = 16000       # float64: 2000 elements; a 4096-element weight gets a bucket of its own
GPT = dict(vocab_size=64, d_model=32, n_layers=4, n_heads=2, seq_len=16)
WIDTH, DEPTH = 24, 8       # the stack: 8 weights of 24 x 24, two per bucket: 4 equal buckets
STACK_BUCKET = 2 * WIDTH * WIDTH * 8
SUBGROUP = [1, 2, 3]       # on 4 ranks: these share the gradients; rank 0 works alone meanwhile


class Spare(nn.Module):
    """ToyMLP (a frozen layer, a module used twice, sizes no N divides) plus a layer no forward uses:
    its gradient never arrives, and its bucket must still be reduced (zeros for it)."""

    def __init__(self):
        super().__init__()
        self.mlp = models.ToyMLP()
        self.spare = nn.Linear(7, 3)

    def forward(self, x, y):
        return self.mlp(x, y)


class Stack(nn.Module):
    """Equal square weights: every bucket (two weights) has the same size."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(DEPTH))

    def forward(self, x, y):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return ((x - y) ** 2).mean()


def _model(name="gpt"):
    if name in ("spare", "stack"):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            return (Spare() if name == "spare" else Stack()).double()
    return models.build(name, seed=0, dtype=torch.float64, **(GPT if name == "gpt" else {}))


def _batch(name, model, rank, micro=0):
    seed = 100 * micro + rank
    if name == "stack":
        g = torch.Generator().manual_seed(seed)
        return (torch.randn(4, WIDTH, generator=g, dtype=torch.float64),
                torch.randn(4, WIDTH, generator=g, dtype=torch.float64))
    return models.batch("gpt" if name == "gpt" else "mlp", seed=seed, batch_size=3, model=model,
                        dtype=torch.float64)


def _expected_shard(name, ranks, rank_index, micro_batches):
    """Group rank ``rank_index``'s partition of the mean over ``ranks`` (global ranks, whose batches)
    of the gradients summed over micro-batches, recomputed here in one process (float64)."""
    model, n = _model(name), len(ranks)
    for r in ranks:
        for m in range(micro_batches):
            (model(*_batch(name, model, r, m)) / n).backward()
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                      for p in unique_trainable(model.parameters())])
    s = -(-flat.numel() // n)
    flat = torch.cat([flat, flat.new_zeros(s * n - flat.numel())])
    return flat[rank_index * s:(rank_index + 1) * s]


def _pieces(name, world_size):
    """Expected (owner, bytes) of every reduce, bucket by bucket in backward order: each bucket's
    intersection with each rank's partition (owner: a group rank)."""
    params = unique_trainable(_model(name).parameters())
    offsets, start = {}, 0
    for p in params:
        offsets[id(p)], start = start, start + p.numel()
    s = -(-start // world_size)
    out = []
    for ps in make_buckets(params[::-1], BUCKET_BYTES if name != "stack" else STACK_BUCKET, params[0].dtype):
        lo, hi = min(offsets[id(p)] for p in ps), max(offsets[id(p)] + p.numel() for p in ps)
        out.append([(q, (min(hi, (q + 1) * s) - max(lo, q * s)) * 8) for q in range(world_size)
                    if max(lo, q * s) < min(hi, (q + 1) * s)])
    return out


def _close(got, want, what):
    if got.shape != want.shape:
        raise AssertionError(f"{what}: shape {tuple(got.shape)}, expected {tuple(want.shape)}")
    if not torch.allclose(got, want, rtol=1e-10, atol=1e-13):
        d = (got - want).abs()
        i = int(d.argmax())
        raise AssertionError(f"{what}: differs from the mean of every rank's gradients (float64, recomputed by the "
                             f"grader) by up to {float(d[i]):.3g} at element {i} (got {float(got[i]):.6g}, expected "
                             f"{float(want[i]):.6g})")


def _calls(calls):
    keep = ("op", "peer", "bytes", "group", "in_backward", "async", "t_start", "t_end", "t_waited")
    return [{k: c[k] for k in keep} for c in calls]


# -- probes: run the submission on its ranks, observe, return plain data ------------------------------
def _probe_values(name, micro_batches, group_ranks=None):
    """``micro_batches`` backward passes + finish(); then zero_grad() and one more. With ``group_ranks``
    (on 4 ranks): those ranks share a subgroup, every other rank works alone on a group of its own."""
    import torch.distributed as dist
    ex = exercise_module("ex04_zero2")
    rank = dist.get_rank()
    group = None
    if group_ranks is not None:
        groups = {tuple(group_ranks): dist.new_group(group_ranks)}    # every rank creates every group
        for r in range(dist.get_world_size()):
            if r not in group_ranks:
                groups[(r,)] = dist.new_group([r])
        group = next(g for ranks, g in groups.items() if rank in ranks)
    model = _model(name)
    grads = ex.Zero2Gradients(model.parameters(), bucket_bytes=BUCKET_BYTES, group=group)
    with record_collectives() as calls:
        for micro in range(micro_batches):
            model(*_batch(name, model, rank, micro)).backward()
            grads.finish()
    summed = grads.grad_shard.clone()
    kept = [k for k, p in model.named_parameters() if p.grad is not None]
    grads.zero_grad()
    model(*_batch(name, model, rank, 0)).backward()
    grads.finish()
    return {"summed": summed, "again": grads.grad_shard.clone(), "kept": kept, "calls": _calls(calls)}


def _probe_communication():
    import torch.distributed as dist

    from zerolab import comm
    ex = exercise_module("ex04_zero2")
    model = _model()
    params = unique_trainable(model.parameters())
    grads = ex.Zero2Gradients(model.parameters(), bucket_bytes=BUCKET_BYTES)
    loss = model(*_batch("gpt", model, dist.get_rank()))
    with record_collectives() as calls:
        for i, p in enumerate(params):   # after the exercise's hooks: when autograd hands over p's gradient
            p.register_hook(lambda g, i=i: calls.mark(f"gradient {i}"))
        dist.barrier()
        with comm.log() as log:
            loss.backward()
            grads.finish()
    return {"calls": _calls(calls), "marks": [{"label": m["label"], "t": m["t"]} for m in calls.marks],
            "measured": log.measured_bytes, "psi_bytes": 8 * sum(p.numel() for p in params)}


def _storage(t):
    st = t.untyped_storage()
    return (st.device.type, st.device.index, st.data_ptr())


def _probe_memory(settle_to):
    import torch.distributed as dist
    ex = exercise_module("ex04_zero2")
    model = _model("stack")
    params = unique_trainable(model.parameters())
    x, y = _batch("stack", model, dist.get_rank())
    hold = []                                 # keeps the census's storages alive: no address reuse
    before = live_storages(hold)              # the model and the batch, before the exercise allocates
    hold += [t.untyped_storage() for t in hold]   # the storages themselves: parameters get rebound
    grads = ex.Zero2Gradients(model.parameters(), bucket_bytes=STACK_BUCKET)
    constructed = live_storages()
    seen = []

    def census(p):                            # runs after the exercise's hooks for p (registered later)
        seen.append(new_bytes(baseline, [q.grad for q in params], settle_to=settle_to, settle_s=1.0))

    for p in params:
        p.register_post_accumulate_grad_hook(census)
    loss = model(x, y)
    # Not gradients: the parameters' flat buffer, grad_shard, and what the forward created. Whatever
    # else the exercise allocated, in its constructor or later, counts.
    baseline = dict(before)
    seen_after, forward = [], {}
    for k, v in live_storages(seen_after).items():
        if k not in constructed:
            forward[k] = v
    hold += [t.untyped_storage() for t in seen_after if _storage(t) in forward]   # addresses stay taken
    del seen_after                            # (it holds every tensor: the exercise's may go)
    baseline.update(forward)
    baseline.update({_storage(grads.flat.data): 0, _storage(grads.grad_shard): 0})
    loss.backward()
    grads.finish()
    after = new_bytes(baseline, [q.grad for q in params], settle_to=1024)
    return {"during": seen, "after": after}


def _probe_reduce_calls(cases):
    ex = exercise_module("ex04_zero2")
    return [int(ex.reduce_calls(list(numels), n)) for numels, n in cases]


# -- the tests: every verdict here ----------------------------------------------------------------------
@pytest.mark.points(2)
@pytest.mark.parametrize("name", ["gpt", "mlp", "spare"])
def test_grad_shard_is_the_average(student, name):
    """values: grad_shard is this rank's partition of the averaged gradients (a frozen layer, a module
    used twice, a layer no forward uses), and no parameter keeps a .grad"""
    for rank, got in enumerate(student.on_ranks(N, _probe_values, name, 1)):
        _close(got["summed"], _expected_shard(name, range(N), rank, 1), f"{name}: rank {rank}: grad_shard after "
               f"one backward")
        assert not got["kept"], (f"{name}: rank {rank}: after finish() these parameters still hold a .grad: "
                                 f"{got['kept'][:4]}: only grad_shard may hold gradients")


@pytest.mark.points(2)
def test_gradient_accumulation(student):
    """gradient accumulation: two backward passes add up in grad_shard; zero_grad() starts over"""
    for rank, got in enumerate(student.on_ranks(N, _probe_values, "gpt", 2)):
        _close(got["summed"], _expected_shard("gpt", range(N), rank, 2),
               f"rank {rank}: grad_shard after two micro-batches (the average of their summed gradients)")
        _close(got["again"], _expected_shard("gpt", range(N), rank, 1),
               f"rank {rank}: grad_shard after zero_grad() and one more backward")


@pytest.mark.points(3)
def test_each_slice_reduced_to_its_owner_during_backward(student):
    """bytes: one reduce per (bucket, owner), that piece's bytes, from inside backward; nothing else"""
    want = sorted(piece for bucket in _pieces("gpt", N) for piece in bucket)
    for rank, got in enumerate(student.on_ranks(N, _probe_communication)):
        calls = got["calls"]
        ops = sorted({c["op"] for c in calls})
        assert ops == ["reduce"], (f"rank {rank}: backward + finish() called {ops}: DeepSpeed's stage 2 uses only "
                                   f"reduce (each slice to its owner), no all-reduce, reduce-scatter or broadcast")
        late = [i for i, c in enumerate(calls) if not c["in_backward"]]
        assert not late, (f"rank {rank}: reduces {late} of {len(calls)} were started after backward returned: "
                          f"start each bucket's reduces from inside backward, when its last gradient arrives")
        pieces = sorted((c["peer"], c["bytes"]) for c in calls)
        assert pieces == want, (f"rank {rank}: {len(pieces)} reduces (owner, bytes) {pieces[:6]}...; expected one "
                                f"per (bucket, owner), {len(want)}: {want[:6]}...")
        if got["measured"] is not None:       # what the sockets carried: about Ψ, never N x Ψ
            assert got["measured"] <= 1.15 * got["psi_bytes"] + 65536, (
                f"rank {rank}: the sockets carried {got['measured']} bytes for {got['psi_bytes']} bytes of "
                f"gradients: each element is reduced once, which sends about its bytes once")


@pytest.mark.points(3)
def test_reduces_in_flight_while_backward_computes(student):
    """overlap, observed: each bucket's reduces are still in flight (started, not waited for) when
    autograd hands over the next gradient"""
    for rank, got in enumerate(student.on_ranks(N, _probe_communication)):
        calls, marks = got["calls"], sorted(m["t"] for m in got["marks"])
        buckets = len(_pieces("gpt", N))
        unwaited = [i for i, c in enumerate(calls) if c["t_waited"] is None]
        assert not unwaited, (f"rank {rank}: reduces {unwaited} were never waited for (wait() on their handles): "
                              f"after finish() every reduce has completed")
        idle, overlapped = [], 0
        for i, c in enumerate(calls):
            later = [t for t in marks if t > c["t_end"]]
            if not later:
                continue                      # started after the last gradient: nothing left to overlap
            if later[0] < c["t_waited"]:
                overlapped += 1
            else:
                idle.append(i)
        assert not idle, (
            f"rank {rank}: reduces {idle} of {len(calls)} had completed (been waited for) before autograd handed "
            f"over the next gradient: start them asynchronously and wait only when you must (before a third "
            f"bucket's buffer would be needed, or in finish()), so that they run while backward computes")
        assert overlapped >= buckets - 1, (
            f"rank {rank}: only {overlapped} reduces were in flight while autograd computed a later gradient; "
            f"the {buckets} buckets of TinyGPT's backward give at least {buckets - 1}")


@pytest.mark.points(3)
def test_at_most_two_buckets_alive_during_backward(student):
    """memory: at most two buckets of full-size gradients during backward, none after (equal buckets)"""
    bound = 2 * STACK_BUCKET + WIDTH * WIDTH * 8 + 1024   # two buckets and the gradient autograd hands over
    for rank, got in enumerate(student.on_ranks(N, _probe_memory, bound)):
        assert len(got["during"]) == DEPTH, f"rank {rank}: grader: {len(got['during'])} gradient hooks ran for {DEPTH}"
        peak = max(got["during"])
        assert peak <= bound, (
            f"rank {rank}: during backward up to {peak} bytes of gradient buffers were alive (gradients at each "
            f"hook: {got['during']}); buckets here are all {STACK_BUCKET} bytes, so two buckets and the gradient "
            f"autograd hands over are at most {bound}: free a bucket's buffer once its reduces completed, "
            f"before a third bucket's is needed")
        assert got["after"] <= 1024, (f"rank {rank}: after finish() {got['after']} bytes of gradient buffers are "
                                      f"still alive: free every full-size gradient buffer; only grad_shard may hold "
                                      f"gradients")


@pytest.mark.points(3)
def test_on_a_subgroup(student):
    """group=: 3 of 4 ranks share the gradients (global ranks 1-3) while rank 0 works alone"""
    got = student.on_ranks(4, _probe_values, "gpt", 1, SUBGROUP)
    _close(got[0]["summed"], _expected_shard("gpt", [0], 0, 1), "rank 0, alone in its own group: grad_shard")
    assert all(c["group"] == (0,) for c in got[0]["calls"]), (
        f"rank 0 (alone in its group) called {[(c['op'], c['group']) for c in got[0]['calls']][:4]}: every "
        f"collective goes to the group given")
    want = sorted((SUBGROUP[q], b) for bucket in _pieces("gpt", len(SUBGROUP)) for q, b in bucket)
    for i, rank in enumerate(SUBGROUP):
        g = got[rank]
        wrong = [(c["op"], c["group"]) for c in g["calls"] if c["group"] != tuple(SUBGROUP)]
        assert not wrong, (f"rank {rank}: collectives outside the group {SUBGROUP}: {wrong[:4]} (a collective "
                           f"without group= runs on every rank, and rank 0 is busy with its own)")
        _close(g["summed"], _expected_shard("gpt", SUBGROUP, i, 1),
               f"rank {rank} (rank {i} of the group {SUBGROUP}): grad_shard")
        pieces = sorted((c["peer"], c["bytes"]) for c in g["calls"])
        assert pieces == want, (f"rank {rank}: reduces (owner as a global rank, bytes) {pieces[:6]}...; expected "
                                f"one per (bucket, owner) to the owners' global ranks: {want[:6]}...")


@pytest.mark.points(2)
def test_reduce_calls_derived(student):
    """derived: reduce calls per backward, by hand and on TinyGPT's buckets"""
    cases = [([10], 2, 2), ([4, 4], 2, 2), ([3, 5], 2, 3), ([1, 1, 1, 1], 4, 4), ([5, 2], 3, 4),
             ([7], 4, 4), ([2, 2, 2], 3, 3), ([9, 1], 3, 4), ([1], 3, 1), ([5, 7], 4, 5)]
    params = unique_trainable(_model().parameters())
    sizes = [sum(p.numel() for p in ps) for ps in make_buckets(params[::-1], BUCKET_BYTES, torch.float64)]
    tiny = [(sizes[::-1], n, sum(len(b) for b in _pieces("gpt", n))) for n in (2, 3, 4, 8)]
    got = student.on_ranks(N, _probe_reduce_calls, [(numels, n) for numels, n, _ in cases + tiny])[0]   # live ranks
    for (numels, n, want), g in zip(cases, got):
        assert g == want, f"reduce_calls({numels}, world_size={n}) = {g}; by hand: {want}"
    for (numels, n, want), g in zip(tiny, got[len(cases):]):
        assert g == want, (f"reduce_calls(TinyGPT's {len(numels)} buckets, {n}) = {g}; the layout has {want} "
                           f"(bucket, owner) pairs")

"""Graded: exercise 02, bucketed data-parallel gradient averaging, and torch DDP's buckets measured.

The submission runs only in probes (its own ranks), which report plain data: every gradient after
``finish()``, every collective it started (recorded by the taps of ``record_collectives``: op, bytes,
group, whether inside backward, and when it started, returned and was waited for), the moments the
probe's own gradient hooks saw autograd hand over each gradient, and a census of the live tensors.
Every verdict is decided here, against references computed here: the mean over the ranks of every
rank's gradient, recomputed in one process in float64; the buckets of ``assign_buckets``; the order
in which this model's gradients arrive, observed here on the same model; DDP's buckets measured on
the grader's own ranks.

Properties, besides the values (a tied weight, a frozen layer, a layer used twice, a layer that some
ranks' forward leaves unused and others use, changing from step to step): one all-reduce per bucket
on the averager's group, each gradient element in exactly one; overlap observed as work in flight,
each bucket's all-reduce started and not yet waited for while autograd computes the gradients that
follow its last one, also when a parameter gets no gradient at all in that backward; no copy of
the gradients (the live tensors of backward measured against Ψ); no communication under
``no_sync`` and the accumulated sum synchronised after it; ``group=`` on a subgroup of 3 of 4 ranks
while the fourth rank works alone; and, on 3 ranks that each leave a different expert unused (a
bucket in the middle, not the first), the values again: there the buckets' gradients become final
in a different order on each rank, and all-reduces started in that order would meet another rank's
other bucket (same size: wrong sums, not a hang)."""
import pytest
import torch
import torch.nn as nn

from zerolab import models
from zerolab.data_parallel import assign_buckets
from zerolab.flat import unique_trainable
from zerolab.grade.helpers import exercise_module, live_storages, new_bytes, record_collectives

# The reference implementation of this exercise: a submission that uses it scores 0
# (checked before and while the tests run, by zerolab.grade.references).
REFERENCE_MODULES = ["zerolab.data_parallel", "zerolab.DataParallel", "zerolab.zero0", "zerolab.stages",
                     "zerolab.initialize"]
REFERENCE_ALLOWED = [  # offered by the exercise
    "zerolab.data_parallel.Bucket",
    "zerolab.data_parallel.assign_buckets",
]

GPT = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=2, seq_len=16)
BUCKET_BYTES = 4096        # float64: 512 elements; TinyGPT's larger weights get buckets of their own
SUBGROUP = [1, 2, 3]       # on 4 ranks: these average together; rank 0 trains alone meanwhile


class Spare(nn.Module):
    """TinyGPT plus a layer registered last (so its parameters are the first to be bucketed, in the
    first bucket to reduce) that the forward uses only when ``use_spare`` is set: on some ranks and
    some steps it gets no gradient at all."""

    def __init__(self):
        super().__init__()
        self.gpt = models.TinyGPT(**GPT)
        self.spare = nn.Linear(GPT["d_model"], 3)
        self.use_spare = True

    def forward(self, x, y):
        loss = self.gpt(x, y)
        if self.use_spare:
            ones = torch.ones(1, GPT["d_model"], dtype=self.spare.weight.dtype)
            loss = loss + 0.01 * self.spare(ones).pow(2).sum()
        return loss


def _uses_spare(rank, step):
    return (rank + step) % 2 == 1       # rank 0 leaves it unused at step 0, rank 1 at step 1


class Experts(nn.Module):
    """Four experts, each one bucket of its own (16 x 32 float64 = BUCKET_BYTES): expert 3 in bucket
    0, expert 0 in bucket 3. The forward skips the experts in ``skip``, as a mixture of experts skips
    those no token was routed to: which buckets miss a gradient differs from rank to rank."""

    def __init__(self):
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(16, 32, bias=False) for _ in range(4))
        self.skip = set()

    def forward(self, x, y):
        loss = 0
        for i, expert in enumerate(self.experts):
            if i not in self.skip:
                loss = loss + (expert(x) - y).pow(2).mean() * (i + 1)
        return loss


# (rank, step) -> the experts that rank's forward skips. Step 0: ranks 0 and 1 skip experts in
# buckets 2 and 1, rank 2 none; step 1: others. Each rank's buckets become final in its own order.
EXPERTS_SKIPPED = {(0, 0): {1}, (1, 0): {2}, (2, 0): set(), (0, 1): set(), (1, 1): {1}, (2, 1): {0, 2}}


def _model(name, rank=0, step=0):
    if name == "spare":
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = Spare().double()
        model.use_spare = _uses_spare(rank, step)
        return model
    if name == "experts":
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = Experts().double()
        model.skip = set(EXPERTS_SKIPPED[rank, step])
        return model
    return models.build(name, seed=0, dtype=torch.float64, **(GPT if name == "gpt" else {}))


def _batch(name, model, rank, step=0):
    seed = 100 * step + rank
    if name == "mlp":
        return models.batch("mlp", seed=seed, batch_size=3, dtype=torch.float64)
    if name == "experts":
        g = torch.Generator().manual_seed(seed)
        return (torch.randn(3, 16, generator=g, dtype=torch.float64),
                torch.randn(3, 32, generator=g, dtype=torch.float64))
    return models.batch("gpt", seed=seed, batch_size=3, vocab_size=GPT["vocab_size"], seq_len=GPT["seq_len"])


def _plain(calls):
    keep = ("op", "bytes", "group", "in_backward", "async", "t_start", "t_end", "t_waited")
    return [{k: c[k] for k in keep} for c in calls]


def _grads(model):
    return {name: (None if p.grad is None else p.grad.detach().clone())
            for name, p in model.named_parameters()}


def _group(group_ranks):
    """Every rank creates every group (torch's rule); returns this rank's group (None: the world)."""
    import torch.distributed as dist
    if group_ranks is None:
        return None
    groups = {tuple(group_ranks): dist.new_group(group_ranks)}
    for r in range(dist.get_world_size()):
        if r not in group_ranks:
            groups[(r,)] = dist.new_group([r])
    return next(g for ranks, g in groups.items() if dist.get_rank() in ranks)


# -- probes: run the submission on its ranks, report plain data ---------------------------------------
def _probe_steps(name, steps, group_ranks=None):
    """``steps`` steps of zero_grad, forward, backward, finish(); the gradients after each and the
    collectives of each."""
    import torch.distributed as dist
    ex = exercise_module("ex02_data_parallel")
    rank = dist.get_rank()
    group = _group(group_ranks)
    model = _model(name, rank)
    sync = ex.BucketedAverager(model, bucket_bytes=BUCKET_BYTES, group=group)
    out = []
    for step in range(steps):
        if name == "spare":
            model.use_spare = _uses_spare(rank, step)
        if name == "experts":
            model.skip = set(EXPERTS_SKIPPED[rank, step])
        model.zero_grad(set_to_none=False)
        with record_collectives() as calls:
            model(*_batch(name, model, rank, step)).backward()
            sync.finish()
        out.append({"grads": _grads(model), "calls": _plain(calls)})
    return out


def _probe_accumulation(name):
    """Micro-batch 0 inside no_sync(), micro-batch 1 outside it, then finish()."""
    import torch.distributed as dist
    ex = exercise_module("ex02_data_parallel")
    rank = dist.get_rank()
    model = _model(name, rank)
    sync = ex.BucketedAverager(model, bucket_bytes=BUCKET_BYTES)
    with record_collectives() as local:
        with sync.no_sync():
            if name == "spare":
                model.use_spare = _uses_spare(rank, 1)
            model(*_batch(name, model, rank, 0)).backward()
    with record_collectives() as synced:
        if name == "spare":
            model.use_spare = _uses_spare(rank, 0)
        model(*_batch(name, model, rank, 1)).backward()
        sync.finish()
    return {"local": _plain(local), "synced": _plain(synced), "grads": _grads(model)}


def _probe_overlap():
    """The first backward of a fresh averager, with the probe's own hooks marking the moment autograd
    hands over each gradient (registered after the averager's)."""
    import torch.distributed as dist
    ex = exercise_module("ex02_data_parallel")
    rank = dist.get_rank()
    model = _model("spare", rank)
    sync = ex.BucketedAverager(model, bucket_bytes=BUCKET_BYTES)
    names = {id(p): n for n, p in model.named_parameters()}
    loss = model(*_batch("spare", model, rank))
    with record_collectives() as calls:
        for p in model.parameters():
            if p.requires_grad:
                p.register_hook(lambda g, n=names[id(p)]: calls.mark(n))
        dist.barrier()
        loss.backward()
        sync.finish()
    return {"calls": _plain(calls), "marks": [{"label": m["label"], "t": m["t"]} for m in calls.marks]}


def _probe_memory(settle_to):
    """A census of the live tensors after every gradient autograd writes (the probe's hooks run after
    the averager's), counting what is new since before the averager was made, beyond the forward's own
    tensors: the gradients and whatever holds them."""
    import torch.distributed as dist
    ex = exercise_module("ex02_data_parallel")
    model = _model("gpt")
    params = unique_trainable(model.parameters())
    x, y = _batch("gpt", model, dist.get_rank())
    hold = []                                 # keeps the census's storages alive: no address reuse
    before = live_storages(hold)
    hold += [t.untyped_storage() for t in hold]
    sync = ex.BucketedAverager(model, bucket_bytes=BUCKET_BYTES)
    constructed = live_storages()
    seen = []

    def census(p):
        seen.append(new_bytes(baseline, [q.grad for q in params], settle_to=settle_to, settle_s=0.2))

    for p in params:
        p.register_post_accumulate_grad_hook(census)
    loss = model(x, y)
    baseline = dict(before)                   # not gradients: what the forward made
    baseline.update({k: v for k, v in live_storages().items() if k not in constructed})
    loss.backward()
    sync.finish()
    return {"during": seen, "after": new_bytes(baseline, [q.grad for q in params], settle_to=settle_to)}


def _probe_ddp(cap):
    import torch.distributed as dist
    ex = exercise_module("ex02_data_parallel")
    rank = dist.get_rank()
    got = ex.ddp_bucket_bytes(models.build("gpt", seed=0), _ddp_batches(rank), cap)
    return [[int(b) for b in it] for it in got]


def _ddp_batches(rank):
    return [models.batch("gpt", seed=10 * i + rank, batch_size=2, vocab_size=256, seq_len=32) for i in range(3)]


def _measure_ddp(cap):
    """The grader's own measurement, on its own ranks (trusted): DDP's communication hook sees every
    bucket it reduces."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    model = models.build("gpt", seed=0)
    ddp, seen, ours = DDP(model, bucket_cap_mb=cap), [], []

    def hook(state, bucket):
        seen.append(bucket.buffer().numel() * bucket.buffer().element_size())
        return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda f: f.value()[0])

    ddp.register_comm_hook(None, hook)
    for x, y in _ddp_batches(dist.get_rank()):
        seen.clear()
        ddp(x, y).backward()
        ours.append(list(seen))
    return ours


# -- references and checks, here --------------------------------------------------------------------
def _mean_grads(name, ranks, steps=(0,), use=None):
    """The mean over ``ranks`` (global ranks, whose batches) of each rank's gradient summed over
    ``steps`` (its micro-batches), recomputed in this process without communication. ``use``:
    (rank, step) -> whether the spare layer is used (default: as the probes set it)."""
    use = use or _uses_spare
    total = {}
    for r in ranks:
        model = _model(name, r)
        for s in steps:
            if name == "spare":
                model.use_spare = use(r, s)
            if name == "experts":
                model.skip = set(EXPERTS_SKIPPED[r, s])
            model(*_batch(name, model, r, s)).backward()
        for pname, p in model.named_parameters():
            if p.requires_grad:
                g = p.grad if p.grad is not None else torch.zeros_like(p)
                total[pname] = total.get(pname, 0) + g / len(ranks)
    return total


def _check_grads(got, expected, model, what):
    for pname, p in model.named_parameters():
        g = got[pname]
        if not p.requires_grad:
            assert g is None, f"{what}: frozen {pname} got a gradient"
            continue
        assert g is not None, f"{what}: {pname}.grad is None after finish()"
        want = expected[pname]
        if not torch.allclose(g, want, rtol=1e-10, atol=1e-12):
            d = (g - want).abs().reshape(-1)
            i = int(d.argmax())
            raise AssertionError(f"{what}: {pname}.grad differs from the mean over the ranks (float64, recomputed "
                                 f"by the grader) by up to {float(d[i]):.3g} at flat index {i} (got "
                                 f"{float(g.reshape(-1)[i]):.6g}, expected {float(want.reshape(-1)[i]):.6g})")


def _bucket_bytes(name="gpt"):
    params = unique_trainable(_model(name).parameters())
    return [sum(p.numel() for p in b) * 8 for b in assign_buckets(params, BUCKET_BYTES)], \
        sum(p.numel() for p in params) * 8


def _arrival(rank):
    """On the overlap probe's model for ``rank``: the trainable parameters' names in the order
    autograd writes their gradients (observed here, on the same model and batch)."""
    model = _model("spare", rank)
    order, names = [], {id(p): n for n, p in model.named_parameters()}
    for p in model.parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(lambda q: order.append(names[id(q)]))
    model(*_batch("spare", model, rank)).backward()
    return order


def _must_overlap(rank):
    """How many buckets can start before backward's last gradient, in index order, a parameter the
    forward did not use counting as ready from backward's first gradient on: the bucket launched at
    the last gradient, and any after it, have no later gradient to overlap."""
    model = _model("spare", rank)
    names = {id(p): n for n, p in model.named_parameters()}
    buckets = [[names[id(p)] for p in b]
               for b in assign_buckets(unique_trainable(model.parameters()), BUCKET_BYTES)]
    order = _arrival(rank)
    ready = {n for b in buckets for n in b} - set(order)          # unused in this forward
    launched = 0
    for name in order[:-1]:                                       # every gradient but the last
        ready.add(name)
        while launched < len(buckets) and all(n in ready for n in buckets[launched]):
            launched += 1
    return launched, len(buckets)


def _collectives_ok(calls, group_ranks, what):
    ops = sorted({c["op"] for c in calls})
    assert set(ops) <= {"all_reduce"}, f"{what}: called {ops}: averaging gradients takes all-reduces only"
    wrong = sorted({c["group"] for c in calls if c["group"] != tuple(group_ranks)}, key=str)
    assert not wrong, (f"{what}: all-reduces on the group(s) {wrong}, not on the averager's group "
                       f"{list(group_ranks)} (pass group= to every collective)")


@pytest.mark.points(3)
@pytest.mark.parametrize("world_size", [2, 3])
def test_bucketed_gradients_are_averaged(student, world_size):
    """values: .grad holds the mean over the ranks, two steps; a tied weight, a frozen layer, a layer
    used twice, a layer some ranks leave unused"""
    for name in ("mlp", "gpt", "spare"):
        got = student.on_ranks(world_size, _probe_steps, name, 2)
        for step in range(2):
            expected = _mean_grads(name, range(world_size), (step,))
            for rank in range(world_size):
                _check_grads(got[rank][step]["grads"], expected, _model(name),
                             f"{name}, {world_size} ranks, rank {rank}, step {step}"
                             + (f" (the spare layer {'used' if _uses_spare(rank, step) else 'unused'} here)"
                                if name == "spare" else ""))


@pytest.mark.points(2)
@pytest.mark.parametrize("name", ["mlp", "gpt", "spare"])
def test_gradient_accumulation_with_no_sync(student, name):
    """gradient accumulation: nothing sent under no_sync; the sum of both micro-batches averaged after,
    every gradient element all-reduced once"""
    buckets, psi_bytes = _bucket_bytes(name)
    expected = _mean_grads(name, range(2), (0, 1), use=lambda r, s: _uses_spare(r, 1 - s))
    for rank, got in enumerate(student.on_ranks(2, _probe_accumulation, name)):
        assert not got["local"], (f"rank {rank}: a backward inside no_sync() started "
                                  f"{[c['op'] for c in got['local']]}: under no_sync gradients only accumulate")
        _collectives_ok(got["synced"], range(2), f"{name}, rank {rank}, the synchronising step")
        sent = sum(c["bytes"] for c in got["synced"])
        assert sent == psi_bytes, (f"{name}, rank {rank}: the synchronising step all-reduced {sent} bytes; every "
                                   f"gradient element once, both micro-batches' sum in it, is {psi_bytes}")
        _check_grads(got["grads"], expected, _model(name), f"{name}, rank {rank}: two micro-batches (no_sync, then sync)")


@pytest.mark.points(2)
def test_one_all_reduce_per_bucket(student):
    """bytes: one all-reduce per bucket of assign_buckets, each gradient element (the tied weight too)
    in exactly one"""
    buckets, psi_bytes = _bucket_bytes("gpt")
    for rank, got in enumerate(student.on_ranks(2, _probe_steps, "gpt", 1)):
        calls = got[0]["calls"]
        _collectives_ok(calls, range(2), f"rank {rank}")
        sizes = sorted(c["bytes"] for c in calls)
        assert sizes == sorted(buckets), (
            f"rank {rank}: all-reduced {len(sizes)} buffers of {sizes} bytes; the {len(buckets)} buckets of "
            f"assign_buckets(trainable parameters, {BUCKET_BYTES}) hold {sorted(buckets)}: one all-reduce per bucket, "
            f"every gradient once ({psi_bytes} bytes in all, the tied weight once)")


@pytest.mark.points(3)
def test_all_reduces_in_flight_while_backward_computes(student):
    """overlap, observed: each bucket's all-reduce is still in flight (started, not waited for) when
    autograd hands over a later gradient, also when a parameter gets no gradient in this backward"""
    for rank, got in enumerate(student.on_ranks(2, _probe_overlap)):
        calls, marks = got["calls"], sorted(m["t"] for m in got["marks"])
        unused = "" if _uses_spare(rank, 0) else " (here the forward left the spare layer unused: it gets no gradient)"
        late = [i for i, c in enumerate(calls) if not c["in_backward"]]
        assert not late, (f"rank {rank}: all-reduces {late} of {len(calls)} started after backward returned{unused}: "
                          f"a bucket's all-reduce starts during backward, once its gradients are final")
        unwaited = [i for i, c in enumerate(calls) if c["t_waited"] is None]
        assert not unwaited, f"rank {rank}: all-reduces {unwaited} were never waited for: finish() completes them"
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
            f"rank {rank}: all-reduces {idle} of {len(calls)} had been waited for before autograd handed over the "
            f"next gradient: start them asynchronously and wait in finish(), so that they run while backward "
            f"computes")
        want, buckets = _must_overlap(rank)
        assert overlapped >= want, (
            f"rank {rank}: only {overlapped} of {len(calls)} all-reduces were in flight while autograd computed later "
            f"gradients; of the {buckets} buckets, {want} are complete before backward's last gradient and can "
            f"run beside it{unused}")


@pytest.mark.points(2)
def test_gradients_not_copied(student):
    """memory: the gradients live in the buffers that are all-reduced, no second copy (a census of the
    live tensors after every gradient)"""
    buckets, psi_bytes = _bucket_bytes("gpt")
    largest = max(p.numel() for p in _model("gpt").parameters()) * 8
    bound = psi_bytes + largest + 1024        # the buckets, and the one gradient autograd hands over
    for rank, got in enumerate(student.on_ranks(2, _probe_memory, bound)):
        peak = max(got["during"], default=0)
        assert got["during"], f"rank {rank}: grader: no gradient hook ran"
        assert peak <= bound, (
            f"rank {rank}: during backward up to {peak} bytes of gradients and buffers were alive (at each gradient: "
            f"{got['during'][-6:]}...); the gradients are {psi_bytes} bytes: with .grad living in the buffers that are "
            f"all-reduced there is nothing more (bound {bound}, with one gradient on its way)")
        assert got["after"] <= bound, (f"rank {rank}: after finish() {got['after']} bytes of gradients and buffers are "
                                       f"alive, more than the {psi_bytes} bytes of gradients")


@pytest.mark.points(3)
def test_on_a_subgroup(student):
    """group=: 3 of 4 ranks average together (global ranks 1-3) while rank 0 trains alone"""
    got = student.on_ranks(4, _probe_steps, "gpt", 1, SUBGROUP)
    model = _model("gpt")
    _check_grads(got[0][0]["grads"], _mean_grads("gpt", [0]), model, "rank 0, alone in its own group")
    _collectives_ok(got[0][0]["calls"], [0], "rank 0, alone in its own group")
    expected = _mean_grads("gpt", SUBGROUP)
    buckets, _ = _bucket_bytes("gpt")
    for rank in SUBGROUP:
        calls = got[rank][0]["calls"]
        _collectives_ok(calls, SUBGROUP, f"rank {rank} of the group {SUBGROUP}")
        _check_grads(got[rank][0]["grads"], expected, model, f"rank {rank}: the mean over the group {SUBGROUP}")
        assert sorted(c["bytes"] for c in calls) == sorted(buckets), (
            f"rank {rank}: all-reduced {sorted(c['bytes'] for c in calls)} bytes; one per bucket: {sorted(buckets)}")


@pytest.mark.points(2)
def test_ddp_buckets_measured(student, clusters):
    """measured: the buckets torch's DDP reduces, iteration by iteration"""
    ours = clusters(2).run(_measure_ddp, 0.1)
    for rank, (theirs, mine) in enumerate(zip(student.on_ranks(2, _probe_ddp, 0.1), ours)):
        assert theirs == mine, (f"rank {rank}: ddp_bucket_bytes = {theirs}; DDP's communication hook saw buckets "
                                f"of {mine} bytes, iteration by iteration (measured on the grader's ranks)")


@pytest.mark.points(2)
def test_ranks_leave_different_buckets_unused(student):
    """values when each rank leaves a different layer unused, in a middle bucket: every rank's all-reduces
    must still meet the same buckets on the other ranks"""
    got = student.on_ranks(3, _probe_steps, "experts", 2)
    bucket = {e: 3 - e for e in range(4)}          # expert e's bucket (reverse order, one each)
    for step in range(2):
        expected = _mean_grads("experts", range(3), (step,))
        unused = "; ".join(f"rank {r}: " + (", ".join(f"expert {e} (bucket {bucket[e]})"
                                                      for e in sorted(EXPERTS_SKIPPED[r, step])) or "none")
                           for r in range(3))
        for rank in range(3):
            what = f"experts, 3 ranks, rank {rank}, step {step}"
            _collectives_ok(got[rank][step]["calls"], range(3), what)
            try:
                _check_grads(got[rank][step]["grads"], expected, _model("experts"), what)
            except AssertionError as exc:
                raise AssertionError(
                    f"{exc}.\nThe forward left these experts unused ({unused}), so each rank's buckets become final "
                    f"in a different order; the all-reduces of the ranks are matched by the order in which each rank "
                    f"starts them, not by the bucket they carry") from None

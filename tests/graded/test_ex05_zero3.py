"""Graded: exercise 05, ZeRO-3's schedule, on what must hold at every moment of a step, not on how.
The submission runs in probes (its own ranks) that report plain data; every verdict is decided here.

The probe adds hooks INSIDE every computation of a step (after the exercise's own hooks): in each
block's forward and backward (on an inner layer and on its output's gradient), in the root's parts
(embeddings and head, forward and backward), and after every gradient. At each of these moments it
notes which units are whole (their buffer has storage), which units' parameters hold a ``.grad``,
and, in backward, the bytes of every live tensor that is not a model shard, a whole unit or what
existed before (a census); every collective is recorded with its start, end and wait times. On a
model whose units all differ in size, a collective's bytes name its unit. From that, checked here:
what is whole when; which all-gather is in flight while each computation runs (prefetch as a fact);
nothing in flight and nothing extra whole without prefetch; every all-gather and reduce-scatter and
their bytes; reduce-scatters in flight while the next unit's backward computes and never more than
two; no ``.grad`` once a unit's reduce-scatter started; the gradient memory bound. Values: gradient
shards against the mean of every rank's gradients recomputed here (float64), over two backward
passes, on TinyGPT, on the model above (blocks return a tensor, a tuple or a dict) and with a
parameter no forward uses; and on a subgroup of 3 of 4 ranks."""
import pytest
import torch
import torch.nn as nn

from zerolab import models
from zerolab.flat import unique_trainable
from zerolab.grade.helpers import exercise_module, live_storages, record_collectives
from zerolab.units import plan_units

# The reference implementation of this exercise: a submission that uses it scores 0
# (checked before and while the tests run, by zerolab.grade.references).
REFERENCE_MODULES = ["zerolab.zero3", "zerolab.stages", "zerolab.initialize", "zerolab.offload"]
REFERENCE_ALLOWED = [  # the four primitives lesson 05 shows, offered by the exercise
    "zerolab.zero3.gather", "zerolab.zero3.free", "zerolab.zero3.reduce_scatter_grads",
    "zerolab.zero3.register_pre_backward",
]

N = 3                           # padding is real: most units' sizes do not divide by 3
GPT = dict(vocab_size=64, d_model=32, n_layers=4, n_heads=2, seq_len=16)
D = 8                           # the ladder's width; its blocks' inner widths differ, so do their sizes
WIDTHS = (6, 10, 14, 18)
KINDS = ("tuple", "dict", "tensor", "tuple")   # what each block returns
SUBGROUP = [1, 2, 3]            # on 4 ranks: these share the model; rank 0 trains alone meanwhile
SLACK = 1024                    # bytes of the census not counted against the bound (counters, views)


class Rung(nn.Module):
    """A block returning a tensor, a tuple or a dict (hidden states and more, as real models' layers
    do); ``spare``: a layer no forward uses."""

    def __init__(self, width, kind, spare=False):
        super().__init__()
        self.up, self.down, self.gate, self.kind = nn.Linear(D, width), nn.Linear(width, D), nn.Linear(D, D), kind
        if spare:
            self.spare = nn.Linear(3, 3)

    def forward(self, x):
        h, g = self.down(torch.tanh(self.up(x))), torch.sigmoid(self.gate(x))
        if self.kind == "tensor":
            return x + h * g
        return {"hidden": h, "gate": g} if self.kind == "dict" else (h, g)


class Ladder(nn.Module):
    """Root: ``inp`` (before the blocks) and ``out`` (the head); blocks of different sizes."""

    def __init__(self, spare=False):
        super().__init__()
        self.inp, self.out = nn.Linear(5, D), nn.Linear(D, 1)
        self.blocks = nn.ModuleList(Rung(w, k, spare=spare and i == 1) for i, (w, k) in enumerate(zip(WIDTHS, KINDS)))

    def forward(self, x, y):
        h = self.inp(x)
        for block in self.blocks:
            out = block(h)
            if isinstance(out, dict):
                h = out["hidden"] * out["gate"] + h
            elif isinstance(out, tuple):
                h = out[0] * out[1] + h
            else:
                h = out
        return ((self.out(h).squeeze(-1) - y) ** 2).mean()


def _model(name):
    if name == "gpt":
        return models.build("gpt", seed=0, dtype=torch.float64, **GPT)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return Ladder(spare=name == "unused").double()


def _batch(name, model, rank, micro=0):
    if name == "gpt":
        return models.batch("gpt", seed=100 * micro + rank, batch_size=3, model=model)
    g = torch.Generator().manual_seed(100 * micro + rank)
    return torch.randn(4, 5, generator=g, dtype=torch.float64), torch.randn(4, generator=g, dtype=torch.float64)


def _units(name, world_size=N):
    """The units as the exercise's given constructor cuts them: [(name, [param names], padded bytes)]."""
    model = _model(name)
    names = {id(p): k for k, p in model.named_parameters()}
    plan = plan_units(model, None, unique_trainable(model.parameters()), persist_numel=0)
    return [(u, [names[id(p)] for p in ps], -(-sum(p.numel() for p in ps) // world_size) * world_size * 8)
            for u, _, ps, _, _ in plan]


def _expected_shards(name, ranks, index, micro_batches):
    """Group rank ``index``'s shard of each unit's mean gradient over ``ranks`` (global ranks, whose
    batches), summed over micro-batches, recomputed here in one process (float64)."""
    model, n = _model(name), len(ranks)
    for r in ranks:
        for m in range(micro_batches):
            (model(*_batch(name, model, r, m)) / n).backward()
    grads = {k: (p.grad if p.grad is not None else torch.zeros_like(p)) for k, p in model.named_parameters()}
    out = []
    for _, params, nbytes in _units(name, n):
        flat = torch.cat([grads[k].reshape(-1) for k in params])
        flat = torch.cat([flat, flat.new_zeros(nbytes // 8 - flat.numel())])
        s = flat.numel() // n
        out.append(flat[index * s:(index + 1) * s])
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


# -- probes: run the submission on its ranks, observe, return plain data ------------------------------
def _group(group_ranks):
    """With ``group_ranks``: every rank creates that group and one group per other rank (alone)."""
    import torch.distributed as dist
    if group_ranks is None:
        return None
    groups = {tuple(group_ranks): dist.new_group(group_ranks)}
    for r in range(dist.get_world_size()):
        if r not in group_ranks:
            groups[(r,)] = dist.new_group([r])
    return next(g for ranks, g in groups.items() if dist.get_rank() in ranks)


def _probe_values(name, micro_batches, group_ranks=None):
    import torch.distributed as dist
    ex = exercise_module("ex05_zero3")
    rank = dist.get_rank()
    group = _group(group_ranks)
    model = _model(name)
    sched = ex.Zero3Schedule(model, group=group)
    with record_collectives() as calls:
        for micro in range(micro_batches):
            model(*_batch(name, model, rank, micro)).backward()
            sched.finish()
    return {"shards": [g.clone() for g in sched.grad_shards], "units": [u.name for u in sched.units],
            "whole": [u.name for u in sched.units if u.full.untyped_storage().nbytes()],
            "grads": [k for k, p in model.named_parameters() if p.grad is not None],
            "groups": sorted({c["group"] for c in calls}, key=str)}


def _storage(t):
    st = t.untyped_storage()
    return (st.device.type, st.device.index, st.data_ptr())


def _probe_trace(prefetch, bounds):
    """One forward + backward + finish of the ladder, watched from inside every computation.
    ``bounds``: per moment, the census's bound, only to re-count a moment later while above it
    (gloo's worker drops a finished collective's tensors a moment after wait() returns)."""
    import gc
    import time

    import torch.distributed as dist
    ex = exercise_module("ex05_zero3")
    model = _model("ladder")
    x, y = _batch("ladder", model, dist.get_rank())
    hold = []                                     # keeps the census's storages alive: no address reuse
    before = live_storages(hold)                  # the model and the batch
    hold += [t.untyped_storage() for t in hold]   # the storages themselves: parameters get rebound
    sched = ex.Zero3Schedule(model, prefetch=prefetch)
    units = sched.units
    params = [(u.name, k, p) for u in units for p in u.flat.params
              for k, q in model.named_parameters() if q is p]
    baseline = dict(before)                       # + the shards and grad_shards the given code made
    baseline.update({_storage(t): 0 for t in [u.shard for u in units] + list(sched.grad_shards)})
    snaps, census = [], [False]

    def held():
        now = live_storages()
        for _, _, p in params:
            if p.grad is not None:
                now[_storage(p.grad)] = p.grad.untyped_storage().nbytes()
        skip = {_storage(u.full) for u in units if u.full.untyped_storage().nbytes()}
        return sum(b for k, b in now.items() if k not in baseline and k not in skip)

    def snap(label):
        rec.mark(label)
        entry = {"label": label, "t": rec.marks[-1]["t"],
                 "whole": sorted(u.name for u in units if u.full.untyped_storage().nbytes()),
                 "grads": sorted({name for name, _, p in params if p.grad is not None}), "held": None}
        if census[0]:
            got, deadline = held(), time.monotonic() + 1.0
            while got > bounds.get(label, 0) and time.monotonic() < deadline:
                time.sleep(0.005)
                gc.collect()
                got = held()
            entry["held"] = got
        snaps.append(entry)

    def inside(label):                            # a moment inside a forward, and one inside its backward
        def hook(module, args, out):
            snap(f"F:{label}")
            if out.requires_grad:
                out.register_hook(lambda g: snap(f"B:{label}"))
        return hook

    model.inp.register_forward_hook(inside("root_in"))
    model.out.register_forward_hook(inside("root_out"))
    for i, block in enumerate(model.blocks):
        block.up.register_forward_hook(inside(str(i)))
    for unit, k, p in params:
        p.register_post_accumulate_grad_hook(lambda p, unit=unit, k=k: snap(f"G:{unit}:{k}"))
    with record_collectives() as rec:
        loss = model(x, y)
        baseline.update({_storage(t): 0 for t in (loss, x, y)})
        baseline.update(_activations(hold))      # what autograd saved for backward: not gradients
        census[0] = True
        loss.backward()
        census[0] = False
        sched.finish()
    keep = ("op", "bytes", "group", "in_backward", "async", "t_start", "t_end", "t_waited")
    return {"snaps": snaps, "calls": [{k: c[k] for k in keep} for c in rec],
            "units": [u.name for u in units], "shards": [g.clone() for g in sched.grad_shards],
            "whole_after": [u.name for u in units if u.full.untyped_storage().nbytes()],
            "grads_after": [k for _, k, p in params if p.grad is not None]}


def _activations(hold):
    """Storages of the tensors autograd's graph holds now (outputs of operations, saved for backward);
    ``hold`` gets the storages, kept alive so that no later buffer takes one's address."""
    import gc
    out = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.grad_fn is not None:
            out[_storage(obj)] = 0
            hold.append(obj.untyped_storage())
    return out


def _probe_ratios(cases):
    ex = exercise_module("ex05_zero3")
    return [float(ex.traffic_ratio(list(blocks), root)) for blocks, root in cases]


def engine_bytes():
    """Trusted: zerolab's own stage-3 and data-parallel engines, one step each: ring bytes per rank."""
    import torch.distributed as dist

    import zerolab
    out = {}
    for stage in (0, 3):
        model = models.build("gpt", seed=0)
        engine = zerolab.initialize(model, stage=stage, lr=1e-3)
        for step in range(2):
            engine.backward(engine(*models.batch("gpt", seed=10 * step + dist.get_rank(), model=model)))
            engine.step()
        out[stage] = engine.last_step_comm.ideal_bytes
    return out[3] / out[0]


# -- reading a trace (here, trusted) ------------------------------------------------------------------------
class Trace:
    """A probe's trace, read: units by name, collectives by unit (their bytes name them), moments."""

    def __init__(self, got):
        self.units = _units("ladder")
        self.size = {name: nbytes for name, _, nbytes in self.units}
        assert [u for u, _, _ in self.units] == got["units"], (
            f"the exercise's units are {got['units']}; the given constructor builds {[u for u, _, _ in self.units]}")
        self.root = self.units[0][0]
        self.blocks = [u for u, _, _ in self.units[1:]]
        by_bytes = {nbytes: name for name, _, nbytes in self.units}
        self.calls = [dict(c, unit=by_bytes.get(c["bytes"])) for c in got["calls"]]
        self.snaps = got["snaps"]
        self.got = got

    def gathers(self, unit=None):
        return [c for c in self.calls if c["op"] == "all_gather" and (unit is None or c["unit"] == unit)]

    def reduce_scatters(self):
        return [c for c in self.calls if c["op"] == "reduce_scatter"]

    @staticmethod
    def in_flight(c, t):
        return c["async"] and c["t_start"] < t and (c["t_waited"] is None or c["t_waited"] > t)

    def gathering(self, t):
        """Units whose all-gather is in flight at time t."""
        return sorted({c["unit"] for c in self.gathers() if self.in_flight(c, t)}, key=str)

    def computing(self):
        """The moments inside computations, in order, each with the block computing (None: the root)
        and the next block to compute (None: none), and whether the next one must be in flight."""
        last = len(self.blocks) - 1
        out = []
        for s in self.snaps:
            kind, _, what = s["label"].partition(":")
            if kind not in ("F", "B"):
                continue
            i = None if what.startswith("root") else int(what)
            block = None if i is None else self.blocks[i]
            if kind == "F":
                nxt = {"root_in": 0, "root_out": last}.get(what, None if i is None or i == last else i + 1)
                must = what == "root_in" or (i is not None and i < last)
            else:
                nxt = {"root_out": last, "root_in": None}.get(what, None if i is None or i == 0 else i - 1)
                must = what == "root_out" or (i is not None and i > 0)
            out.append((s, block, None if nxt is None else self.blocks[nxt], must))
        return out


def _where(s):
    kind, _, what = s["label"].partition(":")
    part = {"root_in": "the embeddings'", "root_out": "the head's"}.get(what, f"block {what}'s")
    return f"inside {part} {'forward' if kind == 'F' else 'backward'}"


_TRACES = {}   # (graded folder, prefetch) -> the traces: one observed step, judged by several tests


def _trace(student, prefetch):
    import os
    key = (os.environ.get("ZEROLAB_IMPL"), prefetch)
    if key not in _TRACES:
        for old in [k for k in _TRACES if k[0] != key[0]]:
            del _TRACES[old]                      # another folder's (pytest --impl-each)
        _TRACES[key] = _observe(student, prefetch)
    got, bounds = _TRACES[key]
    return [Trace(g) for g in got], bounds


def _observe(student, prefetch):
    units = _units("ladder")
    size = {u: b for u, _, b in units}
    root, blocks = units[0][0], [u for u, _, _ in units[1:]]
    before = {b: blocks[i + 1] if i + 1 < len(blocks) else None for i, b in enumerate(blocks)}
    bounds = {"B:root_out": size[root], "B:root_in": size[root] + size[blocks[0]]}
    for i, b in enumerate(blocks):
        bounds[f"B:{i}"] = size[root] + size[b] + (size[before[b]] if before[b] else 0)
    for u, params, _ in units:
        for k in params:
            if u == root:
                bounds[f"G:{u}:{k}"] = size[root] + (size[blocks[0]] if k.startswith("inp.") else 0)
            else:
                bounds[f"G:{u}:{k}"] = size[root] + size[u] + (size[before[u]] if before[u] else 0)
    bounds = {k: v + SLACK for k, v in bounds.items()}
    return student.on_ranks(N, _probe_trace, prefetch, bounds), bounds


# -- the tests: every verdict here ----------------------------------------------------------------------
@pytest.mark.points(3)
@pytest.mark.parametrize("name", ["gpt", "ladder", "unused"])
def test_gradient_shards_with_accumulation(student, name):
    """values: gradient shards over two backward passes (blocks returning a tensor, a tuple or a dict;
    a parameter no forward uses); after finish() every unit freed, no .grad left"""
    want_units = [u for u, _, _ in _units(name)]
    for rank, got in enumerate(student.on_ranks(N, _probe_values, name, 2)):
        assert got["units"] == want_units, (f"rank {rank}: units {got['units']}; the given constructor builds "
                                            f"{want_units}")
        for u, shard, want in zip(want_units, got["shards"], _expected_shards(name, range(N), rank, 2)):
            _close(shard, want, f"{name}: rank {rank}: gradient shard of unit {u} after two backward passes")
        assert not got["whole"], f"{name}: rank {rank}: after finish() these units are still whole: {got['whole']}"
        assert not got["grads"], (f"{name}: rank {rank}: after finish() these parameters still hold a .grad: "
                                  f"{got['grads'][:4]}")


@pytest.mark.points(3)
def test_what_is_whole_when(student):
    """residency: the root from forward to its gradients; a block while it computes; besides it, only
    the next block, and only while its all-gather is in flight (never more than two blocks)"""
    traces, _ = _trace(student, True)
    for rank, tr in enumerate(traces):
        for s, block, nxt, _ in tr.computing():
            where = _where(s)
            assert tr.root in s["whole"], (f"rank {rank}: {where}, the root unit was not whole: it stays whole from "
                                           f"the start of the forward until its gradients are complete")
            others = [u for u in s["whole"] if u not in (tr.root, block)]
            if block is not None:
                assert block in s["whole"], f"rank {rank}: {where}, {block} itself was not whole"
                assert block not in tr.gathering(s["t"]), (
                    f"rank {rank}: {where}, {block}'s own all-gather was still in flight (not waited for): a block "
                    f"computes on its gathered parameters only once its all-gather is complete")
            extra = [u for u in others if u != nxt]
            assert not extra, (
                f"rank {rank}: {where}, {extra} {'was' if len(extra) == 1 else 'were'} whole too "
                f"(whole: {s['whole']}): "
                f"besides the root and the computing block, only the next block to compute ({nxt}) may be whole; "
                f"a block done with for now must be freed, and only the next one prefetched")
            idle = [u for u in others if u not in tr.gathering(s["t"])]
            assert not idle, (
                f"rank {rank}: {where}, {idle[0]} (the next block to compute) was whole, but its all-gather was "
                f"not in flight (all-gathers in flight: {tr.gathering(s['t'])}): it may be whole before its turn "
                f"only while its all-gather runs; a prefetch waited for before its block computes holds the "
                f"memory without overlapping anything")


@pytest.mark.points(3)
def test_collectives_and_bytes(student):
    """bytes: all-gathers of whole units, no more than the residency rules force (each block twice,
    the root once); one reduce-scatter per unit, inside backward; every collective waited for"""
    traces, _ = _trace(student, True)
    for rank, tr in enumerate(traces):
        ops = sorted({c["op"] for c in tr.calls})
        assert set(ops) <= {"all_gather", "reduce_scatter"}, (
            f"rank {rank}: the step called {ops}: stage 3 needs only all-gathers (parameters) and reduce-scatters "
            f"(gradients)")
        odd = [c["bytes"] for c in tr.calls if c["unit"] is None]
        assert not odd, (f"rank {rank}: collectives of {odd} bytes, which is no unit's full buffer "
                         f"({tr.size}): gather and reduce-scatter each unit's flat buffer whole")
        want = {tr.root: 1, **{b: 2 for b in tr.blocks}}
        got = {u: len(tr.gathers(u)) for u in want}
        assert got == want, (
            f"rank {rank}: all-gathers per unit in one step: {got}; the rules force {want}: the root stays whole "
            f"through the step; a block is freed between its forward and its backward, and gathered for each")
        rs = tr.reduce_scatters()
        per_unit = {u: sum(1 for c in rs if c["unit"] == u) for u in want}
        assert per_unit == {u: 1 for u in want}, (
            f"rank {rank}: reduce-scatters per unit: {per_unit}; expected one per unit, of its whole flat gradient")
        late = [c["unit"] for c in rs if not c["in_backward"]]
        assert not late, (f"rank {rank}: the reduce-scatters of {late} started after backward returned: start each "
                          f"one from inside backward, when the unit's gradients are complete")
        unwaited = [(c["op"], c["unit"]) for c in tr.calls if c["async"] and c["t_waited"] is None]
        assert not unwaited, (f"rank {rank}: never waited for: {unwaited}: wait() for every asynchronous "
                              f"collective, at the latest in finish()")


@pytest.mark.points(3)
def test_prefetch_in_flight_while_computing(student):
    """prefetch, observed: while each computation runs, the next block's all-gather is in flight"""
    traces, _ = _trace(student, True)
    for rank, tr in enumerate(traces):
        moments = tr.computing()
        for s, block, nxt, must in moments:
            if must and nxt not in tr.gathering(s["t"]):
                since = max([m["t"] for m, b, _, _ in moments if b == nxt and m["t"] < s["t"]], default=0)
                started = [c for c in tr.gathers(nxt) if since < c["t_start"] < s["t"]]
                state = ("had not been started" if not started else
                         "was blocking" if not started[-1]["async"] else "had already been waited for")
                raise AssertionError(
                    f"rank {rank}: {_where(s)}, the all-gather of {nxt} (the next block to compute) {state}: start "
                    f"it asynchronously before this computation begins and wait for it only when {nxt} starts, so "
                    f"that it runs while this one computes")


@pytest.mark.points(3)
def test_reduce_scatters_in_flight_and_bounded(student):
    """overlap and bound: each reduce-scatter in flight while the next unit's backward computes; never
    more than two in flight"""
    traces, _ = _trace(student, True)
    for rank, tr in enumerate(traces):
        rs = {c["unit"]: c for c in tr.reduce_scatters()}
        for c in rs.values():
            others = [d["unit"] for d in rs.values() if d is not c and tr.in_flight(d, c["t_start"])]
            assert len(others) <= 1, (
                f"rank {rank}: when the reduce-scatter of {c['unit']} started, those of {others} were still in "
                f"flight: at most two reduce-scatters may be in flight at any moment (each holds a unit of "
                f"full-size gradients)")
        moments = {s["label"]: s for s, _, _, _ in tr.computing()}
        order = [(tr.blocks[i], f"B:{i - 1}" if i > 0 else "B:root_in") for i in range(len(tr.blocks) - 1, -1, -1)]
        for unit, label in order:
            c, s = rs.get(unit), moments.get(label)
            assert c is not None and s is not None, f"rank {rank}: no reduce-scatter of {unit}, or no moment {label}"
            state = ("not started yet" if c["t_start"] > s["t"] else "already waited for" if c["async"]
                     else "blocking")
            assert tr.in_flight(c, s["t"]), (
                f"rank {rank}: {_where(s)} (the next unit's backward), the reduce-scatter of {unit} was {state}: "
                f"start it asynchronously when the unit's gradients are complete, and wait for it only when "
                f"you must, so that it runs while backward computes")


@pytest.mark.points(3)
def test_gradients_released_and_memory_bound(student):
    """memory: no .grad once a unit's reduce-scatter started; full-size gradients of at most the root,
    the unit whose gradients arrive, and the one before it (a census at every moment of backward)"""
    traces, bounds = _trace(student, True)
    for rank, tr in enumerate(traces):
        rs = {c["unit"]: c for c in tr.reduce_scatters()}
        for s in tr.snaps:
            started = [u for u, c in rs.items() if c["t_start"] < s["t"]]
            kept = [u for u in s["grads"] if u in started]
            assert not kept, (f"rank {rank}: at {s['label']}, the parameters of {kept} still held a .grad after "
                              f"their reduce-scatter started: the packed buffer holds them now; drop the .grad")
            if s["held"] is not None and s["held"] > bounds[s["label"]]:
                kind, _, what = s["label"].partition(":")
                where = _where(s) if kind == "B" else f"after the gradient of {what.split(':', 1)[1]} arrived"
                raise AssertionError(
                    f"rank {rank}: {where}, {s['held']} bytes of tensors besides the model shards and the whole "
                    f"units were alive; the gradients allowed then (the root's, the arriving unit's and the one "
                    f"before it in backward, full size) are at most {bounds[s['label']]}: a gradient buffer (or a "
                    f".grad) kept longer than needed, or allocated before it is needed")
        assert not tr.got["whole_after"], (f"rank {rank}: after finish() these units are still whole: "
                                           f"{tr.got['whole_after']}")
        assert not tr.got["grads_after"], f"rank {rank}: after finish() .grad left on {tr.got['grads_after'][:4]}"


@pytest.mark.points(2)
def test_without_prefetch(student):
    """prefetch=False: nothing in flight while anything computes, only the computing block whole;
    the same collectives and the same gradient shards"""
    traces, _ = _trace(student, False)
    for rank, tr in enumerate(traces):
        for s, block, _, _ in tr.computing():
            extra = [u for u in s["whole"] if u not in (tr.root, block)]
            were = "was" if len(extra) == 1 else "were"
            assert not extra, (f"rank {rank}: with prefetch=False, {_where(s)}, {extra} {were} "
                               f"whole too: without prefetch only the computing block is")
            flying = tr.gathering(s["t"])
            assert not flying, (f"rank {rank}: with prefetch=False, {_where(s)}, the all-gather of {flying} was in "
                                f"flight: without prefetch a block is gathered when it is needed, and waited for")
        want_counts = {tr.root: 1, **{b: 2 for b in tr.blocks}}
        got = {u: len(tr.gathers(u)) for u in want_counts}
        assert got == want_counts, (f"rank {rank}: with prefetch=False, all-gathers per unit {got}; expected "
                                    f"{want_counts}")
        for u, shard, w in zip(tr.got["units"], tr.got["shards"], _expected_shards("ladder", range(N), rank, 1)):
            _close(shard, w, f"rank {rank}: with prefetch=False, gradient shard of unit {u}")


@pytest.mark.points(3)
def test_on_a_subgroup(student):
    """group=: 3 of 4 ranks share the model (global ranks 1-3) while rank 0 trains alone"""
    got = student.on_ranks(4, _probe_values, "ladder", 1, SUBGROUP)
    units = [u for u, _, _ in _units("ladder")]
    for u, shard, want in zip(units, got[0]["shards"], _expected_shards("ladder", [0], 0, 1)):
        _close(shard, want, f"rank 0, alone in its group: gradient shard of unit {u}")
    assert got[0]["groups"] in ([], [(0,)]), (
        f"rank 0 (alone in its group) ran collectives on {got[0]['groups']}: every collective goes to the group given")
    for i, rank in enumerate(SUBGROUP):
        g = got[rank]
        assert g["groups"] == [tuple(SUBGROUP)], (
            f"rank {rank}: collectives on the groups {g['groups']}; all of them belong to the group {SUBGROUP} (a "
            f"collective without group= runs on every rank, and rank 0 is busy with its own)")
        for u, shard, want in zip(units, g["shards"], _expected_shards("ladder", SUBGROUP, i, 1)):
            _close(shard, want, f"rank {rank} (rank {i} of the group {SUBGROUP}): gradient shard of unit {u}")


@pytest.mark.points(2)
def test_traffic_ratio_derived(student, clusters):
    """derived: stage 3's bytes per step over data parallelism's, by hand and measured"""
    cases = [([10, 10], 0, 1.5), ([], 10, 1.0), ([30], 10, 110 / 80), ([4, 4, 4], 12, 60 / 48), ([5, 1], 2, 22 / 16)]
    model = models.build("gpt", seed=0)
    blocks = [sum(p.numel() for p in b.parameters()) for b in model.blocks]
    root = sum(p.numel() for p in dict.fromkeys(model.parameters())) - sum(blocks)
    got = student.on_ranks(N, _probe_ratios, [(b, r) for b, r, _ in cases] + [(blocks, root)])[0]   # live ranks
    for (b, r, want), g in zip(cases, got):
        assert g == pytest.approx(want, rel=1e-12), f"traffic_ratio({b}, root={r}) = {g}; by hand {want}"
    measured = clusters(N).run(engine_bytes)[0]
    assert got[-1] == pytest.approx(measured, rel=5e-3), (
        f"TinyGPT (root {root}, blocks {blocks}): traffic_ratio = {got[-1]:.4f}; zerolab's engines on {N} ranks "
        f"send {measured:.4f} times data parallelism's bytes (comm log, padding included)")

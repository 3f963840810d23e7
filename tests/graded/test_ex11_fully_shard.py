"""Graded: exercise 11, FSDP2's dim-0 pieces, and the overflow check and clipping of a gradient held
in a mixed layout (shards, copies on every rank or on some, fp32 pieces of an offloaded optimizer).

The submission runs only inside probes; every verdict is decided here, on the plain data they
return, against references computed here: explicit slicing, the float64 norm of the whole gradient
counted once, torch.nn.utils.clip_grad_norm_ and torch.amp.GradScaler on one process. What the
probes observe: each collective's op, group and bytes (recorded through taps installed before the
submission is imported), and the tensors a call allocates (torch's profiler). The layouts run on
ranks 1-3 of 4 as a subgroup, while rank 0 runs the same call on a group of its own. Cheapest first
(the wrong-answer test stops an answer at its first failure)."""
import contextlib
import math

import pytest
import torch

from zerolab import models
from zerolab.grade.helpers import assert_close, exercise_module, record_collectives

# What this exercise must not use (checked before and while the tests run, zerolab.grade.references).
REFERENCE_MODULES = ["zerolab.fully_sharded", "zerolab.mixed_precision", "zerolab.fully_shard",
                     "zerolab.clip_grad_norm_", "zerolab.LossScaler"]

WORLD, SUB = 4, (1, 2, 3)        # the layouts live on global ranks 1-3; rank 0 has a group of its own
SHAPES = [(7, 3), (5,), (2, 4), (12, 2), (1, 5)]
BUDGET = 16 * 1024               # bytes a call may allocate at once; the pieces are several times larger


def _close(actual, expected, what, *, rtol, atol):
    """assert_close, decided here (its rank prefix would name this process, not the rank checked:
    ``what`` names the rank)."""
    try:
        assert_close(actual, expected, what, rtol=rtol, atol=atol)
    except AssertionError as exc:
        raise AssertionError(str(exc).removeprefix("rank 0: ")) from None


@contextlib.contextmanager
def _groups():
    """Every rank makes both groups, in the same order; yields (this rank's group, its global ranks),
    and gives both back at the end (each holds threads and sockets; a sandboxed grader bounds both)."""
    import torch.distributed as dist
    sub, solo = dist.new_group(list(SUB)), dist.new_group([0])
    yield (solo, (0,)) if dist.get_rank() == 0 else (sub, SUB)
    dist.barrier()                          # (not after a failure: the rank's error is reported at once)
    for group in (sub, solo):
        if group != dist.GroupMember.NON_GROUP_MEMBER:
            dist.destroy_process_group(group)


def _calls(rec):
    return [[c["op"], list(c["group"]) if c["group"] is not None else None, c["bytes"]] for c in rec]


# -- 11.1 ---------------------------------------------------------------------------------------
def _piece(full, rank, n):
    """Reference: pad with zero rows to N*c rows, cut into N equal pieces, take piece ``rank``."""
    c = math.ceil(full.shape[0] / n)
    padded = torch.cat([full, full.new_zeros((n * c - full.shape[0],) + tuple(full.shape[1:]))])
    return padded.view((n, c) + tuple(full.shape[1:]))[rank]


def _full(shape, i):
    return torch.randn(shape, generator=torch.Generator().manual_seed(i), dtype=torch.float64)


def _probe_shard():
    ex = exercise_module("ex11_fully_shard")
    out = []
    for i, shape in enumerate(SHAPES):
        for n in (1, 2, 3, 4):
            for rank in range(n):
                full = _full(shape, i)
                got = ex.shard_dim0(full, rank, n)
                piece = got.clone()
                got.fill_(7.0)                       # a view of full would write into it
                out.append([list(shape), n, rank, piece, full])
    return out


@pytest.mark.points(1)
def test_shard_dim0_pads_and_gives_each_rank_its_rows(student):
    """FSDP2's layout: every rank's piece, exactly; full unchanged"""
    for shape, n, rank, got, full_after in student.run(_probe_shard):
        full = _full(tuple(shape), SHAPES.index(tuple(shape)))
        want = _piece(full, rank, n)
        what = f"shard_dim0(full of shape {tuple(shape)}, rank={rank}, world_size={n})"
        assert tuple(got.shape) == tuple(want.shape), (
            f"{what}: shape {tuple(got.shape)}, expected {tuple(want.shape)} (FSDP2's layout: the same "
            f"shape on every rank)")
        _close(got, want, what, rtol=0, atol=0)
        assert torch.equal(full_after, full), f"{what} changed full, or returned a view of it: return a new tensor"


def _probe_unshard():
    with _groups() as (group, ranks):
        return _run_unshard(group, ranks)


def _run_unshard(group, ranks):
    import torch.distributed as dist
    ex = exercise_module("ex11_fully_shard")
    me, n = ranks.index(dist.get_rank()), len(ranks)
    out = []
    for i, shape in enumerate(SHAPES):
        piece = _piece(_full(shape, i), me, n).clone()
        before = piece.clone()
        with record_collectives() as rec:
            got = ex.unshard_dim0(piece, shape[0], group=group)
        out.append({"got": got.detach().clone(), "piece_changed": not torch.equal(piece, before),
                    "calls": _calls(rec), "piece_bytes": piece.numel() * piece.element_size()})
    return {"ranks": list(ranks), "cases": out}


@pytest.mark.points(2)
def test_unshard_dim0_on_a_subgroup(student):
    """values; one collective on the group passed, carrying the N pieces; rank 0 meanwhile on its own group"""
    for rank, got in enumerate(student.on_ranks(WORLD, _probe_unshard)):
        group = got["ranks"]
        for i, (shape, case) in enumerate(zip(SHAPES, got["cases"])):
            what = f"rank {rank}: unshard_dim0 of a {shape} parameter on the group {group}"
            _close(case["got"], _full(shape, i), what, rtol=0, atol=0)
            assert not case["piece_changed"], f"{what} changed the piece it was given"
            want = [["all_gather", group, len(group) * case["piece_bytes"]]]
            assert case["calls"] == want, (f"{what} made the collectives {case['calls']} (op, global ranks of its "
                                           f"group, bytes); expected ONE all_gather on the group passed, of the "
                                           f"{len(group)} equal pieces: {want}")


# -- 11.2 / 11.3: the mixed layout ------------------------------------------------------------------
def _values(key, shape, dtype, scale, seed=0):
    g = torch.Generator().manual_seed(seed * 1000 + sum(map(ord, key)))
    return (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype)


def _layout(case, n):
    """{group rank: [(key, tensor, holders)]} for an n-rank group. Keys name the pieces; copies of
    one piece (same key) are identical on every holder."""
    held = {r: [] for r in range(n)}
    if n == 1 or case == "solo":
        for key, shape, dtype, scale in (("A", (300, 7), torch.float16, 600.0), ("C", (5000,), torch.float32, 3.0)):
            held[0].append((key, _values(key, shape, dtype, scale), (0,)))
        return held
    if case == "empty":              # the last rank holds nothing
        for r in range(n - 1):
            held[r].append((f"S{r}", _values(f"S{r}", (3000,), torch.float16, 40.0), (r,)))
        both = _values("R", (2500,), torch.bfloat16, 2.0)
        for r in range(n - 1):
            held[r].append(("R", both.clone(), tuple(range(n - 1))))
        return held
    # "mixed": shards (fp16, bf16; fp32 on the host), a copy on every rank, copies on some
    for key, shape, dtype, scale in (("A", (2000, 7), torch.float16, 600.0),     # loss-scaled fp16
                                     ("B", (3001,), torch.bfloat16, 1e-3),
                                     ("C", (60000,), torch.float32, 3.0)):       # offloaded: fp32, host
        full = _values(key, shape, dtype, scale)
        for r in range(n):
            held[r].append((f"{key}{r}", _piece(full, r, n).clone(), (r,)))
    copies = {"D": ((500, 3), torch.float16, 30.0, tuple(range(n))),
              "E": ((3000,), torch.bfloat16, 0.5, tuple(range(1, n))),            # not on rank 0
              "F": ((257,), torch.float32, 5.0, (0, n - 1))}
    for key, (shape, dtype, scale, holders) in copies.items():
        value = _values(key, shape, dtype, scale)
        for r in holders:
            held[r].append((key, value.clone(), holders))
    return held


def _inject(held, key, index, value):
    """Put ``value`` at flat ``index`` of every copy of piece ``key``."""
    for pieces in held.values():
        for k, t, _ in pieces:
            if k == key:
                t.view(-1)[index] = value


def _bits(t):
    """The tensor's bits as integers: equal exactly when every element is the same, NaN included."""
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _reference_norm(held):
    seen, total = set(), 0.0
    for pieces in held.values():
        for key, t, _ in pieces:
            if key not in seen:
                seen.add(key)
                total += float(t.double().pow(2).sum())
    return math.sqrt(total)


OVERFLOWS = [None, ("A2", 10, math.inf), ("E", 2999, math.nan), ("C0", 0, -math.inf), ("F", 100, math.inf),
             ("D", 7, math.nan), ("B1", 1000, -math.inf)]


def _probe_found_inf():
    with _groups() as (group, ranks):
        return _run_found_inf(group, ranks)


def _run_found_inf(group, ranks):
    import torch.distributed as dist

    from zerolab.memory import allocation_trace
    ex = exercise_module("ex11_fully_shard")
    me = ranks.index(dist.get_rank())
    out = []
    for bad in OVERFLOWS:
        held = _layout("solo" if len(ranks) == 1 else "mixed", len(ranks))
        if bad is not None and len(ranks) > 1:
            _inject(held, *bad)
        pieces = [(t, holders) for _, t, holders in held[me]]
        with record_collectives() as rec, allocation_trace() as trace:
            got = ex.found_inf(pieces, group=group, budget_bytes=BUDGET)
        out.append({"got": got if isinstance(got, bool) else bool(got), "calls": _calls(rec), "peak": trace["peak"]})
    return {"ranks": list(ranks), "cases": out}


def _check_wire_and_memory(rank, what, group, calls, peak):
    assert len(calls) == 1 and calls[0][1] == group and calls[0][2] <= 8, (
        f"rank {rank}: {what} made the collectives {calls} (op, global ranks of its group, bytes of its largest "
        f"buffer); expected ONE collective on the group passed, {group}, of at most 8 bytes")
    assert peak <= BUDGET, (f"rank {rank}: {what} allocated {peak} bytes at once (torch's profiler); the budget "
                            f"was {BUDGET}, the pieces are several times larger")


@pytest.mark.points(3)
def test_found_inf_same_decision_on_every_rank(student):
    """the overflow check over the mixed layout: the same answer everywhere, one collective of <= 8 bytes, the budget"""
    for rank, got in enumerate(student.on_ranks(WORLD, _probe_found_inf)):
        group = got["ranks"]
        for bad, case in zip(OVERFLOWS, got["cases"]):
            want = bad is not None and len(group) > 1
            where = "nothing bad anywhere" if not want else f"{bad[2]} in piece {bad[0]}"
            assert case["got"] is want, (
                f"rank {rank} (group {group}): found_inf said {case['got']} with {where}; every rank of the group "
                f"must answer {want} (the step is skipped everywhere or nowhere)")
            _check_wire_and_memory(rank, f"found_inf ({where})", group, case["calls"], case["peak"])


CLIPS = [("mixed", 1.0, None), ("mixed", 1e12, None), ("mixed", 1.0, ("E", 5, math.nan)),
         ("mixed", 1.0, ("A1", 3, math.inf)), ("empty", 0.5, None)]


def _probe_clip():
    with _groups() as (group, ranks):
        return _run_clip(group, ranks)


def _run_clip(group, ranks):
    import torch.distributed as dist

    from zerolab.memory import allocation_trace
    ex = exercise_module("ex11_fully_shard")
    me = ranks.index(dist.get_rank())
    out = []
    for case, max_norm, bad in CLIPS:
        held = _layout("solo" if len(ranks) == 1 else case, len(ranks))
        if bad is not None and len(ranks) > 1:
            _inject(held, *bad)
        pieces = [(t, holders) for _, t, holders in held[me]]
        with record_collectives() as rec, allocation_trace() as trace:
            norm = ex.clip_grad_norm_(pieces, max_norm, group=group, budget_bytes=BUDGET)
        out.append({"norm": float(norm), "after": {k: t for k, t, _ in held[me]}, "calls": _calls(rec),
                    "peak": trace["peak"]})
    return {"ranks": list(ranks), "cases": out}


@pytest.mark.points(4)
def test_clip_grad_norm_over_a_mixed_layout(student):
    """the norm of everything counted once; pieces scaled alike; below max_norm and non-finite: unchanged"""
    for rank, got in enumerate(student.on_ranks(WORLD, _probe_clip)):
        group = got["ranks"]
        me = group.index(rank)
        for (case, max_norm, bad), res in zip(CLIPS, got["cases"]):
            held = _layout("solo" if len(group) == 1 else case, len(group))
            if bad is not None and len(group) > 1:
                _inject(held, *bad)
            norm = _reference_norm(held)
            what = f"rank {rank} (group {group}), {case} layout, max_norm {max_norm:g}" + (
                f", {bad[2]} in piece {bad[0]}" if bad is not None and len(group) > 1 else "")
            if math.isfinite(norm):
                assert res["norm"] == pytest.approx(norm, rel=1e-10), (
                    f"{what}: clip_grad_norm_ returned {res['norm']!r}; the norm of the whole gradient, every element "
                    f"once, in float64: {norm!r}")
            else:
                assert not math.isfinite(res["norm"]), (
                    f"{what}: clip_grad_norm_ returned {res['norm']!r}, but an element is {bad[2]}: the norm is not "
                    f"finite, and every rank must see that from its answer")
            coef = min(1.0, max_norm / (norm + 1e-6)) if math.isfinite(norm) else 1.0
            for key, before, _ in held[me]:
                after = res["after"][key]
                if coef == 1.0:
                    assert after.dtype == before.dtype and torch.equal(_bits(after), _bits(before)), (
                        f"{what}: piece {key} changed, though "
                        + ("the norm is below max_norm (torch's coefficient is capped at 1)" if math.isfinite(norm)
                           else "the norm is not finite (the step will be skipped: change nothing)"))
                else:
                    want = (before.double() * coef).to(before.dtype)
                    eps = torch.finfo(before.dtype).eps
                    _close(after.double(), want.double(), f"{what}: piece {key} after clipping "
                           f"(coefficient {coef:.6g})", rtol=2 * eps, atol=0)
            _check_wire_and_memory(rank, f"clip_grad_norm_ ({case} layout, max_norm {max_norm:g})", group,
                                   res["calls"], res["peak"])


# -- in a fully_shard loop ------------------------------------------------------------------------
GPT = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=2, seq_len=16)
MAX_NORM = 0.2


def _batch(step, rank, n=None):
    if n is None:
        return models.batch("gpt", seed=100 * step + rank, batch_size=4, **GPT)
    parts = [_batch(step, r) for r in range(n)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def _gpt():
    return models.build("gpt", seed=0, dtype=torch.float64, **GPT)


def _probe_clip_loop():
    """A fully_shard TinyGPT on ranks 1-3 (a subgroup) whose blocks are sharded and whose embeddings,
    final norm and head are left whole (copies on every rank): the submission's clipping, 2 SGD steps."""
    with _groups() as (group, ranks):
        return _run_clip_loop(group, ranks)


def _run_clip_loop(group, ranks):
    import torch.distributed as dist

    import zerolab
    ex = exercise_module("ex11_fully_shard")
    if len(ranks) == 1:
        return None
    me, everyone = ranks.index(dist.get_rank()), tuple(range(len(ranks)))
    model = _gpt()
    fs = zerolab.fully_shard(model, units=list(model.blocks), group=group)
    opt = torch.optim.SGD(fs.parameters(), lr=0.5)
    norms = []
    for step in range(2):
        fs(*_batch(step, me)).backward()
        fs.finish_gradient_synchronization()
        grads = fs.owned_grads()
        pieces = [(g, (me,)) for g in grads.sharded] + [(g, everyone) for g in grads.replicated]
        norms.append(float(ex.clip_grad_norm_(pieces, MAX_NORM, group=group)))
        opt.step()
        opt.zero_grad()
    return norms, fs.full_state_dict()


@pytest.mark.points(2)
def test_clip_grad_norm_equals_torch(student):
    """a fully_shard TinyGPT on a 3-rank subgroup: norms and weights as torch's clipping on one process"""
    model = _gpt()
    opt, norms = torch.optim.SGD(model.parameters(), lr=0.5), []
    for step in range(2):
        model(*_batch(step, None, len(SUB))).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        opt.step()
        opt.zero_grad()
    assert norms[0] > MAX_NORM
    for rank, res in enumerate(student.on_ranks(WORLD, _probe_clip_loop)):
        if rank not in SUB:
            continue
        got, state = res
        assert got == pytest.approx(norms, rel=1e-10), (
            f"rank {rank}: norms {got}; torch.nn.utils.clip_grad_norm_ on one process: {norms}")
        for name, p in model.named_parameters():
            _close(state[name], p.detach(), f"rank {rank}: {name} after 2 clipped steps", rtol=1e-10, atol=1e-12)


INJECT, STEPS = (1, 3), 5


def _probe_skip():
    """found_inf inside a fully_shard loop on ranks 1-3 with a dynamic loss scale (zerolab.LossScaler's
    rule): the second rank of the group alone holds an inf at steps 1 and 3."""
    with _groups() as (group, ranks):
        return _run_skip(group, ranks)


def _run_skip(group, ranks):
    import torch.distributed as dist

    import zerolab
    ex = exercise_module("ex11_fully_shard")
    if len(ranks) == 1:
        return None
    me = ranks.index(dist.get_rank())
    model = _gpt()
    fs = zerolab.fully_shard(model, group=group)
    opt = torch.optim.SGD(fs.parameters(), lr=0.5)
    scaler = zerolab.LossScaler(2.0 ** 8, growth_interval=2, group=group)
    for step in range(STEPS):
        scaler.scale(fs(*_batch(step, me))).backward()
        fs.finish_gradient_synchronization()
        if me == 1 and step in INJECT:
            model.pos.weight.grad.view(-1)[0] = math.inf          # this rank's own shard
        grads = [p.grad for p in fs.parameters() if p.grad is not None]
        for g in grads:
            g.mul_(scaler.inv_scale)
        found = bool(ex.found_inf([(g, (me,)) for g in grads], group=group))
        if not found:
            opt.step()
        scaler.update(found)
        opt.zero_grad()
    return scaler.history, fs.full_state_dict()


@pytest.mark.points(2)
def test_loss_scaling_skips_like_grad_scaler(student):
    """a fully_shard loop with a dynamic loss scale on a 3-rank subgroup: torch.amp.GradScaler's decisions"""
    n = len(SUB)
    model = _gpt()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    scaler, history = torch.amp.GradScaler("cpu", 2.0 ** 8, growth_interval=2), []
    rows = math.ceil(GPT["seq_len"] / n)                        # the first row of group rank 1's piece
    for step in range(STEPS):
        scale = scaler.get_scale()
        scaler.scale(model(*_batch(step, None, n))).backward()
        if step in INJECT:
            model.pos.weight.grad[rows, 0] = math.inf
        scaler.step(opt)
        scaler.update()
        history.append((scale, scaler.get_scale() < scale))
        opt.zero_grad()
    for rank, res in enumerate(student.on_ranks(WORLD, _probe_skip)):
        if rank not in SUB:
            continue
        got, state = res
        got = [tuple(h) for h in got]
        assert got == history, (f"rank {rank}: (loss scale, skipped) per step {got}; torch.amp.GradScaler on one "
                                f"process: {history}")
        for name, p in model.named_parameters():
            _close(state[name], p.detach(), f"rank {rank}: {name} after {STEPS} steps", rtol=1e-10, atol=1e-12)

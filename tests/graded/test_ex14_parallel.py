"""Graded: exercise 14. A pipeline step under a cap of micro-batches in flight per stage, on 2, 3 and
4 stages (the 3 on a subgroup), in float64: the gradients against one process, the cap and what each
stage holds (autograd's saved bytes and every tensor alive, at each forward's start), the time of the
stages' orders replayed on ideal stages against the fastest the cap allows, the point-to-point sends;
the closed form of that bubble; and a sequence-parallel MLP block on 2, 3 and 4 ranks and on two
groups at once: values and gradients against one process, the bytes each pass sends, what the block
keeps for backward against 1/t of one process's.

The probes run the submission on its own ranks and return plain data; every verdict is decided here,
against references computed here."""
import math
import os

import pytest
import torch
import torch.nn.functional as F

from zerolab.grade.helpers import exercise_module

# What this exercise must not use (checked before and while the tests run, zerolab.grade.references).
REFERENCE_MODULES = ["zerolab.pipeline", "zerolab.tensor_parallel"]

H, SEQ, MB = 16, 8, 2          # hidden width, sequence length, sequences per micro-batch
ACT = MB * SEQ * H * 8         # one activation passed between stages, float64: bytes
# (world size, the pipeline's ranks (None: all), micro-batches m, cap): caps below, at and above p,
# m not a multiple of the cap, m below the cap
CASES = [(2, None, 3, 1), (2, None, 4, 5), (4, (1, 2, 3), 5, 2), (4, None, 4, 2), (4, None, 4, 3),
         (4, None, 2, 3)]
_RUNS = {}                     # (implementation graded, what, args) -> the probes' replies


def _cached(student, what, world, probe, *args):
    """Each probe runs once per implementation graded (``--impl-each`` switches ZEROLAB_IMPL between
    folders); the tests below read the same replies."""
    key = (os.environ.get("ZEROLAB_IMPL", "exercises"), what, world, repr(args))
    if key not in _RUNS:
        _RUNS[key] = student.on_ranks(world, probe, *args)
    return _RUNS[key]


def _fastest(p, m, cap, forward=1.0, backward=2.0):
    """The least time any orders that hold at most ``cap`` micro-batches per stage can take on p
    identical stages (forward 1 unit, backward 2, communication free). Stage 0 can start micro-batch
    j + k only when micro-batch j's round trip through all p stages and back is over: with k =
    min(cap, p) the m micro-batches go in ceil(m/k) groups, and every group after the first waits
    (p - k) slots more than 1F1B's m + p - 1. (Checked against an exhaustive search over every order
    for p <= 3 with m <= 6 and p = 4 with m <= 5, and several forward/backward ratios.)"""
    k = min(cap, p)
    return (forward + backward) * (m + p - 1 + (p - k) * (math.ceil(m / k) - 1))


def _model(p, dtype=torch.float64):
    """The whole model: p TinyGPT blocks, float64, the same on every rank."""
    from zerolab import models
    return models.build("gpt", seed=0, dtype=dtype, d_model=H, n_heads=2, n_layers=p, seq_len=SEQ,
                        tied=False).blocks


def _batch(m, seed=3):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(MB, SEQ, H, generator=g, dtype=torch.float64) for _ in range(m)]
    ys = [torch.randn(MB, SEQ, H, generator=g, dtype=torch.float64) for _ in range(m)]
    return xs, ys


def _mse(out, target):
    return ((out - target) ** 2).mean()


class _Held:
    __slots__ = ("t", "__weakref__")

    def __init__(self, t):
        self.t = t


class _LiveBytes(torch.autograd.graph.saved_tensors_hooks):
    """Bytes autograd holds for backward right now (each storage once while a saved tensor refers to
    it, parameters left out): the grader's own census, independent of the code graded. Each saved
    tensor is kept in a Python object, so a census of every tensor alive sees it too."""

    def __init__(self):
        import weakref
        self.live, self._refs, self._finalize = 0, {}, weakref.finalize
        super().__init__(self._pack, lambda h: h.t if isinstance(h, _Held) else h)

    def __enter__(self):
        super().__enter__()
        return self

    def _pack(self, t):
        if isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter):
            return t.detach()
        st = t.untyped_storage()
        key = st.data_ptr()
        n, size = self._refs.get(key, (0, st.nbytes()))
        if n == 0:
            self.live += size
        self._refs[key] = (n + 1, size)
        held = _Held(t.detach())
        self._finalize(held, self._release, key)
        return held

    def _release(self, key):
        n, size = self._refs[key]
        if n == 1:
            del self._refs[key]
            self.live -= size
        else:
            self._refs[key] = (n - 1, size)


# -- 14.1: the pipeline under a cap ------------------------------------------------------------------
def _probe_pipeline(m, cap, ranks):
    """On every rank of the pipeline (``ranks``: its global ranks, None for all): run the submission's
    step on its stage; record each forward and backward (module and tensor hooks) with the bytes
    autograd holds then and, at each forward's start, the bytes of every tensor alive that the step
    created; the sends; the gradients. Ranks outside the pipeline return None."""
    import torch.distributed as dist

    from zerolab.grade.helpers import live_storages, new_bytes, record_collectives
    group = dist.new_group(list(ranks)) if ranks is not None else None
    if ranks is not None and dist.get_rank() not in ranks:
        return None
    ex = exercise_module("ex14_parallel")
    i, p = dist.get_rank(group), dist.get_world_size(group)
    stage = torch.nn.Sequential(_model(p)[i])
    xs, ys = _batch(m)
    first, last = i == 0, i == p - 1
    # one micro-batch's activation bytes on this stage, measured here before the submission runs
    with _LiveBytes() as one:
        x = xs[0] if first else torch.zeros(MB, SEQ, H, dtype=torch.float64, requires_grad=True)
        out = stage(x)
        if last:
            out = _mse(out, ys[0])
        per_micro_batch = one.live
    del x, out, one
    events, live, forwards = [], _LiveBytes(), []

    def pre(module, args):
        k = len(forwards)
        forwards.append(k)
        events.append(("F", k, live.live, new_bytes(before)))

    def post(module, args, output):
        k = forwards[-1]
        if output.requires_grad:
            output.register_hook(lambda g: events.append(("B", k, live.live, None)))

    hooks = [stage.register_forward_pre_hook(pre), stage.register_forward_hook(post)]
    before = live_storages()
    with record_collectives() as calls, live:
        losses = ex.capped_pipeline_step(stage, m, cap, inputs=xs if first else None, targets=ys if last else None,
                                         loss_fn=_mse if last else None, shape=(MB, SEQ, H), dtype=torch.float64,
                                         group=group)
    for h in hooks:
        h.remove()
    grads = {f"{i}.{n.split('.', 1)[1]}": (q.grad.clone() if q.grad is not None else None)
             for n, q in stage.named_parameters()}
    sends = [(c["op"], c["peer"], c["bytes"]) for c in calls]
    return {"losses": [float(v) for v in losses], "events": events, "per_micro_batch": per_micro_batch,
            "grads": grads, "calls": sends}


def _pipeline_runs(student):
    out = {}
    for world, ranks, m, cap in CASES:
        replies = _cached(student, "pipeline", world, _probe_pipeline, m, cap, ranks)
        ranks = ranks or tuple(range(world))
        out[(len(ranks), m, cap)] = [dict(r, ranks=ranks) for r in replies if r is not None]
    return out


def _reference(p, m):
    """One process, float64: the mean of the m micro-batch losses over the whole model, its gradients."""
    blocks = torch.nn.Sequential(*_model(p))
    xs, ys = _batch(m)
    losses = [_mse(blocks(x), y) for x, y in zip(xs, ys)]
    (sum(losses) / m).backward()
    return [float(v.detach()) for v in losses], {n: q.grad for n, q in blocks.named_parameters()}


def _replay(orders, forward=1.0, backward=2.0):
    """Each stage's recorded order replayed on identical stages: forward 1 unit, backward 2, a forward
    of k waiting for stage i-1's, a backward of k for stage i+1's (and its own forward). The time the
    last stage finishes, or None for orders that could never finish."""
    p = len(orders)
    done, clock, pos = {}, [0.0] * p, [0] * p
    while sum(pos) < sum(len(o) for o in orders):
        moved = False
        for i in range(p):
            if pos[i] == len(orders[i]):
                continue
            op, k = orders[i][pos[i]]
            deps = [("F", i, k)] if op == "B" else []
            deps += [("F", i - 1, k)] if op == "F" and i > 0 else []
            deps += [("B", i + 1, k)] if op == "B" and i < p - 1 else []
            if all(d in done for d in deps):
                clock[i] = max([clock[i]] + [done[d] for d in deps]) + (forward if op == "F" else backward)
                done[(op, i, k)] = clock[i]
                pos[i] += 1
                moved = True
        if not moved:
            return None
    return max(clock)


@pytest.mark.points(3)
def test_capped_step_equals_one_process(student):
    """the capped step: losses and every stage's gradients equal one process on the whole batch (float64)"""
    for (p, m, cap), ranks in _pipeline_runs(student).items():
        want_losses, want = _reference(p, m)
        got = ranks[-1]["losses"]
        assert len(got) == m and all(r["losses"] == [] for r in ranks[:-1]), \
            f"p={p}, m={m}, cap={cap}: the last stage returns its m losses, the others []: got {[r['losses'] for r in ranks]}"
        assert got == pytest.approx(want_losses, rel=1e-12), f"p={p}, m={m}, cap={cap}: losses {got}, one process {want_losses}"
        for i, r in enumerate(ranks):
            for name, g in r["grads"].items():
                assert g is not None, f"p={p}, m={m}, cap={cap}, stage {i}: {name} has no gradient"
                ratio = (g.norm() / want[name].norm()).item()
                assert torch.allclose(g, want[name], rtol=1e-9, atol=1e-12), (
                    f"p={p}, m={m}, cap={cap}, stage {i}: the gradient of {name} differs from one process's "
                    f"gradient of the mean loss (norm ratio {ratio:.4g}; {m:g} would be a sum over micro-batches)")


def _orders(ranks):
    return [[(op, k) for op, k, _, _ in r["events"]] for r in ranks]


@pytest.mark.points(3)
def test_capped_step_respects_the_cap_and_frees_memory(student):
    """memory: at most cap micro-batches in flight; autograd holds exactly theirs; nothing of a micro-batch outlives its backward"""
    for (p, m, cap), ranks in _pipeline_runs(student).items():
        for i, r in enumerate(ranks):
            events = r["events"]
            fwd = [k for op, k, _, _ in events if op == "F"]
            bwd = [k for op, k, _, _ in events if op == "B"]
            assert fwd == list(range(m)) and sorted(bwd) == list(range(m)), (
                f"p={p}, m={m}, cap={cap}, stage {i}: each micro-batch runs forward once, in micro-batch order, and "
                f"backward once: got {_orders([r])[0]}")
            one, in_flight, peak = r["per_micro_batch"], 0, 0
            for op, k, saved, alive in events:
                if op == "F":
                    assert saved == in_flight * one, (
                        f"p={p}, m={m}, cap={cap}, stage {i}: before the forward of micro-batch {k}, {in_flight} in "
                        f"flight, autograd holds {saved} B; {in_flight} x {one} B (one micro-batch's activations "
                        f"here) = {in_flight * one} B")
                    budget = in_flight * (one + ACT) + 2 * ACT + 4096
                    assert alive <= budget, (
                        f"p={p}, m={m}, cap={cap}, stage {i}: at the forward of micro-batch {k}, the tensors this "
                        f"step created and still holds take {alive:,} B; {in_flight} micro-batches in flight need "
                        f"{in_flight} x ({one:,} B saved + {ACT:,} B output), plus a receive and a send in transit "
                        f"({2 * ACT:,} B): {budget:,} B. Something of a finished micro-batch (its output, its "
                        f"input, a send buffer) is kept alive")
                in_flight += 1 if op == "F" else -1
                peak = max(peak, in_flight)
            assert peak <= cap, (
                f"p={p}, m={m}, cap={cap}, stage {i}: {peak} micro-batches in flight at once, more than the cap "
                f"{cap}. Order: {_orders([r])[0]}")


@pytest.mark.points(3)
def test_capped_step_is_as_fast_as_the_cap_allows(student):
    """time: the stages' orders, replayed on ideal stages (forward 1, backward 2), finish as soon as any orders under the cap can"""
    for (p, m, cap), ranks in _pipeline_runs(student).items():
        orders = _orders(ranks)
        end = _replay(orders)
        assert end is not None, f"p={p}, m={m}, cap={cap}: these orders could never finish: {orders}"
        best = _fastest(p, m, cap)
        assert end == pytest.approx(best, abs=1e-9), (
            f"p={p}, m={m}, cap={cap}: replayed (forward 1, backward 2), your orders finish at {end:g}; orders "
            f"holding at most {cap} micro-batches per stage can finish at {best:g}. Orders per stage: {orders}")


@pytest.mark.points(1)
def test_capped_step_point_to_point_to_neighbours(student):
    """communication: one send of an activation forward and one of a gradient backward per micro-batch, to neighbours only"""
    for (p, m, cap), ranks in _pipeline_runs(student).items():
        for i, r in enumerate(ranks):
            others = [c for c in r["calls"] if c[0] not in ("isend", "send", "irecv", "recv")]
            assert not others, f"p={p}, m={m}, cap={cap}, stage {i}: collectives in a pipeline step: {others}"
            to = {}
            for _, peer, nbytes in [c for c in r["calls"] if c[0] in ("isend", "send")]:
                assert nbytes == ACT, f"p={p}, m={m}, cap={cap}, stage {i}: a send of {nbytes} B; one activation is {ACT} B"
                to[peer] = to.get(peer, 0) + 1
            g = r["ranks"]                               # stage j runs on global rank g[j]
            want = {g[q]: m for q in (i - 1, i + 1) if 0 <= q < p}
            assert to == want, (f"p={p}, m={m}, cap={cap}, stage {i} (global rank {g[i]}): sends per peer "
                                f"(global ranks) {to}, expected {want}")


# -- 14.1: the bubble in closed form ------------------------------------------------------------------
GRID = [(p, m, cap) for p in range(1, 9) for m in range(1, 19) for cap in range(1, 11)]
BAD = [(0, 4, 2), (4, 0, 2), (4, 4, 0), (4, 4, -1), (2.0, 4, 2), (4, 4, 1.5), (4, "4", 2)]


def _probe_bubble(grid, bad):
    ex = exercise_module("ex14_parallel")
    values = [float(ex.capped_bubble(p, m, cap)) for p, m, cap in grid]
    refusals = []
    for args in bad:
        try:
            ex.capped_bubble(*args)
            refusals.append(None)
        except Exception as exc:              # the type and message, judged by the test
            refusals.append([type(exc).__name__, str(exc)])
    return {"values": values, "refusals": refusals}


@pytest.mark.points(2)
def test_capped_bubble_closed_form(student):
    """the idle fraction under a cap, against the replay of the fastest orders (p, m, cap on a grid)"""
    got = _cached(student, "bubble", 1, _probe_bubble, GRID, BAD)[0]["values"]
    for (p, m, cap), value in zip(GRID, got):
        want = 1 - m * 3.0 / _fastest(p, m, cap)
        assert value == pytest.approx(want, abs=1e-12), (
            f"capped_bubble(p={p}, m={m}, cap={cap}) = {value:.6g}; the fastest orders under that cap idle "
            f"{want:.6g} of the step on every stage (1F1B's (p-1)/(m+p-1) = {(p - 1) / (m + p - 1):.6g})")


@pytest.mark.points(1)
def test_capped_bubble_refuses_bad_input(student):
    """ValueError naming the bad value for a p, m or cap that is not an int >= 1"""
    got = _cached(student, "bubble", 1, _probe_bubble, GRID, BAD)[0]["refusals"]
    for args, refusal in zip(BAD, got):
        bad = next(v for v in args if not (isinstance(v, int) and not isinstance(v, bool) and v >= 1))
        assert refusal is not None, f"capped_bubble{args} returned a value: p, m and cap must be ints >= 1"
        assert refusal[0] == "ValueError", f"capped_bubble{args} raised {refusal[0]}: expected a ValueError"
        assert repr(bad) in refusal[1] or str(bad) in refusal[1], \
            f"capped_bubble{args}: the message {refusal[1]!r} does not name the bad value {bad!r}"


# -- 14.2: a sequence-parallel MLP block ----------------------------------------------------------------
S2, B2, H2 = 24, 2, 6           # sequence (a multiple of 2, 3 and 4), batch, hidden; 4 * H2 hidden units
FULL = S2 * B2 * H2 * 8         # one (s, b, h) tensor in float64: bytes
SMALL = 3 * H2 * 8              # the three replicated parameters' gradients: bytes
BLOCK_RUNS = [(2, None), (3, None), (4, None), (4, ((0, 2), (1, 3)))]    # (world size, groups)


def _block_tensors(seed=7):
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)
    return {"x": r(S2, B2, H2), "ln_w": 1 + r(H2) / 10, "ln_b": r(H2) / 10, "fc_w": r(4 * H2, H2) / 2,
            "fc_b": r(4 * H2) / 10, "out_w": r(H2, 4 * H2) / 4, "out_b": r(H2) / 10, "c": r(S2, B2, H2)}


def _shares(t, r):
    return slice(r * S2 // t, (r + 1) * S2 // t), slice(r * 4 * H2 // t, (r + 1) * 4 * H2 // t)


NAMES = ("x", "ln_w", "ln_b", "fc_w", "fc_b", "out_w", "out_b")


def _parts(T, t, r):
    """This rank's arguments, cut from the whole tensors: {name: tensor}."""
    rows, units = _shares(t, r)
    return {"x": T["x"][rows], "ln_w": T["ln_w"], "ln_b": T["ln_b"], "fc_w": T["fc_w"][units],
            "fc_b": T["fc_b"][units], "out_w": T["out_w"][:, units], "out_b": T["out_b"]}


def _probe_block(groups):
    """On every rank: the submission's block on this rank's slice, in its group (``groups``: tuples of
    global ranks; None: all ranks); the loss is this rank's share of sum(y * c). Records the
    collectives of each pass and, at the end of forward, the bytes of every tensor the block created
    and still holds (autograd's saved tensors included), each storage once."""
    import torch.distributed as dist

    from zerolab.grade.helpers import live_storages, record_collectives
    group = None
    if groups is not None:
        made = [dist.new_group(list(g)) for g in groups]
        group = next(h for g, h in zip(groups, made) if dist.get_rank() in g)
    ex = exercise_module("ex14_parallel")
    t, r = dist.get_world_size(group), dist.get_rank(group)
    T = _block_tensors()
    args = {name: v.clone().requires_grad_() for name, v in _parts(T, t, r).items()}
    rows, _ = _shares(t, r)
    c = T["c"][rows].clone()
    before = live_storages()
    with record_collectives() as fwd, _LiveBytes():
        y = ex.sequence_parallel_mlp(args["x"], args["ln_w"], args["ln_b"], args["fc_w"], args["fc_b"],
                                     args["out_w"], args["out_b"], group)
    y_key = (y.device.type, y.device.index, y.untyped_storage().data_ptr())
    held = {key: b for key, b in live_storages().items() if key not in before and key != y_key}
    with record_collectives() as bwd:
        (y * c).sum().backward()
    grad = lambda q: q.grad.clone() if q.grad is not None else None
    return {"t": t, "r": r, "y": y.detach().clone(), "held": sorted(held.values()),
            "grads": {name: grad(v) for name, v in args.items()},
            "after": {name: v.detach().clone() for name, v in args.items()},
            "fwd": [(c_["op"], c_["bytes"]) for c_ in fwd], "bwd": [(c_["op"], c_["bytes"]) for c_ in bwd]}


def _block_runs(student):
    return {(world, groups): _cached(student, "block", world, _probe_block, groups) for world, groups in BLOCK_RUNS}


def _block_reference():
    """One process, float64: the block's output, every gradient, and the bytes autograd keeps for its
    backward (parameters and tensors of at most h values left out, as for the ranks)."""
    T = _block_tensors()
    p = {name: T[name].clone().requires_grad_() for name in NAMES}
    saved, leaves = {}, {q.untyped_storage().data_ptr() for q in p.values()}

    def pack(t):                      # every storage autograd saves, the inputs and parameters left out
        st = t.untyped_storage()
        if st.data_ptr() not in leaves:
            saved[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        u = F.layer_norm(p["x"], (H2,), p["ln_w"], p["ln_b"])
        y = p["x"] + F.linear(F.gelu(F.linear(u, p["fc_w"], p["fc_b"])), p["out_w"], p["out_b"])
    (y * T["c"]).sum().backward()
    kept = sum(b for b in saved.values() if b > H2 * 8)
    return y.detach(), {name: q.grad for name, q in p.items()}, kept


@pytest.mark.points(3)
def test_sequence_parallel_block_equals_one_process(student):
    """14.2: each rank's output slice and every gradient equal one process's (float64); the caller's tensors unchanged"""
    y, g, _ = _block_reference()
    T = _block_tensors()
    for (world, groups), ranks in _block_runs(student).items():
        for got in ranks:
            t, r = got["t"], got["r"]
            rows, units = _shares(t, r)
            where = f"t={t}{' (groups ' + str(groups) + ')' if groups else ''}, rank {r}"
            assert tuple(got["y"].shape) == (S2 // t, B2, H2), \
                f"{where}: returned shape {tuple(got['y'].shape)}, expected this rank's slice {(S2 // t, B2, H2)}"
            assert torch.allclose(got["y"], y[rows], rtol=1e-10, atol=1e-12), \
                f"{where}: the output is not rows {rows.start}:{rows.stop} of one process's block output"
            for name, want in _parts(T, t, r).items():
                assert torch.equal(got["after"][name], want), f"{where}: the caller's {name} was changed"
            wants = {"x": g["x"][rows], "fc_w": g["fc_w"][units], "fc_b": g["fc_b"][units],
                     "out_w": g["out_w"][:, units], "ln_w": g["ln_w"], "ln_b": g["ln_b"], "out_b": g["out_b"]}
            for name, want in wants.items():
                gg = got["grads"][name]
                assert gg is not None, f"{where}: {name} has no gradient"
                assert torch.allclose(gg, want, rtol=1e-9, atol=1e-12), (
                    f"{where}: the gradient of {name} differs from one process's"
                    + (" (a replicated parameter: every rank holds the WHOLE gradient, the sum over the ranks' "
                       "tokens)" if name in ("ln_w", "ln_b", "out_b") else "")
                    + f"; largest difference {(gg - want).abs().max().item():.3g}")


def _sent(calls, t):
    """Bytes one rank sends for recorded (op, bytes) calls under a ring: all-reduce 2(t-1)/t of the
    buffer, the others (t-1)/t. torch's list forms (all_gather(list, x), reduce_scatter(out, list))
    are recorded with their largest tensor, the slice: counted as the whole buffer."""
    total = 0.0
    for op, nbytes in calls:
        if op in ("all_gather", "reduce_scatter") and nbytes * t <= FULL:
            nbytes *= t
        total += (2 if op == "all_reduce" else 1) * (t - 1) / t * nbytes
    return total


@pytest.mark.points(2)
def test_sequence_parallel_block_communication(student):
    """14.2: no all-reduce of an activation; forward sends one all-reduce's bytes of (s, b, h), backward one and a half"""
    for (world, groups), ranks in _block_runs(student).items():
        for got in ranks:
            t, r = got["t"], got["r"]
            where = f"t={t}{' (groups ' + str(groups) + ')' if groups else ''}, rank {r}"
            for what, calls, budget in (("forward", got["fwd"], 2 * (t - 1) / t * FULL),
                                        ("backward", got["bwd"], 3 * (t - 1) / t * FULL + 2 * (t - 1) * SMALL)):
                big = [(op, b) for op, b in calls if op == "all_reduce" and b > SMALL]
                assert not big, (f"{where}, {what}: all-reduces of {[b for _, b in big]} B; only the replicated "
                                 f"parameters' gradients ({SMALL} B) may be all-reduced. Calls: {calls}")
                sent = _sent(calls, t)
                extra = ", plus the sums of the replicated parameters' gradients" if what == "backward" else ""
                assert sent <= budget + 1e-6, (
                    f"{where}, {what}: this rank sends {sent:,.0f} B; the budget is {budget:,.0f} B "
                    f"({'one all-reduce' if what == 'forward' else 'one and a half all-reduces'} of the (s, b, h) "
                    f"tensor's {FULL:,} B{extra}). "
                    f"Calls (op, bytes): {calls}")
            assert got["fwd"], f"{where}: no collective in forward: the ranks' partial sums are never combined"


@pytest.mark.points(2)
def test_sequence_parallel_block_memory(student):
    """14.2: what the block keeps for backward is at most 1/t of one process's (every activation 1/t)"""
    _, _, one = _block_reference()
    for (world, groups), ranks in _block_runs(student).items():
        for got in ranks:
            t, r = got["t"], got["r"]
            where = f"t={t}{' (groups ' + str(groups) + ')' if groups else ''}, rank {r}"
            kept = sum(b for b in got["held"] if b > H2 * 8)
            assert kept <= one / t, (
                f"{where}: at the end of forward the block holds {kept:,} B for backward (tensors it created "
                f"and still keeps: {[b for b in got['held'] if b > H2 * 8]}); one process keeps {one:,} B for the "
                f"same block, 1/t of it is {one / t:,.0f} B. A whole (s, b, h) tensor is {FULL:,} B")

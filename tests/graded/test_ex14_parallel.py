"""Graded: exercise 14. The 1F1B schedule on 2 and 4 pipeline stages (gradients against one process
in float64, the order of forwards and backwards, the micro-batches in flight and the activation bytes
autograd holds, the bubble of the order replayed with unit-time forwards and two-unit backwards, the
point-to-point sends), and sequence parallelism's reduce-scatter / all-gather pair on a row-parallel
-> LayerNorm -> column-parallel block over 2 and 4 ranks (values and gradients against one process,
the collectives and bytes of each pass, what the LayerNorm keeps).

The probes run the submission on its own ranks and return plain data; every verdict is decided here,
against references computed here."""
import pytest
import torch
import torch.nn.functional as F

from zerolab.grade.helpers import exercise_module

# What this exercise must not use (checked before and while the tests run, zerolab.grade.references).
REFERENCE_MODULES = ["zerolab.pipeline", "zerolab.tensor_parallel"]

H, SEQ, MB = 16, 8, 2          # hidden width, sequence length, sequences per micro-batch
LAYERS_PER_STAGE = 1
CASES = [(2, 1), (2, 3), (4, 2), (4, 6)]        # (stages p, micro-batches m): m < p too


def _model(p, dtype=torch.float64):
    """The whole model: p x LAYERS_PER_STAGE TinyGPT blocks, float64, the same on every rank."""
    from zerolab import models
    return models.build("gpt", seed=0, dtype=dtype, d_model=H, n_heads=2, n_layers=p * LAYERS_PER_STAGE,
                        seq_len=SEQ, tied=False).blocks


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
    it, parameters left out): the grader's own census, independent of the code graded."""

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


def _probe_pipeline(m):
    """On every rank of the pipeline: run the submission's step on its stage; record each forward and
    backward (module and tensor hooks), the bytes autograd holds at each, the sends, the gradients."""
    import torch.distributed as dist

    from zerolab.grade.helpers import record_collectives
    ex = exercise_module("ex14_parallel")
    s, p = dist.get_rank(), dist.get_world_size()
    blocks = _model(p)
    stage = torch.nn.Sequential(*blocks[s * LAYERS_PER_STAGE:(s + 1) * LAYERS_PER_STAGE])
    xs, ys = _batch(m)
    first, last = s == 0, s == p - 1
    # one micro-batch's activation bytes on this stage, measured here before the submission runs
    with _LiveBytes() as one:
        x = xs[0] if first else torch.zeros(MB, SEQ, H, dtype=torch.float64, requires_grad=True)
        out = stage(x)
        if last:
            out = _mse(out, ys[0])
        per_micro_batch = one.live
    del x, out
    events, live = [], _LiveBytes()
    forwards = []

    def pre(module, args):
        k = len(forwards)
        forwards.append(k)
        events.append(("F", k, live.live))

    def post(module, args, output):
        k = forwards[-1]
        if output.requires_grad:
            output.register_hook(lambda g: events.append(("B", k, live.live)))

    hooks = [stage.register_forward_pre_hook(pre), stage.register_forward_hook(post)]
    with record_collectives() as calls, live:
        losses = ex.one_f_one_b_step(stage, m, inputs=xs if first else None, targets=ys if last else None,
                                     loss_fn=_mse if last else None, shape=(MB, SEQ, H), dtype=torch.float64)
    for h in hooks:
        h.remove()
    grads = {f"{s * LAYERS_PER_STAGE + int(n.split('.')[0])}.{n.split('.', 1)[1]}":
             (q.grad.clone() if q.grad is not None else None) for n, q in stage.named_parameters()}
    sends = [(c["op"], c["peer"], c["bytes"]) for c in calls]
    return {"losses": [float(v) for v in losses], "events": events, "per_micro_batch": per_micro_batch,
            "grads": grads, "calls": sends}


def _reference(p, m):
    """One process, float64: the mean of the m micro-batch losses over the whole model, its gradients."""
    blocks = torch.nn.Sequential(*_model(p))
    xs, ys = _batch(m)
    losses = [_mse(blocks(x), y) for x, y in zip(xs, ys)]
    (sum(losses) / m).backward()
    return [float(v.detach()) for v in losses], {n: q.grad for n, q in blocks.named_parameters()}


def _replay(orders, forward=1.0, backward=2.0):
    """Each stage's recorded order replayed on identical devices: forward 1 unit, backward 2, a
    forward of k waiting for stage s-1's, a backward of k for stage s+1's. Per stage: idle fraction."""
    p = len(orders)
    done, clock, pos = {}, [0.0] * p, [0] * p
    while sum(pos) < sum(len(o) for o in orders):
        moved = False
        for s in range(p):
            if pos[s] == len(orders[s]):
                continue
            op, k = orders[s][pos[s]]
            deps = [("F", s, k)] if op == "B" else []
            deps += [("F", s - 1, k)] if op == "F" and s > 0 else []
            deps += [("B", s + 1, k)] if op == "B" and s < p - 1 else []
            if all(d in done for d in deps):
                clock[s] = max([clock[s]] + [done[d] for d in deps]) + (forward if op == "F" else backward)
                done[(op, s, k)] = clock[s]
                pos[s] += 1
                moved = True
        if not moved:
            return None                               # an order that could never finish
    end = max(clock)
    return [1 - sum(forward if op == "F" else backward for op, _ in o) / end for o in orders]


def _pipeline_runs(student):
    return {(p, m): student.on_ranks(p, _probe_pipeline, m) for p, m in CASES}


@pytest.mark.points(3)
def test_1f1b_equals_one_process(student):
    """the 1F1B step: losses and every stage's gradients equal one process on the whole batch (float64)"""
    for (p, m), ranks in _pipeline_runs(student).items():
        want_losses, want = _reference(p, m)
        got = ranks[-1]["losses"]
        assert len(got) == m and all(r["losses"] == [] for r in ranks[:-1]), \
            f"p={p}, m={m}: the last stage returns its m losses, the others []: got {[r['losses'] for r in ranks]}"
        assert got == pytest.approx(want_losses, rel=1e-12), f"p={p}, m={m}: losses {got}, one process {want_losses}"
        for s, r in enumerate(ranks):
            for name, g in r["grads"].items():
                assert g is not None, f"p={p}, m={m}, stage {s}: {name} has no gradient"
                ratio = (g.norm() / want[name].norm()).item()
                assert torch.allclose(g, want[name], rtol=1e-9, atol=1e-12), (
                    f"p={p}, m={m}, stage {s}: the gradient of {name} differs from one process's gradient of the "
                    f"mean loss (norm ratio {ratio:.4g}; {m:g} would be a sum over micro-batches, not the mean)")


@pytest.mark.points(2)
def test_1f1b_order_and_bubble(student):
    """schedule: forwards and backwards in micro-batch order; replayed with unit costs, the bubble is (p-1)/(m+p-1)"""
    for (p, m), ranks in _pipeline_runs(student).items():
        orders = []
        for s, r in enumerate(ranks):
            order = [(op, k) for op, k, _ in r["events"]]
            bwd = [k for op, k in order if op == "B"]
            assert bwd == list(range(m)), (
                f"p={p}, m={m}, stage {s}: backwards in the order {bwd}; 1F1B runs them oldest first, "
                f"in micro-batch order (a stage frees the micro-batch it has held longest)")
            orders.append(order)
        idle = _replay(orders)
        assert idle is not None, f"p={p}, m={m}: these orders could never finish: {orders}"
        want = (p - 1) / (m + p - 1)
        assert idle == pytest.approx([want] * p, abs=1e-9), (
            f"p={p}, m={m}: replayed (forward 1, backward 2), the stages idle {[round(i, 3) for i in idle]} of the step; "
            f"a pipeline idles (p-1)/(m+p-1) = {want:.3f}. Orders: {orders}")


@pytest.mark.points(3)
def test_1f1b_in_flight_and_activation_memory(student):
    """memory: at most min(p - s, m) micro-batches in flight on stage s, reached, and the bytes autograd holds follow"""
    for (p, m), ranks in _pipeline_runs(student).items():
        for s, r in enumerate(ranks):
            events = r["events"]
            fwd = [k for op, k, _ in events if op == "F"]
            bwd = [k for op, k, _ in events if op == "B"]
            assert fwd == list(range(m)) and sorted(bwd) == list(range(m)), \
                f"p={p}, m={m}, stage {s}: each micro-batch runs forward once and backward once: got {events}"
            in_flight, peak = 0, 0
            for op, _, _ in events:
                in_flight += 1 if op == "F" else -1
                peak = max(peak, in_flight)
            bound = min(p - s, m)
            assert peak == bound, (
                f"p={p}, m={m}, stage {s}: {peak} micro-batches in flight at once; 1F1B holds min(p - s, m) = {bound} "
                f"(GPipe would hold all {m}; fewer means the stage waits where it could work)")
            # at each forward's start, autograd holds the micro-batches in flight: that many x one micro-batch
            one, in_flight = r["per_micro_batch"], 0
            for op, k, live in events:
                if op == "F":
                    assert live == in_flight * one, (
                        f"p={p}, m={m}, stage {s}: before the forward of micro-batch {k}, {in_flight} in flight, "
                        f"autograd holds {live} B; {in_flight} x {one} B (one micro-batch's activations here) = "
                        f"{in_flight * one} B")
                in_flight += 1 if op == "F" else -1


@pytest.mark.points(1)
def test_1f1b_point_to_point_to_neighbours(student):
    """communication: one send of an activation forward and one of a gradient backward per micro-batch, to neighbours only"""
    act = MB * SEQ * H * 8
    for (p, m), ranks in _pipeline_runs(student).items():
        for s, r in enumerate(ranks):
            others = [c for c in r["calls"] if c[0] not in ("isend", "send", "irecv", "recv")]
            assert not others, f"p={p}, m={m}, stage {s}: collectives in a pipeline step: {others}"
            to = {}
            for _, peer, nbytes in [c for c in r["calls"] if c[0] in ("isend", "send")]:
                assert nbytes == act, f"p={p}, m={m}, stage {s}: a send of {nbytes} B; one activation is {act} B"
                to[peer] = to.get(peer, 0) + 1
            want = {q: m for q in (s - 1, s + 1) if 0 <= q < p}
            assert to == want, f"p={p}, m={m}, stage {s}: sends per peer {to}, expected {want}"


# -- 14.2: sequence parallelism's conjugate pair -------------------------------------------------
S2, B2, H2 = 8, 2, 6             # sequence (a multiple of t), batch, hidden; the MLP width is 4 * H2


def _block_tensors(seed=7):
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)
    return {"x": r(S2, B2, 4 * H2), "w_row": r(H2, 4 * H2) / 4, "w_col": r(4 * H2, H2) / 2,
            "ln_w": 1 + r(H2) / 10, "ln_b": r(H2) / 10, "c": r(S2, B2, 4 * H2)}


def _probe_sequence():
    """Row-parallel linear -> reduce_scatter_sequence -> LayerNorm on the slice -> all_gather_sequence
    -> column-parallel linear, on every rank; the loss is each rank's share of sum(v * c)."""
    import torch.distributed as dist

    from zerolab.grade.helpers import record_collectives
    ex = exercise_module("ex14_parallel")
    t, r = dist.get_world_size(), dist.get_rank()
    T = _block_tensors()
    cols = slice(r * 4 * H2 // t, (r + 1) * 4 * H2 // t)            # this rank's columns of the MLP width
    x = T["x"][..., cols].clone().requires_grad_()
    w_row = T["w_row"][:, cols].clone().requires_grad_()            # row-parallel: (h, 4h/t)
    w_col = T["w_col"][cols].clone().requires_grad_()               # column-parallel: (4h/t, h)
    ln_w, ln_b = torch.nn.Parameter(T["ln_w"].clone()), torch.nn.Parameter(T["ln_b"].clone())   # not activations
    with record_collectives() as fwd:
        z = ex.reduce_scatter_sequence(x @ w_row.t(), None)          # (s/t, b, h): this rank's tokens
        with _LiveBytes() as ln:
            u = F.layer_norm(z, (H2,), ln_w, ln_b)
            ln_bytes = ln.live
        v = ex.all_gather_sequence(u, None) @ w_col.t()              # (s, b, 4h/t)
        loss = (v * T["c"][..., cols]).sum()
    with record_collectives() as bwd:
        loss.backward()
    grad = lambda q: q.grad.clone() if q.grad is not None else None
    return {"z": z.detach(), "v": v.detach(), "ln_bytes": ln_bytes,
            "grads": {"x": grad(x), "w_row": grad(w_row), "w_col": grad(w_col), "ln_w": grad(ln_w), "ln_b": grad(ln_b)},
            "fwd": [(c["op"], c["bytes"]) for c in fwd], "bwd": [(c["op"], c["bytes"]) for c in bwd]}


def _sequence_reference():
    T = _block_tensors()
    x, w_row, w_col, ln_w, ln_b = (T[k].clone().requires_grad_() for k in ("x", "w_row", "w_col", "ln_w", "ln_b"))
    z = x @ w_row.t()
    v = F.layer_norm(z, (H2,), ln_w, ln_b) @ w_col.t()
    (v * T["c"]).sum().backward()
    return z.detach(), v.detach(), {"x": x.grad, "w_row": w_row.grad, "w_col": w_col.grad, "ln_w": ln_w.grad,
                                    "ln_b": ln_b.grad}


@pytest.mark.points(2)
def test_sequence_parallel_values_and_gradients(student):
    """14.2: the slice, the gathered output and every gradient equal one process (float64)"""
    z, v, g = _sequence_reference()
    for t in (2, 4):
        ranks = student.on_ranks(t, _probe_sequence)
        for r, got in enumerate(ranks):
            rows, cols = slice(r * S2 // t, (r + 1) * S2 // t), slice(r * 4 * H2 // t, (r + 1) * 4 * H2 // t)
            assert tuple(got["z"].shape) == (S2 // t, B2, H2), \
                f"t={t}, rank {r}: reduce_scatter_sequence returned shape {tuple(got['z'].shape)}, expected its slice {(S2 // t, B2, H2)}"
            assert torch.allclose(got["z"], z[rows], rtol=1e-10, atol=1e-12), \
                f"t={t}, rank {r}: reduce_scatter_sequence is not rows {rows.start}:{rows.stop} of the SUM over ranks"
            assert torch.allclose(got["v"], v[..., cols], rtol=1e-10, atol=1e-12), \
                f"t={t}, rank {r}: the column-parallel output after all_gather_sequence differs from one process"
            for name, index in (("x", (Ellipsis, cols)), ("w_row", (slice(None), cols)), ("w_col", (cols,))):
                gg = got["grads"][name]
                assert gg is not None and torch.allclose(gg, g[name][index], rtol=1e-9, atol=1e-12), (
                    f"t={t}, rank {r}: the gradient of {name} differs from one process's (the backward of "
                    f"all_gather_sequence must sum the ranks' partial gradients, that of reduce_scatter_sequence gather them)")
        for name in ("ln_w", "ln_b"):        # each rank's LayerNorm saw its own tokens: the sum is the whole
            total = sum(got["grads"][name] for got in ranks)
            assert torch.allclose(total, g[name], rtol=1e-9, atol=1e-12), \
                f"t={t}: the LayerNorm's {name} gradients, summed over ranks, differ from one process's"


@pytest.mark.points(2)
def test_sequence_parallel_collectives_bytes_and_memory(student):
    """14.2: one reduce-scatter + one all-gather per pass, of the (s, b, h) tensor's bytes; the LayerNorm keeps s/t of the tokens"""
    full = S2 * B2 * H2 * 8
    for t in (2, 4):
        for r, got in enumerate(student.on_ranks(t, _probe_sequence)):
            for what, calls in (("forward", got["fwd"]), ("backward", got["bwd"])):
                # torch's list forms (dist.all_gather(list, x), dist.reduce_scatter(out, list)) are
                # recorded with their largest tensor, the slice: the same collective, the same bytes
                calls = [(op, full if op in ("all_gather", "reduce_scatter") and nbytes == full // t else nbytes)
                         for op, nbytes in calls]
                assert sorted(calls) == [("all_gather", full), ("reduce_scatter", full)], (
                    f"t={t}, rank {r}, {what}: collectives {calls}; sequence parallelism runs one reduce-scatter and one "
                    f"all-gather of the (s, b, h) tensor ({full} B) per pass: the bytes of ONE all-reduce, no more")
            tokens = S2 // t * B2
            want = tokens * H2 * 8 + 2 * tokens * 8          # its input slice, and a mean and 1/std per token
            assert got["ln_bytes"] == want, (
                f"t={t}, rank {r}: the LayerNorm keeps {got['ln_bytes']} B for backward; its slice of s/t tokens "
                f"(input + mean + 1/std) is {want} B: the slice must own its storage")

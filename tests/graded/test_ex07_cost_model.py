"""Graded: exercise 07, a cost model whose placement rules are read off a measured step. The
submission runs only in its own processes (``student.module``, probes); every verdict is decided
here, on the plain data that comes back.

The timelines: one step of zerolab's stage 3 with prefetch, measured on 2 CPU ranks (TinyGPT with
3 blocks; the engine's own timeline and comm log, rounded to the microsecond), and steps built by
hand after the shape of real ones: data parallelism with buckets (the last launched as backward's
compute ends), ZeRO-3 with and without prefetch (without it, each gather runs in a gap between
compute spans), a stage-2 system whose parameter all-gather of the update overlaps the next forward
(Megatron-LM's distributed optimizer with overlap_param_gather), collectives that span the end of
forward and the start of backward, one launched in a gap and in flight into compute. Their placement
is worked out by hand below, span by span; the step times are computed here from that placement,
the ring formula and the FLOP counts. Then steps the ideal machine runs (built here, span by span:
compute lasting its FLOPs, collectives their ring time, one at a time on one link, each launched when
its segment of the step starts): the model, at the run's own Ψ, N and hardware, must give the step's
length, and placement the phase each collective was built beside. The largest model is checked
against the ZeRO papers' headline numbers (arXiv 1910.02054, arXiv 2101.06840) and cases by hand
(a reserve larger than the memory fits nothing), and with one micro-batch's activations beside the
model states against the largest Ψ solved here by bisection (activations grow as Ψ^(2/3))."""
import pytest

from zerolab.grade.helpers import exercise_module

# The reference implementation of this exercise: a submission that uses it scores 0
# (checked before and while the tests run, by zerolab.grade.references).
REFERENCE_MODULES = ["zerolab.cost", "zerolab.calculator", "zerolab.calibrate", "zerolab.memory"]

# Hand-picked hardware: 100 TFLOP/s at 50% -> 50 TFLOP/s; 1 GB/s links with 10 µs per ring step.
HW = dict(peak_flops=100e12, mfu=0.5, bandwidth=1e9, latency=1e-5)
F, B = "forward", "backward"


def C(phase, start_ms, end_ms):
    return {"kind": "compute", "phase": phase, "start": start_ms / 1e3, "end": end_ms / 1e3}


def X(op, nbytes, start_ms, end_ms):
    return {"kind": op, "bytes": nbytes, "start": start_ms / 1e3, "end": end_ms / 1e3}


# name: (timeline, the placement of its collectives in order, worked out by hand)
TIMELINES = {
    # Measured: zerolab stage 3 + prefetch, TinyGPT (3 blocks, 168,512 fp32 parameters), rank 0 of 2, on
    # a busy 2-core CPU. Compute spans are the blocks' (the root's embedding and head are not marked).
    "measured stage 3 with prefetch": ({"num_params": 168_512, "world_size": 2, "spans": [
        X("all_gather", 74240, 0.412, 20.348),           # root: before any compute          -> None
        X("all_gather", 199936, 23.219, 35.392),         # block 0: done before compute      -> None
        X("all_gather", 199936, 35.891, 48.819),         # block 1, beside block 0            -> forward
        C(F, 35.963, 50.261),
        X("all_gather", 199936, 63.269, 90.191),         # block 2, beside block 1            -> forward
        C(F, 63.369, 64.914),
        C(F, 90.417, 92.030),
        X("all_gather", 199936, 106.533, 127.420),       # between the phases                 -> None
        C(B, 127.567, 149.033),
        X("all_gather", 199936, 128.061, 148.778),       # beside block 2's backward          -> backward
        X("reduce_scatter", 199936, 149.418, 164.939),   # in a gap                           -> None
        C(B, 165.261, 180.646),
        X("all_gather", 199936, 165.553, 185.712),       #                                    -> backward
        X("reduce_scatter", 199936, 191.951, 217.750),   # in a gap                           -> None
        C(B, 218.130, 235.732),
        X("reduce_scatter", 199936, 248.162, 268.855),   # after the last compute             -> None
        X("reduce_scatter", 74240, 269.690, 278.080),    #                                    -> None
    ]}, [None, None, F, F, None, B, None, B, None, None, None]),
    "data parallel, 3 buckets": ({"num_params": 1_000_000, "world_size": 4, "spans": [
        C(F, 0, 2.5), C(F, 2.5, 5), C(F, 5, 7.5), C(F, 7.5, 10),
        C(B, 10, 15), C(B, 15, 20),
        X("all_reduce", 800_000, 15, 22),                # launched from a hook               -> backward
        C(B, 20, 25),
        X("all_reduce", 800_000, 22, 29),                #                                    -> backward
        C(B, 25, 30),
        X("all_reduce", 400_000, 30, 33),                # touches the end of compute only    -> None
    ]}, [B, B, None]),
    "ZeRO-3 with prefetch": ({"num_params": 1_000_000, "world_size": 4, "spans": [
        X("all_gather", 400_000, 0, 2),                  # root: nothing to hide under        -> None
        C(F, 2, 3),
        X("all_gather", 800_000, 2, 4.5),                #                                    -> forward
        C(F, 4.5, 8),
        X("all_gather", 800_000, 4.6, 7),                #                                    -> forward
        C(F, 8, 11.5), C(F, 11.5, 12),
        X("all_gather", 800_000, 12, 14),                # touches the forward's end          -> None
        C(B, 14, 14.5), C(B, 14.5, 19),
        X("all_gather", 800_000, 14.6, 17),              #                                    -> backward
        C(B, 19, 24),
        X("reduce_scatter", 800_000, 19, 23),            #                                    -> backward
        C(B, 24, 25),
        X("reduce_scatter", 800_000, 24, 28),            # beside the root's backward          -> backward
        X("reduce_scatter", 400_000, 25, 26),            #                                    -> None
    ]}, [None, F, F, None, B, B, B, None]),
    "ZeRO-3 without prefetch": ({"num_params": 1_000_000, "world_size": 4, "spans": [
        X("all_gather", 400_000, 0, 1), C(F, 1, 2),
        X("all_gather", 800_000, 2, 4), C(F, 4, 7.5),    # each gather in a gap before its unit -> None
        X("all_gather", 800_000, 7.5, 9.5), C(F, 9.5, 13), C(F, 13, 13.5),
        X("all_gather", 800_000, 13.5, 15.5), C(B, 15.5, 16), C(B, 16, 20.5),
        X("reduce_scatter", 800_000, 20.5, 23),
        X("all_gather", 800_000, 23, 25), C(B, 25, 30),
        X("reduce_scatter", 800_000, 30, 32.5), C(B, 32.5, 33.5),
        X("reduce_scatter", 400_000, 33.5, 34.5),
    ]}, [None] * 8),
    "stage 2, parameter all-gather in the next forward": ({"num_params": 1_000_000, "world_size": 8, "spans": [
        X("all_gather", 2_000_000, 0, 6),                # the update's parameters, beside forward -> forward
        C(F, 0.2, 2.5), C(F, 2.5, 5), C(F, 5, 7.5), C(F, 7.5, 10),
        C(B, 10, 15), C(B, 15, 20),
        X("reduce_scatter", 1_000_000, 18, 24),          #                                    -> backward
        C(B, 20, 25), C(B, 25, 30),
        X("reduce_scatter", 1_000_000, 30, 36),          #                                    -> None
    ]}, [F, B, None]),
    "across the phases": ({"num_params": 1_000_000, "world_size": 4, "spans": [
        C(F, 0, 10),
        X("all_reduce", 1_000_000, 5, 11),               # 5 ms beside forward, 1 beside backward -> forward
        X("all_reduce", 1_000_000, 8, 16),               # 2 ms beside forward, 6 beside backward -> backward
        C(B, 10, 20),
    ]}, [F, B]),
    "launched in a gap": ({"num_params": 1_000_000, "world_size": 2, "spans": [
        C(F, 0, 4),
        X("all_gather", 1_000_000, 4.5, 7),              # launched while nothing computes, then beside -> forward
        C(F, 5, 9), C(B, 9, 20),
        X("reduce_scatter", 2_000_000, 20, 21),          #                                    -> None
    ]}, [F, None]),
}


# -- steps the ideal machine runs, built here ------------------------------------------------------------
def _ideal_step(psi, n, tokens, segments):
    """A step of the ideal machine, span by span, at Ψ = psi on n ranks with HW: ``segments`` in order,
    each (phase or None, its share of that phase's compute, [(op, bytes), ...]). A phase segment
    computes from its start (two back-to-back compute spans) while its collectives run one after
    another on the link from the same moment; a None segment only runs its collectives. A segment ends
    when its compute and its collectives are both done. -> (timeline, placement of each collective:
    the segment's phase if it was launched before the segment's compute ended, else None; length)."""
    rate = HW["peak_flops"] * HW["mfu"]
    t, spans, placed = 0.0, [], []
    for phase, share, ops in segments:
        c = share * {F: 2, B: 4}[phase] * psi * tokens / rate if phase else 0.0
        if phase:
            spans += [{"kind": "compute", "phase": phase, "start": t, "end": t + c / 3},
                      {"kind": "compute", "phase": phase, "start": t + c / 3, "end": t + c}]
        link = t
        for op, nbytes in ops:
            d = _ring(op, nbytes, n)
            spans.append({"kind": op, "bytes": nbytes, "start": link, "end": link + d})
            placed.append(phase if link < t + c else None)
            link += d
        t = max(t + c, link)
    return {"num_params": psi, "world_size": n, "spans": spans}, placed, t


AG, RS, AR = "all_gather", "reduce_scatter", "all_reduce"
# name: (Ψ, N, tokens per rank, segments); at Ψ = 1e6 and 50 TFLOP/s, 1e5 tokens compute 4 + 8 ms.
IDEAL = {
    "ideal data parallel, buckets hidden": (1e6, 4, 100_000, [
        (F, 1, []), (B, 1 / 3, []), (B, 1 / 3, [(AR, 800_000)]), (B, 1 / 3, [(AR, 800_000)]),
        (None, 0, [(AR, 400_000)])]),
    "ideal data parallel, backward communication-bound": (1e6, 4, 10_000, [
        (F, 1, []), (B, 1, [(AR, 800_000), (AR, 800_000), (AR, 400_000)])]),
    "ideal ZeRO-3 without prefetch": (1e6, 4, 100_000, [
        (None, 0, [(AG, 400_000)]), (F, 1 / 2, []), (None, 0, [(AG, 800_000)]), (F, 1 / 2, []),
        (None, 0, [(AG, 800_000)]), (B, 1 / 2, []), (None, 0, [(RS, 800_000), (AG, 800_000)]),
        (B, 1 / 2, []), (None, 0, [(RS, 800_000), (RS, 400_000)])]),
    "ideal ZeRO-3 with prefetch": (1e6, 4, 100_000, [
        (None, 0, [(AG, 400_000)]), (F, 1 / 2, [(AG, 800_000)]), (F, 1 / 2, [(AG, 800_000)]),
        (B, 1 / 2, [(AG, 800_000), (RS, 800_000)]), (B, 1 / 2, [(RS, 800_000)]), (None, 0, [(RS, 400_000)])]),
    "ideal stage 2, gather in the next forward, both phases communication-bound": (1e6, 8, 20_000, [
        (F, 1, [(AG, 2_000_000)]), (B, 1, [(RS, 1_000_000), (RS, 1_000_000)])]),
}


# -- a probe: run the submission, return what it did ---------------------------------------------------
def _results(function, calls):
    """``function`` of the exercise on each argument tuple of ``calls``: per call, {"value": ...} or
    {"raised": the exception's class and its bases, "message": ...}."""
    ex = exercise_module("ex07_cost_model")
    out = []
    for args, kwargs in calls:
        try:
            out.append({"value": getattr(ex, function)(*args, **kwargs)})
        except NotImplementedError:
            raise                  # an unfinished exercise: the test fails with the stub's message
        except Exception as exc:
            out.append({"raised": [c.__name__ for c in type(exc).__mro__], "message": str(exc)})
    return out


def _value(result, what):
    assert "value" in result, f"{what}: raised {result['raised'][0]}: {result['message'][:300]}"
    return result["value"]


def _refused(result, what):
    assert "raised" in result, f"{what}: accepted (returned {result['value']!r}); expected a ValueError naming it"
    assert "ValueError" in result["raised"], (
        f"{what}: raised {result['raised'][0]} ({result['message'][:200]}); expected a ValueError naming it")


def _close(got, want, what, rel=1e-9):
    assert isinstance(got, (int, float)) and not isinstance(got, bool) and got == pytest.approx(want, rel=rel), (
        f"{what}: got {got!r}, expected {want!r} (by hand)")


# -- by hand, here ---------------------------------------------------------------------------------------
def _ring(op, nbytes, n):
    """One ring collective on HW's links (the exercise's formula)."""
    return {"all_reduce": 2, "reduce_scatter": 1, "all_gather": 1}[op] * (
        (n - 1) * HW["latency"] + (n - 1) / n * nbytes / HW["bandwidth"])


def _by_hand(name, psi, n, tokens):
    """The step of timeline ``name`` at Ψ = psi on n ranks, its collectives placed as worked out above."""
    timeline, placed = TIMELINES[name]
    return _model(timeline, placed, psi, n, tokens)


def _model(timeline, placed, psi, n, tokens):
    """The ideal model, here: the timeline's collectives at Ψ = psi on n ranks, placed as ``placed``
    says; each phase the longer of its compute and what hides under it (one link: they add up); the
    rest added."""
    scale = psi / timeline["num_params"]
    compute = {F: 2 * psi * tokens / 50e12, B: 4 * psi * tokens / 50e12}
    hidden, exposed = {F: 0.0, B: 0.0}, 0.0
    for span, where in zip([s for s in timeline["spans"] if s["kind"] != "compute"], placed):
        t = _ring(span["kind"], span["bytes"] * scale, n)
        if where is None:
            exposed += t
        else:
            hidden[where] += t
    return max(compute[F], hidden[F]) + max(compute[B], hidden[B]) + exposed


# -- the graded tests -------------------------------------------------------------------------------------
@pytest.mark.points(3)
def test_placement_read_off_the_timeline(student):
    """placement: the phase whose compute hid each collective, read off the timeline"""
    cases = {**TIMELINES, **{name: _ideal_step(*IDEAL[name])[:2] for name in IDEAL}}
    calls = [((timeline,), {}) for timeline, _ in cases.values()]
    base = TIMELINES["launched in a gap"][0]
    bad = {
        "a collective of an unknown kind ('all_to_all')":
            {**base, "spans": base["spans"] + [X("all_to_all", 1000, 21, 22)]},
        "a compute span of an unknown phase ('optimizer')":
            {**base, "spans": base["spans"] + [C("optimizer", 21, 22)]},
        "a collective that ends before it starts": {**base, "spans": base["spans"] + [X("all_gather", 1000, 22, 21)]},
    }
    calls += [((timeline,), {}) for timeline in bad.values()]
    results = student.run(_results, "placement", calls)
    for (name, (timeline, want)), result in zip(cases.items(), results):
        got = _value(result, f"placement({name})")
        assert isinstance(got, (list, tuple)) and len(got) == len(want), (
            f"placement({name}): {got!r}; expected one entry per collective ({len(want)})")
        spans = timeline["spans"]
        wrong = [f"collective {i} ({spans[j]['kind']} [{spans[j]['start'] * 1e3:g}, {spans[j]['end'] * 1e3:g}] ms): "
                 f"{g!r}, expected {w!r}"
                 for i, (j, g, w) in enumerate(zip([k for k, s in enumerate(spans) if s["kind"] != "compute"],
                                                   got, want)) if g != w]
        assert not wrong, f"placement({name}): " + "; ".join(wrong)
    for what, result in zip(bad, results[len(cases):]):
        _refused(result, f"placement of a timeline with {what}")


@pytest.mark.points(3)
def test_step_time_at_another_scale(student):
    """the model: the measured schedule at a new Ψ, N and hardware, phase by phase, by hand"""
    calls, wants = [], []
    for name in TIMELINES:
        for psi, n in ((0.5e9, 8), (20e9, 64)):
            # comm-bound, in between (at Ψ = 0.5e9 on 8 ranks, 30,000 tokens: "across the phases"
            # forward waits for its all-reduce, its backward does not), compute-bound
            for tokens in (1000, 20_000, 30_000, 1_000_000):
                calls.append(((TIMELINES[name][0], psi, n), dict(tokens_per_rank=tokens, **HW)))
                wants.append((f"step_time({name}, Ψ={psi:g}, N={n}, {tokens} tokens per rank)", _by_hand(name, psi, n, tokens)))
        calls.append(((TIMELINES[name][0], 0.5e9, 1), dict(tokens_per_rank=1000, **HW)))
        wants.append((f"step_time({name}) on one rank: compute only", 6 * 0.5e9 * 1000 / 50e12))
    # Two cases written out in full. Data parallelism at Ψ = 0.5e9 on 8 ranks, 20,000 tokens: buckets of
    # 0.8e6 / 0.8e6 / 0.4e6 bytes at Ψ_run = 1e6 become 4e8 / 4e8 / 2e8 bytes; the first two all-reduces
    # hide under backward, the last adds.
    f, b = 2 * 0.5e9 * 20_000 / 50e12, 4 * 0.5e9 * 20_000 / 50e12
    ar = lambda s: 2 * (7 * 1e-5 + 7 / 8 * s / 1e9)
    assert _by_hand("data parallel, 3 buckets", 0.5e9, 8, 20_000) == pytest.approx(f + max(b, 2 * ar(4e8)) + ar(2e8))
    # ZeRO-3 without prefetch: nothing hides, everything adds: 2Ψ bytes of gathers forward (root + 2
    # blocks), 2 blocks gathered again backward, 2Ψ bytes of reduce-scatters.
    ph = lambda s: 7 * 1e-5 + 7 / 8 * s / 1e9
    assert _by_hand("ZeRO-3 without prefetch", 0.5e9, 8, 20_000) == pytest.approx(
        f + b + ph(2e8) + 2 * ph(4e8) + 2 * ph(4e8) + 2 * ph(4e8) + ph(2e8))
    results = student.run(_results, "step_time", calls)
    for (what, want), result in zip(wants, results):
        _close(_value(result, what), want, what)


@pytest.mark.points(2)
def test_step_time_reproduces_an_ideal_step(student):
    """the model run at the measured scale: on steps the ideal machine ran, the step's own length"""
    calls, wants = [], []
    for name, (psi, n, tokens, segments) in IDEAL.items():
        timeline, placed, length = _ideal_step(psi, n, tokens, segments)
        # The builder runs the model's machine, so the model, here, must give its length: a check of
        # the builder, before the submission is asked.
        assert _model(timeline, placed, psi, n, tokens) == pytest.approx(length, rel=1e-12), name
        calls.append(((timeline, psi, n), dict(tokens_per_rank=tokens, **HW)))
        wants.append((f"step_time({name}) at its own Ψ={psi:g}, N={n}, {tokens} tokens: the step's length", length))
    results = student.run(_results, "step_time", calls)
    for (what, want), result in zip(wants, results):
        _close(_value(result, what), want, what)


@pytest.mark.points(2)
def test_largest_model_zero_paper(student):
    """derived: the ZeRO paper's largest models on 64 and 1024 V100s"""
    ex = student.module("ex07_cost_model")
    # ZeRO Table 2 / Fig. 1: 32 GB V100s, N = 64, model states only: 2B, 7.6B, 14.4B, 128B
    for stage, paper in enumerate([2.0e9, 7.6e9, 14.4e9, 128e9]):
        got = ex.largest_model(64, stage, 32e9)
        assert got == pytest.approx(paper, rel=0.01), (
            f"ex.largest_model(N=64, stage {stage}, 32 GB) = {got / 1e9:.2f}B; the ZeRO paper: {paper / 1e9:g}B")
    got = ex.largest_model(1024, 3, 32e9)
    assert got >= 1e12, f"stage 3 on 1024 x 32 GB: {got / 1e12:.2f}T; the paper: a trillion parameters fit"


@pytest.mark.points(2)
def test_largest_model_zero_offload(student):
    """derived: ZeRO-Offload's 13B on one V100, what stays on the device, a reserve beyond the memory"""
    calls = {
        "one GPU, stage 2 + offload, no reserve": ((1, 2, 32e9), dict(offload=True)),
        "one GPU, no offload, no reserve": ((1, 0, 32e9), {}),
        "13B with offload": ((1, 2, 32e9), dict(offload=True, reserved_bytes=32e9 - 2 * 13e9)),
        "without offload, the same reserve": ((1, 0, 32e9), dict(reserved_bytes=32e9 - 2 * 13e9)),
        "stage 1 + offload, N = 4": ((4, 1, 32e9), dict(offload=True)),
        "stage 3 + offload, N = 4": ((4, 3, 32e9), dict(offload=True)),
        "a few parameters per rank: stage 3, N = 64, 100 bytes": ((64, 3, 100.0), {}),
        "a fraction of a parameter: stage 1, N = 7, 100 bytes": ((7, 1, 100.0), {}),
        "a reserve larger than the memory": ((8, 3, 32e9), dict(reserved_bytes=40e9)),
        "a reserve larger than the memory, with offload": ((8, 2, 32e9), dict(offload=True, reserved_bytes=33e9)),
    }
    bad = {
        "stage 4": ((8, 4, 32e9), {}),
        "offload at stage 0": ((8, 0, 32e9), dict(offload=True)),
        "negative device memory": ((8, 3, -1e9), {}),
        "a negative reserve": ((8, 3, 32e9), dict(reserved_bytes=-1e9)),
    }
    results = dict(zip(list(calls) + list(bad), student.run(_results, "largest_model", list(calls.values()) + list(bad.values()))))
    got = {what: _value(results[what], f"largest_model: {what}") for what in calls}
    # ZeRO-Offload: one 32 GB V100, 13B with offload vs ~1.4B without. Model states alone: 2 bytes per
    # parameter stay on the device (32 GB / 2 = 16B) against 16 (2B).
    _close(got["one GPU, stage 2 + offload, no reserve"], 16e9, "one GPU, stage 2 + offload, no reserve")
    _close(got["one GPU, no offload, no reserve"], 2e9, "one GPU, no offload, no reserve")
    _close(got["13B with offload"], 13e9, "13B with offload (the reserve the 13B headline implies)")
    without = got["without offload, the same reserve"]
    assert without == pytest.approx(1.4e9, rel=0.2), f"without offload {without / 1e9:.2f}B; the paper: ~1.4B"
    _close(got["stage 1 + offload, N = 4"], 32e9 / 4, "stage 1 + offload keeps 2Ψ params + 2Ψ grads")
    _close(got["stage 3 + offload, N = 4"], 32e9 / (2 / 4), "stage 3 + offload keeps 2Ψ/N")
    # Ψ is a real number: 16Ψ/64 = 100 bytes at Ψ = 400 (not 384, a multiple of N); 4Ψ + 12Ψ/7 = 100
    # at Ψ = 17.5 (not 17, nor 14)
    _close(got["a few parameters per rank: stage 3, N = 64, 100 bytes"], 400.0,
           "stage 3, N = 64, 100 bytes: 16 bytes per parameter over 64 ranks (no padding, no rounding)")
    _close(got["a fraction of a parameter: stage 1, N = 7, 100 bytes"], 17.5,
           "stage 1, N = 7, 100 bytes: (4 + 12/7) bytes per parameter (no padding, no rounding)")
    for what in ("a reserve larger than the memory", "a reserve larger than the memory, with offload"):
        assert got[what] == 0, f"largest_model with {what}: {got[what]!r}; nothing fits: 0"
    for what in bad:
        _refused(results[what], f"largest_model with {what}")


def _largest_with_activations(n, stage, memory, offload, tokens, reserve=0.0):
    """By hand: ZeRO's bytes per parameter on the device (with ZeRO-Offload, what stays there: the
    2-byte parameters, their 1/N shard at stage 3, and stage 1's full 2-byte gradients, reduced only
    after backward), plus one micro-batch's activations, never partitioned nor offloaded: L·32·h bytes
    per token, with Ψ = 12·L·h² and L = h/128, i.e. tokens·h²/4 with h³ = 32Ψ/3. In x = Ψ^(1/3) the
    bytes are per·x³ + tokens·(32/3)^(2/3)/4·x², increasing: the largest x by bisection, in float64."""
    per = ({1: 4.0, 2: 2.0, 3: 2.0 / n} if offload else
           {0: 16.0, 1: 4.0 + 12.0 / n, 2: 2.0 + 14.0 / n, 3: 16.0 / n})[stage]
    budget = memory - reserve
    if budget <= 0:
        return 0.0
    a = tokens * (32.0 / 3.0) ** (2.0 / 3.0) / 4.0
    lo, hi = 0.0, (budget / per) ** (1.0 / 3.0) * 1.01
    for _ in range(300):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if per * mid ** 3 + a * mid ** 2 <= budget else (lo, mid)
    return lo ** 3


@pytest.mark.points(3)
def test_largest_model_with_activations(student):
    """derived: one micro-batch's activations beside the model states, at every stage, with and without offload"""
    cases = {f"N={n}, stage {stage}{' + offload' if off else ''}, {tokens:,} tokens, {mem / 1e9:g} GB"
             + (f", reserve {res / 1e9:g} GB" if res else ""): (n, stage, mem, off, tokens, res)
             for n, stage, mem, off, tokens, res in [
                 (64, s, 32e9, False, 2048, 0.0) for s in (0, 1, 2, 3)] + [
                 (64, s, 32e9, True, 2048, 0.0) for s in (1, 2, 3)] + [
                 (1024, 3, 32e9, False, 2048, 0.0), (1024, 3, 32e9, False, 16384, 0.0),
                 (1, 2, 32e9, True, 4096, 2e9), (1, 0, 80e9, False, 1, 0.0), (8, 3, 80e9, True, 8192, 0.0),
                 (4, 1, 80e9, True, 8192, 0.0), (3, 2, 40e9, False, 512, 1e9), (8, 3, 32e9, False, 4096, 40e9)]}
    calls = [((n, stage, mem), dict(offload=off, tokens=tokens, reserved_bytes=res))
             for n, stage, mem, off, tokens, res in cases.values()]
    bad = {"negative tokens": ((8, 3, 32e9), dict(tokens=-1))}
    results = student.run(_results, "largest_model", calls + list(bad.values()))
    for (what, args), result in zip(cases.items(), results):
        want = _largest_with_activations(*args)
        got = _value(result, f"largest_model: {what}")
        if want == 0:
            assert got == 0, f"largest_model: {what}: {got!r}; nothing fits: 0"
        else:
            _close(got, want, f"largest_model: {what}", rel=1e-6)
    # What the headline leaves out: with one 2,048-token sequence per GPU, a trillion no longer fits on 1024.
    assert _largest_with_activations(1024, 3, 32e9, False, 2048) < 1e12
    for what, result in zip(bad, results[len(calls):]):
        _refused(result, f"largest_model with {what}")

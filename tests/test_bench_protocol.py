"""The benchmark protocol (benchmarks/protocol.py) and the ceilings (benchmarks/ceilings.py): their
logic, on made-up clocks and on the compiled kernels' results, never on timings (a timed assertion on
a shared machine is a flaky test; performance is measured in `make bench`)."""
import pytest
import torch

from benchmarks import ceilings, protocol


def test_rounds_warm_up_pairs_and_alternating_order():
    """Every round runs every contender once; the warm-up round is run and thrown away; the order
    rotates (two contenders: A B, B A, ...); each contender's fn sees the round number."""
    calls, fake_time = [], iter(range(1, 1000))
    contenders = {name: (lambda r, name=name: calls.append((r, name))) for name in "AB"}
    times = protocol.rounds(contenders, timed=5, warmup=1, clock=lambda fn: (fn(), next(fake_time))[1])
    assert calls == [(0, "A"), (0, "B"), (1, "B"), (1, "A"), (2, "A"), (2, "B"), (3, "B"), (3, "A"),
                     (4, "A"), (4, "B"), (5, "B"), (5, "A")]
    assert times == {"A": [4, 5, 8, 9, 12], "B": [3, 6, 7, 10, 11]}       # warm-up's 1 and 2 dropped
    assert protocol.order(list("ABC"), 4) == list("BCA")
    with pytest.raises(ValueError, match="at least 5"):
        protocol.rounds(contenders, timed=4)


def test_ratio_is_paired_and_a_verdict_needs_the_middle_half():
    """A ratio per round (not a ratio of medians); a win only with the whole middle half on one side."""
    a, b = [1.0, 2.0, 3.0, 4.0, 5.0], [2.0, 4.0, 6.0, 8.0, 10.0]
    r = protocol.Ratio.of(a, b)
    assert r.ratios == [0.5] * 5 and r.median == 0.5 and r.side() == -1
    noisy = protocol.Ratio([0.8, 0.9, 1.05, 1.1, 1.2])                    # middle half 0.9-1.1 crosses 1
    assert noisy.side() == 0 and noisy.verdict(below="win", above="loss") == "no difference"
    assert protocol.Ratio([1.2, 1.3, 1.4, 1.5, 1.6]).side() == 1
    assert noisy.side(0.85) == 1 and noisy.side(1.2) == -1
    what, cell, reading = protocol.headline("x", noisy, below="win", above="loss")
    assert cell.startswith("1.05 [") and reading.startswith("no difference")
    with pytest.raises(ValueError, match="same rounds"):
        protocol.Ratio.of([1.0] * 5, [1.0] * 6)


def test_ceiling_fraction_per_round_and_the_loud_failure():
    """A row's fraction is its rate over the fastest ceiling of the same round (paired) and its best
    round over the ceiling's best; a row above its ceiling out of the noise (paired) raises, a lucky
    best round alone is returned as a warning, noise alone passes."""
    ceiling = {"copy": [10.0, 10.0, 10.0, 10.0, 10.0], "pattern": [20.0, 5.0, 20.0, 20.0, 20.0]}
    f = ceilings.fraction([10.0, 10.0, 12.0, 10.0, 10.0], ceiling)
    assert f.ratios == [0.5, 1.0, 0.6, 0.5, 0.5] and f.best == 12.0 / 20.0
    noisy = ceilings.fraction([9.0, 9.5, 10.0, 10.5, 11.0], {"c": [10.0] * 4 + [20.0]})
    assert noisy.side() == 0 and noisy.best == 11.0 / 20.0
    ceilings.check({"row": f, "noisy": noisy})
    with pytest.raises(ceilings.CeilingExceeded, match="fast row"):
        ceilings.check({"row": f, "fast row": ceilings.fraction([12.0, 13.0, 16.0, 15.0, 14.0], {"c": [10.0] * 5})})
    lucky = ceilings.fraction([5.0, 5.0, 5.0, 5.0, 21.0], ceiling)      # one round beyond the best ceiling
    assert ceilings.check({"lucky row": lucky, "row": f}) == {"lucky row": lucky}
    assert "lucky row" in ceilings.warning({"lucky row": lucky}) and ceilings.warning({}) == ""


def test_memory_kernels_move_the_bytes_they_count():
    """The ceiling kernels do the work their byte counts assume (a kernel that skipped its stores would
    be a fake ceiling): STREAM copy and triad, and AdamW's traffic reads g, m, v, p and writes p, m, v
    (and the bf16 parameter)."""
    lib = ceilings._library()
    if lib is None:
        pytest.skip("no C compiler here: the ceilings are torch's copy and triad")
    import ctypes
    ptr = lambda t: ctypes.c_void_p(t.data_ptr())
    n = 1000
    a, b, c = torch.arange(n, dtype=torch.float32), torch.full((n,), 2.0), torch.zeros(n)
    lib.stream_copy(ptr(c), ptr(a), ctypes.c_int64(n), 2)
    assert torch.equal(c, a)
    lib.stream_triad(ptr(a), ptr(b), ptr(c), ctypes.c_float(3.0), ctypes.c_int64(n), 2)
    assert torch.equal(a, 2.0 + 3.0 * c)
    p, g, m, v = torch.zeros(n), torch.arange(n, dtype=torch.float32), torch.ones(n), torch.ones(n)
    lib.adam_traffic_f32(ptr(p), ptr(g), ptr(m), ptr(v), ctypes.c_int64(n), 2)
    assert torch.equal(m, 1 + g) and torch.equal(v, 1 + g) and torch.equal(p, -(1 + g))
    g16, out16 = torch.arange(n).to(torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)
    p, m, v = torch.zeros(n), torch.zeros(n), torch.zeros(n)
    lib.adam_traffic_bf16(ptr(p), ptr(g16), ptr(m), ptr(v), ptr(out16), ctypes.c_int64(n), 2)
    assert torch.equal(m, g16.float()) and torch.equal(p, -g16.float()) and torch.equal(out16, (-g16.float()).bfloat16())


def _spin_and_sleep():
    import time
    from benchmarks import protocol
    clock, split = protocol.cpu_all_ranks(), protocol.cpu_all_ranks(part="split")

    def spin():                          # 0.2 s of a busy loop (perf_counter: read in user space, no system call)
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 0.2:
            pass
    return clock(spin), clock(lambda: time.sleep(0.2)), split(spin)


def test_cpu_clock_sums_the_ranks_cpu_time_not_the_wall():
    """Two ranks each burn 0.2 s of CPU, then each sleep 0.2 s: the clock reads about 0.4 s, then about
    nothing (a wall clock would read 0.2 s both times), the same on every rank. (On 2 ranks sharing fewer
    than 2 free cores the busy loops take turns and still burn 0.2 s of wall time each: less CPU, which the
    bounds allow for.)"""
    from zerolab import Cluster
    with Cluster(2) as cluster:
        results = cluster.run(_spin_and_sleep)
    assert results[0] == results[1]
    busy, asleep, (user, system) = results[0]
    assert 0.2 <= busy < 0.6 and asleep < 0.05
    assert 0.15 <= user <= 0.6 and system < user / 4     # a spinning loop runs in user time, not in the kernel
    with pytest.raises(ValueError, match="part='wall'"):
        protocol.cpu_all_ranks(part="wall")

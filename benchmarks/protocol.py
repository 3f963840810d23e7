"""The protocol behind every timed headline ratio of ``make bench``, in one place.

A ratio of two timings taken on a shared machine is only as good as the way it was taken. Every
benchmark script times its contenders with :func:`rounds` and reads each headline with :func:`ratio`:

1. **warm-up**: the first round of every contender runs and is thrown away (allocations, lazy
   optimizer state, page faults, connections, thread pools);
2. **paired runs in alternating order**: a round runs every contender once, back to back, so that
   whatever else loads the machine during a round loads all of them alike; the order rotates from
   round to round (two contenders: A B, B A, A B, ...), so that none always runs first or last;
3. **the slowest rank**: on ranks, a contender's time in a round is the slowest rank's
   (:func:`slowest_rank`: a step is over when its last rank is done);
4. **the median of at least 5 paired ratios, with their spread**: one ratio per round (A's time / B's
   time in the same round), the median over the rounds, and the spread as the middle half of the
   ratios (lower to upper quartile) and their range;
5. **a verdict that needs the spread**: a ratio is reported as below (or above) a reference, 1 or a
   target, only when its whole middle half lies on that side; a middle half that crosses it is
   "no difference" (or "at the target"), never a win.

It is robust to load in the sense that matters here: load slows both sides of a pair alike, and a
round that one side happened to lose shows in the spread instead of moving the headline.
"""
import resource
import statistics
import time
from dataclasses import dataclass

MIN_ROUNDS = 5            # timed rounds (paired ratios) behind every headline


def local_clock(fn):
    """Seconds ``fn()`` takes in this process."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def slowest_rank(group=None):
    """A clock for code that runs on every rank of ``group``: the ranks start together (a barrier) and
    the time is the slowest rank's (a MAX all-reduce), the same number on every rank."""
    def clock(fn):
        import torch
        import torch.distributed as dist
        dist.barrier(group)
        t0 = time.perf_counter()
        fn()
        t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return t.item()
    return clock


def cpu_all_ranks(group=None, *, part="all"):
    """A clock for code that runs on every rank of ``group``, in CPU seconds instead of wall seconds: the
    ranks start together (a barrier) and the result is the CPU time all ranks' processes spent in
    ``fn()``, their background threads included (gloo's transport), summed over the ranks (a SUM
    all-reduce), the same number on every rank. Against the wall time times the cores, it says how
    busy the machine's cores were. ``part``: "all"; or "split", (user, system): the processes' own code,
    and the kernel working for them (system calls, copies into and out of sockets, page faults), both
    from the same call."""
    if part not in ("all", "split"):
        raise ValueError(f"cpu_all_ranks: part={part!r}; use 'all' or 'split'")

    def read():                           # getrusage: the process's user and system time, in microseconds
        r = resource.getrusage(resource.RUSAGE_SELF)      # (os.times counts clock ticks: 10 ms)
        return r.ru_utime, r.ru_stime

    def clock(fn):
        import torch
        import torch.distributed as dist
        dist.barrier(group)
        u0, s0 = read()
        fn()
        u1, s1 = read()
        c = torch.tensor([u1 - u0, s1 - s0], dtype=torch.float64)
        dist.all_reduce(c, group=group)
        user, system = c.tolist()
        return (user, system) if part == "split" else user + system
    return clock


def order(names, r):
    """Round ``r``'s order: ``names`` rotated by r (two names: alternating)."""
    k = r % len(names)
    return names[k:] + names[:k]


def rounds(contenders, *, timed=7, warmup=1, clock=local_clock):
    """Run every contender once per round, ``warmup`` + ``timed`` rounds, in :func:`order`. ``contenders``:
    {name: fn(round)}; fn gets the round number (0-based, warm-up rounds included: e.g. to pick the
    round's batch). Returns {name: [seconds in each timed round]}, the rounds aligned across names."""
    if timed < MIN_ROUNDS:
        raise ValueError(f"rounds: timed={timed}; the protocol needs at least {MIN_ROUNDS} paired rounds")
    names = list(contenders)
    times = {n: [] for n in names}
    for r in range(warmup + timed):
        for n in order(names, r):
            t = clock(lambda: contenders[n](r))
            if r >= warmup:
                times[n].append(t)
    return times


def values(contenders, *, rounds=MIN_ROUNDS):
    """:func:`rounds` for a measure that is not a time (a peak's bytes): every contender once per round
    in :func:`order`, no warm-up. ``contenders``: {name: fn(round) -> value}. Returns {name: [value in
    each round]}, the rounds aligned across names."""
    names = list(contenders)
    out = {n: [] for n in names}
    for r in range(rounds):
        for n in order(names, r):
            out[n].append(contenders[n](r))
    return out


@dataclass
class Ratio:
    """Paired ratios a/b, one per round, and how to read them."""
    ratios: list

    @classmethod
    def of(cls, a, b):
        """From two lists of per-round seconds (or any per-round measure) of the same rounds."""
        if len(a) != len(b) or len(a) < MIN_ROUNDS:
            raise ValueError(f"Ratio.of: {len(a)} and {len(b)} rounds; needs the same rounds, at least {MIN_ROUNDS}")
        return cls([x / y for x, y in zip(a, b)])

    @property
    def median(self):
        return statistics.median(self.ratios)

    @property
    def middle_half(self):
        """(lower quartile, upper quartile) of the ratios: the spread a verdict needs."""
        q = statistics.quantiles(self.ratios, n=4, method="inclusive")
        return q[0], q[2]

    @property
    def range(self):
        return min(self.ratios), max(self.ratios)

    def side(self, reference=1.0):
        """-1 if the whole middle half is below ``reference``, +1 if above, 0 if it crosses it."""
        lo, hi = self.middle_half
        return -1 if hi < reference else 1 if lo > reference else 0

    def verdict(self, reference=1.0, *, below, above, crosses="no difference"):
        return {-1: below, 1: above, 0: crosses}[self.side(reference)]

    def __str__(self):
        lo, hi = self.middle_half
        return f"{self.median:.2f} [{lo:.2f}-{hi:.2f}]"

    def cell(self):
        """'median [middle half] (range)', for tables."""
        return f"{self} ({self.range[0]:.2f}-{self.range[1]:.2f})"


def ratio(times, a, b):
    """The paired :class:`Ratio` of contender ``a`` to ``b`` in ``times`` (from :func:`rounds`)."""
    return Ratio.of(times[a], times[b])


def headline(what, r, *, below, above, reference=1.0, crosses=None, note=""):
    """A headline row (comparison, ratio with its middle half, how to read it: the verdict first).
    ``crosses``: what a middle half across the reference says (default: no difference from it)."""
    crosses = crosses or ("no difference: the middle half crosses 1" if reference == 1.0 else
                          f"at the target {reference:g}, out of the noise: the middle half crosses it")
    verdict = r.verdict(reference, below=below, above=above, crosses=crosses)
    return what, str(r), verdict + (f"; {note}" if note else "")


def median(xs):
    return statistics.median(xs)


PROTOCOL_NOTE = ("Every timed ratio is the median of paired ratios, one per round, after a warm-up round, the "
                 "contenders' order rotating from round to round, the slowest rank's time; [a-b] is the middle half "
                 "of the ratios (lower to upper quartile), and a verdict needs all of it on one side of 1 or of the "
                 "target (benchmarks/protocol.py).")

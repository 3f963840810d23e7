"""Per-rank timelines: what each rank was doing, and when, measured with ``time.perf_counter``.

A :class:`Timeline` records named spans on one rank::

    tl = Timeline()                              # t = 0 for this rank (start it after a barrier)
    with tl.span("backward compute", "compute"):
        loss.backward()
    work = comm.all_reduce(bucket, async_op=True)
    tl.mark_async("all_reduce bucket 0", "comm", work)   # ends when the collective completes
    spans = tl.collect()                         # plain Span tuples, picklable back to the parent

and :func:`plot_timeline` draws one row per rank. Data parallelism uses it to show gradient
all-reduces overlapping backward compute; ZeRO-3 uses it for gather / compute / free. Nothing
here knows about either: a span is a name, a category (which picks the colour) and two times.

Clocks: ``perf_counter`` is CLOCK_MONOTONIC on Linux, one clock for every process of a machine,
so spans of ranks on one host line up as they are. Each timeline also keeps its own origin
``t0``; start the timeline right after a barrier and the ranks' origins agree to within the
barrier's skew, which is what makes timelines of ranks on different machines comparable.
"""
import contextlib
import threading
import time
from typing import NamedTuple

CATEGORY_COLORS = {"compute": "tab:blue", "comm": "tab:orange", "wait": "tab:red",
                   "optimizer": "tab:green", "memory": "tab:purple", "other": "tab:gray"}


class Span(NamedTuple):
    name: str
    category: str
    start: float   # seconds since the timeline's origin
    end: float

    @property
    def seconds(self):
        return self.end - self.start


class Timeline:
    """Spans recorded on this rank. Thread-safe: async spans end on the backend's threads."""

    def __init__(self):
        self._lock = threading.Lock()
        self.reset()

    def reset(self):
        """Forget all spans and put t = 0 at now."""
        with self._lock:
            self.t0 = time.perf_counter()
            self._spans = []
            self._pending = []   # futures of async spans whose end is not recorded yet

    def now(self):
        return time.perf_counter() - self.t0

    def record(self, name, category, start, end):
        """Add a span with times already relative to the origin (see :meth:`now`)."""
        with self._lock:
            self._spans.append(Span(name, category, start, end))

    @contextlib.contextmanager
    def span(self, name, category="compute"):
        """Record the wall time of the ``with`` block as one span."""
        start = self.now()
        try:
            yield
        finally:
            self.record(name, category, start, self.now())

    def mark_async(self, name, category, work):
        """Start a span now that ends when ``work`` (an async collective's handle, or a
        ``torch.futures.Future``) completes. Returns ``work`` so a call can be wrapped inline."""
        start = self.now()
        try:
            fut = work.get_future() if hasattr(work, "get_future") else work
        except RuntimeError:          # some work has no future (gloo's emulated reduce_scatter)
            fut = None
        if fut is not None:
            # The callback runs on the thread that completes the work (gloo's worker thread), at the
            # moment it completes: that is the end of the span, whoever waits for it and when.
            done = fut.then(lambda _f: self.record(name, category, start, self.now()))
        else:
            # No future to attach to: a watcher thread waits for the work (waiting on it from two
            # threads is allowed) and records the end the moment it returns.
            def watch():
                try:
                    work.wait()
                finally:
                    self.record(name, category, start, self.now())
            done = threading.Thread(target=watch, name="zerolab-timeline-watch", daemon=True)
            done.start()
        with self._lock:
            self._pending.append(done)
        return work

    def collect(self):
        """All spans, sorted by start, once every async span has ended (waits for them)."""
        with self._lock:
            pending, self._pending = self._pending, []
        for fut in pending:
            fut.join() if isinstance(fut, threading.Thread) else fut.wait()
        with self._lock:
            return sorted(self._spans, key=lambda s: (s.start, s.end))

    def gather(self, group=None, dst=0):
        """Collect every rank's spans onto rank ``dst`` (a list indexed by rank there, None
        elsewhere). A collective: every rank of ``group`` must call it."""
        import torch.distributed as dist
        spans = self.collect()
        out = [None] * dist.get_world_size(group) if dist.get_rank(group) == dst else None
        dist.gather_object(spans, out, dst=dist.get_global_rank(group, dst) if group else dst,
                           group=group)
        return out


def maybe_span(timeline, name, category="compute"):
    """``timeline.span(...)`` or a no-op when ``timeline`` is None (instrumentation off)."""
    return timeline.span(name, category) if timeline is not None else contextlib.nullcontext()


def plot_timeline(per_rank_spans, ax=None, *, title=None, label_spans=True, colors=None, sub_rows=None):
    """Draw one row per rank: each span a bar from start to end, coloured by category.

    ``per_rank_spans``: a list (index = rank) of lists of :class:`Span` (or (name, category,
    start, end) tuples). Spans of one rank that overlap in time (compute while a collective is in
    flight) are stacked in sub-rows, so overlap is visible rather than hidden; no two bars of one
    sub-row overlap. ``sub_rows``: a list of categories, each given its own fixed sub-row(s) in that
    order from the top (other categories share the last), so that compute, say, stays on one line and
    collectives on another; by default a span takes the first sub-row free at its start. Returns ``ax``.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    colors = dict(CATEGORY_COLORS, **(colors or {}))
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 0.9 + 0.8 * len(per_rank_spans)))
    seen, yticks, ylabels, y = [], [], [], 0.0
    xmax = max((Span(*s).end for spans in per_rank_spans for s in spans), default=1.0) * 1e3
    for rank in reversed(range(len(per_rank_spans))):
        spans = [Span(*s) for s in per_rank_spans[rank]]
        groups = list(sub_rows or []) + [None]           # None: every other category
        group_of = lambda s: s.category if s.category in groups else None
        lanes, placed = [], []   # lanes: (group, end time of its last span), top to bottom
        for g in groups:
            for s in sorted((s for s in spans if group_of(s) == g), key=lambda s: s.start):
                lane = next((i for i, (lg, end) in enumerate(lanes) if lg == g and end <= s.start + 1e-9), None)
                if lane is None:
                    lanes.append((g, s.end))
                    lane = len(lanes) - 1
                lanes[lane] = (g, s.end)
                placed.append((s, lane))
        height = 0.8 / max(1, len(lanes))
        for s, lane in placed:
            color = colors.get(s.category, colors["other"])
            if s.category not in seen:
                seen.append(s.category)
            bottom = y + 0.1 + (len(lanes) - 1 - lane) * height     # the first sub-row on top
            ax.broken_barh([(s.start * 1e3, max(s.seconds * 1e3, 1e-3))], (bottom, height * 0.9),
                           facecolors=color, edgecolors="black", linewidth=0.4)
            label = _short(s.name)
            if label_spans and s.seconds * 1e3 > 0.008 * xmax * (len(label) + 1):   # only if it fits
                ax.text((s.start + s.seconds / 2) * 1e3, bottom + height * 0.45, label,
                        ha="center", va="center", fontsize=7, clip_on=True)
        yticks.append(y + 0.5)
        ylabels.append(f"rank {rank}")
        y += 1.0
    ax.set_yticks(yticks)
    ax.set_yticklabels(ylabels)
    ax.set_ylim(0, y)
    ax.set_xlabel("time since start (ms)")
    if title:
        ax.set_title(title)
    ax.legend(handles=[Patch(facecolor=colors.get(c, colors["other"]), label=c) for c in seen],
              loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8, frameon=False)
    return ax


def _short(name):
    # "all_reduce bucket 3" -> "b3": bars are narrow; the legend says what the colour means.
    parts = name.split()
    if len(parts) >= 2 and parts[-2] == "bucket":
        return "b" + parts[-1]
    return name

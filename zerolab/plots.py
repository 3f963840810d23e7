"""Pictures for the lessons: who holds what, before and after a collective, and the ring schedule."""
import matplotlib.pyplot as plt
import numpy as np


def _grid(ax, values, title, highlight=None, width=None):
    """Draw one row of boxes per rank with the value in each box."""
    values = [list(v) for v in values]
    width = width or max(len(v) for v in values)
    for r, row in enumerate(values):
        for i, v in enumerate(row):
            color = "#fde68a" if highlight and (r, i) in highlight else "#dbeafe"
            ax.add_patch(plt.Rectangle((i, -r), 0.92, 0.85, color=color, ec="#1e3a8a", lw=0.8))
            ax.text(i + 0.46, -r + 0.42, f"{v:g}", ha="center", va="center", fontsize=9)
        ax.text(-0.2, -r + 0.42, f"rank {r}", ha="right", va="center", fontsize=9)
    ax.set_xlim(-1.3, max(width, 1) + 0.1)
    ax.set_ylim(-len(values) + 0.8, 1.1)
    ax.set_title(title, fontsize=10)
    ax.axis("off")


def draw_collective(name, before, after, note=""):
    """Two panels: each rank's tensor before and after collective ``name`` (values from real ranks)."""
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 0.55 * len(before) + 1.0))
    width = max(len(v) for v in list(before) + list(after))  # one scale for both panels
    _grid(a, before, f"{name}: before", width=width)
    _grid(b, after, f"{name}: after" + (f"  ({note})" if note else ""), width=width)
    fig.tight_layout()
    return fig


def draw_ring_schedule(world_size):
    """The ring reduce-scatter then all-gather schedule: which chunk each rank sends at each step.
    Row = rank, column = step; the label is the chunk index sent to the right neighbour."""
    n = world_size
    steps = 2 * (n - 1)
    sched = np.zeros((n, steps), dtype=int)
    for r in range(n):
        for s in range(n - 1):
            sched[r, s] = (r - s - 1) % n          # reduce-scatter: send chunk r-s-1
            sched[r, n - 1 + s] = (r - s) % n      # all-gather: send chunk r-s
    fig, ax = plt.subplots(figsize=(1.1 * steps + 2, 0.5 * n + 1.2))
    ax.imshow(sched, cmap="tab10", vmin=0, vmax=9, aspect="auto")
    for r in range(n):
        for s in range(steps):
            ax.text(s, r, f"c{sched[r, s]}", ha="center", va="center", color="white", fontsize=10)
    ax.set_xticks(range(steps), [f"RS {s + 1}" if s < n - 1 else f"AG {s - n + 2}" for s in range(steps)])
    ax.set_yticks(range(n), [f"rank {r}" for r in range(n)])
    ax.axvline(n - 1.5, color="black", lw=2)
    ax.set_title(f"Ring all-reduce on {n} ranks: chunk sent to the right neighbour at each step "
                 f"(RS = reduce-scatter, AG = all-gather)", fontsize=10)
    fig.tight_layout()
    return fig


def draw_flat_partition(params, shards, numel, padded, title=""):
    """ZeRO's partitioning of one flat buffer: the parameters packed back to back (top row, zero
    padding hatched) and the contiguous slice each rank owns (bottom row). ``params``: [(name,
    offset, numel)], ``shards``: [(lo, hi)] per rank, as reported by the ranks themselves."""
    fig, ax = plt.subplots(figsize=(10, 2.9))
    colors = plt.cm.Pastel1(np.linspace(0, 1, 9))
    for i, (name, off, n) in enumerate(params):
        ax.barh(1, n, left=off, color=colors[i % 9], edgecolor="k", lw=0.6, label=name)
        if n > 0.08 * padded:
            ax.text(off + n / 2, 1, name, ha="center", va="center", fontsize=8)
    if padded > numel:
        ax.barh(1, padded - numel, left=numel, color="w", edgecolor="k", hatch="///", lw=0.6,
                label=f"padding ({padded - numel})")
    for r, (lo, hi) in enumerate(shards):
        ax.barh(0, hi - lo, left=lo, color=plt.cm.tab10(r), alpha=0.55, edgecolor="k", lw=0.6)
        ax.text((lo + hi) / 2, 0, f"rank {r}: [{lo}, {hi})", ha="center", va="center", fontsize=8)
        ax.axvline(lo, color="k", ls=":", lw=0.8)
    ax.set_yticks([0, 1], ["owner", "flat buffer"])
    ax.set_xlim(0, padded)
    ax.set_xlabel("element of the flat buffer")
    ax.set_title(title, fontsize=10)
    handles, labels = ax.get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=7, ncol=8, loc="lower center", frameon=False)
    fig.subplots_adjust(left=0.09, right=0.98, top=0.86, bottom=0.36)
    return fig


_STAGE_TITLES = {0: "stage 0 (DP): (2+2+K)Ψ", 1: "stage 1: 4Ψ + KΨ/N", 2: "stage 2: 2Ψ + (2+K)Ψ/N",
                 3: "stage 3: (4+K)Ψ/N"}


def draw_memory_per_rank(measured, theory, stages, world_sizes=(1, 2, 4)):
    """Measured model states of every rank as stacked bars (params, grads, master, optimizer),
    the theory as a black line over each group of N ranks, process RSS growth as red markers.
    ``measured[(stage, n)]``: per rank ({kind: bytes}, rss_growth_bytes);
    ``theory(stage, n)``: bytes per rank."""
    kinds = ("params", "grads", "master", "optimizer")
    colors = ("#93c5fd", "#fca5a5", "#fcd34d", "#86efac")
    fig, axes = plt.subplots(1, len(stages), figsize=(4.0 * len(stages), 3.4), sharey=True)
    axes = np.atleast_1d(axes)
    for ax, stage in zip(axes, stages):
        x, centers = 0.0, []
        for n in world_sizes:
            start = x
            for kinds_bytes, grown in measured[(stage, n)]:
                bottom = 0.0
                for kind, c in zip(kinds, colors):
                    mb = kinds_bytes.get(kind, 0) / 1e6
                    ax.bar(x, mb, bottom=bottom, color=c, edgecolor="k", lw=0.4, label=kind if x == 0 else None)
                    bottom += mb
                ax.plot(x, grown / 1e6, "rv", ms=6, label="process RSS growth" if x == 0 else None)
                x += 1
            ax.hlines(theory(stage, n) / 1e6, start - 0.45, x - 0.55, color="k", lw=2,
                      label="ZeRO formula" if start == 0 else None)
            centers.append((start + x - 1) / 2)
            x += 0.7
        ax.set_xticks(centers, [f"N = {n}" for n in world_sizes])
        ax.set_title(_STAGE_TITLES[stage], fontsize=10)
    axes[0].set_ylabel("MB per rank (one bar per rank)")
    handles, labels = axes[0].get_legend_handles_labels()
    axes[-1].legend(handles, labels, fontsize=7, loc="upper right")
    fig.tight_layout()
    return fig


def draw_buckets(buckets, world_size, title=""):
    """ZeRO-2's layout: one row per gradient bucket (in the order backward fills them), each its
    own padded flat buffer cut into ``world_size`` equal slices, slice r owned by rank r.
    ``buckets``: [(label, numel, padded)]."""
    fig, ax = plt.subplots(figsize=(10, 0.42 * len(buckets) + 1.3))
    for i, (label, numel, padded) in enumerate(buckets):
        s = padded // world_size
        for r in range(world_size):
            ax.barh(-i, s, left=r * s, color=plt.cm.tab10(r), alpha=0.55, edgecolor="k", lw=0.5,
                    label=f"rank {r}" if i == 0 else None)
        if padded > numel:
            ax.barh(-i, padded - numel, left=numel, color="w", edgecolor="k", hatch="///", lw=0.5,
                    label="padding" if not any(p > n for _, n, p in buckets[:i]) else None)
        ax.text(padded * 1.01, -i, label, va="center", fontsize=7)
    ax.set_yticks([-i for i in range(len(buckets))], [f"bucket {i}" for i in range(len(buckets))])
    ax.set_xlabel("element of the bucket's flat buffer")
    ax.set_xlim(0, max(p for _, _, p in buckets) * 1.6)
    ax.legend(fontsize=7, loc="lower right")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return fig


def zero2_layouts(bucket_numels, world_size):
    """The two ZeRO-2 layouts of the same gradient buckets, as element ranges (accounting, no ranks):
    ``bucket_numels`` in the order backward fills them (the last layers' first).

    {"sharded": [[(rank, lo, hi)] per bucket], "owner": [[(rank, lo, hi)] per bucket], "psi", "partition"}:
    "sharded" (FSDP, Megatron's distributed optimizer, zerolab): each bucket padded to a multiple of N
    and cut into N equal slices, slice r to rank r (ranges within the bucket). "owner" (DeepSpeed): one
    global partition of the Ψ elements in forward order, rank r owning [r·P, (r+1)·P) with P = ceil(Ψ/N);
    bucket k covers the elements backward produced k-th, counted from the end, cut at the partition
    boundaries, each piece reduced to its owner (ranges in global element order)."""
    n, psi = world_size, sum(bucket_numels)
    part = -(-psi // n)
    sharded = []
    for numel in bucket_numels:
        s = -(-numel // n)
        sharded.append([(r, r * s, (r + 1) * s) for r in range(n)])
    owner, end = [], psi
    for numel in bucket_numels:
        lo, pieces = end - numel, []
        for r in range(n):
            a, b = max(lo, r * part), min(end, (r + 1) * part)
            if a < b:
                pieces.append((r, a, b))
        owner.append(pieces)
        end = lo
    return {"sharded": sharded, "owner": owner, "psi": psi, "partition": part}


def draw_zero2_layouts(bucket_numels, world_size, title=""):
    """Left: each bucket its own buffer sharded 1/N (FSDP, Megatron, zerolab). Right: one global
    partition, each bucket's pieces reduced to their owners (DeepSpeed). Colour = the rank that
    receives those gradients. See :func:`zero2_layouts`."""
    lay = zero2_layouts(bucket_numels, world_size)
    k = len(bucket_numels)
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 0.33 * k + 1.8))
    for i, slices in enumerate(lay["sharded"]):
        for r, lo, hi in slices:
            a.barh(-i, hi - lo, left=lo, color=plt.cm.tab10(r), alpha=0.6, edgecolor="k", lw=0.4,
                   label=f"rank {r}" if i == 0 else None)
    a.set_title("each bucket its own buffer, sharded 1/N\n(FSDP, Megatron's distributed optimizer, zerolab): "
                "one reduce-scatter per bucket", fontsize=9)
    a.set_xlabel("element of the bucket (padded to a multiple of N)")
    psi, part = lay["psi"], lay["partition"]
    for r in range(world_size):                       # the global partition, forward order
        b.barh(1, min(part, psi - r * part), left=r * part, color=plt.cm.tab10(r), alpha=0.6, edgecolor="k", lw=0.4)
    b.text(0, 1.55, "one global partition (ZeRO-1's): rank r owns a contiguous 1/N", fontsize=8)
    for i, pieces in enumerate(lay["owner"]):
        for r, lo, hi in pieces:
            b.barh(-i, hi - lo, left=lo, color=plt.cm.tab10(r), alpha=0.6, edgecolor="k", lw=0.4)
        if len(pieces) > 1:
            b.text(pieces[-1][2] + psi * 0.01, -i, f"{len(pieces)} reduces", va="center", fontsize=7)
    b.set_title("one global partition, each bucket's pieces REDUCED to their owners\n(DeepSpeed stage 2): "
                "one dist.reduce per piece", fontsize=9)
    b.set_xlabel("element of the model's parameters (forward order)")
    b.set_xlim(0, psi * 1.15)
    for ax in (a, b):
        ax.set_yticks([-i for i in range(k)], [f"bucket {i}" for i in range(k)], fontsize=7)
    b.set_yticks([1] + [-i for i in range(k)], ["partition"] + [f"bucket {i}" for i in range(k)], fontsize=7)
    a.legend(fontsize=7, loc="lower right")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def draw_flat_vs_dim0(rows, world_size, width=4):
    """Lesson 11's comparison of the two ways to shard parameters on ``world_size`` ranks: left, the
    flat layout of lesson 05 (the parameters back to back in one buffer, cut into N equal slices
    wherever the boundaries fall); right, FSDP2's per-parameter layout (each parameter cut along dim 0
    into pieces of ceil(rows / N) rows, zero rows padding the last, hatched). ``rows``: {name: number
    of rows}, each row ``width`` elements. The legend sits outside the axes, so it covers no bar."""
    colors = [plt.cm.tab10(r) for r in range(world_size)]
    fig, (flat, dim0) = plt.subplots(1, 2, figsize=(11, 2.8))
    total = sum(rows.values()) * width
    per = -(-total // world_size)
    x = 0
    for name, r in rows.items():                       # flat: elements back to back
        flat.barh(0, r * width, left=x, color="white", edgecolor="black")
        flat.text(x + r * width / 2, 0, name, ha="center", va="center")
        x += r * width
    for rank in range(world_size):
        flat.barh(-1, per, left=rank * per, color=colors[rank], edgecolor="black")
        flat.text(rank * per + per / 2, -1, f"rank {rank}", ha="center", va="center", color="white")
    flat.set_yticks([0, -1], ["parameters", "flat shards"])
    flat.set_xlabel("element")
    flat.set_title("flat (lesson 05): one buffer cut into N slices", fontsize=10)
    y = 0
    for name, r in rows.items():                       # per-parameter: each cut along its rows
        c = -(-r // world_size)
        for rank in range(world_size):
            real = max(0, min(c, r - rank * c))
            dim0.barh(y, real, left=rank * c, color=colors[rank], edgecolor="black")
            if real < c:
                dim0.barh(y, c - real, left=rank * c + real, color="lightgray", hatch="//", edgecolor="black")
        dim0.text(-0.3, y, name, ha="right", va="center")
        y -= 1
    dim0.set_yticks([])
    dim0.set_xlabel("row (gray: zero padding rows)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors]
    handles.append(plt.Rectangle((0, 0), 1, 1, facecolor="lightgray", hatch="//", edgecolor="black"))
    dim0.legend(handles=handles, labels=[f"rank {r}" for r in range(world_size)] + ["padding"],
                fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    dim0.set_title("per-parameter (FSDP2): every parameter cut along dim 0", fontsize=10)
    fig.tight_layout()
    return fig

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

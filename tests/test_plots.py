"""Figures that must not hide what they show: lesson 11's per-parameter layout keeps its legend off
the padding it draws, and the demo's timeline says its time axis once. Fast: no ranks."""
import matplotlib

matplotlib.use("Agg")

from matplotlib.patches import Rectangle  # noqa: E402

from zerolab import demo, plots  # noqa: E402


def _bars(ax):
    return [p for p in ax.patches if isinstance(p, Rectangle) and p.get_width() > 0]


def test_lesson_11_legend_covers_no_bar_and_names_the_padding():
    fig = plots.draw_flat_vs_dim0({"A": 5, "B": 3, "C": 7}, 3)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    dim0 = fig.axes[1]
    legend = dim0.get_legend().get_window_extent(renderer)
    padding = [p for p in _bars(dim0) if p.get_hatch() == "//"]
    assert len(padding) == 2, "A (5 rows) and C (7 rows) need padding rows on 3 ranks; B (3) does not"
    for bar in _bars(dim0):
        assert not legend.overlaps(bar.get_window_extent(renderer)), "the legend covers a bar"
    assert "padding" in [t.get_text() for t in dim0.get_legend().get_texts()]


def test_demo_timeline_has_one_time_axis_label_and_one_legend():
    spans = [[("forward", "forward", 0.0, 0.01), ("backward", "backward + gradient comm", 0.01, 0.03),
              ("optimizer step", "optimizer step + param comm", 0.03, 0.035)]] * 2
    results = {s: {"state_bytes": 1, "theory_bytes": 1, "wire_measured": 1, "wire_theory": 1,
                   "timeline": spans} for s in ("0", "1", "2", "3")}
    fig = dict(demo.figures(results, 2))["timeline.png"]
    labels = [ax.get_xlabel() for ax in fig.axes]
    assert labels[-1] and not any(labels[:-1]), labels
    assert sum(ax.get_legend() is not None for ax in fig.axes) == 1

"""The memory calculator of lesson 01: per-rank model-state bytes for any model size, world size,
ZeRO stage, precision, optimizer and offload.

The logic is plain functions (:func:`calculate`, :func:`describe`, :func:`plot_per_rank`), tested
without a browser; :class:`MemoryCalculator` is a thin ipywidgets view that calls them whenever a
control changes. All numbers come from :func:`zerolab.memory.model_state_placement` (the ZeRO
formulas, arXiv 1910.02054, and ZeRO-Offload's split, arXiv 2101.06840).
"""
import io

import matplotlib
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from zerolab import memory

GB = 1e9  # the paper's unit: 10^9 bytes
STAGE_NAMES = {0: "DP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}
PRECISIONS = {"mixed": True, "fp32": False}
OPTIMIZERS = ("adam", "sgd-momentum", "sgd")
COLORS = {"params": "#4C72B0", "grads": "#DD8452", "optimizer": "#55A868", "activations": "#C44E52"}
KINDS = ("params", "grads", "optimizer")


def calculate(num_params, world_size, stage, *, precision="mixed", optimizer="adam", offload=False):
    """Per-rank model-state bytes for one configuration.

    Returns {"device": {kind: bytes}, "host": {kind: bytes}, "device_total", "host_total", "k"},
    kinds "params", "grads", "optimizer"; ``k`` is the optimizer's bytes/param (K in the paper).
    ``precision``: "mixed" (2-byte params and grads, fp32 master in the optimizer) or "fp32".
    ``optimizer``: "adam" (m, v), "sgd-momentum" or "sgd". Raises ValueError naming a bad value.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is not known: choose one of {list(PRECISIONS)}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer={optimizer!r} is not known: choose one of {list(OPTIMIZERS)}")
    mixed = PRECISIONS[precision]
    k = memory.optimizer_k(optimizer, mixed_precision=mixed)
    split = memory.model_state_placement(num_params, world_size, stage, mixed_precision=mixed,
                                         offload=offload, k=k)
    return {"device": split["device"], "host": split["host"], "k": k,
            "device_total": sum(split["device"].values()), "host_total": sum(split["host"].values())}


def _unit(largest):
    for name, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if largest >= size:
            return name, size
    return "bytes", 1


def _fmt(x):
    return f"{x:.3g}"


def params_label(num_params):
    """7.5e9 -> '7.5B', 1e6 -> '1M', 1.2e12 -> '1.2T' (3 significant figures)."""
    for suffix, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if num_params >= size:
            return f"{num_params / size:.3g}{suffix}"
    return f"{num_params:.3g}"


def describe(result, *, device_gb=None):
    """One line of text for a :func:`calculate` result (GB = 1e9 bytes), and whether it fits."""
    d, h = result["device"], result["host"]
    text = (f"per rank: device {_fmt(result['device_total'] / GB)} GB (params {_fmt(d['params'] / GB)}, "
            f"grads {_fmt(d['grads'] / GB)}, optimizer {_fmt(d['optimizer'] / GB)})")
    if result["host_total"]:
        text += (f"; host {_fmt(result['host_total'] / GB)} GB (grads {_fmt(h['grads'] / GB)}, "
                 f"optimizer {_fmt(h['optimizer'] / GB)})")
    if device_gb is not None:
        fits = result["device_total"] <= device_gb * GB
        text += (f" — model states {'fit' if fits else 'do NOT fit'} in {_fmt(device_gb)} GB "
                 f"(activations and buffers come on top)")
    return text


def plot_per_rank(results, ax, *, device_gb=None, title=None):
    """Stacked bars of per-rank bytes: for each ``label: calculate(...)`` in ``results`` a device
    bar and, if it offloads anything, a hatched host bar, stacked params / grads / optimizer.

    Returns {(label, "device" or "host", kind): bytes} of the segments drawn, in draw order.
    ``device_gb`` draws the device's capacity as a dashed line.
    """
    largest = max(max(r["device_total"], r["host_total"]) for r in results.values()) or 1
    unit, scale = _unit(max(largest, (device_gb or 0) * GB))
    drawn, ticks, labels, legend = {}, [], [], set()
    x = 0
    for label, r in results.items():
        places = ("device", "host") if r["host_total"] else ("device",)
        for place in places:
            bottom = 0
            for kind in KINDS:
                value = r[place][kind]
                ax.bar(x, value / scale, bottom=bottom / scale, color=COLORS[kind], width=0.8,
                       hatch="//" if place == "host" else None, edgecolor="white",
                       label=None if kind in legend else kind)
                legend.add(kind)
                drawn[(label, place, kind)] = value
                bottom += value
            ax.annotate(_fmt(bottom / scale), (x, bottom / scale), ha="center", va="bottom",
                        fontsize=8, xytext=(0, 2), textcoords="offset points")
            ticks.append(x)
            labels.append(place if len(places) > 1 else label)
            x += 1
        if len(places) > 1:   # the configuration's name once, under its device and host bars
            ax.annotate(label, xy=(x - 1.5, 0), xycoords=("data", "axes fraction"), xytext=(0, -16),
                        textcoords="offset points", ha="center", va="top", fontsize=8)
        x += 0.5
    handles, names = ax.get_legend_handles_labels()
    by_name = dict(zip(names, handles))
    if device_gb is not None:
        line = ax.axhline(device_gb * GB / scale, color="black", linestyle="--", linewidth=1)
        by_name[f"device memory ({_fmt(device_gb)} GB)"] = line
    ax.legend(by_name.values(), by_name.keys(), fontsize=8, loc="upper right")
    ax.set_xticks(ticks, labels, fontsize=8)
    ax.set_ylabel(f"{unit} per rank" + (" (1 GB = 1e9 bytes)" if unit == "GB" else ""))
    ax.set_ylim(0, ax.get_ylim()[1] * 1.12)  # room for the total above the tallest bar
    if title:
        ax.set_title(title, fontsize=10)
    return drawn


class MemoryCalculator:
    """ipywidgets view: controls -> :func:`calculate` -> :func:`plot_per_rank` into a PNG image.

    ``controls`` (dict of widgets), ``figure`` (the matplotlib Figure last drawn), ``image`` (the
    widget showing it), ``message`` (text summary or the ValueError), ``box`` (the layout).
    Changing any control calls :meth:`update`. Display it in a notebook cell: ``MemoryCalculator()``.
    The selected configuration is drawn next to plain data parallelism for reference.
    """

    def __init__(self, num_params=7.5e9, world_size=64, stage=2, *, precision="mixed",
                 optimizer="adam", offload=False, device_gb=80.0):
        import ipywidgets as w
        style = {"description_width": "9em"}
        self.controls = {
            "num_params": w.FloatLogSlider(value=num_params, base=10, min=6, max=12.5, step=0.01,
                                           readout_format=".3g", description="parameters Ψ",
                                           style=style),
            "world_size": w.BoundedIntText(value=world_size, min=1, max=1_000_000,
                                           description="ranks N", style=style),
            "stage": w.Dropdown(options=[(f"{v} (stage {s})", s) for s, v in STAGE_NAMES.items()],
                                value=stage, description="ZeRO stage", style=style),
            "precision": w.Dropdown(options=[("mixed (bf16/fp16 + fp32 master)", "mixed"),
                                             ("fp32", "fp32")],
                                    value=precision, description="precision", style=style),
            "optimizer": w.Dropdown(options=[("Adam / AdamW", "adam"), ("SGD + momentum", "sgd-momentum"),
                                             ("SGD", "sgd")],
                                    value=optimizer, description="optimizer", style=style),
            "offload": w.Checkbox(value=offload, description="CPU offload (ZeRO-Offload)"),
            "device_gb": w.BoundedFloatText(value=device_gb, min=0.1, max=1e5,
                                            description="device GB", style=style),
        }
        self.image = w.Image(format="png")
        self.message = w.HTML()
        self.figure = None
        c = self.controls
        left = w.VBox([c["num_params"], c["world_size"], c["stage"], c["device_gb"]])
        right = w.VBox([c["precision"], c["optimizer"], c["offload"]])
        self.box = w.VBox([w.HBox([left, right]), self.message, self.image])
        for control in self.controls.values():
            control.observe(lambda change: self.update(), names="value")
        self.update()

    def values(self):
        """The current settings, as :func:`calculate`'s arguments."""
        c = self.controls
        return {"num_params": int(round(c["num_params"].value)), "world_size": c["world_size"].value,
                "stage": c["stage"].value, "precision": c["precision"].value,
                "optimizer": c["optimizer"].value, "offload": c["offload"].value}

    def update(self):
        """Recompute and redraw (the widgets' callback)."""
        v = self.values()
        device_gb = self.controls["device_gb"].value
        figure = Figure(figsize=(7.5, 3.4), dpi=90)
        FigureCanvasAgg(figure)
        ax = figure.add_subplot()
        try:
            selected = calculate(**v)
        except ValueError as exc:
            self.message.value = f"<b>Not a valid setting:</b> {exc}"
            ax.text(0.5, 0.5, str(exc), ha="center", va="center", wrap=True, transform=ax.transAxes)
            ax.set_axis_off()
        else:
            results = {}
            if v["stage"] != 0:
                results["DP"] = calculate(**dict(v, stage=0, offload=False))
            name = STAGE_NAMES[v["stage"]] + (" + offload" if v["offload"] else "")
            results[name] = selected
            plot_per_rank(results, ax, device_gb=device_gb,
                          title=f"Ψ = {params_label(v['num_params'])} params, N = {v['world_size']}, "
                                f"{v['precision']}, {v['optimizer']} (K = {selected['k']})")
            self.message.value = describe(selected, device_gb=device_gb)
        figure.tight_layout()
        buf = io.BytesIO()
        figure.savefig(buf, format="png", bbox_inches="tight")
        self.figure = figure
        self.image.value = buf.getvalue()

    def _repr_mimebundle_(self, **kwargs):
        # The live widget, plus a fixed text/plain (the widgets' own repr embeds the PNG bytes,
        # which change with matplotlib versions): a saved notebook stays stable under nbval.
        bundle = self.box._repr_mimebundle_(**kwargs)
        data = bundle[0] if isinstance(bundle, tuple) else bundle
        data["text/plain"] = "MemoryCalculator: run the notebook to use the controls."
        return bundle

"""The memory calculator of lesson 01: per-rank model-state bytes for any model size, world size,
ZeRO stage, precision, optimizer and offload.

The logic is plain functions (:func:`calculate`, :func:`describe`, :func:`plot_per_rank`), tested
without a browser; :class:`MemoryCalculator` is a thin ipywidgets view that calls them whenever a
control changes. All numbers come from :func:`zerolab.memory.model_state_placement` (the ZeRO
formulas, arXiv 1910.02054, and ZeRO-Offload's split, arXiv 2101.06840).

"What would this cost at N GPUs": :func:`at_scale` / :func:`describe_at_scale` feed the same setting
to the cost model :mod:`zerolab.cost` (calibrated against measured step times in lesson 07) with a
published hardware profile: fits or not, bytes on the wire, predicted step time, largest model.
"""
import html
import io
import textwrap

import matplotlib
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from zerolab import cost, memory

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


# ------------------------------------------------------------------------ at scale (zerolab.cost)
# The published profiles of zerolab.cost, and where their numbers come from (cost.py cites them
# at the line that defines them; repeated here so the widget can say it to the student).
HARDWARE = {"V100 32GB": cost.V100_32GB, "A100 80GB": cost.A100_80GB, "H100 80GB": cost.H100_80GB}
SOURCES = {
    "V100 32GB": "NVIDIA V100 datasheet (32 GB, 125 TFLOP/s fp16); link: the ZeRO paper's cluster, "
                 "800 Gb/s InfiniBand per 16-GPU DGX-2 node = 100 Gb/s per GPU; PCIe 3 x16; HBM 0.9 TB/s",
    "A100 80GB": "NVIDIA A100 datasheet (80 GB, 312 TFLOP/s bf16); one 200 Gb/s NIC per GPU; PCIe 4 x16; "
                 "HBM 2.0 TB/s",
    "H100 80GB": "NVIDIA H100 SXM datasheet (80 GB, 989 TFLOP/s bf16 dense); one 400 Gb/s NIC per GPU; "
                 "PCIe 5 x16; HBM 3.35 TB/s",
}
ASSUMPTIONS = ("MFU 0.3-0.4 (the ZeRO paper's 38 TFLOP/s per V100); host Adam throughput is an assumption "
               "of the right order (fused CPU AdamW: 1.3e9 params/s on 2 cores); device Adam = HBM "
               "bandwidth / 28 bytes per parameter")


def _hardware(hardware):
    if isinstance(hardware, cost.Hardware):
        return hardware, f"your profile {hardware.name!r}"
    if hardware in HARDWARE:
        return HARDWARE[hardware], f"{SOURCES[hardware]}; {ASSUMPTIONS} (zerolab/cost.py)"
    raise ValueError(f"hardware={hardware!r} is not known: choose one of {list(HARDWARE)} "
                     f"or pass a zerolab.cost.Hardware")


def at_scale(num_params, world_size, stage, *, hardware="A100 80GB", tokens_per_gpu=4096,
             precision="mixed", offload=False, overlap=True, reserved_bytes=0.0):
    """What one configuration would cost on ``world_size`` GPUs of ``hardware``, from :mod:`zerolab.cost`.

    ``hardware``: a name in :data:`HARDWARE` or a :class:`zerolab.cost.Hardware` (e.g. a calibrated
    profile). ``tokens_per_gpu``: tokens each GPU processes per step (micro-batch x sequence x
    accumulation). The optimizer is Adam (the cost model's update rates are Adam's).
    ``reserved_bytes``: room kept for activations and buffers (see :func:`zerolab.cost.activation_bytes`).

    The step is phase-aware (:func:`zerolab.cost.step_time`): gradient reductions hide only under
    backward, stage 1-2's parameter all-gather runs after the update (DeepSpeed's order), stage 3's
    gathers hide under forward and backward compute with prefetch.

    Returns the setting (``num_params`` ... ``overlap``, as passed) and {"hardware", "source",
    "device_bytes", "host_bytes", "device_memory", "fits",
    "wire_bytes", "host_link_bytes", "times" (:func:`zerolab.cost.step_time`: compute, comm,
    exposed_comm, update, offload, forward, backward, step, total), "total_no_overlap", "bound" (the
    largest of compute, exposed communication, update and offload), "largest_params"}.
    Raises ValueError naming a bad value.
    """
    hw, source = _hardware(hardware)
    if not tokens_per_gpu > 0:
        raise ValueError(f"tokens_per_gpu={tokens_per_gpu!r} must be positive")
    states = calculate(num_params, world_size, stage, precision=precision, offload=offload)
    mixed = PRECISIONS[precision]
    word = 2 if mixed else 4    # bytes per gradient / parameter element on the wire
    common = dict(tokens_per_rank=tokens_per_gpu, hw=hw, offload=offload, grad_bytes=word, param_bytes=word)
    times = cost.step_time(num_params, world_size, stage, overlap=overlap, **common)
    serial = cost.step_time(num_params, world_size, stage, overlap=False, **common)["total"]
    # ZeRO-Offload: each rank sends its gradient shard down and gets its parameter shard back.
    host_link = 2 * word * num_params / world_size if offload else 0.0
    return {"num_params": num_params, "world_size": world_size, "stage": stage, "precision": precision,
            "offload": offload, "tokens_per_gpu": tokens_per_gpu, "overlap": overlap,
            "hardware": hw, "source": source, "device_bytes": states["device_total"],
            "host_bytes": states["host_total"], "device_memory": hw.device_memory,
            "fits": states["device_total"] <= hw.device_memory - reserved_bytes,
            "wire_bytes": cost.wire_bytes(num_params, world_size, stage, grad_bytes=word, param_bytes=word),
            "host_link_bytes": host_link, "times": times, "total_no_overlap": serial,
            "bound": max((("compute", times["compute"]), ("communication", times["exposed_comm"]),
                          ("optimizer update", times["update"]), ("host offload", times["offload"])),
                         key=lambda kv: kv[1])[0],
            "largest_params": cost.largest_model(world_size, stage, hw, offload=offload,
                                                 reserved_bytes=reserved_bytes, mixed_precision=mixed)}


def _secs(t):
    if t == 0:
        return "0 s"
    return f"{t:.3g} s" if t >= 1 else f"{t * 1e3:.3g} ms" if t >= 1e-3 else f"{t * 1e6:.3g} µs"


def _rate(x):
    return "not modelled (free)" if x == float("inf") else f"{x:.2g}".replace("e+0", "e").replace("e+", "e")


def describe_at_scale(r):
    """Text for an :func:`at_scale` result: memory, wire bytes, step time, largest model, and the
    hardware numbers used with their sources (GB = 1e9 bytes)."""
    hw, t, n = r["hardware"], r["times"], r["world_size"]
    name = STAGE_NAMES[r["stage"]] + (" + offload" if r["offload"] else "")
    if not r["overlap"]:
        over = "not overlapped"
    elif t["exposed_comm"] <= 1e-3 * t["comm"]:
        over = "all of it hidden"
    else:
        over = f"{_secs(t['exposed_comm'])} of it exposed"
    host = f", host {_fmt(r['host_bytes'] / GB)} GB" if r["host_bytes"] else ""
    lines = [
        f"{name}, Ψ = {params_label(r['num_params'])}, N = {n} x {hw.name}, "
        f"{r['tokens_per_gpu']:,} tokens per GPU, {r['precision']} precision, Adam:",
        f"  memory   model states {_fmt(r['device_bytes'] / GB)} GB per GPU{host} — "
        f"{'fit' if r['fits'] else 'do NOT fit'} in {_fmt(r['device_memory'] / GB)} GB "
        f"(activations and buffers come on top)",
        f"  wire     each GPU sends {_fmt(r['wire_bytes'] / GB)} GB per step"
        + (f"; {_fmt(r['host_link_bytes'] / GB)} GB over the host link" if r["host_link_bytes"] else ""),
        f"  time     compute {_secs(t['compute'])} | comm {_secs(t['comm'])} ({over}) | "
        f"update {_secs(t['update'])} | offload {_secs(t['offload'])}",
        f"           step = forward {_secs(t['forward'])} + backward {_secs(t['backward'])} + optimizer step "
        f"{_secs(t['step'])} = {_secs(t['total'])} ({_secs(r['total_no_overlap'])} without overlap); "
        f"bottleneck: {r['bound']}",
        "           (gradient reductions hide only under backward; stage 1-2's all-gather runs after the "
        "update, DeepSpeed's order; stage 3's gathers hide under compute with prefetch)",
        f"  largest  model whose states fit at N = {n}, {name}: {params_label(r['largest_params'])}",
        f"  hardware {_fmt(hw.peak_flops / 1e12)} TFLOP/s x MFU {hw.mfu:g}; "
        f"link {_fmt(hw.link_bandwidth / GB)} GB/s + {_fmt(hw.link_latency * 1e6)} µs per ring step; "
        f"host link {_fmt(hw.host_link_bandwidth / GB)} GB/s; "
        f"Adam {_rate(hw.host_adam_params_per_s)} params/s on the host, "
        f"{_rate(hw.device_adam_params_per_s)} on the device",
        f"  sources  {r['source']}",
    ]
    return "\n".join(textwrap.fill(line, 100, subsequent_indent=" " * 11) for line in lines)


class MemoryCalculator:
    """ipywidgets view: controls -> :func:`calculate` -> :func:`plot_per_rank` into a PNG image,
    and below it :func:`at_scale` -> :func:`describe_at_scale` ("what would this cost at N GPUs").

    ``controls`` (dict of widgets), ``figure`` (the matplotlib Figure last drawn), ``image`` (the
    widget showing it), ``message`` (text summary or the ValueError), ``cost_message`` (the at-scale
    text), ``box`` (the layout). Changing any control calls :meth:`update`; choosing a hardware also
    sets "device GB" to its memory. Display it in a notebook cell: ``MemoryCalculator()``.
    The selected configuration is drawn next to plain data parallelism for reference.
    """

    def __init__(self, num_params=7.5e9, world_size=64, stage=2, *, precision="mixed",
                 optimizer="adam", offload=False, device_gb=None, hardware="A100 80GB",
                 tokens_per_gpu=4096):
        import ipywidgets as w
        if device_gb is None:                      # default: the chosen GPU's memory
            device_gb = _hardware(hardware)[0].device_memory / GB
        style = {"description_width": "9em"}
        # Wide enough for the longest choice after the 9em description ("mixed (bf16/fp16 + fp32
        # master)" needs about 17em with the dropdown's arrow): ipywidgets' default, 300px, cut it.
        wide = dict(style=style, layout=w.Layout(width="28em"))
        self.controls = {
            "num_params": w.FloatLogSlider(value=num_params, base=10, min=6, max=12.5, step=0.001,
                                           readout_format=".3g", description="parameters Ψ",
                                           **wide),
            "world_size": w.BoundedIntText(value=world_size, min=1, max=1_000_000,
                                           description="ranks N", **wide),
            "stage": w.Dropdown(options=[(f"{v} (stage {s})", s) for s, v in STAGE_NAMES.items()],
                                value=stage, description="ZeRO stage", **wide),
            "precision": w.Dropdown(options=[("mixed (bf16/fp16 + fp32 master)", "mixed"),
                                             ("fp32", "fp32")],
                                    value=precision, description="precision", **wide),
            "optimizer": w.Dropdown(options=[("Adam / AdamW", "adam"), ("SGD + momentum", "sgd-momentum"),
                                             ("SGD", "sgd")],
                                    value=optimizer, description="optimizer", **wide),
            "offload": w.Checkbox(value=offload, description="CPU offload (ZeRO-Offload)"),
            "device_gb": w.BoundedFloatText(value=device_gb, min=0.1, max=1e5,
                                            description="device GB", **wide),
            "hardware": w.Dropdown(options=list(HARDWARE), value=hardware, description="at scale on",
                                   **wide),
            "tokens_per_gpu": w.BoundedIntText(value=tokens_per_gpu, min=1, max=10**9,
                                               description="tokens per GPU", **wide),
        }
        self.image = w.Image(format="png")
        self.message = w.HTML()
        self.cost_message = w.HTML()
        self.figure = None
        c = self.controls
        left = w.VBox([c["num_params"], c["world_size"], c["stage"], c["device_gb"]])
        right = w.VBox([c["precision"], c["optimizer"], c["offload"], c["hardware"], c["tokens_per_gpu"]])
        self.box = w.VBox([w.HBox([left, right]), self.message, self.image,
                           w.HTML("<b>What would this cost at N GPUs?</b> (predicted by zerolab.cost from "
                                  "published hardware numbers; lesson 07 checks the model against measured "
                                  "steps)"), self.cost_message])
        for name, control in self.controls.items():
            if name != "hardware":
                control.observe(lambda change: self.update(), names="value")
        c["hardware"].observe(self._on_hardware, names="value")
        self.update()

    def _on_hardware(self, change):
        # The chart's "device GB" follows the chosen GPU; its own observer then redraws.
        gb = HARDWARE[change["new"]].device_memory / GB
        if self.controls["device_gb"].value != gb:
            self.controls["device_gb"].value = gb
        else:
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
        self.cost_message.value = self._at_scale_html(v)
        figure.tight_layout()
        buf = io.BytesIO()
        figure.savefig(buf, format="png", bbox_inches="tight")
        self.figure = figure
        self.image.value = buf.getvalue()

    def _at_scale_html(self, v):
        c = self.controls
        if v["optimizer"] != "adam":
            return ("The cost model covers Adam / AdamW (its update rates are Adam's): choose it "
                    "as the optimizer to see the at-scale view.")
        try:
            r = at_scale(v["num_params"], v["world_size"], v["stage"], offload=v["offload"],
                         precision=v["precision"], hardware=c["hardware"].value,
                         tokens_per_gpu=c["tokens_per_gpu"].value)
        except ValueError as exc:
            return f"<b>Not a valid setting:</b> {html.escape(str(exc))}"
        text = describe_at_scale(r)
        if abs(c["device_gb"].value * GB - r["device_memory"]) > 0.05 * GB:   # the box was edited by hand
            text += (f"\nnote     this panel uses the {c['hardware'].value}'s {_fmt(r['device_memory'] / GB)} GB; "
                     f"the chart above uses the {_fmt(c['device_gb'].value)} GB typed in 'device GB'")
        return f"<pre style='white-space: pre-wrap; font-size: 85%; margin: 0'>{html.escape(text)}</pre>"

    def _repr_mimebundle_(self, **kwargs):
        # The live widget, plus a fixed text/plain (the widgets' own repr embeds the PNG bytes,
        # which change with matplotlib versions): a saved notebook stays stable under nbval.
        bundle = self.box._repr_mimebundle_(**kwargs)
        data = bundle[0] if isinstance(bundle, tuple) else bundle
        data["text/plain"] = "MemoryCalculator: run the notebook to use the controls."
        return bundle

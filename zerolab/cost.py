"""A cost model for memory and step time at any scale: what a laptop cannot run, predicted.

Everything here is closed-form and documented; ``benchmarks/bench_cost.py`` measures this
machine's profile and checks the predictions against zerolab's own measured times, phase by phase
(forward, backward, optimizer step), so the extrapolations to 64-4096 GPUs rest on a model that was
confronted with measurements.

Per step and per rank, for Ψ parameters on N data-parallel ranks (ZeRO, arXiv 1910.02054):

* model states: :func:`zerolab.memory.model_state_bytes` (16Ψ for DP, down to 16Ψ/N for stage 3);
* activations: Korthikanti et al. 2022 (arXiv 2205.05198), 16-bit, per layer
  ``s·b·h·(34 + 5·a·s/h)`` bytes without recomputation, ``2·s·b·h`` with full recomputation
  (:func:`activation_bytes`);
* bytes on the wire: DP all-reduce 2Ψ (in 2-byte grads: 2·2Ψ·(N-1)/N bytes); stages 1-2 the same
  (reduce-scatter + all-gather); stage 3 1.5x (all-gather twice + reduce-scatter);
* time of a ring collective (alpha-beta model): each of its (N-1) steps per phase costs a latency α
  plus (S/N)/B, so a phase takes (N-1)·α + (N-1)/N·S/B;
* compute: forward 2·Ψ, backward 4·Ψ FLOPs per token (Kaplan et al. 2020), 6·Ψ in all; full
  activation recomputation runs the forward once more inside backward: 8·Ψ (Korthikanti Sec. 5);
* offload (ZeRO-Offload, arXiv 2101.06840): each rank moves 2Ψ/N bytes of grads down and 2Ψ/N of
  params up over the host link, and the host updates Ψ/N parameters at its Adam throughput.

**A step is not max(compute, comm).** Each collective runs in the phase where it can run
(:func:`phase_collectives`), and only hides under that phase's compute (:func:`step_time`):

=========  ==============================  =================================================
phase      compute                         communication (and whether it can hide)
=========  ==============================  =================================================
forward    2Ψ per token                    stage 3: all-gather per unit, hidden only with
                                           prefetch; stages 1-2 with ``gather_order=
                                           "next_forward"`` (FSDP / Megatron's
                                           ``overlap_param_gather``): the parameter all-gather
backward   4Ψ per token (6Ψ recomputing)   gradient all-reduce (DP) / reduce-scatter (1-3):
                                           hides, launched bucket by bucket as grads appear;
                                           stage 3's second all-gather: hidden with prefetch
step       the optimizer update, offload   stages 1-2 (DeepSpeed's order, the default):
                                           the parameter all-gather, AFTER the update: exposed
=========  ==============================  =================================================

Exposed time of a phase = what cannot hide + max(0, what can hide - the phase's compute); the step
is the sum of the phases' compute and exposed communication, plus the update and offload.
"""
import dataclasses
import json
import math

from zerolab import activations
from zerolab.memory import model_state_bytes

PHASES = ("forward", "backward", "step")
GATHER_ORDERS = ("after_step", "next_forward")
REDUCTIONS = ("all_reduce", "reduce_scatter", "all_to_all")   # all_to_all: qgZ's gradient reduce-scatter


@dataclasses.dataclass(frozen=True)
class Hardware:
    """One rank's hardware. Bandwidths in bytes/s, latency in s, rates per second."""
    name: str
    device_memory: float            # bytes available to one rank
    peak_flops: float               # dense FLOP/s at the training precision
    mfu: float                      # achieved fraction of peak in training
    link_bandwidth: float           # per-rank bus bandwidth of the data-parallel collectives
    link_latency: float             # per ring step
    host_link_bandwidth: float      # device <-> host (PCIe), per direction
    host_adam_params_per_s: float   # host optimizer throughput (parameters updated per second)
    # The device's own optimizer update (parameters per second). Default: free, the usual GPU
    # assumption (a memory-bound update of Ψ/N params takes ~ms); a CPU profile measures it.
    device_adam_params_per_s: float = math.inf

    def to_json(self):
        return json.dumps(dataclasses.asdict(self), indent=2)

    @classmethod
    def from_json(cls, text):
        return cls(**json.loads(text))


# Published profiles. Sources: NVIDIA V100 datasheet (32 GB, 125 TFLOP/s fp16 tensor cores);
# A100 datasheet (80 GB, 312 TFLOP/s bf16); H100 SXM datasheet (80 GB, 989 TFLOP/s bf16 dense).
# Link: the ZeRO paper's cluster, 800 Gb/s InfiniBand per 16-GPU DGX-2 node = 100 Gb/s-class per GPU
# (12.5 GB/s); A100/H100 pods: one 200/400 Gb/s NIC per GPU (25 / 50 GB/s). PCIe 3/4/5 x16 ~ 12/25/50
# GB/s usable. Host Adam throughput is an ASSUMPTION of the right order, not a datasheet number: torch's
# fused CPU AdamW updates ~1.3e9 fp32 params/s on the course's 2-core CI machine (33.6M params in
# 26 ms, shared/COURSE.md); a server host with many cores does at least as well.
# MFU 0.3-0.4: typical of the ZeRO paper's reported 38 TFLOP/s per V100 and of modern LLM training.
# Device Adam: the update is memory-bound, ~28 bytes moved per parameter (read fp32 master, m, v and
# the 2-byte grad, write master, m, v and the 2-byte param) at the datasheets' HBM bandwidth (V100
# 0.9 TB/s, A100 80GB 2.0 TB/s, H100 SXM 3.35 TB/s): what data parallelism pays Ψ times per step and
# ZeRO's partitioned optimizer Ψ/N times.
V100_32GB = Hardware("V100 32GB + 100 Gb/s IB", 32e9, 125e12, 0.30, 12.5e9, 10e-6, 12e9, 1.0e9, 0.9e12 / 28)
A100_80GB = Hardware("A100 80GB + 200 Gb/s IB", 80e9, 312e12, 0.40, 25e9, 8e-6, 25e9, 2.0e9, 2.0e12 / 28)
H100_80GB = Hardware("H100 80GB + 400 Gb/s IB", 80e9, 989e12, 0.40, 50e9, 6e-6, 50e9, 3.0e9, 3.35e12 / 28)
PROFILES = {"V100": V100_32GB, "A100": A100_80GB, "H100": H100_80GB}


def activation_bytes(*, layers, hidden, seq_len, micro_batch, heads, checkpointing=False):
    """Activation memory of a GPT-style transformer, 16-bit with dropout (Korthikanti et al. 2022,
    Eq. 2): per layer s·b·h·(34 + 5·a·s/h) bytes (the 5as/h term is the attention scores, softmax and
    dropout, quadratic in s). With full activation checkpointing (``checkpointing=True``) each layer
    keeps only its 2-byte input (2·s·b·h), plus ONE layer's working set recomputed during backward.
    Embeddings and logits are left out, as in the paper's per-layer count.

    The per-layer model is :func:`zerolab.activations.activation_bytes_per_layer`, the closed form
    that lesson 10 checks term by term against what TinyGPT's blocks save; the planner below uses it
    through this function."""
    def per_layer(recompute):
        return activations.activation_bytes_per_layer(seq_len, micro_batch, hidden, heads, dtype_bytes=2,
                                                      recompute=recompute)
    if checkpointing:
        return layers * per_layer("full") + per_layer(None)
    return layers * per_layer(None)


def ring_time(op, nbytes, world_size, hw):
    """Seconds for one ring collective of ``nbytes`` (the full buffer) on ``world_size`` ranks (an
    all_to_all, pairwise, sends the same (N-1)/N of its input in N-1 steps: costed alike)."""
    n = world_size
    if n == 1:
        return 0.0
    phases = {"all_reduce": 2, "reduce_scatter": 1, "all_gather": 1, "all_to_all": 1}[op]
    return phases * ((n - 1) * hw.link_latency + (n - 1) / n * nbytes / hw.link_bandwidth)


def _check_gather_order(gather_order):
    if gather_order not in GATHER_ORDERS:
        raise ValueError(f"gather_order={gather_order!r} is not known: choose one of {list(GATHER_ORDERS)}")


def phase_collectives(num_params, world_size, stage, *, grad_bytes=2, param_bytes=2, gather_order="after_step"):
    """The collectives of one step, by the phase they run in: {"forward", "backward", "step": [(op,
    full-buffer bytes)]}, one call per phase as in ZeRO Sec. 7 (an engine cuts them into buckets or
    units). Gradient reductions run during backward; stage 1-2's parameter all-gather after the
    update (``gather_order="after_step"``, DeepSpeed) or in the next forward ("next_forward", FSDP's
    order and Megatron's ``overlap_param_gather``); stage 3 gathers in forward and again in backward."""
    _check_gather_order(gather_order)
    g, p = grad_bytes * num_params, param_bytes * num_params
    if stage == 0:
        return {"forward": [], "backward": [("all_reduce", g)], "step": []}
    if stage in (1, 2):
        gather = [("all_gather", p)]
        early = gather_order == "next_forward"
        return {"forward": gather if early else [], "backward": [("reduce_scatter", g)],
                "step": [] if early else gather}
    if stage == 3:
        return {"forward": [("all_gather", p)], "backward": [("all_gather", p), ("reduce_scatter", g)],
                "step": []}
    raise ValueError(f"stage={stage!r}: choose 0, 1, 2 or 3")


def step_collectives(num_params, world_size, stage, *, grad_bytes=2, param_bytes=2):
    """The collectives of one step as (op, full-buffer bytes), per ZeRO Sec. 7 (arXiv 1910.02054)."""
    phases = phase_collectives(num_params, world_size, stage, grad_bytes=grad_bytes, param_bytes=param_bytes)
    return [c for phase in PHASES for c in phases[phase]]


def wire_bytes(num_params, world_size, stage, **kwargs):
    """Bytes one rank sends per step under the ideal ring: 2Ψ·(N-1)/N words for stages 0-2 and
    3Ψ·(N-1)/N for stage 3 (ZeRO Sec. 7), times the bytes per word."""
    n = world_size
    factor = {"all_reduce": 2, "reduce_scatter": 1, "all_gather": 1}
    return sum(factor[op] * (n - 1) / n * b for op, b in step_collectives(num_params, n, stage, **kwargs))


def comm_time(collectives, world_size, hw, *, links=None):
    """Seconds of a list of (op, full-buffer bytes) ring collectives run one after the other: each
    launch pays its own latency, so a schedule cut into buckets or units costs more than one call.
    ``links``: optional {op: Hardware} whose link_bandwidth/link_latency a collective of that kind
    uses instead of ``hw``'s (a backend's all-gather need not run at its all-reduce's speed).
    ``collectives`` may also hold (op, bytes, group size, Hardware) entries: a call on a group of its
    own over a link of its own (the two-link model below, :func:`hybrid_collectives`)."""
    links = links or {}
    total = 0.0
    for call in collectives:
        op, nbytes, *own = call
        n, link = own if own else (world_size, links.get(op, hw))
        total += ring_time(op, nbytes, n, link)
    return total


def update_time(num_params, world_size, stage, hw, *, offload=False):
    """The device's optimizer update: Ψ parameters in data parallelism, the owned Ψ/N in stages 1-3
    (ZeRO Sec. 5.1: each rank updates only its partition); 0 with offload (the host does it)."""
    if offload:
        return 0.0
    return (num_params if stage == 0 else num_params / world_size) / hw.device_adam_params_per_s


def compute_phases(num_params, tokens, hw, *, recompute=False):
    """{"forward", "backward"} seconds: 2·Ψ and 4·Ψ FLOPs per token at peak·MFU; with full
    activation recomputation the backward runs the forward again first: 6·Ψ (8·Ψ in all, +33%)."""
    rate = hw.peak_flops * hw.mfu
    return {"forward": 2 * num_params * tokens / rate,
            "backward": (6 if recompute else 4) * num_params * tokens / rate}


def compute_time(num_params, tokens, hw, *, recompute=False):
    """Forward + backward: 6·Ψ FLOPs per token (2 forward, 4 backward) at peak·MFU; 8·Ψ with full
    activation recomputation."""
    return sum(compute_phases(num_params, tokens, hw, recompute=recompute).values())


def offload_time(num_params, world_size, hw, *, grad_bytes=2, param_bytes=2):
    """ZeRO-Offload's extra per-step work on one rank: its gradient shard down and its parameter shard
    up over the host link, and the host Adam update of Ψ/N parameters."""
    shard = num_params / world_size
    transfer = (grad_bytes + param_bytes) * shard / hw.host_link_bandwidth
    return transfer + shard / hw.host_adam_params_per_s


def _hides(op, phase, stage, *, prefetch, gather_order):
    """Can a collective of kind ``op`` in ``phase`` run beside that phase's compute?"""
    if phase == "backward" and op in REDUCTIONS:
        return True                              # launched bucket by bucket as gradients appear
    if op == "all_gather" and phase in ("forward", "backward"):
        if stage == 3:
            return prefetch                      # without prefetch each gather blocks its unit
        return phase == "forward" and gather_order == "next_forward"
    return False


def _by_phase(collectives, stage, gather_order):
    if isinstance(collectives, dict):
        unknown = set(collectives) - set(PHASES)
        if unknown:
            raise ValueError(f"collectives: unknown phase(s) {sorted(unknown)}; use {list(PHASES)}")
        return {phase: list(collectives.get(phase, [])) for phase in PHASES}
    out = {phase: [] for phase in PHASES}        # a flat list: each call in its kind's phase
    for op, nbytes, *own in collectives:
        if op in REDUCTIONS:
            out["backward"].append((op, nbytes, *own))
        elif stage == 3:
            raise ValueError("stage 3 all-gathers run in forward AND backward: pass collectives as "
                             "{'forward': [...], 'backward': [...], 'step': [...]}")
        else:
            out["forward" if gather_order == "next_forward" else "step"].append((op, nbytes, *own))
    return out


def step_time(num_params, world_size, stage, *, tokens_per_rank, hw, offload=False, overlap=True,
              grad_bytes=2, param_bytes=2, collectives=None, links=None, prefetch=True,
              gather_order="after_step", recompute=False, micro_batches=1):
    """Predicted seconds per step on one rank, phase by phase.

    Returns {"compute", "comm", "exposed_comm", "update", "offload", "forward", "backward", "step",
    "total", "phases"}: "compute" and "comm" are the work done (comm: every collective's ring time),
    "exposed_comm" the part of it that adds to the step; "forward" / "backward" / "step" the predicted
    duration of each phase over the whole step (all micro-batches); "phases" their breakdown
    {phase: {"compute", "comm", "exposed"}}.

    Each collective runs in its phase (:func:`phase_collectives`; the table in the module docstring).
    With ``overlap``, what can hide costs max(0, its time - the phase's compute); what cannot
    (stage 1-2's all-gather after the update; stage 3's gathers without ``prefetch``) adds in full.
    Without ``overlap`` (CPU ranks, which share their cores) everything adds. The device's update and
    the host's work (offload: transfers and host Adam, :func:`offload_time`) are in the step phase and
    never hide: no delayed parameter update, and the gradient copy to the host is counted there too
    (conservative: ZeRO-Offload overlaps it with backward).

    ``tokens_per_rank``: tokens per rank per optimizer step, in ``micro_batches`` equal micro-batches
    (gradient accumulation): stages 0-1 reduce gradients once, after the last micro-batch (DDP's
    ``no_sync``); stage 2 after every micro-batch (DeepSpeed: its gradients exist only as shards);
    stage 3 gathers and reduces every micro-batch; stage 1-2's parameter all-gather is once per step.
    ``recompute``: full activation recomputation (8Ψ per token). ``collectives``: the calls of ONE
    micro-batch to cost instead of :func:`phase_collectives`' one per phase: {phase: [(op, bytes)]}
    (e.g. an engine's real schedule), or a flat list placed by kind; ``links``: per-op link profiles,
    see :func:`comm_time`. The model is optimistic by one call per phase: the first gather and the
    last reduction of a phase have no compute to hide under.
    """
    _check_gather_order(gather_order)
    if not (isinstance(micro_batches, int) and not isinstance(micro_batches, bool) and micro_batches >= 1):
        raise ValueError(f"micro_batches={micro_batches!r} must be an int >= 1")
    m = micro_batches
    compute = compute_phases(num_params, tokens_per_rank / m, hw, recompute=recompute)   # one micro-batch
    if collectives is None:
        collectives = phase_collectives(num_params, world_size, stage, grad_bytes=grad_bytes,
                                        param_bytes=param_bytes, gather_order=gather_order)
    calls = _by_phase(collectives, stage, gather_order)

    def rounds(op, phase):
        """How many micro-batches of the step run this call."""
        if op in REDUCTIONS and stage in (0, 1):
            return 1                             # accumulated locally, reduced after the last one
        if op == "all_gather" and stage in (1, 2):
            return 1                             # the updated parameters, once per step
        return m

    phases = {}
    for phase in ("forward", "backward"):
        hidden, exposed = [0.0] * m, [0.0] * m   # per micro-batch; the one-per-step calls go in the last
        for op, nbytes, *own in calls[phase]:
            t = comm_time([(op, nbytes, *own)], world_size, hw, links=links)
            for i in range(m - rounds(op, phase), m):
                if overlap and _hides(op, phase, stage, prefetch=prefetch, gather_order=gather_order):
                    hidden[i] += t
                else:
                    exposed[i] += t
        phases[phase] = {"compute": m * compute[phase], "comm": sum(hidden) + sum(exposed),
                         "exposed": sum(e + max(0.0, h - compute[phase]) for h, e in zip(hidden, exposed))}
    step_comm = comm_time(calls["step"], world_size, hw, links=links)
    phases["step"] = {"compute": 0.0, "comm": step_comm, "exposed": step_comm}
    update = update_time(num_params, world_size, stage, hw, offload=offload)
    host = offload_time(num_params, world_size, hw, grad_bytes=grad_bytes, param_bytes=param_bytes) \
        if offload else 0.0
    out = {phase: phases[phase]["compute"] + phases[phase]["exposed"] for phase in ("forward", "backward")}
    out["step"] = step_comm + update + host
    return {"compute": phases["forward"]["compute"] + phases["backward"]["compute"],
            "comm": sum(p["comm"] for p in phases.values()),
            "exposed_comm": sum(p["exposed"] for p in phases.values()),
            "update": update, "offload": host, "forward": out["forward"], "backward": out["backward"],
            "step": out["step"], "total": out["forward"] + out["backward"] + out["step"], "phases": phases}


def largest_model(world_size, stage, hw, *, offload=False, reserved_bytes=0.0, mixed_precision=True):
    """The largest Ψ whose per-rank model states fit in ``hw.device_memory - reserved_bytes``
    (the ZeRO paper's 'max model size through memory analysis'; reserve room for activations and
    buffers with ``reserved_bytes``). Per-rank bytes are linear in Ψ, so this is one division."""
    per_param = model_state_bytes(1, world_size, stage, mixed_precision=mixed_precision,
                                  offload=offload)["total"]
    budget = hw.device_memory - reserved_bytes
    return max(0.0, budget / per_param) if per_param else math.inf


def gpt_shape(num_params, *, head_dim=128, aspect=128):
    """A GPT-3-like shape for Ψ parameters: Ψ = 12·L·h² (attention 4h², MLP 8h² per layer; embeddings
    left out), L = h / ``aspect`` layers, heads of ``head_dim``. {"layers", "hidden", "heads"}, not
    rounded: a smooth family of shapes, so that costs change smoothly with Ψ (GPT-3 175B: L ≈ 96,
    h ≈ 12,300, a ≈ 96)."""
    h = (aspect * num_params / 12) ** (1 / 3)
    return {"layers": h / aspect, "hidden": h, "heads": h / head_dim}


OPTIONS = ((0, False), (1, False), (2, False), (3, False), (1, True), (2, True), (3, True))

# What plan() assumes, in one place (lesson 07b prints it): (what, assumption, where it comes from).
PLANNER_ASSUMPTIONS = (
    ("model states", "16 bytes/param before partitioning (bf16 params and grads, fp32 master, Adam m, v); "
                     "ZeRO's per-stage formulas", "ZeRO Sec. 5.1; zerolab.memory.model_state_bytes"),
    ("activations", "16-bit, s·b·h·(34 + 5·a·s/h) bytes per layer; full recomputation keeps 2·s·b·h per "
                    "layer + one layer's working set", "Korthikanti et al. 2022, arXiv 2205.05198"),
    ("model shape", "Ψ = 12·L·h², L = h/128 layers, heads of 128 (GPT-3-like)", "cost.gpt_shape"),
    ("micro-batch", "the largest that fits beside the model states without recomputation, and the largest "
                    "with it; the faster of the two; the step's tokens in equal micro-batches", "cost.plan"),
    ("compute", "2Ψ forward + 4Ψ backward FLOPs per token (6Ψ), 8Ψ with full recomputation, at peak x MFU",
     "Kaplan et al. 2020; Korthikanti Sec. 5"),
    ("communication", "ring alpha-beta per collective; each in its phase: gradient reductions hide under "
                      "backward, stage 1-2's all-gather after the update (exposed), stage 3's gathers "
                      "under forward/backward with prefetch", "ZeRO Sec. 7; cost.step_time"),
    ("accumulation", "stages 0-1 reduce once per step, stage 2 every micro-batch, stage 3 gathers and "
                     "reduces every micro-batch", "DDP no_sync; DeepSpeed stage 2/3"),
    ("optimizer", "device Adam memory-bound (28 B/param at HBM bandwidth); offload: PCIe 4Ψ/N bytes + "
                  "host Adam of Ψ/N params, never hidden (no DPU)", "ZeRO-Offload; cost.offload_time"),
    ("not modelled", "tensor / pipeline parallelism, buffers and fragmentation, MFU changing with "
                     "micro-batch size, hierarchical collectives", ""),
    ("choice", "fastest predicted option that fits; within 5%: no offload first, then the larger "
               "micro-batch (what ZeRO-2's freed gradients buy), then the lower stage", "cost.plan"),
)


def _divisors_desc(n):
    return [d for d in range(n, 0, -1) if n % d == 0]


def plan(num_params, world_size, hw, *, tokens_per_rank, reserved_bytes=0.0, mixed_precision=True,
         overlap=True, tolerance=0.05, options=OPTIONS, shape=None, seq_len=None, recompute=False,
         gather_order="after_step", activations=activation_bytes):
    """Every (stage, offload) option for Ψ = ``num_params`` on ``world_size`` ranks of ``hw``, best
    first: [{"stage", "offload", "device_bytes", "activation_bytes", "micro_batch", "micro_batches",
    "recompute", "fits", "step_s", "times"}] (the decision rule of lessons 07 and 07b).

    Without ``shape``: ``tokens_per_rank`` in one micro-batch, with or without ``recompute``, and the
    activations are whatever ``reserved_bytes`` reserves. With ``shape`` ({"layers", "hidden",
    "heads"}, e.g. :func:`gpt_shape`) and ``seq_len``: the step's ``tokens_per_rank / seq_len``
    sequences per rank are split into the fewest equal micro-batches whose ``activations`` (default
    :func:`activation_bytes`) fit beside the model states in ``hw.device_memory - reserved_bytes``,
    without recomputation and with full recomputation (8Ψ per token), and the faster of the two is
    kept: memory an option frees (ZeRO-2's gradients) buys a larger micro-batch or no recomputation.
    An option fits if one sequence per micro-batch fits. Among the options that fit, the fastest predicted step wins;
    options within ``tolerance`` of the fastest count as equally fast, and then no offload wins, then
    the larger micro-batch, then the lower stage. Options that do not fit come last, least memory
    first. Every assumption: :data:`PLANNER_ASSUMPTIONS`."""
    if (shape is None) != (seq_len is None):
        raise ValueError("plan: pass shape and seq_len together (or neither)")
    sequences = None
    if shape is not None:
        sequences = tokens_per_rank / seq_len
        if sequences < 1 or sequences != int(sequences):
            raise ValueError(f"plan: tokens_per_rank={tokens_per_rank!r} must be a whole number (>= 1) of "
                             f"sequences of seq_len={seq_len!r}")
        sequences = int(sequences)
    word = 2 if mixed_precision else 4
    rows = []
    for stage, offload in options:
        dev = model_state_bytes(num_params, world_size, stage, mixed_precision=mixed_precision,
                                offload=offload)["total"]
        free = hw.device_memory - reserved_bytes - dev
        time = lambda recomp, m: step_time(num_params, world_size, stage, tokens_per_rank=tokens_per_rank, hw=hw,
                                           offload=offload, overlap=overlap, grad_bytes=word, param_bytes=word,
                                           recompute=recomp, micro_batches=m, gather_order=gather_order)
        if shape is None:
            row = {"activation_bytes": 0.0, "micro_batch": None, "micro_batches": 1, "recompute": recompute,
                   "fits": free >= 0, "times": time(recompute, 1)}
        else:
            # per recomputation mode, the largest micro-batch that fits; then the faster of the two
            candidates = []
            for recomp in (False, True):
                for b in _divisors_desc(sequences):
                    act = activations(seq_len=seq_len, micro_batch=b, checkpointing=recomp, **shape)
                    if act <= free:
                        candidates.append({"activation_bytes": act, "micro_batch": b, "micro_batches": sequences // b,
                                           "recompute": recomp, "fits": True, "times": time(recomp, sequences // b)})
                        break
            if candidates:
                row = min(candidates, key=lambda c: (c["times"]["total"], c["recompute"]))
            else:
                row = {"activation_bytes": activations(seq_len=seq_len, micro_batch=1, checkpointing=True, **shape),
                       "micro_batch": None, "micro_batches": sequences, "recompute": True, "fits": False,
                       "times": time(True, sequences)}
        rows.append(dict(row, stage=stage, offload=offload, device_bytes=dev, step_s=row["times"]["total"]))
    fastest = min((r["step_s"] for r in rows if r["fits"]), default=math.inf)
    return sorted(rows, key=lambda r: (0, r["step_s"] > fastest * (1 + tolerance), r["offload"],
                                       -(r["micro_batch"] or 0), r["stage"])
                  if r["fits"] else (1, r["device_bytes"] + r["activation_bytes"]))


# -- two links: fast inside a node, slow between nodes (lesson 12) ------------------------------------
@dataclasses.dataclass(frozen=True)
class TwoLinks:
    """A cluster's two networks, per direction (bytes/s; latency per ring step, s): each GPU's link
    into the node's switch (``intra_bandwidth``), and the node's ``nics`` network cards of
    ``nic_bandwidth`` each, shared by its ``per_node`` GPUs.

    What a collective crossing nodes gets, per GPU, depends on its shape (:meth:`bandwidth`):

    * a group of one GPU per node ("inter": HSDP's all-reduce, qgZ's second hop), all ``per_node``
      such groups running at once: the node's NICs shared, ``nics·nic_bandwidth / per_node``;
    * a ring over all N ranks ("all"): NCCL builds one ring per NIC, each carrying 1/nics of the
      buffer and leaving the node through its own NIC, so the node's NICs work together and each
      GPU's share runs at ``min(intra_bandwidth, nics·nic_bandwidth)`` (NVIDIA's nccl-tests: a flat
      ring's bus bandwidth is the node's total NIC bandwidth). ``flat="one_ring"``: one ring, as
      gloo runs it here, every hop across nodes through ONE NIC: ``nic_bandwidth``.
    """
    name: str
    per_node: int
    intra_bandwidth: float
    intra_latency: float
    nics: int
    nic_bandwidth: float
    inter_latency: float

    def bandwidth(self, link, flat="per_nic"):
        """Per-GPU bandwidth of a collective on ``link`` ("intra", "inter" or "all"), see above."""
        if flat not in FLAT_RINGS:
            raise ValueError(f"flat={flat!r} is not known: choose one of {list(FLAT_RINGS)}")
        if link == "intra":
            return self.intra_bandwidth
        if link == "inter":
            return self.nics * self.nic_bandwidth / self.per_node
        if flat == "one_ring":
            return self.nic_bandwidth
        return min(self.intra_bandwidth, self.nics * self.nic_bandwidth)


FLAT_RINGS = ("per_nic", "one_ring")

# Sources: NVIDIA DGX A100 datasheet: 8 GPUs, NVLink 3 / NVSwitch "600 GB/s GPU-to-GPU" bidirectional
# (300 GB/s each way), 8 x ConnectX-6 HDR InfiniBand 200 Gb/s for the compute fabric, one per GPU
# (25 GB/s). NVIDIA DGX H100 datasheet: 8 GPUs, NVLink 4 "900 GB/s" bidirectional per GPU (450 GB/s
# each way), 8 x ConnectX-7 400 Gb/s (50 GB/s per GPU). Latencies are assumptions of the right order.
DGX_A100 = TwoLinks("DGX A100 (NVSwitch 300 GB/s per GPU, 8 x HDR IB 25 GB/s)", 8, 300e9, 3e-6, 8, 25e9, 8e-6)
DGX_H100 = TwoLinks("DGX H100 (NVSwitch 450 GB/s per GPU, 8 x NDR IB 50 GB/s)", 8, 450e9, 3e-6, 8, 50e9, 6e-6)
# The regime ZeRO++ was built for (its evaluation: low-bandwidth clusters): the same H100 node with
# ONE 400 Gb/s NIC for its 8 GPUs. An illustration, not a product.
ONE_NIC_H100 = TwoLinks("H100 node, 1 x 400 Gb/s NIC for 8 GPUs (a low-bandwidth cluster)", 8, 450e9, 3e-6,
                        1, 50e9, 6e-6)
SCHEMES = ("zero3", "hsdp", "hpz", "qwz", "qgz", "zero++")


def _check_scheme(scheme):
    if scheme not in SCHEMES:
        raise ValueError(f"scheme={scheme!r} is not known: choose one of {list(SCHEMES)}")


def hybrid_collectives(num_params, nodes, per_node, scheme, *, word=2, block=2048):
    """One step's collectives of stage 3 on ``nodes`` x ``per_node`` ranks, by phase, each as
    (op, full-buffer bytes, link): link "intra" (a group inside one node, p ranks), "inter" (one
    device per node, m ranks) or "all" (N ranks, crossing nodes: runs at the inter-node speed).
    ``word``: bytes of a parameter/gradient (bf16: 2). Schemes (zerolab.hybrid's table):
    "zero3" flat; "hsdp" sharded in the node, gradient shard all-reduced across nodes; "hpz"
    backward gathers inside the node; "qwz" int8 weight gathers; "qgz" int4 gradients through the
    hierarchical all-to-all; "zero++" = hpZ + qwZ + qgZ (ZeRO++ Sec. 3)."""
    _check_scheme(scheme)
    psi, p = num_params, per_node
    w = psi * word
    int8 = psi * (1 + 4 / block)                     # int8 codes + an fp32 scale per block
    int4 = psi * (0.5 + 4 / block)
    if scheme == "hsdp":
        return {"forward": [("all_gather", w, "intra")],
                "backward": [("all_gather", w, "intra"), ("reduce_scatter", w, "intra"),
                             ("all_reduce", w / p, "inter")], "step": []}
    quant_w = scheme in ("qwz", "zero++")
    forward = [("all_gather", int8 if quant_w else w, "all")]
    if scheme in ("hpz", "zero++"):
        back_gather = ("all_gather", w, "intra")     # the secondary copy, inside the node
    else:
        back_gather = ("all_gather", int8 if quant_w else w, "all")
    if scheme in ("qgz", "zero++"):                  # hierarchical all-to-all: node, then nodes
        grads = [("all_to_all", int4, "intra"), ("all_to_all", int4 / p, "inter")]
    else:
        grads = [("reduce_scatter", w, "all")]
    return {"forward": forward, "backward": [back_gather] + grads, "step": []}


def hybrid_link_bytes(num_params, nodes, per_node, scheme, **kw):
    """{"intra", "inter"}: bytes one rank sends per step under the ideal algorithms (accounting),
    counting a collective over all N ranks as cross-node (the paper's "cross-node volume": its
    slowest hop runs at the inter-node speed)."""
    n = {"intra": per_node, "inter": nodes, "all": nodes * per_node}
    factor = {"all_reduce": 2, "reduce_scatter": 1, "all_gather": 1, "all_to_all": 1}
    out = {"intra": 0.0, "inter": 0.0}
    for calls in hybrid_collectives(num_params, nodes, per_node, scheme, **kw).values():
        for op, nbytes, link in calls:
            g = n[link]
            out["intra" if link == "intra" else "inter"] += factor[op] * (g - 1) / g * nbytes
    return out


def hybrid_state_bytes(num_params, nodes, per_node, scheme, *, k=12):
    """Per-rank model-state bytes (mixed precision: 2 + 2 + K per parameter): (4+K)Ψ/N for ZeRO-3 and
    its quantized variants; (4+K)Ψ/p for HSDP (replicated across nodes); hpZ (and ZeRO++) add the
    secondary copy, 2Ψ/p."""
    _check_scheme(scheme)
    n = nodes * per_node
    base = (4 + k) * num_params / (per_node if scheme == "hsdp" else n)
    return base + (2 * num_params / per_node if scheme in ("hpz", "zero++") else 0.0)


def hybrid_step_time(num_params, nodes, per_node, scheme, *, tokens_per_rank, hw, links, flat="per_nic",
                     **kw):
    """:func:`step_time` of stage 3 with :func:`hybrid_collectives`: each call on its own group and
    link, at the per-GPU bandwidth :meth:`TwoLinks.bandwidth` gives it (``flat``: how a ring over all
    N ranks uses the NICs). The update is costed for the shard each rank steps: Ψ/p for HSDP (its
    ranks hold 1/p, replicated across nodes), Ψ/N otherwise."""
    sizes = {"intra": per_node, "inter": nodes, "all": nodes * per_node}
    latency = {"intra": links.intra_latency, "inter": links.inter_latency, "all": links.inter_latency}
    speed = {link: dataclasses.replace(hw, link_bandwidth=links.bandwidth(link, flat), link_latency=latency[link])
             for link in sizes}
    calls = {phase: [(op, b, sizes[link], speed[link]) for op, b, link in c]
             for phase, c in hybrid_collectives(num_params, nodes, per_node, scheme).items()}
    out = step_time(num_params, nodes * per_node, 3, tokens_per_rank=tokens_per_rank, hw=hw,
                    collectives=calls, **kw)
    if scheme == "hsdp":                     # each rank steps 1/p of the parameters, not 1/N
        extra = update_time(num_params, per_node, 3, hw) - out["update"]
        out["update"] += extra
        out["step"] += extra
        out["total"] += extra
    return out

"""A cost model for memory and step time at any scale: what a laptop cannot run, predicted.

Everything here is closed-form and documented; ``benchmarks/bench_cost.py`` measures this
machine's profile and checks the predictions against zerolab's own measured times, phase by phase
(forward, backward, optimizer step), so the extrapolations to 64-4096 GPUs rest on a model that was
confronted with measurements.

Per step and per rank, for Ψ parameters on N data-parallel ranks (ZeRO, arXiv 1910.02054):

* model states: :func:`zerolab.memory.model_state_bytes` (16Ψ for DP, down to 16Ψ/N for stage 3);
* activations: Korthikanti et al. 2022 (arXiv 2205.05198), 16-bit, per layer: with a fused
  (FlashAttention-style) kernel and no dropout, what current stacks run, ``32·s·b·h`` bytes; in the
  paper's setting (naive attention, dropout) ``s·b·h·(34 + 5·a·s/h)``; ``2·s·b·h`` with full
  recomputation; selective recomputation drops the attention's s² terms (:func:`activation_bytes`);
* bytes on the wire: DP all-reduce 2Ψ (in 2-byte grads: 2·2Ψ·(N-1)/N bytes); stages 1-2 the same
  (reduce-scatter + all-gather); stage 3 1.5x (all-gather twice + reduce-scatter);
* time of a ring collective (alpha-beta model): each of its (N-1) steps per phase costs a latency α
  plus (S/N)/B, so a phase takes (N-1)·α + (N-1)/N·S/B;
* compute: forward 2·Ψ, backward 4·Ψ FLOPs per token (Kaplan et al. 2020), 6·Ψ in all, plus the
  core attention's 4·L·s·h per token when given (:func:`attention_flops`); full activation
  recomputation runs the forward once more inside backward: 8·Ψ (Korthikanti Sec. 5); selective, the
  core attention's forward only;
* offload (ZeRO-Offload, arXiv 2101.06840): each rank moves 2Ψ/N bytes of grads down (beside
  backward) and 2Ψ/N of params up over the host link, and the host updates Ψ/N parameters at its
  Adam throughput.

Rules of thumb in closed form (:func:`tokens_to_hide`, :func:`data_parallel_limit`): a stage's
communication hides once each GPU processes about F/B tokens per step (F the achieved FLOP/s, B the
link's bytes/s, bf16), and data parallelism alone stops where N·max(sequence, F/B) tokens pass the
critical batch size.

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
is the sum of the phases' compute and exposed communication, plus the update and offload. What the
model leaves out, it leaves out on purpose and says so: stage 3's per-unit launch, hook and allocator
time (``unit_overhead``, default 0), prefetch that lands late, fragmentation, and the compute that
communication kernels take from a GPU while they overlap it.
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


ATTENTIONS = ("fused", "paper")
RECOMPUTE = (None, "selective", "full")


def _check_recompute(recompute):
    """None / False: no recomputation; True or "full": every layer; "selective": the core attention."""
    mode = {False: None, True: "full"}.get(recompute, recompute) if isinstance(recompute, bool) else recompute
    if mode not in RECOMPUTE:
        raise ValueError(f"recompute={recompute!r} is not known: choose one of {list(RECOMPUTE)} (or False / True)")
    return mode


def activation_bytes(*, layers, hidden, seq_len, micro_batch, heads, recompute=None, attention="fused"):
    """Activation memory of a GPT-style transformer's layers, 16-bit (Korthikanti et al. 2022, arXiv
    2205.05198, Sec. 4.1, per layer through :func:`zerolab.activations.activation_bytes_per_layer`, the
    closed form lesson 10 checks term by term against what TinyGPT's blocks save).

    ``attention="fused"`` (the default, what current stacks run): a FlashAttention-style kernel and no
    dropout, s·b·h·32 bytes per layer plus the kernel's fp32 logsumexp (4·a·s·b); ``"paper"``: the
    paper's setting, naive attention with dropout, s·b·h·(34 + 5·a·s/h) (Eq. 1; at a = h/128, s = 2048
    that is 114·s·b·h, about 3.5x the fused kernel's).

    ``recompute``: None keeps every layer's activations; ``"selective"`` (Sec. 5) recomputes each core
    attention, so its s² terms are not kept (with the fused kernel there are none: the kernel already
    recomputes its scores in backward, and selective recomputation saves nothing more); ``"full"``
    keeps only each layer's 2-byte input (2·s·b·h). A recomputing mode also holds, during backward,
    ONE layer's recomputed working set on top. Embeddings and logits are left out, as in the paper's
    per-layer count."""
    mode = _check_recompute(recompute)
    if attention not in ATTENTIONS:
        raise ValueError(f"attention={attention!r} is not known: choose one of {list(ATTENTIONS)}")
    fused = attention == "fused"

    def per_layer(m):
        return activations.activation_bytes_per_layer(seq_len, micro_batch, hidden, heads, dtype_bytes=2,
                                                      recompute=m, flash=fused, dropout=not fused)
    kept = layers * per_layer(mode)
    return kept if mode is None else kept + per_layer(None) - per_layer(mode)


def attention_flops(*, layers, hidden, seq_len):
    """FLOPs per token of the core attention's forward, QK^T and AV over the sequence: 4·L·s·h
    (Korthikanti et al. Sec. 5; the 6Ψ of :func:`compute_phases` counts only the matrix multiplies
    with parameters). Backward costs twice the forward; selective recomputation runs it once more."""
    return 4 * layers * seq_len * hidden


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


def compute_phases(num_params, tokens, hw, *, recompute=False, attention=0.0):
    """{"forward", "backward"} seconds at peak·MFU: 2·Ψ and 4·Ψ FLOPs per token (Kaplan et al. 2020),
    plus ``attention`` (:func:`attention_flops`, default 0: left out) in forward and twice it in
    backward. Recomputation runs in backward what forward did not keep: ``"full"`` (or True) the whole
    forward again, 2·Ψ + attention (8·Ψ in all, +33%); ``"selective"`` the core attention's forward
    only (Korthikanti et al. Sec. 5: a few percent)."""
    mode = _check_recompute(recompute)
    rate = hw.peak_flops * hw.mfu
    again = {None: 0.0, "selective": attention, "full": 2 * num_params + attention}[mode]
    return {"forward": (2 * num_params + attention) * tokens / rate,
            "backward": (4 * num_params + 2 * attention + again) * tokens / rate}


def compute_time(num_params, tokens, hw, *, recompute=False, attention=0.0):
    """Forward + backward (:func:`compute_phases`): 6·Ψ FLOPs per token (2 forward, 4 backward) at
    peak·MFU; 8·Ψ with full activation recomputation."""
    return sum(compute_phases(num_params, tokens, hw, recompute=recompute, attention=attention).values())


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
              gather_order="after_step", recompute=False, micro_batches=1, attention=0.0, units=None,
              unit_overhead=0.0):
    """Predicted seconds per step on one rank, phase by phase.

    Returns {"compute", "comm", "exposed_comm", "update", "offload", "forward", "backward", "step",
    "total", "phases"}: "compute" and "comm" are the work done (comm: every collective's ring time),
    "exposed_comm" the part of it that adds to the step; "offload" the host's work (:func:`offload_time`);
    "forward" / "backward" / "step" the predicted duration of each phase over the whole step (all
    micro-batches); "phases" their breakdown {phase: {"compute", "comm", "exposed"}}.

    Each collective runs in its phase (:func:`phase_collectives`; the table in the module docstring).
    With ``overlap``, what can hide costs max(0, its time - the phase's compute); what cannot
    (stage 1-2's all-gather after the update; stage 3's gathers without ``prefetch``) adds in full.
    Without ``overlap`` (CPU ranks, which share their cores) everything adds. The device's update is in
    the step phase. Offload (ZeRO-Offload, arXiv 2101.06840): at stages 2-3 each bucket's gradient shard
    goes down to the host as soon as it is reduced, so that copy can hide under backward (the paper's
    Sec. 4.1 schedule); the parameters' way up and the host's Adam run in the step phase and never hide
    (no delayed parameter update). At stage 1 the copy is in the step phase too.

    ``tokens_per_rank``: tokens per rank per optimizer step, in ``micro_batches`` equal micro-batches
    (gradient accumulation): stages 0-1 reduce gradients once, after the last micro-batch (DDP's
    ``no_sync``); stage 2 after every micro-batch (DeepSpeed: its gradients exist only as shards);
    stage 3 gathers and reduces every micro-batch; stage 1-2's parameter all-gather is once per step.
    ``recompute``: None/False, "selective" or "full"/True (:func:`compute_phases`); ``attention``: the
    core attention's forward FLOPs per token (:func:`attention_flops`; default 0, left out).

    Stage 3 with ``units`` (the number of gathered units, e.g. one per layer): each phase's collectives
    are cut into one call per unit (each paying its own latency), and prefetch is no longer perfect:
    the first unit's all-gather of forward and of backward, and the last unit's reduce-scatter, have no
    compute beside them and are exposed. ``unit_overhead``: seconds of exposed host-side work per
    gathered unit and gather (hooks, launches, allocating and freeing the full buffer: no datasheet
    gives it; default 0, left out). Without ``units`` the model is optimistic by those calls.

    ``collectives``: the calls of ONE micro-batch to cost instead of :func:`phase_collectives`' one per
    phase: {phase: [(op, bytes)]} (e.g. an engine's real schedule), or a flat list placed by kind;
    ``links``: per-op link profiles, see :func:`comm_time`.
    """
    _check_gather_order(gather_order)
    if not (isinstance(micro_batches, int) and not isinstance(micro_batches, bool) and micro_batches >= 1):
        raise ValueError(f"micro_batches={micro_batches!r} must be an int >= 1")
    if units is not None and not (isinstance(units, int) and not isinstance(units, bool) and units >= 1):
        raise ValueError(f"units={units!r} must be None or an int >= 1")
    if not unit_overhead >= 0:
        raise ValueError(f"unit_overhead={unit_overhead!r} must be >= 0 seconds")
    m = micro_batches
    compute = compute_phases(num_params, tokens_per_rank / m, hw, recompute=recompute,
                             attention=attention)                  # one micro-batch
    if collectives is None:
        collectives = phase_collectives(num_params, world_size, stage, grad_bytes=grad_bytes,
                                        param_bytes=param_bytes, gather_order=gather_order)
        if stage == 3 and units:                                    # one call per unit, in order
            collectives = {phase: [(op, b / units) for _ in range(units) for op, b in calls]
                           for phase, calls in collectives.items()}
    calls = _by_phase(collectives, stage, gather_order)

    def rounds(op, phase):
        """How many micro-batches of the step run this call."""
        if op in REDUCTIONS and stage in (0, 1):
            return 1                             # accumulated locally, reduced after the last one
        if op == "all_gather" and stage in (1, 2):
            return 1                             # the updated parameters, once per step
        return m

    def beside_nothing(phase):
        """Stage 3 cut into units: indices of the calls no compute runs beside (imperfect prefetch)."""
        if stage != 3 or not units:
            return set()
        ops = [op for op, *_ in calls[phase]]
        out = {ops.index("all_gather")} if "all_gather" in ops else set()
        if phase == "backward" and "reduce_scatter" in ops:
            out.add(len(ops) - 1 - ops[::-1].index("reduce_scatter"))
        return out

    # offload: the host link's work (not the network's). A gradient shard goes down per reduction
    # (stages 2-3: every micro-batch, during backward; stage 1: once, in the step), the parameter shard
    # comes up once, and the host updates Ψ/N parameters: none of it on the network.
    shard = num_params / world_size
    down = grad_bytes * shard / hw.host_link_bandwidth if offload else 0.0
    copies_in_backward = offload and stage >= 2
    phases, host_exposed = {}, 0.0
    for phase in ("forward", "backward"):
        hidden, exposed = [0.0] * m, [0.0] * m   # per micro-batch; the one-per-step calls go in the last
        alone = beside_nothing(phase)
        for j, (op, nbytes, *own) in enumerate(calls[phase]):
            t = comm_time([(op, nbytes, *own)], world_size, hw, links=links)
            for i in range(m - rounds(op, phase), m):
                if overlap and j not in alone and _hides(op, phase, stage, prefetch=prefetch,
                                                         gather_order=gather_order):
                    hidden[i] += t
                else:
                    exposed[i] += t
        gathers = sum(op == "all_gather" for op, *_ in calls[phase]) if stage == 3 else 0
        overhead = gathers * unit_overhead                          # per micro-batch, never hidden
        phases[phase] = {"compute": m * compute[phase], "comm": sum(hidden) + sum(exposed),
                         "exposed": sum(e + max(0.0, h - compute[phase]) for h, e in zip(hidden, exposed))}
        phases[phase]["overhead"] = m * overhead
        if phase == "backward" and copies_in_backward:              # PCIe beside backward's compute
            host_exposed = m * (max(0.0, down - compute[phase]) if overlap else down)
    step_comm = comm_time(calls["step"], world_size, hw, links=links)
    phases["step"] = {"compute": 0.0, "comm": step_comm, "exposed": step_comm, "overhead": 0.0}
    update = update_time(num_params, world_size, stage, hw, offload=offload)
    host = 0.0
    if offload:
        host = offload_time(num_params, world_size, hw, grad_bytes=grad_bytes, param_bytes=param_bytes) \
            + ((m - 1) * down if copies_in_backward else 0.0)
    in_step = host - (m * down if copies_in_backward else 0.0)
    out = {phase: phases[phase]["compute"] + phases[phase]["exposed"] + phases[phase]["overhead"]
           for phase in ("forward", "backward")}
    out["backward"] += host_exposed
    out["step"] = step_comm + update + in_step
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
    ("activations", "16-bit, fused (FlashAttention-style) attention, no dropout: 32·s·b·h bytes per layer "
                    "+ the kernel's fp32 logsumexp (the paper's naive attention with dropout, "
                    "s·b·h·(34 + 5·a·s/h), is attention='paper': 114·s·b·h at s = 2048)",
     "Korthikanti et al. 2022, arXiv 2205.05198, Sec. 4.1; cost.activation_bytes"),
    ("recomputation", "none; selective (each core attention recomputed: drops its s² terms, which a fused "
                      "kernel never keeps); full (each layer's 2·s·b·h input kept); a recomputing mode "
                      "holds one layer's working set on top", "Korthikanti Sec. 5"),
    ("model shape", "Ψ = 12·L·h², L = h/128 layers, heads of 128 (GPT-3-like)", "cost.gpt_shape"),
    ("micro-batch", "per recomputation mode, the largest that fits beside the model states; the fastest "
                    "of the three; the step's tokens in equal micro-batches", "cost.plan"),
    ("compute", "2Ψ forward + 4Ψ backward FLOPs per token plus the core attention's 4·L·s·h forward (x3 "
                "with backward); selective recomputation adds that attention forward once more, full "
                "recomputation the whole forward (8Ψ); at peak x MFU", "Kaplan et al. 2020; Korthikanti Sec. 5"),
    ("communication", "ring alpha-beta per collective; each in its phase: gradient reductions hide under "
                      "backward, stage 1-2's all-gather after the update (exposed), stage 3's gathers "
                      "under forward/backward with prefetch, one call per layer, the first gather of each "
                      "phase and the last reduce-scatter exposed", "ZeRO Sec. 7; cost.step_time(units=...)"),
    ("accumulation", "stages 0-1 reduce once per step, stage 2 every micro-batch, stage 3 gathers and "
                     "reduces every micro-batch", "DDP no_sync; DeepSpeed stage 2/3"),
    ("optimizer", "device Adam memory-bound (28 B/param at HBM bandwidth); offload: the gradient shard's "
                  "copy to the host hides under backward, the parameters' copy back and the host Adam of "
                  "Ψ/N params do not (no delayed update)", "ZeRO-Offload Sec. 4.1; cost.offload_time"),
    ("not modelled", "tensor / pipeline parallelism; stage 3's per-unit launch, hook and allocator time "
                     "(step_time's unit_overhead, 0 here) and its fragmentation; prefetch landing late "
                     "when a unit's compute is short; the SMs and memory bandwidth overlapped "
                     "communication takes from compute; MFU changing with micro-batch size; hierarchical "
                     "collectives", ""),
    ("choice", "fastest predicted option that fits; within 5%: no offload first, then the larger "
               "micro-batch (what ZeRO-2's freed gradients buy), then the lower stage. Stage 3 for "
               "memory: a ZeRO-3 option wins only where no stage 0-2 option (same offload) fits the same "
               "micro-batch with no more recomputation; a predicted edge for ZeRO-3 there rests on what "
               "the model leaves out", "cost.plan(stage3='memory'); Hugging Face's DeepSpeed guide"),
)

STAGE3_RULES = ("memory", "speed")
_RECOMPUTE_RANK = {None: 0, "selective": 1, "full": 2}


def _divisors_desc(n):
    return [d for d in range(n, 0, -1) if n % d == 0]


def plan(num_params, world_size, hw, *, tokens_per_rank, reserved_bytes=0.0, mixed_precision=True,
         overlap=True, tolerance=0.05, options=OPTIONS, shape=None, seq_len=None, recompute=None,
         gather_order="after_step", activations=activation_bytes, attention="fused", stage3="memory",
         unit_overhead=0.0):
    """Every (stage, offload) option for Ψ = ``num_params`` on ``world_size`` ranks of ``hw``, best
    first: [{"stage", "offload", "device_bytes", "activation_bytes", "micro_batch", "micro_batches",
    "recompute", "fits", "step_s", "times"}] (the decision rule of lessons 07 and 07b).

    Without ``shape``: ``tokens_per_rank`` in one micro-batch, with ``recompute`` (None, "selective",
    "full"), and the activations are whatever ``reserved_bytes`` reserves. With ``shape`` ({"layers",
    "hidden", "heads"}, e.g. :func:`gpt_shape`) and ``seq_len``: for each recomputation mode (none,
    selective, full) the step's ``tokens_per_rank / seq_len`` sequences per rank are split into the
    fewest equal micro-batches whose ``activations`` (default :func:`activation_bytes` with
    ``attention``) fit beside the model states in ``hw.device_memory - reserved_bytes``, and the
    fastest is kept: memory an option frees (ZeRO-2's gradients) buys a larger micro-batch or less
    recomputation. Compute then counts the core attention (:func:`attention_flops`), and stage 3 is
    costed one unit per layer (:func:`step_time`'s ``units``, with ``unit_overhead``). An option fits
    if one sequence per micro-batch fits.

    Among the options that fit, the fastest predicted step wins; options within ``tolerance`` of the
    fastest count as equally fast, and then no offload wins, then the larger micro-batch, then the
    lower stage. ``stage3="memory"`` (default): a stage-3 option counts as no faster than any stage
    0-2 option with the same offload that fits the same or a larger micro-batch with no more
    recomputation (ZeRO-3 is chosen for what it fits, not for a predicted edge the model gets by
    leaving out its per-unit costs); ``"speed"``: the prediction alone. Options that do not fit come
    last, least memory first. Every assumption: :data:`PLANNER_ASSUMPTIONS`."""
    if (shape is None) != (seq_len is None):
        raise ValueError("plan: pass shape and seq_len together (or neither)")
    if stage3 not in STAGE3_RULES:
        raise ValueError(f"stage3={stage3!r} is not known: choose one of {list(STAGE3_RULES)}")
    recompute = _check_recompute(recompute)
    sequences, attn, units = None, 0.0, None
    if shape is not None:
        sequences = tokens_per_rank / seq_len
        if sequences < 1 or sequences != int(sequences):
            raise ValueError(f"plan: tokens_per_rank={tokens_per_rank!r} must be a whole number (>= 1) of "
                             f"sequences of seq_len={seq_len!r}")
        sequences = int(sequences)
        attn = attention_flops(layers=shape["layers"], hidden=shape["hidden"], seq_len=seq_len)
        units = max(1, round(shape["layers"]))
    word = 2 if mixed_precision else 4
    rows = []
    for stage, offload in options:
        dev = model_state_bytes(num_params, world_size, stage, mixed_precision=mixed_precision,
                                offload=offload)["total"]
        free = hw.device_memory - reserved_bytes - dev
        time = lambda recomp, m: step_time(num_params, world_size, stage, tokens_per_rank=tokens_per_rank, hw=hw,
                                           offload=offload, overlap=overlap, grad_bytes=word, param_bytes=word,
                                           recompute=recomp, micro_batches=m, gather_order=gather_order,
                                           attention=attn, units=units if stage == 3 else None,
                                           unit_overhead=unit_overhead)
        if shape is None:
            row = {"activation_bytes": 0.0, "micro_batch": None, "micro_batches": 1, "recompute": recompute,
                   "fits": free >= 0, "times": time(recompute, 1)}
        else:
            # per recomputation mode, the largest micro-batch that fits; then the fastest of those
            candidates = []
            for recomp in RECOMPUTE:
                for b in _divisors_desc(sequences):
                    act = activations(seq_len=seq_len, micro_batch=b, recompute=recomp, attention=attention,
                                      **shape)
                    if act <= free:
                        candidates.append({"activation_bytes": act, "micro_batch": b, "micro_batches": sequences // b,
                                           "recompute": recomp, "fits": True, "times": time(recomp, sequences // b)})
                        break
            if candidates:
                row = min(candidates, key=lambda c: (c["times"]["total"], _RECOMPUTE_RANK[c["recompute"]]))
            else:
                row = {"activation_bytes": activations(seq_len=seq_len, micro_batch=1, recompute="full",
                                                       attention=attention, **shape),
                       "micro_batch": None, "micro_batches": sequences, "recompute": "full", "fits": False,
                       "times": time("full", sequences)}
        rows.append(dict(row, stage=stage, offload=offload, device_bytes=dev, step_s=row["times"]["total"]))

    def ranked_time(r):
        """The time the choice compares: with stage3='memory', a ZeRO-3 option is no faster than a
        lower stage that fits as much with as little recomputation."""
        if stage3 == "speed" or r["stage"] != 3:
            return r["step_s"]
        peers = [q["step_s"] for q in rows if q["fits"] and q["stage"] < 3 and q["offload"] == r["offload"]
                 and (q["micro_batch"] or 0) >= (r["micro_batch"] or 0)
                 and _RECOMPUTE_RANK[q["recompute"]] <= _RECOMPUTE_RANK[r["recompute"]]]
        return max([r["step_s"]] + [min(peers)] if peers else [r["step_s"]])

    for r in rows:
        r["ranked_s"] = ranked_time(r) if r["fits"] else r["step_s"]
    fastest = min((r["ranked_s"] for r in rows if r["fits"]), default=math.inf)
    return sorted(rows, key=lambda r: (0, r["ranked_s"] > fastest * (1 + tolerance), r["offload"],
                                       -(r["micro_batch"] or 0), r["stage"])
                  if r["fits"] else (1, r["device_bytes"] + r["activation_bytes"]))


# -- rules of thumb: what the cost model implies, in closed form (lesson 07b) ---------------------------
def tokens_to_hide(stage, hw, *, word_bytes=2, gather_order="after_step"):
    """The fewest tokens per GPU per step (one micro-batch) for which ``stage``'s communication that CAN
    hide does hide under its phase's compute, in the large-N, bandwidth-only limit of :func:`step_time`
    ((N-1)/N -> 1, latency left out): {"forward", "backward"} tokens, and "exposed_bytes_per_param",
    the bytes per parameter that never hide (stage 1-2's all-gather after the update).

    With F = peak·MFU FLOP/s, B the link's bytes/s and w bytes per word, a phase of c·Ψ·T FLOPs hides
    k·w·Ψ bytes when T >= k·w·F / (c·B): forward c = 2, backward c = 4. DP all-reduces 2w in backward:
    T >= w·F/(2B); stages 1-2 reduce-scatter w in backward, T >= w·F/(4B), and all-gather w after the
    update (never hidden) or in the next forward, T >= w·F/(2B); stage 3 gathers w in forward and w +
    a reduce-scatter w in backward: T >= w·F/(2B) in both. In bf16 (w = 2) that is T >= F/B."""
    _check_gather_order(gather_order)
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage={stage!r}: choose 0, 1, 2 or 3")
    rate, b, w = hw.peak_flops * hw.mfu, hw.link_bandwidth, word_bytes
    per_param = {"forward": 0.0, "backward": 0.0}                  # bytes per parameter that can hide
    exposed = 0.0
    if stage == 0:
        per_param["backward"] = 2 * w
    elif stage in (1, 2):
        per_param["backward"] = w
        if gather_order == "next_forward":
            per_param["forward"] = w
        else:
            exposed = w
    else:
        per_param["forward"], per_param["backward"] = w, 2 * w
    flops = {"forward": 2, "backward": 4}
    out = {phase: per_param[phase] * rate / (flops[phase] * b) for phase in flops}
    out["exposed_bytes_per_param"] = exposed
    return out


def data_parallel_limit(hw, *, critical_batch_tokens, seq_len, stage=3, word_bytes=2):
    """How many GPUs data parallelism alone can use before its global batch passes the critical batch:
    each GPU needs at least one sequence and at least :func:`tokens_to_hide` tokens per step (else its
    communication shows), so the global batch is at least N·max(seq_len, T_hide); past
    ``critical_batch_tokens`` a larger batch no longer cuts the number of steps (McCandlish et al. 2018,
    arXiv 1812.06162; Kaplan et al. 2020, Sec. 5.1). Beyond N = critical batch / max(seq_len, T_hide)
    more GPUs need tensor or pipeline parallelism (Narayanan et al. 2021, Sec. 1 and 3)."""
    t = tokens_to_hide(stage, hw, word_bytes=word_bytes)
    return critical_batch_tokens / max(seq_len, t["forward"], t["backward"])


def critical_batch_tokens(loss):
    """Kaplan et al. 2020 (arXiv 2001.08361, Eq. 1.4): B_crit(L) ≈ B* / L^(1/α_B) tokens, B* ≈ 2·10^8,
    α_B ≈ 0.21, for a cross-entropy loss L in nats per token (their WebText2 fit: an order of
    magnitude, not a law of your data)."""
    if not loss > 0:
        raise ValueError(f"loss={loss!r} must be a positive loss in nats per token")
    return 2e8 / loss ** (1 / 0.21)


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
    """{"intra", "inter"}: bytes that cross each kind of link per NODE per step under the ideal
    algorithms (accounting): summed over the node's ``per_node`` GPUs, so a byte is counted once, on
    the wire it crosses. One convention for every scheme, ZeRO++'s own ("cross-node volume", Sec. 3:
    ZeRO-3's 3M down to 0.75M, M the model's bytes):

    * a group inside the node ("intra"): each GPU sends factor·(p-1)/p of the buffer, all inside;
    * a group of one GPU per node ("inter", p of them at once): each GPU sends factor·(m-1)/m of its
      buffer across nodes, p GPUs per node;
    * a ring over all N ranks, numbered node-major ("all"): the ring leaves each node once, so
      factor·(N-1)/N of the buffer crosses per node and (p-1) times that stays inside. The same
      whether NCCL runs one ring per network card (each carrying 1/cards of the buffer through its own
      card) or gloo one ring: the cards change the speed (:meth:`TwoLinks.bandwidth`), not the bytes.

    factor: 2 for an all-reduce, 1 for a reduce-scatter, an all-gather or an all-to-all (for an
    all-to-all over all N ranks, each GPU sends (N-p)/N of its input across nodes, (p-1)/N inside)."""
    m, p = nodes, per_node
    n = m * p
    factor = {"all_reduce": 2, "reduce_scatter": 1, "all_gather": 1, "all_to_all": 1}
    out = {"intra": 0.0, "inter": 0.0}
    for calls in hybrid_collectives(num_params, nodes, per_node, scheme, **kw).values():
        for op, nbytes, link in calls:
            f = factor[op] * nbytes
            if link == "intra":
                out["intra"] += p * f * (p - 1) / p
            elif link == "inter":
                out["inter"] += p * f * (m - 1) / m
            elif op == "all_to_all":
                out["inter"] += p * f * (n - p) / n
                out["intra"] += p * f * (p - 1) / n
            else:
                out["inter"] += f * (n - 1) / n if m > 1 else 0.0
                out["intra"] += (p - 1 if m > 1 else p) * f * (n - 1) / n
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

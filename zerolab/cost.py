"""A cost model for memory and step time at any scale: what a laptop cannot run, predicted.

Everything here is closed-form and documented; ``benchmarks/bench_cost.py`` measures this
machine's profile and checks the predictions against zerolab's own measured step times, so the
extrapolations to 64-4096 GPUs rest on a model that was confronted with measurements.

Per step and per rank, for Ψ parameters on N data-parallel ranks (ZeRO, arXiv 1910.02054):

* model states: :func:`zerolab.memory.model_state_bytes` (16Ψ for DP, down to 16Ψ/N for stage 3);
* activations: Korthikanti et al. 2022 (arXiv 2205.05198), 16-bit, per layer
  ``s·b·h·(34 + 5·a·s/h)`` bytes without recomputation, ``2·s·b·h`` with full checkpointing;
* bytes on the wire: DP all-reduce 2Ψ (in 2-byte grads: 2·2Ψ·(N-1)/N bytes); stages 1-2 the same
  (reduce-scatter + all-gather); stage 3 1.5x (all-gather twice + reduce-scatter);
* time of a ring collective (alpha-beta model): each of its (N-1) steps per phase costs a latency α
  plus (S/N)/B, so a phase takes (N-1)·α + (N-1)/N·S/B;
* compute: 6·Ψ·tokens FLOPs (forward 2, backward 4; Kaplan et al. 2020) at peak·MFU;
* offload (ZeRO-Offload, arXiv 2101.06840): each rank moves 2Ψ/N bytes of grads down and 2Ψ/N of
  params up over the host link, and the host updates Ψ/N parameters at its Adam throughput.
"""
import dataclasses
import json
import math

from zerolab.memory import model_state_bytes


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
    """Activation memory of a GPT-style transformer, 16-bit (Korthikanti et al. 2022, Eq. 2).
    With full activation checkpointing only each layer's 2-byte input (2·s·b·h) is kept, plus one
    layer's working set recomputed during backward."""
    s, b, h, a = seq_len, micro_batch, hidden, heads
    per_layer = s * b * h * (34 + 5 * a * s / h)
    if checkpointing:
        return layers * 2 * s * b * h + per_layer
    return layers * per_layer


def ring_time(op, nbytes, world_size, hw):
    """Seconds for one ring collective of ``nbytes`` (the full buffer) on ``world_size`` ranks."""
    n = world_size
    if n == 1:
        return 0.0
    phases = {"all_reduce": 2, "reduce_scatter": 1, "all_gather": 1}[op]
    return phases * ((n - 1) * hw.link_latency + (n - 1) / n * nbytes / hw.link_bandwidth)


def step_collectives(num_params, world_size, stage, *, grad_bytes=2, param_bytes=2):
    """The collectives of one step as (op, full-buffer bytes), per ZeRO Sec. 7 (arXiv 1910.02054)."""
    g, p = grad_bytes * num_params, param_bytes * num_params
    if stage == 0:
        return [("all_reduce", g)]
    if stage in (1, 2):
        return [("reduce_scatter", g), ("all_gather", p)]
    if stage == 3:
        return [("all_gather", p), ("all_gather", p), ("reduce_scatter", g)]
    raise ValueError(f"stage={stage!r}: choose 0, 1, 2 or 3")


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
    uses instead of ``hw``'s (a backend's all-gather need not run at its all-reduce's speed)."""
    links = links or {}
    return sum(ring_time(op, nbytes, world_size, links.get(op, hw)) for op, nbytes in collectives)


def update_time(num_params, world_size, stage, hw, *, offload=False):
    """The device's optimizer update: Ψ parameters in data parallelism, the owned Ψ/N in stages 1-3
    (ZeRO Sec. 5.1: each rank updates only its partition); 0 with offload (the host does it)."""
    if offload:
        return 0.0
    return (num_params if stage == 0 else num_params / world_size) / hw.device_adam_params_per_s


def compute_time(num_params, tokens, hw):
    """Forward + backward: 6·Ψ FLOPs per token (2 forward, 4 backward) at peak·MFU."""
    return 6 * num_params * tokens / (hw.peak_flops * hw.mfu)


def offload_time(num_params, world_size, hw, *, grad_bytes=2, param_bytes=2):
    """ZeRO-Offload's extra per-step work on one rank: its gradient shard down and its parameter shard
    up over the host link, and the host Adam update of Ψ/N parameters."""
    shard = num_params / world_size
    transfer = (grad_bytes + param_bytes) * shard / hw.host_link_bandwidth
    return transfer + shard / hw.host_adam_params_per_s


def step_time(num_params, world_size, stage, *, tokens_per_rank, hw, offload=False, overlap=True,
              grad_bytes=2, param_bytes=2, collectives=None, links=None):
    """Predicted seconds per step on one rank: {"compute", "comm", "update", "offload", "total"}.
    With ``overlap`` communication hides behind compute (buckets, prefetch) and only the excess is
    paid; without, they add. The host update is never hidden (no delayed parameter update); the
    device's own optimizer update ("update") is 0 unless ``hw.device_adam_params_per_s`` is finite.
    ``collectives``: a list of (op, full-buffer bytes) to cost instead of :func:`step_collectives`'s
    one call per phase (e.g. an engine's real schedule: one call per bucket or unit); ``links``: per-op
    link profiles, see :func:`comm_time`."""
    compute = compute_time(num_params, tokens_per_rank, hw)
    if collectives is None:
        collectives = step_collectives(num_params, world_size, stage,
                                       grad_bytes=grad_bytes, param_bytes=param_bytes)
    comm = comm_time(collectives, world_size, hw, links=links)
    update = update_time(num_params, world_size, stage, hw, offload=offload)
    host = offload_time(num_params, world_size, hw, grad_bytes=grad_bytes, param_bytes=param_bytes) \
        if offload else 0.0
    total = (max(compute, comm) if overlap else compute + comm) + update + host
    return {"compute": compute, "comm": comm, "update": update, "offload": host, "total": total}


def largest_model(world_size, stage, hw, *, offload=False, reserved_bytes=0.0, mixed_precision=True):
    """The largest Ψ whose per-rank model states fit in ``hw.device_memory - reserved_bytes``
    (the ZeRO paper's 'max model size through memory analysis'; reserve room for activations and
    buffers with ``reserved_bytes``). Per-rank bytes are linear in Ψ, so this is one division."""
    per_param = model_state_bytes(1, world_size, stage, mixed_precision=mixed_precision,
                                  offload=offload)["total"]
    budget = hw.device_memory - reserved_bytes
    return max(0.0, budget / per_param) if per_param else math.inf


OPTIONS = ((0, False), (1, False), (2, False), (3, False), (1, True), (2, True), (3, True))


def plan(num_params, world_size, hw, *, tokens_per_rank, reserved_bytes=0.0, mixed_precision=True,
         overlap=True, tolerance=0.05, options=OPTIONS):
    """Every (stage, offload) option for Ψ = ``num_params`` on ``world_size`` ranks of ``hw``, best
    first: [{"stage", "offload", "device_bytes", "fits", "step_s", "times"}].

    The decision rule of lesson 07, from the two things this module predicts: an option is possible
    only if its per-rank model states fit in ``hw.device_memory - reserved_bytes`` (reserve room for
    activations and buffers there); among those, the fastest predicted step wins, and options within
    ``tolerance`` of the fastest count as equally fast, the lowest stage (fewest collectives, no
    host round trip) first. Options that do not fit come last, smallest first."""
    word = 2 if mixed_precision else 4
    rows = []
    for stage, offload in options:
        dev = model_state_bytes(num_params, world_size, stage, mixed_precision=mixed_precision,
                                offload=offload)["total"]
        times = step_time(num_params, world_size, stage, tokens_per_rank=tokens_per_rank, hw=hw,
                          offload=offload, overlap=overlap, grad_bytes=word, param_bytes=word)
        rows.append({"stage": stage, "offload": offload, "device_bytes": dev,
                     "fits": dev <= hw.device_memory - reserved_bytes, "step_s": times["total"], "times": times})
    fastest = min((r["step_s"] for r in rows if r["fits"]), default=math.inf)
    return sorted(rows, key=lambda r: (0, r["step_s"] > fastest * (1 + tolerance), r["offload"], r["stage"])
                  if r["fits"] else (1, r["device_bytes"]))

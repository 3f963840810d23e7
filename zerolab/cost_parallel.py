"""Tensor, sequence and pipeline parallelism in the cost model: bytes, memory, bubble and step time.

Closed forms (accounting, not measurements), each checked against lesson 14's measurements and
built on :mod:`zerolab.cost`'s public functions (ring times, model states, activation terms):

* tensor parallelism over t ranks, per transformer layer and micro-batch of s·b tokens of width h
  (e bytes per value): 4 all-reduces of s·b·h·e bytes, two in forward and two in backward
  (Shoeybi et al. 2019, Sec. 3): each rank sends 4·2(t-1)/t·sbhe, Narayanan et al.'s
  8·bsh·(t-1)/t values (arXiv 2104.04473, Sec. 3.2); sequence parallelism: the same bytes as
  reduce-scatters + all-gathers (Korthikanti et al., arXiv 2205.05198, Sec. 4.2.2), plus, Megatron-LM's
  way, one all-gather per column-parallel linear again in backward (:func:`tp_layer_collectives`);
* activations per layer and rank (:func:`tp_layer_terms`): the paper's s·b·h·(10 + 24/t + 5as/(ht))
  with tensor parallelism, s·b·h·(34 + 5as/h)/t with sequence parallelism too;
* pipeline parallelism over p stages with m micro-batches: the bubble (p-1)/(m+p-1) of the step
  (Narayanan Sec. 2.2: (p-1)/m of the ideal time), s·b·h·e bytes per micro-batch each way between
  consecutive stages, at most min(p-s, m) micro-batches in flight on stage s with 1F1B (m with GPipe);
* a 3-D step (:func:`parallel_step_time`): compute per GPU, the bubble, TP's all-reduces on its link,
  PP's point-to-point bytes, DP's gradient reduction, and the memory per GPU (:func:`parallel_memory`),
  to find the fastest (t, p, d) that fits (:func:`best_layouts`).
"""
import math

from zerolab import cost
from zerolab.activations import layer_terms
from zerolab.memory import model_state_bytes

# Terms of activations.layer_terms, by how tensor (and sequence) parallelism splits them:
# - computed on this rank's heads or columns only: 1/t with tensor parallelism alone;
_SPLIT_BY_TP = ("Q, K and V", "softmax output", "attention dropout mask + output", "flash kernel: logsumexp",
                "output projection input", "GeLU input", "MLP output-layer input")
# - the inputs of the column-parallel linears: whole on every rank with tensor parallelism, 1/t with
#   sequence parallelism when the linear keeps its sequence slice (Megatron-LM re-gathers it);
_LINEAR_INPUTS = ("QKV projection input", "MLP input")
# - what acts on every token of the residual stream (LayerNorms, dropouts): 1/t with sequence parallelism.
_PER_TOKEN = ("LayerNorm inputs (2)", "dropout masks (attention out, MLP out)", "LayerNorm mean and 1/std (2)")


def tp_layer_terms(seq_len, micro_batch, d_model, n_heads, t, *, sequence_parallel=False, regather=True,
                   **layer_kwargs):
    """:func:`zerolab.activations.layer_terms` on ONE rank of a tensor-parallel group of ``t``:
    [(term, saved by, bytes)]. With ``sequence_parallel`` every per-token term is split too, and the
    column-parallel linears' inputs are 1/t if they keep only their slice (``regather=True``,
    Megatron-LM) or whole if they keep the gathered input. ``layer_kwargs``: dtype_bytes, dropout,
    flash, mask_bytes, stats_bytes, as for layer_terms."""
    if not (isinstance(t, int) and t >= 1):
        raise ValueError(f"t={t!r}: the tensor-parallel size must be an int >= 1")
    out = []
    for name, where, nbytes in layer_terms(seq_len, micro_batch, d_model, n_heads, **layer_kwargs):
        split = (name in _SPLIT_BY_TP
                 or (sequence_parallel and name in _PER_TOKEN)
                 or (sequence_parallel and regather and name in _LINEAR_INPUTS))
        out.append((name, where, nbytes / t if split else nbytes))
    return out


def tp_activation_bytes_per_layer(seq_len, micro_batch, d_model, n_heads, t, **kwargs):
    """Bytes one layer keeps for backward on one rank (:func:`tp_layer_terms` summed). 16-bit with
    dropout (the defaults): s·b·h·(10 + 24/t + 5as/(ht)), or s·b·h·(34 + 5as/h)/t with
    ``sequence_parallel=True`` (Korthikanti et al., Sec. 4.2)."""
    return sum(b for _, _, b in tp_layer_terms(seq_len, micro_batch, d_model, n_heads, t, **kwargs))


def tp_layer_collectives(act_bytes, *, sequence_parallel=False, regather=True, replicated_grad_bytes=0):
    """The collectives one transformer layer runs per micro-batch on its tensor-parallel group, by
    pass: {"forward": [(op, bytes of the whole (s, b, h) tensor)], "backward": [...]}. Tensor
    parallelism: g's all-reduce after attention and after the MLP in forward, f's before each in
    backward; sequence parallelism: an all-gather before each column-parallel linear and a
    reduce-scatter after each row-parallel one, in both passes, and Megatron-LM's re-gather of
    each column-parallel linear's input in backward (``regather``), and, when
    ``replicated_grad_bytes`` (the bytes of one of the layer's h-sized replicated parameters) is
    given, the sum of the gradients of its six replicated parameters (two LayerNorms' weight and bias,
    two row-parallel biases), which saw only this rank's tokens (:mod:`zerolab.tensor_parallel`
    sums them in backward; Megatron-LM once per step)."""
    s = act_bytes
    if not sequence_parallel:
        return {"forward": [("all_reduce", s)] * 2, "backward": [("all_reduce", s)] * 2}
    backward = [("all_gather", s), ("reduce_scatter", s)] * 2
    if regather:
        backward += [("all_gather", s)] * 2
    if replicated_grad_bytes:
        backward += [("all_reduce", replicated_grad_bytes)] * 6
    return {"forward": [("all_gather", s), ("reduce_scatter", s)] * 2, "backward": backward}


def sent_bytes(collectives, group_size):
    """Bytes one rank sends for a list of (op, bytes) ring collectives on ``group_size`` ranks:
    all-reduce 2(n-1)/n, reduce-scatter and all-gather (n-1)/n of the whole buffer
    (:func:`zerolab.comm.ring_bytes`' factors; ZeRO's accounting)."""
    factor = {"all_reduce": 2, "reduce_scatter": 1, "all_gather": 1}
    n = group_size
    return sum(factor[op] * (n - 1) / n * b for op, b in collectives)


def tp_layer_sent_bytes(act_bytes, t, **kwargs):
    """Bytes one rank sends per layer and micro-batch, forward + backward: 8(t-1)/t x the (s, b, h)
    tensor's bytes for tensor parallelism (Narayanan Sec. 3.2's 8bsh(t-1)/t values), the same for
    sequence parallelism's gathers and scatters, 10(t-1)/t with Megatron-LM's re-gather."""
    calls = tp_layer_collectives(act_bytes, **kwargs)
    return sent_bytes(calls["forward"] + calls["backward"], t)


# -- pipeline parallelism -------------------------------------------------------------------------
def check_pipeline(p, m):
    for name, v in (("p", p), ("m", m)):
        if not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
            raise ValueError(f"{name}={v!r}: pipeline stages and micro-batches must be ints >= 1")


def bubble_fraction(p, m, *, interleave=1):
    """Fraction of a pipelined step that each stage spends idle, GPipe or 1F1B, with ``m`` micro-batches
    of equal cost on ``p`` stages: (p-1)/(m+p-1). Narayanan et al. (Sec. 2.2) quote it relative to
    the ideal time m·(t_f + t_b), (p-1)/m; the interleaved schedule (``interleave`` = v model chunks
    per stage, Sec. 2.2.2) divides the bubble time by v: (p-1)/(v·m + p-1) of the step."""
    check_pipeline(p, m)
    return (p - 1) / (interleave * m + p - 1)


def in_flight(p, m, stage, schedule):
    """Micro-batches whose activations stage ``stage`` holds at once, at most: GPipe all m (every
    forward before any backward), 1F1B min(p - stage, m) (Narayanan Sec. 2.2.1; DeepSpeed's
    TrainSchedule.num_pipe_buffers; Megatron-LM's p - stage - 1 warm-up forwards, then one more)."""
    check_pipeline(p, m)
    if schedule == "gpipe":
        return m
    if schedule == "1f1b":
        return min(p - stage, m)
    raise ValueError(f"schedule={schedule!r}: choose 'gpipe' or '1f1b'")


def p2p_bytes(act_bytes, p, m):
    """Bytes stage s sends per step: its output activation to stage s+1 (forward) and its input's
    gradient to stage s-1 (backward), act_bytes per micro-batch each: {"first", "middle", "last"}."""
    check_pipeline(p, m)
    return {"first": m * act_bytes if p > 1 else 0, "middle": 2 * m * act_bytes, "last": m * act_bytes if p > 1 else 0}


def zero_bytes_under_pipeline(stage_params, d, m, zero_stage, *, word=2):
    """Bytes one rank sends per step on its data-parallel group of ``d`` for the ``stage_params``
    parameters of its pipeline stage, with m micro-batches (gradient accumulation), by ZeRO stage:
    ZeRO-1 accumulates locally and reduce-scatters once, then all-gathers the updated parameters
    once (2 x (d-1)/d x the bytes); ZeRO-2 keeps only its gradient shard, so every micro-batch's
    gradients are reduce-scattered (m + 1 phases); ZeRO-3 also gathers the parameters in every
    micro-batch's forward and backward (3m phases). Why DeepSpeed's pipeline engine asserts
    stage < 2 (deepspeed/runtime/pipe/engine.py)."""
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage={zero_stage!r}: choose 0, 1, 2 or 3")
    check_pipeline(1, m)
    phase = (d - 1) / d * stage_params * word
    return {0: 2 * phase, 1: 2 * phase, 2: (m + 1) * phase, 3: 3 * m * phase}[zero_stage]


# -- a 3-D step at scale ------------------------------------------------------------------------------
ZERO_STAGES = (0, 1, 2, 3)

# What parallel_memory / parallel_step_time / best_layouts assume, in one place (lesson 14 prints it
# above its table): (what, assumption, where it comes from). Every layout is costed under these,
# data parallelism alone (t = p = 1) included: it is the same model with t = p = 1.
ASSUMPTIONS = (
    ("model states", "16 bytes/param before partitioning (bf16 params and grads, fp32 master, Adam m, v); "
                     "Ψ/(t·p) params per GPU, ZeRO-k's formulas over the d data-parallel ranks (Megatron-LM's "
                     "distributed optimizer is ZeRO-1's layout)", "ZeRO Sec. 5.1; zerolab.memory.model_state_bytes"),
    ("activations", "16-bit, fused (FlashAttention-style) attention, no dropout (cost.activation_bytes); "
                    "sequence parallelism with Megatron-LM's re-gather: every term / t; the first stage "
                    "holds min(p, m) micro-batches of its L/p layers (1F1B): L layers' worth of one "
                    "micro-batch once m >= p; embeddings and logits left out",
     "Korthikanti et al. Sec. 4.2.2-4.2.3; lesson 14's measurement"),
    ("recomputation", "searched: none, selective, full (full keeps each layer's input, 2·s·b·h/t, and one "
                      "layer's working set)", "Korthikanti Sec. 5; cost.activation_bytes"),
    ("micro-batch", "searched: every power of two dividing the sequences per replica; m = B / (d·b) per "
                    "pipeline", "best_layouts"),
    ("ZeRO stage", "searched: 0, 1, 2, 3 on the data-parallel axis; per micro-batch (gradient "
                   "accumulation and pipelining alike): stages 0-1 reduce once per step, stage 2 "
                   "reduce-scatters every micro-batch, stage 3 also all-gathers every micro-batch's forward "
                   "and backward, one unit per layer", "zero_bytes_under_pipeline; lesson 14 Sec. 4"),
    ("compute", "2Ψ + 4Ψ FLOPs per token (8Ψ with full recomputation) plus the core attention's 4·L·s·h "
                "forward (x3 with backward), / (t·p) per GPU, at peak x MFU", "cost.compute_phases"),
    ("data-parallel overlap", "as lesson 07b's planner (cost.step_time): gradient reductions hide under "
                              "the backward of the micro-batch that produces them; stage 1-2's parameter "
                              "all-gather after the update is exposed; stage 3's gathers hide with prefetch "
                              "except each phase's first gather and the last reduce-scatter",
     "cost.step_time (units = L/p)"),
    ("tensor parallelism", "sequence parallelism's all-gathers and reduce-scatters (the bytes of 4 "
                           "all-reduces per layer and micro-batch) exposed, Megatron-LM's default; its "
                           "re-gather (2 all-gathers per layer in backward) hidden beside the "
                           "input-gradient GEMM as far as that GEMM lasts; NVSwitch for t <= 8, the "
                           "network cards beyond", "Megatron-LM layers.py; cost.TwoLinks"),
    ("pipeline", "1F1B: (m + p - 1) slots of one micro-batch's forward, backward, exposed communication; "
                 "each stage boundary's (s/t, b, h) slice each way per micro-batch, exposed",
     "Narayanan et al. Sec. 2.2, 4.1"),
    ("links", "a data-parallel group of one GPU per node shares the node's network cards (50 GB/s per "
              "GPU here); a group with several GPUs per node runs one ring per card (cost.TwoLinks): "
              "min(NVSwitch, cards x 50 GB/s / min(t, 8)) per GPU", "cost.TwoLinks (lesson 12)"),
    ("not modelled", "interleaved schedules, overlapping TP or p2p communication, the embedding and output "
                     "layer's own cost, stage 3's per-unit launch costs and gathered-unit buffers, MFU "
                     "changing with t or the micro-batch", ""),
)


def _check_layout(t, p, d):
    for name, v in (("t", t), ("p", p), ("d", d)):
        if not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
            raise ValueError(f"{name}={v!r}: the tensor, pipeline and data-parallel sizes must be ints >= 1")


def parallel_memory(num_params, shape, *, t, p, d, seq_len, micro_batch, micro_batches=None, zero_stage=1,
                    recompute=None, attention="fused", sequence_parallel=True):
    """Bytes per GPU of the first pipeline stage (the fullest): {"states", "activations", "total"}.

    Model states of Ψ/(t·p) parameters with ZeRO ``zero_stage`` over the d data-parallel ranks
    (mixed-precision Adam, 16 bytes per parameter before partitioning). Activations: the first stage
    holds min(p, m) micro-batches (1F1B; m = ``micro_batches``, default: at least p) of its L/p
    layers, :func:`zerolab.cost.activation_bytes` of that many layers (``attention``: "fused", the
    default, or the paper's naive attention with dropout; ``recompute``: None, "selective", "full"),
    divided by t: with sequence parallelism and Megatron-LM's re-gather every per-layer term is split
    (lesson 14 measures it). ``sequence_parallel=False``: tensor parallelism alone
    (:func:`tp_layer_terms`), without recomputation only."""
    _check_layout(t, p, d)
    if zero_stage not in ZERO_STAGES:
        raise ValueError(f"zero_stage={zero_stage!r}: choose one of {list(ZERO_STAGES)}")
    layers, h, a = shape["layers"], shape["hidden"], shape["heads"]
    in_flight = p if micro_batches is None else min(p, micro_batches)
    held = layers * in_flight / p                       # layer-micro-batches the first stage keeps
    states = model_state_bytes(num_params / (t * p), d, zero_stage)["total"]
    if sequence_parallel:
        acts = cost.activation_bytes(layers=held, hidden=h, seq_len=seq_len, micro_batch=micro_batch, heads=a,
                                     recompute=recompute, attention=attention) / t
    else:
        if recompute not in (None, False):
            raise ValueError("parallel_memory: recomputation is modelled with sequence_parallel=True only")
        if attention not in cost.ATTENTIONS:
            raise ValueError(f"attention={attention!r} is not known: choose one of {list(cost.ATTENTIONS)}")
        fused = attention == "fused"
        acts = held * tp_activation_bytes_per_layer(seq_len, micro_batch, h, a, t, flash=fused, dropout=not fused)
    return {"states": states, "activations": acts, "total": states + acts}


def parallel_step_time(num_params, shape, *, t, p, d, global_batch, seq_len, micro_batch, hw, links,
                       zero_stage=1, recompute=None, attention="fused", word=2):
    """Predicted seconds per step of a transformer (``shape``: layers, hidden, heads) on t·p·d GPUs
    (``hw``: one GPU; ``links``: a :class:`zerolab.cost.TwoLinks` node): tensor (and sequence)
    parallelism over t, a 1F1B pipeline over p, data parallelism with ZeRO ``zero_stage`` over d;
    ``global_batch`` sequences per step in micro-batches of ``micro_batch``, m = global_batch /
    (d·micro_batch) per pipeline. Every assumption: :data:`ASSUMPTIONS`; with t = p = 1 this is
    :func:`zerolab.cost.step_time`'s data-parallel step (the same phases and overlap rule).

    A slot (one micro-batch on one stage): forward and backward compute of Ψ/(t·p) parameters and
    the stage's share of the core attention; sequence parallelism's gathers and scatters, exposed,
    and its re-gather beyond the input-gradient GEMM; the stage boundary's slice each way; and the
    data-parallel traffic a micro-batch makes (ZeRO-2's reduce-scatter, ZeRO-3's gathers and
    reduce-scatter) beyond the compute it hides under. The pipeline takes (m + p - 1) slots; then
    what a step does once: stages 0-1's reduction beyond the last backward it hides under, stage
    1-2's parameter all-gather, the optimizer update.
    Returns {"compute", "tp", "p2p", "dp", "bubble", "update", "total", "m", "dp_bytes"} (seconds; dp_bytes:
    what one GPU sends on its data-parallel group per step)."""
    _check_layout(t, p, d)
    if zero_stage not in ZERO_STAGES:
        raise ValueError(f"zero_stage={zero_stage!r}: choose one of {list(ZERO_STAGES)}")
    if global_batch % (d * micro_batch):
        raise ValueError(f"global_batch={global_batch} sequences do not split into d={d} replicas of "
                         f"micro-batches of {micro_batch}")
    m = global_batch // (d * micro_batch)
    layers, h = shape["layers"], shape["hidden"]
    tokens = seq_len * micro_batch
    psi = num_params / (t * p)                                  # parameters on one GPU
    attn = cost.attention_flops(layers=layers, hidden=h, seq_len=seq_len) / (t * p)
    phases = cost.compute_phases(psi, tokens, hw, recompute=recompute, attention=attn)
    c_f, c_b = phases["forward"], phases["backward"]
    per_node = links.per_node
    # Megatron-LM numbers ranks tensor-parallel fastest, then data-parallel, then pipeline
    # (parallel_state.py's default order "tp-cp-ep-dp-pp"): a TP group is t consecutive ranks, a DP
    # group strides by t, consecutive stages are t·d ranks apart.
    act = seq_len * micro_batch * h * word
    tp_hw = _link(hw, links, "intra" if t <= per_node else "all")
    calls = tp_layer_collectives(act, sequence_parallel=True, regather=False)
    slot_tp = layers / p * cost.comm_time(calls["forward"] + calls["backward"], t, tp_hw)
    regather = layers / p * cost.comm_time([("all_gather", act)] * 2, t, tp_hw)
    dgrad = 2 * psi * tokens / (hw.peak_flops * hw.mfu)         # the input-gradient GEMMs it runs beside
    slot_tp += max(0.0, regather - dgrad)
    slot_p2p = 0.0
    if p > 1:          # per micro-batch: the activation forward, its gradient backward; each TP rank
        # sends its 1/t (Narayanan Sec. 4.1's scatter/gather; with sequence parallelism the slice it holds)
        p2p_link = _link(hw, links, "intra" if t * d * p <= per_node else "inter")
        slot_p2p = 2 * (p2p_link.link_latency + act / t / p2p_link.link_bandwidth)
    dp_slot, dp_step, dp_bytes = _data_parallel(psi, d, zero_stage, m, c_f, c_b, units=max(1, round(layers / p)),
                                                hw=_dp_link(hw, links, t, d), word=word)
    update = cost.update_time(psi, d, zero_stage, hw)
    slot = c_f + c_b + slot_tp + slot_p2p + dp_slot
    total = (m + p - 1) * slot + dp_step + update
    return {"compute": m * (c_f + c_b), "tp": m * slot_tp, "p2p": m * slot_p2p, "dp": m * dp_slot + dp_step,
            "bubble": (p - 1) * slot, "update": update, "total": total, "m": m, "dp_bytes": dp_bytes}


def _data_parallel(psi, d, zero_stage, m, c_f, c_b, *, units, hw, word):
    """ZeRO ``zero_stage``'s data-parallel time on d ranks for ``psi`` parameters per GPU, m
    micro-batches of forward ``c_f`` and backward ``c_b`` seconds: (exposed seconds per micro-batch,
    exposed seconds once per step, bytes sent per step). cost.step_time's rule: a reduction hides
    under the backward of its micro-batch, a stage 1-2 parameter all-gather after the update does not,
    stage 3's gathers hide with prefetch but for each phase's first (and backward's last
    reduce-scatter), one call per unit (layer)."""
    if d == 1:
        return 0.0, 0.0, 0.0
    ring = lambda op, nbytes: cost.ring_time(op, nbytes, d, hw)
    g = p_ = psi * word
    if zero_stage == 0:
        return 0.0, max(0.0, ring("all_reduce", g) - c_b), zero_bytes_under_pipeline(psi, d, m, 0, word=word)
    if zero_stage == 1:
        return (0.0, max(0.0, ring("reduce_scatter", g) - c_b) + ring("all_gather", p_),
                zero_bytes_under_pipeline(psi, d, m, 1, word=word))
    if zero_stage == 2:
        return (max(0.0, ring("reduce_scatter", g) - c_b), ring("all_gather", p_),
                zero_bytes_under_pipeline(psi, d, m, 2, word=word))
    gather, scatter = ring("all_gather", p_ / units), ring("reduce_scatter", g / units)
    forward = gather + max(0.0, (units - 1) * gather - c_f)
    backward = gather + scatter + max(0.0, (units - 1) * (gather + scatter) - c_b)
    return forward + backward, 0.0, zero_bytes_under_pipeline(psi, d, m, 3, word=word)


def _link(hw, links, which):
    """``hw`` with the link bandwidth and latency of ``which`` ("intra", "inter", "all") on ``links``."""
    import dataclasses
    latency = links.intra_latency if which == "intra" else links.inter_latency
    return dataclasses.replace(hw, link_bandwidth=links.bandwidth(which), link_latency=latency)


def _dp_link(hw, links, t, d):
    """The data-parallel group's link: inside a node (NVSwitch) when its t·d GPUs fit in one, else a
    ring crossing nodes whose per-GPU bandwidth is the node's network cards shared by the min(t,
    per_node) data-parallel groups that have GPUs in the node (t = 1: one group, all the cards, as
    TwoLinks' "all"; t >= per_node: one GPU per node and group, TwoLinks' "inter")."""
    import dataclasses
    if t * d <= links.per_node:
        return _link(hw, links, "intra")
    share = links.nics * links.nic_bandwidth / min(t, links.per_node)
    return dataclasses.replace(hw, link_bandwidth=min(links.intra_bandwidth, share), link_latency=links.inter_latency)


def layouts(n_gpus, *, max_t=None):
    """Every (t, p, d) of powers of two with t·p·d = ``n_gpus`` (t up to ``max_t``)."""
    out = []
    t = 1
    while t <= n_gpus and (max_t is None or t <= max_t):
        p = 1
        while t * p <= n_gpus:
            if n_gpus % (t * p) == 0:
                out.append((t, p, n_gpus // (t * p)))
            p *= 2
        t *= 2
    return out


def best_layouts(num_params, shape, n_gpus, *, global_batch, seq_len, hw, links, zero_stages=ZERO_STAGES,
                 recomputes=cost.RECOMPUTE, micro_batches=None, attention="fused", max_t=None):
    """Every (t, p, d) for ``n_gpus`` whose layers split evenly (L divisible by p, heads by t) and whose
    d replicas each get a sequence, with the fastest option that fits in ``hw.device_memory``: the
    ZeRO stage (``zero_stages``), recomputation mode (``recomputes``) and micro-batch (``micro_batches``,
    default: every power of two dividing the global_batch / d sequences of a replica) searched, all
    under :data:`ASSUMPTIONS`. Layouts with an option that fits come first, fastest first; then the
    others, each with its least-memory option. Rows: {"t", "p", "d", "m", "zero_stage", "recompute",
    "micro_batch", "fits", "memory", "time"}. Data parallelism alone is the row t = p = 1."""
    rows = []
    for t, p, d in layouts(n_gpus, max_t=max_t):
        if shape["layers"] % p or shape["heads"] % t or global_batch % d:
            continue
        per_replica = global_batch // d
        sizes = micro_batches or [b for b in (2 ** i for i in range(per_replica.bit_length())) if per_replica % b == 0]
        options = []
        for zero in zero_stages:
            for mode in recomputes:   # None, "selective", "full" (validated by cost.activation_bytes)
                for b in sizes:
                    if per_replica % b:
                        continue
                    m = per_replica // b
                    mem = parallel_memory(num_params, shape, t=t, p=p, d=d, seq_len=seq_len, micro_batch=b,
                                          micro_batches=m, zero_stage=zero, recompute=mode, attention=attention)
                    time = parallel_step_time(num_params, shape, t=t, p=p, d=d, global_batch=global_batch,
                                              seq_len=seq_len, micro_batch=b, hw=hw, links=links, zero_stage=zero,
                                              recompute=mode, attention=attention)
                    options.append({"t": t, "p": p, "d": d, "m": m, "zero_stage": zero, "recompute": mode,
                                    "micro_batch": b, "fits": mem["total"] <= hw.device_memory, "memory": mem,
                                    "time": time})
        rank = {None: 0, "selective": 1, "full": 2}
        fitting = [o for o in options if o["fits"]]
        for o in fitting:
            # lesson 07b's rule (cost.plan, stage3="memory"): a ZeRO-3 option counts as no faster than a
            # lower stage that fits the same or a larger micro-batch with no more recomputation; its
            # predicted edge there rests on what the model leaves out (per-unit costs, late prefetch)
            peers = [q["time"]["total"] for q in fitting if q["zero_stage"] < 3 and q["micro_batch"] >= o["micro_batch"]
                     and rank[q["recompute"]] <= rank[o["recompute"]]] if o["zero_stage"] == 3 else []
            o["ranked"] = max([o["time"]["total"], min(peers)]) if peers else o["time"]["total"]
        if fitting:     # the fastest; on a tie, the lower stage, less recomputation, the larger micro-batch
            rows.append(min(fitting, key=lambda o: (round(o["ranked"], 9), o["zero_stage"], rank[o["recompute"]],
                                                    -o["micro_batch"])))
        elif options:
            rows.append(dict(min(options, key=lambda o: o["memory"]["total"]), ranked=None))
    return sorted(rows, key=lambda r: (0, r["ranked"]) if r["fits"] else (1, r["memory"]["total"]))

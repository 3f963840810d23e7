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
def parallel_memory(num_params, shape, *, t, p, d, seq_len, micro_batch, zero_stage=1, recompute=False,
                    sequence_parallel=True):
    """Bytes per GPU of the first pipeline stage (the fullest): model states of Ψ/(t·p) parameters
    with ZeRO ``zero_stage`` over the d data-parallel ranks (mixed-precision Adam, 16 bytes before
    partitioning; Megatron-LM's distributed optimizer is ZeRO-1), and the activations of its L/p
    layers for the p micro-batches 1F1B keeps in flight there: L layers' worth of one micro-batch
    (Korthikanti Sec. 4.2.3), split by t (:func:`tp_activation_bytes_per_layer`; 16-bit, dropout),
    or each layer's input alone with full recomputation (2·sbh/t with sequence parallelism, plus one
    layer's working set)."""
    layers, h, a = shape["layers"], shape["hidden"], shape["heads"]
    states = model_state_bytes(num_params / (t * p), d, zero_stage)["total"]
    per_layer = tp_activation_bytes_per_layer(seq_len, micro_batch, h, a, t, sequence_parallel=sequence_parallel)
    if recompute:
        kept = 2 * seq_len * micro_batch * h / (t if sequence_parallel else 1)
        acts = layers * kept + per_layer
    else:
        acts = layers * per_layer
    return {"states": states, "activations": acts, "total": states + acts}


def parallel_step_time(num_params, shape, *, t, p, d, global_batch, seq_len, micro_batch, hw, links,
                       zero_stage=1, recompute=False, word=2):
    """Predicted seconds per step of a transformer (``shape``: layers, hidden, heads) on t·p·d GPUs
    (``hw``: one GPU; ``links``: a :class:`zerolab.cost.TwoLinks` node): tensor parallelism over t,
    pipeline over p (1F1B), data parallelism over d, ``global_batch`` sequences per step in
    micro-batches of ``micro_batch``, so m = global_batch / (d·micro_batch) per pipeline.

    Per micro-batch and stage: forward and backward compute of Ψ/(t·p) parameters (2 and 4 FLOPs per
    parameter per token, 6 for backward with recomputation), TP's four all-reduces per layer
    (:func:`tp_layer_collectives`) on NVSwitch when t <= the node's GPUs, across the NICs otherwise,
    never hidden (Megatron-LM's default; overlapping them is an option, not modelled), and with p > 1
    the stage boundary's activation and gradient over the network; the pipeline takes (m + p - 1)
    such slots. Then the data-parallel gradient reduction of the stage's Ψ/(t·p) parameters, after
    the last micro-batch (ZeRO-1: reduce-scatter + all-gather; hidden under nothing here: the
    conservative bound), over the network when the d replicas are on different nodes.
    Returns {"compute", "tp", "p2p", "bubble", "dp", "total", "m"}."""
    if global_batch % (d * micro_batch):
        raise ValueError(f"global_batch={global_batch} sequences do not split into d={d} replicas of "
                         f"micro-batches of {micro_batch}")
    m = global_batch // (d * micro_batch)
    layers, h = shape["layers"], shape["hidden"]
    tokens = seq_len * micro_batch
    phases = cost.compute_phases(num_params / (t * p), tokens, hw, recompute=recompute)
    slot_compute = phases["forward"] + phases["backward"]
    per_node = links.per_node
    tp_link = "intra" if t <= per_node else "all"
    act = seq_len * micro_batch * h * word
    tp_calls = tp_layer_collectives(act)
    tp_hw = _link(hw, links, tp_link)
    slot_tp = layers / p * cost.comm_time(tp_calls["forward"] + tp_calls["backward"], t, tp_hw)
    # Megatron-LM numbers ranks tensor-parallel fastest, then data-parallel, then pipeline
    # (parallel_state.py's default order "tp-cp-ep-dp-pp"): a TP group is t consecutive ranks, a DP
    # group strides by t, consecutive stages are t·d ranks apart.
    slot_p2p = 0.0
    if p > 1:          # per micro-batch: the activation forward, its gradient backward; each TP rank
        # sends its 1/t (Narayanan Sec. 4.1's scatter/gather; with sequence parallelism the slice it holds)
        p2p_link = _link(hw, links, "intra" if t * d * p <= per_node else "inter")
        slot_p2p = 2 * (p2p_link.link_latency + act / t / p2p_link.link_bandwidth)
    slot = slot_compute + slot_tp + slot_p2p
    pipeline = (m + p - 1) * slot
    dp_link = _link(hw, links, "intra" if t * d <= per_node else "inter")
    grads = num_params / (t * p) * word
    dp = cost.comm_time(cost.step_collectives(num_params / (t * p), d, zero_stage, grad_bytes=word,
                                              param_bytes=word), d, dp_link) if d > 1 else 0.0
    return {"compute": m * slot_compute, "tp": m * slot_tp, "p2p": m * slot_p2p, "bubble": (p - 1) * slot,
            "dp": dp, "total": pipeline + dp, "m": m, "grads_bytes": grads}


def _link(hw, links, which):
    """``hw`` with the link bandwidth and latency of ``which`` ("intra", "inter", "all") on ``links``."""
    import dataclasses
    latency = links.intra_latency if which == "intra" else links.inter_latency
    return dataclasses.replace(hw, link_bandwidth=links.bandwidth(which), link_latency=latency)


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


def best_layouts(num_params, shape, n_gpus, *, global_batch, seq_len, hw, links, micro_batch=1,
                 zero_stage=1, recompute=False, max_t=None):
    """Every (t, p, d) for ``n_gpus`` whose layers split evenly (L divisible by p, heads by t), with its
    predicted step time and memory per GPU, fastest first among those that fit in ``hw.device_memory``
    (then those that do not, least memory first). Rows: {"t", "p", "d", "m", "fits", "memory",
    "time"}; a layout whose d·micro_batch does not divide the global batch is left out (DP alone
    needs at least one sequence per replica)."""
    rows = []
    for t, p, d in layouts(n_gpus, max_t=max_t):
        if shape["layers"] % p or shape["heads"] % t or global_batch % (d * micro_batch):
            continue
        mem = parallel_memory(num_params, shape, t=t, p=p, d=d, seq_len=seq_len, micro_batch=micro_batch,
                              zero_stage=zero_stage, recompute=recompute)
        time = parallel_step_time(num_params, shape, t=t, p=p, d=d, global_batch=global_batch, seq_len=seq_len,
                                  micro_batch=micro_batch, hw=hw, links=links, zero_stage=zero_stage,
                                  recompute=recompute)
        rows.append({"t": t, "p": p, "d": d, "m": time["m"], "fits": mem["total"] <= hw.device_memory,
                     "memory": mem, "time": time})
    return sorted(rows, key=lambda r: (0, r["time"]["total"]) if r["fits"] else (1, r["memory"]["total"]))

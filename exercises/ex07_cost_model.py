"""Exercise 07 — a step-time model whose rules you read off a measured step, and the largest model
that fits.

Lesson 07 takes the stages from 2-4 ranks on a laptop to 64-4096 GPUs with a cost model. A step is
not max(compute, communication): what a collective can hide under depends on the system, on when it
launches each collective and when it waits for it. Here nobody tells you those rules: you read them
off measured steps of a system (07.1), build a model on them and predict the same system at another
scale (07.2). 07.3 derives the largest model that fits: the ZeRO papers' headline numbers, and
what one micro-batch's activations make of them.

A timeline is one rank's measured step, as plain data::

    {"num_params": 1_000_000,            # Ψ of the measured run
     "world_size": 4,                    # N of the measured run
     "spans": [
        {"kind": "compute", "phase": "forward", "start": 0.0, "end": 0.0025},
        {"kind": "all_gather", "bytes": 800_000, "start": 0.0004, "end": 0.0031},
        ...]}

What a timeline says, and all it says: the device computes inside each compute span (one per layer
or unit, say), of phase "forward" or "backward", and computes nothing between them; the optimizer's
update is in neither the timeline nor the model. Every other span is a collective, "all_reduce",
"reduce_scatter" or "all_gather", in flight from its launch (start) to its completion (end);
"bytes" is its full buffer (the input of a reduce-scatter, the output of an all-gather), which is
proportional to the model. Times in seconds; a moment has no length.

To look at real ones: ``engine.timeline = zerolab.timeline.Timeline()`` before a step of an engine
from ``zerolab.initialize(...)`` records its spans (``.collect()``: category "compute" for compute,
"comm" for collectives, named after the op), and ``engine.last_step_comm.records`` each collective's
bytes (``tensor_bytes``). Record stage 3 with and without prefetch, stage 0 with one bucket and with
several, and look where the device waits.

Grade your work:  ``make grade`` or, in lesson 07, ``zerolab.grade.check("07")``.
"""


def placement(timeline):
    """For each collective of ``timeline``, in their order in its spans: the phase whose compute
    hid it in this step, "forward" or "backward" — the phase 07.2's model hides it under — or None
    where no compute hid any of it, so the device waited for it.

    Contract: read it off the timeline, not off the collective's kind or the stage (the same kind
    hides in one system and not in another). The model hides a collective whole under one phase;
    where compute of both phases hid parts of one, it goes to the phase that hid more of it.
    Graded, answer by answer, on one measured stage-3 step and on steps built after the schedules of
    stages 0-3 (stage 3 with and without prefetch) and of other systems (Megatron-LM's overlapped parameter
    gather, collectives crossing from forward into backward, one launched while nothing computes),
    including steps that 07.2's ideal machine runs. A span of an unknown kind or phase, or one that
    ends before it starts: a ValueError naming it."""
    raise NotImplementedError(
        "Exercise 07.1: for each collective, the phase whose compute hid it, read off the timeline.")


def step_time(timeline, num_params, world_size, *, tokens_per_rank, peak_flops, mfu, bandwidth, latency):
    """Seconds of one step of the timeline's system with Ψ = ``num_params`` on N = ``world_size``
    ranks, each processing ``tokens_per_rank`` tokens, on this hardware (``peak_flops·mfu``
    FLOP/s; ring links of ``bandwidth`` bytes/s and ``latency`` s per ring step).

    Contract: what carries over from the measurement is the system's schedule (its collectives,
    their kinds, their buffers relative to Ψ, and where 07.1 finds each one hides), never its
    durations. The model is an ideal machine: FLOPs per token per phase and the ring's alpha-beta
    time per collective as lesson 07 section 3 counts them; one link, which carries
    one collective at a time; and no other cost and no other dependency: within a phase, its
    compute and the collectives it hides overlap perfectly, and the device waits for a collective
    that nothing hides. One rank: no communication.

    Graded against cases computed by hand, from communication-bound to compute-bound, and by
    consistency: on steps the ideal machine ran (compute and collectives lasting exactly what the
    model says), ``step_time`` with the run's own Ψ, N, tokens and hardware is the measured step,
    its last end minus its first start."""
    raise NotImplementedError(
        "Exercise 07.2: the measured schedule, at the new scale, on the ideal machine.")


def largest_model(world_size, stage, device_memory, *, offload=False, reserved_bytes=0.0, tokens=0):
    """The largest Ψ whose per-rank model states, and the activations of one micro-batch of
    ``tokens`` tokens on each rank, fit on the device in ``device_memory - reserved_bytes`` bytes;
    0 when nothing fits. Ψ is a real number, as in the papers' accounting: never rounded to whole
    parameters or padded to a multiple of N. Model states as the ZeRO paper counts them for mixed-precision Adam and
    partitions them per stage (arXiv 1910.02054 Secs. 3.1 and 5; lesson 01). ``offload=True``
    (stages 1-3): ZeRO-Offload's placement (arXiv 2101.06840, lesson 06); what lives on the host
    does not count.

    The model is a GPT of lesson 07b's family: Ψ = 12·L·h² for L layers of width h, with L = h/128.
    Its activations are 16-bit with a fused attention kernel, no dropout and no recomputation:
    32·h bytes per token per layer (Korthikanti et al., arXiv 2205.05198, Sec. 4.1, less the dropout
    masks and the attention scores a fused kernel does not keep, and leaving out its small fp32
    statistics), held for backward where ZeRO-DP and ZeRO-Offload hold them. Which bytes grow with
    Ψ, how, and what the largest Ψ then is, are yours to work out.

    Graded against the papers' numbers with ``tokens=0`` (7.6B, 14.4B and 128B on 64 V100s of 32 GB,
    a trillion on 1024, ZeRO-Offload's 13B on one), cases by hand (offload at every stage and N),
    and, with activations, against the largest Ψ computed here to a relative 1e-6, at every stage,
    with and without offload, from one GPU to 1024. An unknown stage, offload at stage 0, negative
    bytes or tokens: a ValueError naming it."""
    raise NotImplementedError(
        "Exercise 07.3: the largest model whose model states and one micro-batch's activations fit.")

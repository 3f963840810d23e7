"""Exercise 07 — a step-time model whose rules you read off a measured step, and the largest model
that fits.

Lesson 07 takes the stages from 2-4 ranks on a laptop to 64-4096 GPUs with a cost model. A step is
not max(compute, communication): a collective hides only under compute that runs while it is in
flight, and which compute that is depends on the system, on when it launches each collective and
when it waits for it. Here nobody tells you those rules: you read them off one measured step of a
system (07.1), build a model on them and predict the same system at another scale (07.2). 07.3
derives the ZeRO papers' headline numbers.

A timeline is one rank's measured step, as plain data::

    {"num_params": 1_000_000,            # Ψ of the measured run
     "world_size": 4,                    # N of the measured run
     "spans": [
        {"kind": "compute", "phase": "forward", "start": 0.0, "end": 0.0025},
        {"kind": "all_gather", "bytes": 800_000, "start": 0.0004, "end": 0.0031},
        ...]}

A compute span is the device computing (one per layer or unit, say: between them the device is
idle or waiting); its phase is "forward" or "backward" (the optimizer's update is in neither the
timeline nor the model). Every other span is a collective, "all_reduce", "reduce_scatter" or
"all_gather", from its launch to its completion; "bytes" is its full buffer (the input of a
reduce-scatter, the output of an all-gather), which is proportional to the model. Times in seconds.

One ring phase on a buffer of S bytes takes (N-1)·latency + (N-1)/N·S/bandwidth; an all-reduce is two
phases, a reduce-scatter or an all-gather one.

To look at real ones: ``engine.timeline = zerolab.timeline.Timeline()`` before a step of an engine
from ``zerolab.initialize(...)`` records its spans (``.collect()``: category "compute" for compute,
"comm" for collectives, named after the op), and ``engine.last_step_comm.records`` each collective's
bytes (``tensor_bytes``).

Grade your work:  ``make grade`` or, in lesson 07, ``zerolab.grade.check("07")``.
"""


def placement(timeline):
    """For each collective of ``timeline``, in their order in its spans: the phase whose compute it
    can hide under, "forward" or "backward", or None.

    Contract (graded on timelines of stages 0-3 with and without prefetch, and of other systems'
    schedules): a collective can hide only under compute that runs while it is in flight, that is,
    compute spans that share some time with its span (spans that only touch share none); if it
    shares time with compute of both phases, the phase it shares more time with; None if it shares
    time with no compute at all. A span of an unknown kind or phase, or one that ends before it
    starts: a ValueError naming it."""
    raise NotImplementedError(
        "Exercise 07.1: for each collective, the compute it was in flight beside.")


def step_time(timeline, num_params, world_size, *, tokens_per_rank, peak_flops, mfu, bandwidth, latency):
    """Seconds of one step of the timeline's system with Ψ = ``num_params`` on N = ``world_size``
    ranks, on this hardware (``peak_flops·mfu`` FLOP/s; ring links of ``bandwidth`` bytes/s and
    ``latency`` s per ring step).

    Contract (graded against cases computed by hand): the step runs the measured step's collectives
    again, each on its buffer scaled to the new Ψ and hiding only under the phase 07.1 finds for it.
    The model to build is the ideal one: forward computes 2·Ψ FLOPs per token and backward 4·Ψ;
    collectives run one at a time on one link; within a phase, its compute and the communication
    hidden under it proceed side by side, neither waiting for the other; a collective that hides
    under nothing holds the whole step up for its duration. One rank: no communication."""
    raise NotImplementedError(
        "Exercise 07.2: the measured schedule, at the new scale, under the ideal model.")


def largest_model(world_size, stage, device_memory, *, offload=False, reserved_bytes=0.0):
    """The largest Ψ whose per-rank model states (mixed-precision Adam: 2-byte parameters and
    gradients, a 12-byte fp32 master, momentum and variance, partitioned per stage as in ZeRO
    Sec. 5) fit on the device in ``device_memory - reserved_bytes`` bytes; 0 when nothing fits.
    ``offload=True`` (stages 1-3): ZeRO-Offload's placement (arXiv 2101.06840, lesson 06); what
    lives on the host does not count.

    Derive it; graded against the papers' numbers (7.6B, 14.4B and 128B on 64 V100s of 32 GB, a
    trillion on 1024, ZeRO-Offload's 13B on one) and cases by hand. An unknown stage, offload at
    stage 0, negative bytes: a ValueError naming it."""
    raise NotImplementedError(
        "Exercise 07.3: the device bytes per parameter for this stage, N and offload, then the budget.")

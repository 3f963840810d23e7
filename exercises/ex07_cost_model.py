"""Exercise 07 — a step-time model that respects when each collective can run, and the largest
model that fits.

Lesson 07 takes the stages from 2-4 ranks on a laptop to 64-4096 GPUs with a cost model. A step is
not max(compute, communication): a collective can hide only under the compute of the phase it runs
in, and some cannot hide at all. 07.1 asks you to build that model; its structure is yours.
07.2 derives the ZeRO paper's headline numbers.

Notation: Ψ parameters, N ranks, ``word_bytes`` bytes per element communicated. One phase of a ring
collective on a buffer of S bytes takes (N-1)·latency + (N-1)/N·S/bandwidth; an all-reduce is two
phases (reduce-scatter, then all-gather); a reduce-scatter or an all-gather is one. Every
collective below is on the full buffer, S = word_bytes·Ψ.

Grade your work:  ``make grade`` or, in lesson 07, ``zerolab.grade.check("07")``.
"""


def step_time(num_params, world_size, stage, *, tokens_per_rank, peak_flops, mfu, bandwidth,
              latency, word_bytes=2, prefetch=True):
    """Seconds of one training step on one rank (no optimizer update, no offload).

    Contract (graded against cases computed by hand):

    * compute at ``peak_flops·mfu``: forward 2·Ψ FLOPs per token, backward 4·Ψ (ZeRO-3 too: its
      gathers move bytes, not FLOPs);
    * what each stage sends, and when it can run:
      stage 0: an all-reduce of the gradients, during backward;
      stage 1: a reduce-scatter of the gradients once backward is done, then an all-gather of the
      parameters after the update: neither overlaps anything;
      stage 2: the reduce-scatter during backward (buckets), the all-gather after the update;
      stage 3: an all-gather in forward, which runs during forward only with ``prefetch`` (else
      it waits in front of every unit: not overlapped), and an all-gather plus a reduce-scatter
      during backward;
    * a phase (forward, backward) lasts the longer of its compute and the communication that runs
      during it; communication that runs during no phase adds to the step;
    * one rank: no communication at all."""
    raise NotImplementedError(
        "Exercise 07.1: the step's phases, each the longer of its compute and what runs beside it, "
        "plus what cannot run beside anything.")


def largest_model(world_size, stage, device_memory, *, offload=False, reserved_bytes=0.0):
    """The largest Ψ whose per-rank model states (mixed-precision Adam: 2 + 2 + 12 bytes per
    parameter, partitioned per stage as in ZeRO Sec. 5) fit in ``device_memory - reserved_bytes``.
    ``offload=True`` (stage >= 1, ZeRO-Offload arXiv 2101.06840): the gradient shard and the
    optimizer states live on the host; the device keeps the 2-byte parameters (all of them in
    stages 1-2, the 1/N shard in stage 3) and, in stage 1, the full 2-byte gradients.
    Derive it; graded against the papers' numbers (7.6B, 14.4B, 128B on 64 V100s; 13B on one)."""
    raise NotImplementedError(
        "Exercise 07.2: the device bytes per parameter for this stage, N and offload, then one division.")

"""Exercise 07 — a cost model you can check: bytes on the wire, step time, the largest model.

Three functions, each a few lines. They are what lesson 07 uses to go from the 2-4 ranks of a
laptop to 64-4096 GPUs, so the graded tests check them against hand-computed cases, against the
bytes that zerolab's real engines send on real ranks, and against the ZeRO papers' numbers.

Notation: Ψ parameters, N ranks, ``word_bytes`` bytes per gradient/parameter element (2 in mixed
precision, 4 in fp32). A ring collective on a buffer of S bytes sends (N-1)/N·S per rank per phase;
an all_reduce has two phases (reduce-scatter, then all-gather), the others one.

Grade your work:  ``make grade`` or, in lesson 07, ``zerolab.grade.check("07")``.
"""


def wire_bytes(num_params, world_size, stage, *, word_bytes=2):
    """Bytes ONE rank sends per training step under the ideal ring, for stage 0 (data parallelism:
    one all_reduce of the gradients), 1 and 2 (reduce-scatter the gradients, all-gather the
    parameters) and 3 (all-gather the parameters in forward, again in backward, reduce-scatter the
    gradients). 0 on one rank. ZeRO, arXiv 1910.02054, Sec. 7."""
    raise NotImplementedError(
        "Exercise 07.1: list the step's collectives for this stage, each a full buffer of "
        "word_bytes·Ψ bytes, and add up (N-1)/N·S per phase (an all_reduce has 2 phases).")


def step_time(num_params, world_size, stage, *, tokens_per_rank, peak_flops, mfu, bandwidth,
              latency, overlap=True, word_bytes=2):
    """Predicted seconds of one step on one rank: compute + communication.

    * compute: 6·Ψ FLOPs per token (2 forward, 4 backward) at ``peak_flops·mfu``;
    * communication: the stage's collectives one after the other; one phase of a ring collective
      costs (N-1)·latency + (N-1)/N·S/bandwidth (S its full buffer in bytes; all_reduce: 2 phases);
    * ``overlap=True``: communication runs beside compute, the step takes the longer of the two;
      ``overlap=False``: they add up. No optimizer update, no offload."""
    raise NotImplementedError(
        "Exercise 07.2: compute = 6·Ψ·tokens / (peak·mfu); comm = sum over the stage's collectives "
        "of phases·((N-1)·latency + (N-1)/N·S/bandwidth); then max() or +.")


def largest_model(world_size, stage, device_memory, *, offload=False, reserved_bytes=0.0):
    """The largest Ψ whose per-rank model states (mixed-precision Adam: 2 + 2 + 12 bytes per
    parameter, partitioned per stage as in ZeRO Sec. 5) fit in ``device_memory - reserved_bytes``.
    ``offload=True`` (stage >= 1, ZeRO-Offload arXiv 2101.06840): the gradient shard and the
    optimizer states live on the host; the device keeps the 2-byte parameters (all of them in
    stages 1-2, the 1/N shard in stage 3) and, in stage 1, the full 2-byte gradients."""
    raise NotImplementedError(
        "Exercise 07.3: per-rank bytes are a·Ψ for a constant a that depends on stage, N and "
        "offload; the answer is one division (zerolab.memory has the formulas).")

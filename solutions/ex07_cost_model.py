"""Exercise 07 — a cost model you can check (worked answers). See exercises/ex07_cost_model.py."""
from zerolab import comm
from zerolab.memory import model_state_bytes

PHASES = {"all_reduce": 2, "reduce_scatter": 1, "all_gather": 1}


def _collectives(num_params, stage, word_bytes):
    """The step's collectives as (op, full-buffer bytes), ZeRO Sec. 7."""
    s = word_bytes * num_params
    if stage == 0:
        return [("all_reduce", s)]                              # gradients: 2Ψ
    if stage in (1, 2):
        return [("reduce_scatter", s), ("all_gather", s)]       # grads to owners, params back: 2Ψ
    if stage == 3:
        return [("all_gather", s), ("all_gather", s), ("reduce_scatter", s)]   # 3Ψ = 1.5x DP
    raise ValueError(f"stage={stage!r}: choose 0, 1, 2 or 3")


def wire_bytes(num_params, world_size, stage, *, word_bytes=2):
    # zerolab.comm.ring_bytes is the ring's per-rank count of one collective: (N-1)/N·S per phase
    return sum(comm.ring_bytes(op, s, world_size) for op, s in _collectives(num_params, stage, word_bytes))


def step_time(num_params, world_size, stage, *, tokens_per_rank, peak_flops, mfu, bandwidth,
              latency, overlap=True, word_bytes=2):
    n = world_size
    compute = 6 * num_params * tokens_per_rank / (peak_flops * mfu)
    comm_s = 0.0
    if n > 1:
        for op, s in _collectives(num_params, stage, word_bytes):
            # alpha-beta: N-1 ring steps per phase, each a latency plus a 1/N chunk over the link
            comm_s += PHASES[op] * ((n - 1) * latency + (n - 1) / n * s / bandwidth)
    return max(compute, comm_s) if overlap else compute + comm_s


def largest_model(world_size, stage, device_memory, *, offload=False, reserved_bytes=0.0):
    # per-rank bytes are linear in Ψ: the bytes of ONE parameter, then a division
    per_param = model_state_bytes(1, world_size, stage, mixed_precision=True, offload=offload)["total"]
    return max(0.0, (device_memory - reserved_bytes) / per_param)

"""Exercise 07 — worked answers: a phase-aware step time and the largest model that fits.
See exercises/ex07_cost_model.py."""
from zerolab.memory import model_state_bytes

PHASES = {"all_reduce": 2, "reduce_scatter": 1, "all_gather": 1}

# When each stage's collectives run (ZeRO Sec. 7; DeepSpeed's order): "forward" / "backward" can
# hide under that phase's compute; "exposed" runs while nothing computes.
SCHEDULE = {
    0: [("all_reduce", "backward")],                                  # DDP: buckets during backward
    1: [("reduce_scatter", "exposed"), ("all_gather", "exposed")],    # after backward, after the update
    2: [("reduce_scatter", "backward"), ("all_gather", "exposed")],   # buckets during backward
    3: [("all_gather", "forward"), ("all_gather", "backward"), ("reduce_scatter", "backward")],
}


def step_time(num_params, world_size, stage, *, tokens_per_rank, peak_flops, mfu, bandwidth,
              latency, word_bytes=2, prefetch=True):
    if stage not in SCHEDULE:
        raise ValueError(f"stage={stage!r}: choose 0, 1, 2 or 3")
    n, s = world_size, word_bytes * num_params
    flops = peak_flops * mfu
    compute = {"forward": 2 * num_params * tokens_per_rank / flops,
               "backward": 4 * num_params * tokens_per_rank / flops}
    comm = {"forward": 0.0, "backward": 0.0, "exposed": 0.0}
    if n > 1:
        for op, when in SCHEDULE[stage]:
            if when == "forward" and not prefetch:
                when = "exposed"                  # without prefetch every gather blocks its unit
            comm[when] += PHASES[op] * ((n - 1) * latency + (n - 1) / n * s / bandwidth)
    return (max(compute["forward"], comm["forward"]) + max(compute["backward"], comm["backward"])
            + comm["exposed"])


def largest_model(world_size, stage, device_memory, *, offload=False, reserved_bytes=0.0):
    # per-rank bytes are linear in Ψ: the bytes of ONE parameter, then a division
    per_param = model_state_bytes(1, world_size, stage, mixed_precision=True, offload=offload)["total"]
    return max(0.0, (device_memory - reserved_bytes) / per_param)

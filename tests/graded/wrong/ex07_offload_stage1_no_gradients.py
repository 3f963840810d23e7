"""Wrong answer to exercise 07: the step time is right; the largest model with offload keeps only
the 2-byte parameters on the device at every stage, forgetting that stage 1 does not partition the
gradients, so its full 2-byte gradients stay on the device too."""


def step_time(num_params, world_size, stage, *, tokens_per_rank, peak_flops, mfu, bandwidth,
              latency, word_bytes=2, prefetch=True):
    n = world_size
    flop_rate = peak_flops * mfu
    forward = 2 * num_params * tokens_per_rank / flop_rate
    backward = 4 * num_params * tokens_per_rank / flop_rate
    ring = 0.0 if n == 1 else (n - 1) * latency + (n - 1) / n * word_bytes * num_params / bandwidth
    during_fwd, during_bwd, alone = {0: (0, 2, 0), 1: (0, 0, 2), 2: (0, 1, 1), 3: (1, 2, 0)}[stage]
    if stage == 3 and not prefetch:
        during_fwd, alone = 0, 1
    return max(forward, during_fwd * ring) + max(backward, during_bwd * ring) + alone * ring


def largest_model(world_size, stage, device_memory, *, offload=False, reserved_bytes=0.0):
    n = world_size
    if offload:
        per = 2 / n if stage == 3 else 2
    else:
        per = [16, 4 + 12 / n, 2 + 14 / n, 16 / n][stage]
    return max(0.0, (device_memory - reserved_bytes) / per)

"""Wrong answer to exercise 07: the step takes the longer of ALL its compute and ALL its
communication (perfect overlap everywhere), the model lesson 07 warns against: right where compute
or communication dominates everything, wrong wherever some communication cannot hide."""


def step_time(num_params, world_size, stage, *, tokens_per_rank, peak_flops, mfu, bandwidth,
              latency, word_bytes=2, prefetch=True):
    n = world_size
    compute = 6 * num_params * tokens_per_rank / (peak_flops * mfu)
    if n == 1:
        return compute
    phases = {0: 2, 1: 2, 2: 2, 3: 3}[stage]
    size = word_bytes * num_params
    comm = phases * ((n - 1) * latency + (n - 1) / n * size / bandwidth)
    return max(compute, comm)


def largest_model(world_size, stage, device_memory, *, offload=False, reserved_bytes=0.0):
    n = world_size
    if offload:
        per = {1: 2 + 2, 2: 2, 3: 2 / n}[stage]
    else:
        per = {0: 16, 1: 4 + 12 / n, 2: 2 + 14 / n, 3: 16 / n}[stage]
    return max(0.0, (device_memory - reserved_bytes) / per)

"""WRONG (07.3): the largest model rounded down to a multiple of N, as an engine pads its flat
buffers so that every rank holds whole elements: within N parameters of the papers' numbers, so
every headline still checks out. The papers' accounting is in real numbers (the stub says so).

Caught by: test_largest_model_zero_offload.
"""
PHASES = ("forward", "backward")
RING_PHASES = {"all_reduce": 2, "reduce_scatter": 1, "all_gather": 1}   # an all-reduce: RS then AG
FLOPS_PER_TOKEN = {"forward": 2, "backward": 4}                         # x Ψ (ZeRO-3's gathers: bytes)


def _check(timeline):
    """The collectives and the compute spans of ``timeline``, each span checked."""
    compute, collectives = [], []
    for i, span in enumerate(timeline["spans"]):
        kind = span.get("kind")
        if kind == "compute":
            if span.get("phase") not in PHASES:
                raise ValueError(f"span {i}: phase {span.get('phase')!r}: a compute span is 'forward' or 'backward'")
            compute.append(span)
        elif kind in RING_PHASES:
            collectives.append(span)
        else:
            raise ValueError(f"span {i}: kind {kind!r}: choose 'compute' or one of {sorted(RING_PHASES)}")
        if not span["end"] >= span["start"]:
            raise ValueError(f"span {i} ({kind}) ends at {span['end']!r}, before it starts at {span['start']!r}")
    return compute, collectives


def _shared(a, b):
    """Seconds two spans share (0 if they only touch, or are apart)."""
    return max(0.0, min(a["end"], b["end"]) - max(a["start"], b["start"]))


def placement(timeline):
    compute, collectives = _check(timeline)
    out = []
    for c in collectives:
        # What runs while it is in flight: the time it shares with each phase's compute spans (the
        # gaps between them, where the device waits, hide nothing).
        beside = {p: sum(_shared(c, s) for s in compute if s["phase"] == p) for p in PHASES}
        best = max(PHASES, key=beside.get)
        out.append(best if beside[best] > 0 else None)
    return out


def step_time(timeline, num_params, world_size, *, tokens_per_rank, peak_flops, mfu, bandwidth, latency):
    _, collectives = _check(timeline)
    n, scale = world_size, num_params / timeline["num_params"]    # buffers are model-sized
    rate = peak_flops * mfu
    compute = {p: FLOPS_PER_TOKEN[p] * num_params * tokens_per_rank / rate for p in PHASES}
    hidden, exposed = {p: 0.0 for p in PHASES}, 0.0
    for c, where in zip(collectives, placement(timeline)):
        t = RING_PHASES[c["kind"]] * ((n - 1) * latency + (n - 1) / n * c["bytes"] * scale / bandwidth)
        if where is None:
            exposed += t                     # the device waits for it: it adds in full
        else:
            hidden[where] += t               # one link: a phase's collectives add up, beside its compute
    return sum(max(compute[p], hidden[p]) for p in PHASES) + exposed


def largest_model(world_size, stage, device_memory, *, offload=False, reserved_bytes=0.0, tokens=0):
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage={stage!r}: choose 0, 1, 2 or 3")
    if offload and stage == 0:
        raise ValueError("offload=True needs a partitioned optimizer: stage 1, 2 or 3 (ZeRO-Offload)")
    if device_memory < 0 or reserved_bytes < 0:
        raise ValueError(f"device_memory={device_memory!r}, reserved_bytes={reserved_bytes!r}: bytes are >= 0")
    if tokens < 0:
        raise ValueError(f"tokens={tokens!r}: a micro-batch holds >= 0 tokens")
    n = world_size
    if offload:
        # ZeRO-Offload: the gradient shard and the optimizer states live on the host; the device keeps
        # the 2-byte parameters (stage 3: its 1/N shard) and, in stage 1, whose gradients are reduced
        # only after backward, the full 2-byte gradients.
        per = {1: 2 + 2, 2: 2, 3: 2 / n}[stage]
    else:   # ZeRO Sec. 5: (2 + 2 + 12) bytes, partitioned from the stage on (P_os, P_os+g, P_os+g+p)
        per = {0: 2 + 2 + 12, 1: 2 + 2 + 12 / n, 2: 2 + (2 + 12) / n, 3: (2 + 2 + 12) / n}[stage]
    budget = device_memory - reserved_bytes
    if budget <= 0:
        return 0.0                                                   # a reserve beyond the memory: nothing fits

    def activations(psi):
        # Every rank holds its own micro-batch's activations in full, at every stage and with offload
        # (stages 1-3 partition model states only; ZeRO-Offload keeps activations on the device): all
        # L layers at the end of forward, 32·h bytes per token per layer, L = h/128, Ψ = 12·L·h².
        hidden = (128 * psi / 12) ** (1 / 3)
        return tokens * (hidden / 128) * 32 * hidden

    # per·Ψ + activations(Ψ) grows with Ψ but not linearly (activations ~ Ψ^(2/3)): bisect.
    lo, hi = 0.0, budget / per
    for _ in range(200):
        mid = (lo + hi) / 2
        if per * mid + activations(mid) <= budget:
            lo = mid
        else:
            hi = mid
    return float(int(lo // n) * n)                                   # whole elements on every rank

"""Wrong answer to exercise 01: the measurement is right; fp32 Adam is given mixed precision's K = 12
(an fp32 master copy beside fp32 parameters that are already fp32): 4 + 4 + 12 = 20 bytes per
parameter for data parallelism, where fp32 Adam holds 16 (lesson 01, section 3, measures it).

Caught by: test_each_stage_shards_one_more_kind.
"""


def _new_bytes(tensors, seen):
    """Bytes of the storages behind ``tensors`` not yet in ``seen`` (which is updated)."""
    total = 0
    for t in tensors:
        if t is None:
            continue
        storage = t.untyped_storage()
        key = (storage.device, storage.data_ptr())   # one allocation = one (device, address)
        if storage.nbytes() and key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total


def _census(model, optimizer):
    params = list(model.parameters())
    own = {id(p) for p in params}
    masters = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in own]
    state = [t for s in optimizer.state.values() for t in s.values() if hasattr(t, "untyped_storage")]
    seen = set()  # shared: a storage belongs to the first kind that counts it
    kinds = {"params": _new_bytes(params, seen),
             "grads": _new_bytes([p.grad for p in params + masters], seen),
             "optimizer": _new_bytes(masters + state, seen)}
    return kinds


def peak_model_states(model, optimizer, run_step):
    peak = {"params": 0, "grads": 0, "optimizer": 0, "total": 0}

    def sample(*_):
        now = _census(model, optimizer)
        for kind, nbytes in now.items():
            peak[kind] = max(peak[kind], nbytes)
        peak["total"] = max(peak["total"], sum(now.values()))

    handles = [p.register_post_accumulate_grad_hook(sample) for p in model.parameters() if p.requires_grad]
    handles += [optimizer.register_step_pre_hook(sample), optimizer.register_step_post_hook(sample)]
    try:                       # the contract: nothing left behind, even when run_step() raises
        sample()
        run_step()
        sample()
    finally:
        for h in handles:
            h.remove()
    return peak


def model_state_bytes(num_params, world_size, stage, *, mixed_precision=True, offload=False):
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage!r}")
    if offload and stage == 0:
        raise ValueError("offload needs a sharded optimizer (stage 1, 2 or 3), got stage 0")
    # Bytes per element (ZeRO Sec. 3.1): mixed precision computes on 2-byte params and grads, and
    # Adam keeps an fp32 master, momentum and variance (K = 12); fp32 Adam too.
    param, grad, k = (2, 2, 12) if mixed_precision else (4, 4, 12)
    psi, n = num_params, world_size
    # ZeRO Sec. 5.1: P_os from stage 1, P_g from stage 2, P_p at stage 3.
    params = param * psi / (n if stage >= 3 else 1)
    grads = grad * psi / (n if stage >= 2 else 1)
    optim = k * psi / (n if stage >= 1 else 1)
    host = 0
    if offload:
        # ZeRO-Offload: what the rank owns (gradient shard, optimizer state) on the host
        host = (grad + k) * psi / n
        optim = 0
        grads = grads if stage == 1 else 0
    return {"params": params, "grads": grads, "optimizer": optim,
            "total": params + grads + optim, "host": host}

"""Wrong answer to exercise 01: the measurement is right; with offload the formula keeps only the
parameters on the device at every stage, forgetting that stage 1 does not partition gradients, so
its full gradient stays on the device.

Caught by: test_offload_moves_the_owned_states_to_the_host.
"""
PRECISIONS = {True: {"param": 2, "grad": 2, "k": 12}, False: {"param": 4, "grad": 4, "k": 8}}  # bytes/element


def _new_bytes(tensors, seen):
    """Bytes of the storages behind ``tensors`` not yet in ``seen`` (which is updated)."""
    total = 0
    for t in tensors:
        if t is None:
            continue
        storage = t.untyped_storage()
        key = (storage.device, storage.data_ptr())
        if storage.nbytes() and key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total


def _census(model, optimizer):
    params = list(model.parameters())
    own = {id(p) for p in params}
    masters = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in own]
    state = [t for s in optimizer.state.values() for t in s.values() if hasattr(t, "untyped_storage")]
    seen = set()
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
    try:
        sample()
        run_step()
        sample()
    finally:
        for h in handles:
            h.remove()
    return peak



def model_state_bytes(num_params, world_size, stage, *, mixed_precision=True, offload=False):
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0-3, got {stage!r}")
    if offload and stage == 0:
        raise ValueError("offload needs stage >= 1")
    b = PRECISIONS[mixed_precision]
    n = world_size
    params = b["param"] * num_params / (n if stage == 3 else 1)
    grads = b["grad"] * num_params / (n if stage >= 2 else 1)
    optim = b["k"] * num_params / (n if stage else 1)
    host = 0
    if offload:
        host = (b["grad"] + b["k"] + (0 if mixed_precision else 4)) * num_params / n
        grads = optim = 0
    return {"params": params, "grads": grads, "optimizer": optim, "total": params + grads + optim, "host": host}

"""Wrong answer to exercise 01: sampled at the start, at every gradient and at the end, but not
around the optimizer step: the moment right after optimizer.step(), when parameters, gradients and
the new optimizer state all exist, is missed, and with it the step's peak.

Caught by: test_peak_of_a_step_tied_weights_fp32_adam.
"""
import torch


def _bytes(tensors, seen):
    total = 0
    for t in tensors:
        if t is None:
            continue
        st = t.untyped_storage()
        if st.nbytes() and (st.device, st.data_ptr()) not in seen:
            seen.add((st.device, st.data_ptr()))
            total += st.nbytes()
    return total


def _now(model, optimizer):
    params = list(model.parameters())
    mine = {id(p) for p in params}
    extra = [q for g in optimizer.param_groups for q in g["params"] if id(q) not in mine]
    state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    seen = set()
    return {"params": _bytes(params, seen), "grads": _bytes([p.grad for p in params + extra], seen),
            "optimizer": _bytes(extra + state, seen)}


def peak_model_states(model, optimizer, run_step):
    best = {"params": 0, "grads": 0, "optimizer": 0, "total": 0}

    def sample(*unused):
        now = _now(model, optimizer)
        for k, v in now.items():
            best[k] = max(best[k], v)
        best["total"] = max(best["total"], sum(now.values()))

    handles = [p.register_post_accumulate_grad_hook(sample) for p in model.parameters() if p.requires_grad]
    try:
        sample()
        run_step()
        sample()
    finally:
        for h in handles:
            h.remove()
    return best


def model_state_bytes(num_params, world_size, stage, *, mixed_precision=True, offload=False):
    if stage not in (0, 1, 2, 3) or (offload and stage == 0):
        raise ValueError(f"unsupported stage {stage!r} (offload={offload})")
    p_b, g_b, k = (2, 2, 12) if mixed_precision else (4, 4, 8)
    n = world_size
    params = p_b * num_params / (n if stage == 3 else 1)
    grads = g_b * num_params / (n if stage >= 2 else 1)
    optim = k * num_params / (n if stage >= 1 else 1)
    host = 0
    if offload:
        host = (g_b + k + (0 if mixed_precision else 4)) * num_params / n
        optim = 0
        if stage != 1:
            grads = 0
    return {"params": params, "grads": grads, "optimizer": optim, "total": params + grads + optim, "host": host}

"""Wrong answer to exercise 01: the "peak" is measured before and after the step only. Right when
everything the step holds survives it; but zero_grad(set_to_none=True) releases the gradients before
the step returns, and the moment after optimizer.step(), when everything coexists, is never seen.

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
    before = _now(model, optimizer)
    run_step()
    after = _now(model, optimizer)
    out = {k: max(before[k], after[k]) for k in before}
    out["total"] = max(sum(before.values()), sum(after.values()))
    return out


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

"""Wrong answer to exercise 01: sampled at the right moments, but bytes are counted per tensor
(numel x element size), not per storage: TinyGPT's tied embedding/head weight counts twice, and so
does its gradient.

Caught by: test_peak_of_a_step_tied_weights_fp32_adam.
"""
import torch


def _count(model, optimizer):
    params = [p for _, p in model.named_parameters(remove_duplicate=False)]
    own = {id(p) for p in params}
    masters = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in own]
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts if t is not None)
    state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    return {"params": nbytes(params), "grads": nbytes([p.grad for p in params + masters]),
            "optimizer": nbytes(masters + state)}


def peak_model_states(model, optimizer, run_step):
    peak = dict(params=0, grads=0, optimizer=0, total=0)

    def look(*args):
        c = _count(model, optimizer)
        for k in c:
            peak[k] = max(peak[k], c[k])
        peak["total"] = max(peak["total"], sum(c.values()))

    hooks = [p.register_post_accumulate_grad_hook(look) for p in model.parameters() if p.requires_grad]
    hooks.append(optimizer.register_step_pre_hook(look))
    hooks.append(optimizer.register_step_post_hook(look))
    look()
    run_step()
    look()
    for h in hooks:
        h.remove()
    return peak


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

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


def _numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def _state_elements(shape, optimizer):
    # measured on torch's optimizers: Adam keeps two moments, SGD one momentum buffer, Adafactor a
    # vector's full second moment or, for a matrix, one value per row and one per column
    numel = _numel(shape)
    if optimizer == "adam":
        return 2 * numel
    if optimizer == "sgd":
        return numel
    if len(shape) < 2:
        return numel
    batch = numel // (shape[-2] * shape[-1])     # leading dims: a stack of matrices
    return batch * (shape[-2] + shape[-1])


def model_state_bytes(shapes, world_size, stage, *, optimizer="adam", mixed_precision=True, offload=False):
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage!r}")
    if optimizer not in ("adam", "sgd", "adafactor"):
        raise ValueError(f"optimizer must be 'adam', 'sgd' or 'adafactor', got {optimizer!r}")
    if optimizer == "adafactor" and stage >= 1:
        # a factored second moment (a row and a column statistic per matrix) cannot be cut into the
        # flat 1/N slices ZeRO partitions; zerolab's engines refuse it at stages 1-3
        raise ValueError(f"optimizer='adafactor' at stage {stage}: its factored state cannot be "
                         f"partitioned into flat slices; zerolab's engines refuse it (use stage 0)")
    if offload and stage == 0:
        raise ValueError("offload needs a sharded optimizer (stage 1, 2 or 3), got stage 0")
    shapes = [tuple(s) for s in shapes]
    psi = sum(_numel(s) for s in shapes)
    states = 4 * sum(_state_elements(s, optimizer) for s in shapes)      # the optimizer's state is fp32
    param = grad = 2 if mixed_precision else 4
    master = 4 * psi if mixed_precision else 0                          # ZeRO Sec. 3.1's fp32 master
    n = world_size
    # ZeRO Sec. 5.1: P_os from stage 1, P_g from stage 2, P_p at stage 3.
    params = param * psi / (n if stage >= 3 else 1)
    grads = grad * psi / (n if stage >= 2 else 1)
    optim = (master + states) / (n if stage >= 1 else 1)
    host = 0
    if offload:
        # ZeRO-Offload: the owned gradient shard, an fp32 copy of the owned parameters, the state
        host = (grad * psi + 4 * psi + states) / n
        optim = 0
        grads = grads if stage == 1 else 0
    return {"params": params, "grads": grads, "optimizer": optim,
            "total": params + grads + optim, "host": host}

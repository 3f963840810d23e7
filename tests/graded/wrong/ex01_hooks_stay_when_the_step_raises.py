"""Wrong answer to exercise 01: the peaks are right and the hooks are removed after an ordinary
step, but the removal is not guarded: when run_step() raises, the exception leaves
peak_model_states before the hooks are removed, and they stay on the parameters and the optimizer,
taking censuses in every later backward and step (from an independent review).

Caught by: test_nothing_left_behind_when_the_step_raises."""


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
    sample()
    run_step()
    sample()
    for h in handles:
        h.remove()
    return peak


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

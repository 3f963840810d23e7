"""Worked answers to exercise 01: the peak of a step by kind, measured with hooks, and the ZeRO
formulas with ZeRO-Offload's placement, derived for three optimizers from their own state (see
lesson 01)."""
import math


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


def _optimizer_elements(shape, optimizer):
    """Elements of optimizer state torch keeps for one parameter of ``shape`` (step counters aside)."""
    numel = math.prod(shape)
    if optimizer == "adam":            # torch.optim.Adam: exp_avg and exp_avg_sq, each like the parameter
        return 2 * numel
    if optimizer == "sgd":             # torch.optim.SGD(momentum>0): one momentum_buffer like the parameter
        return numel
    if len(shape) < 2:                 # torch.optim.Adafactor: a vector keeps its full second moment ...
        return numel
    # ... a matrix (or a stack of them: leading dims batch) keeps one mean per row and one per column
    # of its last two dims (Shazeer & Stern, arXiv 1804.04235, Sec. 3).
    rows, cols = shape[-2], shape[-1]
    batch = numel // (rows * cols)
    return batch * (rows + cols)


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
    if not shapes or any(len(s) == 0 or any(int(d) != d or d < 1 for d in s) for s in shapes):
        raise ValueError(f"shapes must be a non-empty list of shapes with positive integer sizes, got {shapes!r}")
    psi = sum(math.prod(s) for s in shapes)
    # The optimizer's own state is fp32 (it updates the fp32 master in mixed precision, ZeRO Sec. 3.1).
    states = 4 * sum(_optimizer_elements(s, optimizer) for s in shapes)
    param = grad = 2 if mixed_precision else 4
    master = 4 * psi if mixed_precision else 0
    n = world_size
    # ZeRO Sec. 5.1: P_os from stage 1, P_g from stage 2, P_p at stage 3; a share is exactly 1/N.
    params = param * psi / (n if stage >= 3 else 1)
    grads = grad * psi / (n if stage >= 2 else 1)
    optim = (master + states) / (n if stage >= 1 else 1)
    host = 0
    if offload:
        # zerolab's offload engines (ZeRO-Offload Sec. 4.1): the rank's optimizer state and its
        # gradient shard go to the host, with an fp32 copy of its parameter shard to update (the
        # master in mixed precision; its own copy in fp32, since the device's parameters cannot be
        # it). The device keeps the parameters as the stage has them, and at stage 1 its full gradient.
        host = (grad * psi + 4 * psi + states) / n
        optim = 0
        grads = grads if stage == 1 else 0
    return {"params": params, "grads": grads, "optimizer": optim,
            "total": params + grads + optim, "host": host}

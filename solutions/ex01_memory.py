"""Worked answers to exercise 01: the peak of a step by kind, measured with hooks, and the ZeRO
formulas with ZeRO-Offload's placement, for any torch optimizer, from its state measured (see
lesson 01)."""
import math

import torch

from zerolab.engine import ELEMENTWISE_OPTIMIZERS


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


def _state_elements(shape, optimizer, kwargs):
    """Elements of state ``optimizer(params, **kwargs)`` keeps for one parameter of ``shape`` after a
    step, MEASURED: one step on a parameter of that shape, then its state tensors counted, 0-dim ones
    (step counts, NAdam's mu_product) aside. On the meta device first (no memory, so a 7.5e9-element
    vector costs nothing); an optimizer that reads a value back (Adafactor calls .item()) cannot
    step there, and is measured on a real parameter."""
    def measure(device):
        p = torch.zeros(shape, device=device, requires_grad=True)
        p.grad = torch.ones_like(p)
        opt = optimizer([p], **kwargs)
        opt.step()
        return sum(t.numel() for t in opt.state[p].values() if torch.is_tensor(t) and t.dim() > 0)
    try:
        return measure("meta")
    except (RuntimeError, NotImplementedError):
        if math.prod(shape) > 1 << 26:
            raise ValueError(f"{optimizer.__name__} cannot step on the meta device, and a real parameter of "
                             f"shape {shape} is too large to measure it on") from None
        return measure("cpu")


def _refused(optimizer, kwargs, stage):
    """Why zerolab's engines refuse ``optimizer`` at ``stage``, or None: they partition flat slices of
    the parameters from stage 1 on, which is exact only for an elementwise update; and they step
    without a closure (tried here: a step without one on a one-element parameter)."""
    if stage >= 1 and not issubclass(optimizer, ELEMENTWISE_OPTIMIZERS):
        return f"its update is not elementwise, so a flat 1/N slice cannot step alone (stage {stage})"
    p = torch.zeros(1, 1, requires_grad=True)      # a matrix: some optimizers (Muon) take nothing else
    p.grad = torch.zeros(1, 1)
    try:
        optimizer([p], **kwargs).step()
    except TypeError as exc:
        return f"it cannot step without a closure, which the engines do not pass ({exc})"
    return None


def model_state_bytes(shapes, world_size, stage, *, optimizer, optimizer_kwargs=None, mixed_precision=True,
                      offload=False):
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage!r}")
    if not (isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer)):
        raise ValueError(f"optimizer must be a torch optimizer class such as torch.optim.Adam, got {optimizer!r}")
    kwargs = dict(optimizer_kwargs or {})
    why = _refused(optimizer, kwargs, stage)
    if why:
        raise ValueError(f"{optimizer.__name__} at stage {stage}: zerolab's engines refuse it: {why}")
    if offload and stage == 0:
        raise ValueError("offload needs a sharded optimizer (stage 1, 2 or 3), got stage 0")
    shapes = [tuple(s) for s in shapes]
    if not shapes or any(len(s) == 0 or any(int(d) != d or d < 1 for d in s) for s in shapes):
        raise ValueError(f"shapes must be a non-empty list of shapes with positive integer sizes, got {shapes!r}")
    psi = sum(math.prod(s) for s in shapes)
    # The optimizer's own state is fp32 (it updates the fp32 master in mixed precision, ZeRO Sec. 3.1).
    per_shape = {s: _state_elements(s, optimizer, kwargs) for s in set(shapes)}   # each shape once
    states = 4 * sum(per_shape[s] for s in shapes)
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

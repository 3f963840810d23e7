"""Wrong answer to exercise 01 (written by an independent attacker from the stub alone): no closure
rule. The state is measured right and non-elementwise optimizers are refused from stage 1, but an
optimizer whose step needs a closure (LBFGS) is accepted at stage 0, where zerolab's engines refuse
it (they step without one). On a matrix its probe happens to raise an unrelated ValueError; on a
vector it returns numbers.

Caught by: test_settings_that_do_not_exist_are_refused.
"""
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




_PROBE_DIMS = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29)      # distinct, none of them 1


def _tensors(value):
    if torch.is_tensor(value):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)


def _state_bytes(shape, optimizer, kwargs, dtype=torch.float32):
    """Bytes of per-element state (0-dim scalars left out) that ``optimizer`` keeps for one parameter
    of ``shape`` after one step. Measured on a small probe with distinct dims, each state dim mapped
    back to the parameter's dim it came from (so a 7.5e9 vector costs nothing to measure)."""
    shape = tuple(int(d) for d in shape)
    probe = _PROBE_DIMS[:len(shape)]
    p = torch.zeros(probe, dtype=dtype, requires_grad=True)
    opt = optimizer([p], **kwargs)
    p.grad = torch.full_like(p, 0.5)
    opt.step(lambda: torch.zeros(()))           # a closure for those that want one (LBFGS)
    total = 0
    for t in _tensors(opt.state[p]):
        if t.dim() == 0:                        # step counters and the like: not counted
            continue
        n = 1
        for d in t.shape:
            if d != 1:
                n *= shape[probe.index(d)]
        total += n * t.element_size()
    return total


def _needs_closure(optimizer, kwargs):
    """True if a step without a closure fails for lack of one (LBFGS)."""
    p = torch.zeros(2, 3, requires_grad=True)
    opt = optimizer([p], **kwargs)
    p.grad = torch.ones_like(p)
    try:
        opt.step()
    except TypeError:
        return True
    return False


def _div(numerator, n):
    return numerator // n if numerator % n == 0 else numerator / n


def _check(world_size, stage, optimizer, offload):
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage!r}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    if offload and stage == 0:
        raise ValueError("offload needs a partitioned optimizer: stage 1, 2 or 3, got stage 0")
    if not (isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer)) \
            or optimizer is torch.optim.Optimizer:
        raise ValueError(f"optimizer must be a torch optimizer class, got {optimizer!r}")
    if stage > 0 and not issubclass(optimizer, ELEMENTWISE_OPTIMIZERS):
        raise ValueError(f"stage {stage} shards the optimizer over flat slices: {optimizer.__name__} "
                         f"is not elementwise, zerolab's engines refuse it")


def model_state_bytes(shapes, world_size, stage, *, optimizer, optimizer_kwargs=None, mixed_precision=True,
                      offload=False):
    _check(world_size, stage, optimizer, offload)
    kwargs = dict(optimizer_kwargs or {})
    n = world_size
    psi = 0
    state = 0
    for shape in shapes:
        numel = 1
        for d in shape:
            numel *= int(d)
        psi += numel
        state += _state_bytes(shape, optimizer, kwargs)
    b_param = b_grad = 2 if mixed_precision else 4
    master = 4 * psi if mixed_precision else 0          # fp32 training: the parameter is its own master
    optim = master + state

    params = _div(b_param * psi, n) if stage >= 3 else b_param * psi
    grads = _div(b_grad * psi, n) if stage >= 2 else b_grad * psi
    opt = _div(optim, n) if stage >= 1 else optim
    host = 0
    if offload:
        # the host: this rank's gradient shard, an fp32 master of its own (fp32 too) and the state
        host = _div(b_grad * psi + 4 * psi + state, n)
        opt = 0
        if stage >= 2:
            grads = 0                                   # the reduced shard goes straight to the host
    return {"params": params, "grads": grads, "optimizer": opt, "total": params + grads + opt,
            "host": host}

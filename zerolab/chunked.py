"""A torch optimizer stepped one chunk at a time, its per-element state handed in for that chunk.

Under ZeRO-Infinity's optimizer offload (Rajbhandari et al., arXiv 2104.07857, Sec. 5.1) the fp32
master and Adam's moments of a rank's shard live on disk; only a few chunks of them are in memory at
any moment. DeepSpeed steps its optimizer one "sub group" at a time (``sub_group_size`` elements;
``DeepSpeedZeroOptimizer_Stage3.step`` in ``deepspeed/runtime/zero/stage3.py``: swap in, step, swap
out, sub group after sub group), pointing the sub group's fp32 tensor and its state at swapped-in
buffers (``OptimizerStateSwapInfo.set_swap_buffers`` in ``deepspeed/runtime/swap_tensor/
optimizer_utils.py``). :class:`ChunkedOptimizer` does the same with a plain torch optimizer: one
placeholder parameter per chunk, whose data and state are set to the chunk's buffers just before its
step and dropped right after, so the optimizer itself holds only scalars (Adam's step counters).

Adam's update is elementwise, so stepping chunk after chunk is the same arithmetic as one step on the
whole shard: bit for bit with torch's for-loop and fused CPU kernels (checked in tests/test_infinity.py).
"""
import torch

from zerolab.shard_optim import master_dtype

# The per-element state each supported optimizer keeps (torch's names), in the order a chunk's record
# stores them after the master values. Adam/AdamW without amsgrad: two moments.
STATE_FIELDS = {torch.optim.Adam: ("exp_avg", "exp_avg_sq"), torch.optim.AdamW: ("exp_avg", "exp_avg_sq")}


def state_fields(optimizer_class, opt_kwargs):
    """The per-element state of ``optimizer_class(**opt_kwargs)`` a chunk record must hold, or
    ValueError naming what cannot be streamed this way."""
    fields = next((f for cls, f in STATE_FIELDS.items() if issubclass(optimizer_class, cls)), None)
    if fields is None:
        raise ValueError(f"a chunked (disk-offloaded) optimizer streams Adam's two moments; "
                         f"{optimizer_class.__name__} is not supported: use torch.optim.Adam or AdamW")
    if opt_kwargs.get("amsgrad"):
        raise ValueError("amsgrad=True keeps a third per-element state (max_exp_avg_sq), which the chunk "
                         "records do not hold: use amsgrad=False")
    if opt_kwargs.get("foreach"):
        raise ValueError("foreach=True: a chunk is one tensor, there is nothing to batch; use fused=True/False")
    return ("param",) + fields


class ChunkedOptimizer:
    """``optimizer_class(**opt_kwargs)`` over ``n_chunks`` placeholder tensors of ``dtype``.

    :meth:`step_chunk` runs the optimizer on chunk i: ``param`` (the chunk's master values, updated in
    place), ``state`` ({name: tensor} of its per-element state, updated in place) and ``grad``.
    ``self.optimizer`` is a real ``torch.optim.Optimizer`` (set its ``lr`` for schedules; its
    ``state`` keeps each chunk's step counter between steps). ``fused``: as
    :func:`zerolab.offload.host_optimizer` (None: torch's fused CPU kernel where it exists)."""

    def __init__(self, optimizer_class, n_chunks, dtype, *, fused=None, **opt_kwargs):
        self.fields = state_fields(optimizer_class, opt_kwargs)[1:]
        self.dtype = master_dtype(dtype)
        self.placeholders = [torch.empty(0, dtype=self.dtype) for _ in range(n_chunks)]
        if fused is None:
            try:
                self.optimizer, self.fused = optimizer_class(self.placeholders, fused=True, **opt_kwargs), True
            except (RuntimeError, TypeError, ValueError):
                self.optimizer, self.fused = optimizer_class(self.placeholders, **opt_kwargs), False
        else:
            self.optimizer, self.fused = optimizer_class(self.placeholders, fused=fused, **opt_kwargs), bool(fused)
        self._empty = torch.empty(0, dtype=self.dtype)

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def steps_taken(self, i):
        """How many updates chunk i has had (Adam's ``step`` counter; 0 before the first)."""
        st = self.optimizer.state.get(self.placeholders[i], {})
        return int(st["step"]) if "step" in st else 0

    def set_steps(self, i, steps):
        """Set chunk i's step counter (a checkpoint load, or undoing a failed step)."""
        p = self.placeholders[i]
        if steps == 0:
            self.optimizer.state.pop(p, None)
        else:
            template = torch.tensor(0.0)            # torch keeps 'step' as a float32 scalar tensor on CPU
            self.optimizer.state[p] = {"step": torch.full_like(template, float(steps))}

    @torch.no_grad()
    def step_chunk(self, i, param, state, grad):
        """One optimizer update of chunk i, in place on ``param`` and ``state`` (tensors of one shape,
        the optimizer's dtype; ``grad`` likewise). Nothing of them stays referenced afterwards."""
        p = self.placeholders[i]
        p.data = param
        p.grad = grad
        steps = self.steps_taken(i)
        if steps:                                   # later steps: the moments come from the record
            self.optimizer.state[p].update({name: state[name] for name in self.fields})
        else:                                       # first step: torch would start from zeros; so do
            for name in self.fields:                # the records (written as zeros at creation)
                state[name].zero_()
            self.optimizer.state[p] = {"step": torch.tensor(0.0), **{name: state[name] for name in self.fields}}
        try:
            self.optimizer.step()                   # every other placeholder has no grad: skipped
        finally:
            st = self.optimizer.state[p]
            for name in self.fields:
                st.pop(name, None)                  # the record's buffers go back to the pool
            p.grad = None
            p.data = self._empty

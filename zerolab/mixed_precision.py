"""Mixed precision with sharded gradients: the overflow check and dynamic loss scale of fp16
training, and gradient clipping, when no rank holds the whole gradient.

Two questions a step must answer about the FULL gradient, while each rank holds only its shard
(ZeRO stages 1-3, ``fully_shard``) or a replica (stage 0, parameters left whole):

* **did anything overflow?** (fp16 loss scaling) A rank sees only its shard: an inf in rank 1's
  shard is invisible to rank 0. Each rank checks what it holds, then ONE all-reduce (MAX) of a
  one-element flag tells every rank, and every rank skips the step together (:func:`found_inf`).
  A rank that skipped alone would leave its shard one update behind the others': silently wrong.
* **what is the global norm?** (clipping) ||g||² is a sum over elements, and every element is
  owned by exactly one rank: each rank sums the squares of its shard, ONE all-reduce (SUM) of that
  float64 scalar gives ||g||² everywhere (:func:`global_grad_norm`). Padding zeros add nothing;
  replicated gradients (identical on every rank) are counted on rank 0 only, once.

Both cost one scalar on the wire, not Ψ. DeepSpeed does the same (its fp16 optimizers' overflow
check all-reduces a flag with MAX over the data-parallel group; ``clip_grad_norm`` all-reduces the
squared partition norms), as does FSDP2 (``ShardedGradScaler``; the sharded ``DTensor`` norm).

:class:`LossScaler` is ``torch.amp.GradScaler``'s dynamic loss scale (same defaults, same rule:
an overflow halves the scale and skips the step, ``growth_interval`` good steps in a row double
it), with the overflow check made across ranks. The engines use it through their ``loss_scale``
option; in your own loop (``zerolab.fully_shard``) it has GradScaler's shape::

    scaler = LossScaler()                       # init_scale 2**16, x2 every 2000 good steps
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)                  # fp32 shard grads / scale; one all-reduce of a flag
    zerolab.clip_grad_norm_(model, 1.0)         # optional, on the unscaled gradients
    scaler.step(optimizer)                      # skipped on EVERY rank if ANY rank overflowed
    scaler.update()
"""
import math

import torch
import torch.distributed as dist

from zerolab import comm
from zerolab.launch import rank_device

NORM_TYPES = (2.0, math.inf)


def _flag_device(tensors):
    return tensors[0].device if tensors else rank_device()   # NCCL reduces only GPU tensors


def found_inf(grads, group=None):
    """True on every rank if any tensor in ``grads`` holds an inf or NaN on ANY rank of ``group``.
    Each rank checks only what it holds (its gradient shards); one all-reduce (MAX) of a
    one-element flag makes the answer the same everywhere."""
    grads = [g for g in grads if g is not None]
    flag = torch.zeros(1, device=_flag_device(grads))
    for g in grads:
        flag = torch.maximum(flag, (~torch.isfinite(g)).any().to(flag))   # 1.0: this rank saw one
    comm.all_reduce(flag, op=dist.ReduceOp.MAX, group=group, tag="overflow flag")
    return bool(flag.item())


def global_grad_norm(sharded, replicated=(), group=None, norm_type=2.0):
    """The ``norm_type`` norm (2 or inf) of the whole gradient, as a float64 0-dim tensor, equal on
    every rank. ``sharded``: this rank's gradient shards (every element is owned by one rank; zero
    padding adds nothing); ``replicated``: gradients every rank holds whole and alike (counted on
    rank 0 only). One all-reduce of a float64 scalar: the sum of squares (SUM), or the largest
    magnitude (MAX) for the inf-norm."""
    if norm_type not in NORM_TYPES:
        raise ValueError(f"norm_type={norm_type!r} is not supported: 2.0 or math.inf")
    sharded = [g for g in sharded if g is not None]
    replicated = [g for g in replicated if g is not None] if dist.get_rank(group) == 0 else []
    mine = sharded + replicated
    local = torch.zeros((), dtype=torch.float64, device=_flag_device(mine))
    if norm_type == 2.0:
        for g in mine:
            local += g.double().pow(2).sum().to(local.device)            # Σ g² over what I own
        comm.all_reduce(local, group=group, tag="grad norm")             # Σ over ranks = ||g||²
        return local.sqrt()
    for g in mine:
        local = torch.maximum(local, g.double().abs().max().to(local.device) if g.numel() else local)
    comm.all_reduce(local, op=dist.ReduceOp.MAX, group=group, tag="grad norm")
    return local


def clip_grad_norm_(sharded, replicated, max_norm, *, norm_type=2.0, group=None, grad_scale=1.0):
    """``torch.nn.utils.clip_grad_norm_`` for gradients spread over ranks: the global norm from
    :func:`global_grad_norm` (one all-reduce of a scalar), then every gradient this rank holds is
    multiplied in place by min(1, max_norm / (norm + 1e-6)), torch's coefficient. Returns the norm
    (float64, 0-dim, the same on every rank). ``grad_scale``: the gradients still carry a loss scale
    S (fp16 before the unscale): the norm returned and clipped against is the true one, norm / S."""
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not max_norm > 0:
        raise ValueError(f"max_norm must be a positive number, got {max_norm!r}")
    sharded, replicated = list(sharded), list(replicated)
    norm = global_grad_norm(sharded, replicated, group, norm_type) / grad_scale
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in sharded + replicated:
        if g is not None:
            g.mul_(coef.to(g.device))
    return norm


class LossScaler:
    """Dynamic loss scaling, ``torch.amp.GradScaler``'s rule across ranks.

    fp16 has 5 exponent bits: gradients below ~6e-8 become 0. Multiplying the loss by ``scale``
    multiplies every gradient by it (backward is linear), lifting small ones into range; the step
    divides it out again in fp32. Too large a scale makes gradients overflow to inf: then the step
    is skipped on every rank and the scale multiplied by ``backoff_factor``; after
    ``growth_interval`` steps without overflow it is multiplied by ``growth_factor``.
    ``dynamic=False``: a static scale, never changed (an overflow still skips the step).

    The engines call :meth:`update` with the flag from :func:`found_inf`; in your own loop use it
    as GradScaler: :meth:`scale`, :meth:`unscale_` (optional, before clipping), :meth:`step`,
    :meth:`update`. ``history``: (scale used, overflowed) per step, for plots.
    """

    def __init__(self, init_scale=2.0 ** 16, *, growth_factor=2.0, backoff_factor=0.5,
                 growth_interval=2000, dynamic=True, group=None):
        for name, v, ok in (("init_scale", init_scale, lambda v: v > 0 and math.isfinite(v)),
                            ("growth_factor", growth_factor, lambda v: v > 1), ("backoff_factor",
                            backoff_factor, lambda v: 0 < v < 1)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not ok(v):
                raise ValueError(f"LossScaler: {name}={v!r} is not valid (GradScaler's default "
                                 f"{ {'init_scale': 2.0 ** 16, 'growth_factor': 2.0, 'backoff_factor': 0.5}[name]})")
        if isinstance(growth_interval, bool) or not isinstance(growth_interval, int) or growth_interval < 1:
            raise ValueError(f"LossScaler: growth_interval must be an int >= 1, got {growth_interval!r}")
        self.scale_value = float(init_scale)
        self.growth_factor, self.backoff_factor = float(growth_factor), float(backoff_factor)
        self.growth_interval, self.dynamic, self.group = growth_interval, dynamic, group
        self.growth_tracker = 0          # good steps in a row since the last change
        self.history = []
        self._found = None               # this step's verdict, once unscale_ (or step) computed it

    # -- the rule ---------------------------------------------------------------------------
    def update(self, found=None):
        """End of a step: ``found`` (default: what :meth:`unscale_` found) says whether any rank
        overflowed. Overflow: scale x backoff_factor, count from 0; else one more good step, and
        after growth_interval of them scale x growth_factor (``torch._amp_update_scale_``)."""
        found = self._found if found is None else found
        if found is None:
            raise RuntimeError("LossScaler.update(): no verdict for this step: call step() (or unscale_) first")
        self.history.append((self.scale_value, bool(found)))
        if self.dynamic:
            if found:
                self.scale_value *= self.backoff_factor
                self.growth_tracker = 0
            else:
                self.growth_tracker += 1
                if self.growth_tracker == self.growth_interval:
                    self.scale_value *= self.growth_factor
                    self.growth_tracker = 0
        self._found = None

    def state_dict(self):
        """What a checkpoint keeps (GradScaler's keys): the scale and the good steps counted."""
        return {"scale": self.scale_value, "growth_factor": self.growth_factor, "backoff_factor":
                self.backoff_factor, "growth_interval": self.growth_interval, "_growth_tracker": self.growth_tracker}

    def load_state_dict(self, state):
        self.scale_value, self.growth_tracker = float(state["scale"]), int(state["_growth_tracker"])

    def get_scale(self):
        """The current scale (GradScaler's name for it)."""
        return self.scale_value

    @property
    def inv_scale(self):
        """1 / scale, what the step multiplies the fp32 gradients by (exact: scales are powers of 2
        unless you chose another)."""
        return 1.0 / self.scale_value

    # -- GradScaler's shape, for your own loop ----------------------------------------------
    def scale(self, loss):
        """``loss`` x the current scale: call ``.backward()`` on the result."""
        return loss * self.scale_value

    @staticmethod
    def _grads(optimizer):
        return [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]

    @torch.no_grad()
    def unscale_(self, optimizer):
        """Divide the gradients of ``optimizer``'s parameters by the scale, in place (they must be
        fp32 or wider: an fp16 gradient divided by 2**16 would underflow, the very thing scaling
        prevents; ``fully_shard`` keeps fp32 shard gradients), and decide, across ranks, whether
        this step overflowed (one all-reduce of a flag). At most once per step."""
        if self._found is not None:
            raise RuntimeError("LossScaler.unscale_() was already called since the last update()")
        grads = self._grads(optimizer)
        low = sorted({str(g.dtype) for g in grads if g.element_size() < 4})
        if low:
            raise ValueError(f"LossScaler.unscale_: gradients in {low}: unscale fp32 gradients (the master's), "
                             f"never 2-byte ones (they would underflow)")
        for g in grads:
            g.mul_(self.inv_scale)
        self._found = found_inf(grads, self.group)

    def step(self, optimizer, *args, **kwargs):
        """``optimizer.step()`` unless some rank overflowed (then nothing, on every rank). Unscales
        first if :meth:`unscale_` was not called. Returns the optimizer's return value or None."""
        if self._found is None:
            self.unscale_(optimizer)
        return None if self._found else optimizer.step(*args, **kwargs)

"""One rank's share of the optimizer: an fp32 master copy of the shard(s) it owns, and a torch
optimizer over that master copy alone.

This is ZeRO's optimizer-state partitioning, P_os (Rajbhandari et al., arXiv 1910.02054, Sec. 5.1):
rank r keeps fp32 weights and Adam moments only for its 1/N of the flat parameters, so K bytes per
parameter become K/N. Stages 1, 2 and 3 and the CPU offload all build on this one object; they differ
in where the gradient shard comes from and in how the updated parameters get back to everyone.

    shard (compute dtype, a view into a flat buffer)      master (fp32, here or on the host)
    | bf16 bf16 bf16 ... |   --- init: fp32 values --->    | fp32 fp32 fp32 ... |  + exp_avg, exp_avg_sq
                             <-- step: cast + copy ----

In fp32 training the master IS the shard: no second copy, only Adam's 8 bytes per owned element
(K = 8; the 4-byte values are the parameters themselves). In bf16/fp16 it is a separate fp32 tensor:
master 4 + moments 8 = K = 12 bytes per owned element.
Adam's update is elementwise, so running it on a flat slice equals running it on whole parameters.
"""
import torch

from zerolab import comm


def master_dtype(dtype):
    """The optimizer's dtype for parameters computed in ``dtype``: fp32 for 2-byte types (bf16,
    fp16), else ``dtype`` itself (fp32 trains in fp32, fp64 in fp64: exactness tests)."""
    return torch.float32 if torch.empty((), dtype=dtype).element_size() < 4 else dtype


class ShardOptimizer:
    """``optimizer_class(**opt_kwargs)`` over fp32 master copies of ``shards``.

    ``shards``: a 1-D tensor or a list of them, this rank's slice(s) of flat parameter buffers in the
    compute dtype; :meth:`step` writes the updated values back into them (cast). ``init``: optional
    list of fp32 tensors with the exact initial values (for bf16 shards: see
    ``FlatParams.shard_from``); default: the shards themselves. ``device``: where the master copy
    and the optimizer state live (default: with the shards; 'cpu' = ZeRO-Offload's host placement).
    """

    def __init__(self, shards, optimizer_class, *, init=None, device=None, **opt_kwargs):
        self.shards = [shards] if torch.is_tensor(shards) else list(shards)
        if not self.shards or any(s.dim() != 1 for s in self.shards):
            raise ValueError("ShardOptimizer needs one or more 1-D shard tensors")
        init = [None] * len(self.shards) if init is None else list(init)
        if len(init) != len(self.shards):
            raise ValueError(f"ShardOptimizer: {len(init)} init tensors for {len(self.shards)} shards")
        self.master = []
        for shard, start in zip(self.shards, init):
            dev = torch.device(device) if device is not None else shard.device
            dtype = master_dtype(shard.dtype)
            if shard.dtype == dtype and shard.device == dev:
                self.master.append(shard)  # fp32 already, same place: the shard is its own master
            else:
                src = shard if start is None else start
                self.master.append(src.detach().to(dev, dtype, copy=True))  # fp32: 4 bytes/element
        self.optimizer = optimizer_class(self.master, **opt_kwargs)

    @property
    def param_groups(self):
        """The inner optimizer's param groups (set 'lr' here for schedules)."""
        return self.optimizer.param_groups

    def aliased(self, i):
        """True if master i is the shard itself (fp32 training without offload)."""
        return self.master[i] is self.shards[i]

    @torch.no_grad()
    def step(self, grads, *, inv_scale=1.0):
        """One optimizer step from this rank's gradient shard(s), laid out like ``shards`` (any
        dtype/device: they are upcast to fp32 where the master lives), then write the new values
        back into the shards in the compute dtype. ``inv_scale``: multiply the fp32 gradient by it
        first (1 / loss scale: fp16 training; in fp32, where a small gradient cannot underflow)."""
        grads = [grads] if torch.is_tensor(grads) else list(grads)
        if len(grads) != len(self.master):
            raise ValueError(f"ShardOptimizer.step: {len(grads)} gradient shards for {len(self.master)} shards")
        for m, g in zip(self.master, grads):
            if g.shape != m.shape:
                raise ValueError(f"ShardOptimizer.step: gradient shard of shape {tuple(g.shape)} for a "
                                 f"master shard of shape {tuple(m.shape)}")
            m.grad = g.to(m.device, m.dtype)  # no copy when already fp32 and in place
            if inv_scale != 1.0:
                m.grad.mul_(inv_scale)        # the loss scale out (in place: the shard is consumed)
        with comm.span("optimizer step", "optimizer"):
            self.optimizer.step()
        for m in self.master:
            m.grad = None
        self.write_back()

    @torch.no_grad()
    def write_back(self):
        """Cast each master into its shard in the compute dtype (after a step, or after a checkpoint
        load wrote the masters)."""
        for i, (m, shard) in enumerate(zip(self.master, self.shards)):
            if not self.aliased(i):
                shard.copy_(m)                         # fp32 -> compute dtype (and host -> device)

    def element_bytes(self, i):
        """Bytes this object holds per element of shard i: the separate master (4, or 0 when
        aliased) plus the per-element optimizer state (8 for Adam after its first step)."""
        state = self.optimizer.state.get(self.master[i], {})
        return (0 if self.aliased(i) else self.master[i].element_size()) + sum(t.element_size() for t in state.values()
                                                  if torch.is_tensor(t) and t.dim() > 0)

    def state_tensors(self):
        """{'master': separate fp32 copies, 'optimizer': per-element state (Adam's exp_avg and
        exp_avg_sq)}. Scalar state (Adam's 0-dim 'step' counter, 4 bytes per shard) is not
        per-parameter memory and is left out, as in the ZeRO accounting."""
        master = [m for i, m in enumerate(self.master) if not self.aliased(i)]
        state = [t for s in self.optimizer.state.values() for t in s.values()
                 if torch.is_tensor(t) and t.dim() > 0]
        return {"master": master, "optimizer": state}

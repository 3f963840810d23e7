"""Exercise 06 — the offloaded optimizer step (lesson 06, ZeRO-Offload, arXiv 2101.06840).

``OffloadedAdam`` is set up for you for one padded flat buffer of parameters on rank r of N
(``zerolab.flat.FlatParams``: the parameters are views into ``self.flat.data``, their ``.grad``
views into ``self.grads``). What lives where:

    device: self.flat.data     full parameters, compute dtype (bf16 or fp32), every rank
            self.grads         full local gradients, laid out like self.flat.data
    host:   self.grad_host     this rank's gradient shard, compute dtype (pinned on a GPU)
            self.master        this rank's parameter shard in fp32 (fp64 for fp64 models)
            self.optimizer     AdamW over [self.master] only: its moments are host, shard-sized

You write the two halves of one step:

06.1 ``offload_gradients()``: reduce-scatter ``self.grads`` so that this rank holds the SUM of its
     shard of everybody's gradients, divide by N, and copy that shard into ``self.grad_host``
     (``copy_(..., non_blocking=True)``: asynchronous on a GPU). This is the 2Ψ/N bytes down.
06.2 ``host_update()``: on the host only: the gradient of ``self.master`` is ``self.grad_host`` in
     the master's dtype; one ``self.optimizer.step()``; cast the new master into this rank's shard
     of ``self.flat.data`` (the 2Ψ/N bytes up); all-gather so every rank has all new parameters.
     It must not read ``self.grads`` (the device gradients are gone by then, in ZeRO-Offload).

Tools: ``self.flat.shard(buffer)`` (this rank's slice, a view), ``zerolab.comm.reduce_scatter(output,
input, group=...)`` and ``zerolab.comm.all_gather(output, input, group=...)`` (output may be the
rank's own slice of input, as in exercise 03). On a GPU, wait for the asynchronous copy before the
host reads ``self.grad_host`` (``torch.cuda.current_stream().synchronize()``).
Grade your work: ``make grade`` or ``zerolab.grade.check("06")``.
"""
import torch
import torch.distributed as dist

from zerolab import comm
from zerolab.flat import FlatParams, unique_trainable
from zerolab.offload import host_buffer, host_optimizer
from zerolab.shard_optim import master_dtype


class OffloadedAdam:
    """``opt = OffloadedAdam(model.parameters(), lr=1e-3, param_dtype=torch.bfloat16)``; then
    ``loss.backward(); opt.step(); opt.zero_grad()``. ``self.fused``: torch's fused CPU AdamW in use."""

    def __init__(self, params, *, lr, param_dtype=None, group=None):
        self.group = group
        self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        params = unique_trainable(params)
        originals = [p.detach().clone() for p in params]            # exact values, before any cast
        self.flat = FlatParams(params, self.world_size, self.rank, dtype=param_dtype)
        self.grads = self.flat.new_buffer()                          # device: full gradients
        for p, g in zip(self.flat.params, self.flat.views(self.grads)):
            p.grad = g
        own = self.flat.shard(self.flat.data)
        self.grad_host = host_buffer(own.numel(), own.dtype, like=own)            # host: 2Ψ/N (bf16)
        self.master = self.flat.shard_from(originals, master_dtype(own.dtype)).cpu()  # host: 4Ψ/N
        self.optimizer, self.fused = host_optimizer([self.master], torch.optim.AdamW, lr=lr)  # host: 8Ψ/N

    @torch.no_grad()
    def offload_gradients(self):
        """06.1: average shard r of the gradients over the ranks and send it to the host."""
        raise NotImplementedError(
            "Exercise 06.1: own = self.flat.shard(self.grads); comm.reduce_scatter(own, self.grads, "
            "group=self.group); divide own by self.world_size; self.grad_host.copy_(own, non_blocking=True).")

    @torch.no_grad()
    def host_update(self):
        """06.2: update the fp32 master on the host, bring the new shard back, all-gather."""
        raise NotImplementedError(
            "Exercise 06.2: self.master.grad = self.grad_host.to(self.master.dtype); "
            "self.optimizer.step(); self.master.grad = None; copy self.master into "
            "self.flat.shard(self.flat.data) (the cast); comm.all_gather(self.flat.data, that shard, "
            "group=self.group).")

    def step(self):
        self.offload_gradients()
        self.host_update()

    def zero_grad(self):
        self.grads.zero_()

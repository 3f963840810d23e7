"""Worked answers to exercise 06: the offloaded optimizer step (see lesson 06).
zerolab.offload is the full version (several buckets, gradients sent during backward, the fp32
workspace, pinned staging, delayed parameter update)."""
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
        own = self.flat.shard(self.grads)                  # rank r's slice is the reduce-scatter's output
        comm.reduce_scatter(own, self.grads, group=self.group)
        own.div_(self.world_size)                          # sum -> average
        self.grad_host.copy_(own, non_blocking=True)       # 2Ψ/N bytes down (async D2H on a GPU)

    @torch.no_grad()
    def host_update(self):
        if self.grads.is_cuda:
            torch.cuda.current_stream().synchronize()      # the D2H copy has landed
        self.master.grad = self.grad_host.to(self.master.dtype)   # upcast on the host
        self.optimizer.step()                              # master, m, v: host, shard-sized
        self.master.grad = None
        own = self.flat.shard(self.flat.data)
        own.copy_(self.master)                             # cast to the compute dtype; 2Ψ/N bytes up
        comm.all_gather(self.flat.data, own, group=self.group)

    def step(self):
        self.offload_gradients()
        self.host_update()

    def zero_grad(self):
        self.grads.zero_()

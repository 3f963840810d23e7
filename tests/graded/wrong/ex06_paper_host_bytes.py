"""Wrong answer to exercise 06: the delayed update is right; the host bytes are the paper's
(2 + 12) bytes per owned parameter (gradient shard, fp32 master, two moments), not what the engine
keeps on the host.

Caught by: test_host_bytes_per_element_measured."""
import threading

import torch
import torch.distributed as dist

from zerolab import comm, models
from zerolab.flat import FlatParams, unique_trainable
from zerolab.offload import host_buffer, host_optimizer
from zerolab.shard_optim import master_dtype


class DelayedOffloadAdam:
    def __init__(self, params, *, lr, param_dtype=None, group=None):
        self.group = group
        self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        params = unique_trainable(params)
        originals = [p.detach().clone() for p in params]
        self.flat = FlatParams(params, self.world_size, self.rank, dtype=param_dtype)
        self.grads = self.flat.new_buffer()
        for p, g in zip(self.flat.params, self.flat.views(self.grads)):
            p.grad = g
        own = self.flat.shard(self.flat.data)
        self.grad_host = host_buffer(own.numel(), own.dtype, like=own)
        self.master = self.flat.shard_from(originals, master_dtype(own.dtype)).cpu()
        self.optimizer, self.fused = host_optimizer([self.master], torch.optim.AdamW, lr=lr)
        self.job = None
        self.unpublished = False

    @torch.no_grad()
    def step(self):
        own = self.flat.shard(self.grads)
        comm.reduce_scatter(own, self.grads, group=self.group)
        own.div_(self.world_size)
        self._finish()
        self.grad_host.copy_(own, non_blocking=True)
        if self.grads.is_cuda:
            torch.cuda.current_stream().synchronize()

        self.master.grad = self.grad_host.to(self.master.dtype, copy=True)
        self.job = threading.Thread(target=self._update, name="host-update", daemon=True)
        self.job.start()
        self.unpublished = True

    def _update(self):
        self.optimizer.step()
        self.master.grad = None

    def _finish(self):
        if self.job is not None:
            self.job.join()
            self.job = None
        if self.unpublished:
            own = self.flat.shard(self.flat.data)
            own.copy_(self.master)
            comm.all_gather(self.flat.data, own, group=self.group)
            self.unpublished = False

    def flush(self):
        self._finish()

    def zero_grad(self):
        self.grads.zero_()



def host_bytes_per_element(param_dtype):
    return 2 + 12      # ZeRO-Offload, Sec. 4.1: 2Ψ/N gradients + 12Ψ/N optimizer states on the host

"""Wrong answer to exercise 06: no delay at all: step() offloads, updates on the host and publishes
at once. Correct ZeRO-Offload training, but not the delayed update the exercise asks for: nothing
overlaps, and the parameters are not one update behind.

Caught by: test_one_update_behind_from_host_copies."""
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

    @torch.no_grad()
    def step(self):
        own = self.flat.shard(self.grads)
        comm.reduce_scatter(own, self.grads, group=self.group)
        own /= self.world_size
        self.grad_host.copy_(own)
        self.master.grad = self.grad_host.to(self.master.dtype)
        self.optimizer.step()
        self.master.grad = None
        mine = self.flat.shard(self.flat.data)
        mine.copy_(self.master)
        comm.all_gather(self.flat.data, mine, group=self.group)

    def flush(self):
        pass

    def zero_grad(self):
        self.grads.zero_()


def host_bytes_per_element(param_dtype):
    import zerolab
    model = models.build("gpt")
    engine = zerolab.initialize(model, stage=2, offload="optimizer", lr=1e-3, param_dtype=param_dtype)
    engine.backward(engine(*models.batch("gpt", seed=dist.get_rank(), model=model)))
    engine.step()
    return engine.placement()["host"] / sum(b.shard_numel for b in engine.buckets)

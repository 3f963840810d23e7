"""Wrong answer to exercise 06: the delayed update, but the master's gradient is the device shard
converted with .to(master dtype): a copy for bf16, the very same tensor for float64. The background
update then reads device gradients that the next backward (here: a wipe) overwrites.

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
        self.worker = None
        self.new_values = False

    @torch.no_grad()
    def step(self):
        own = self.flat.shard(self.grads)
        comm.reduce_scatter(own, self.grads, group=self.group)
        own.div_(self.world_size)
        self.flush()
        self.grad_host.copy_(own, non_blocking=True)
        self.master.grad = own.to(self.master.dtype)
        self.worker = threading.Thread(target=self.optimizer.step)
        self.worker.start()
        self.new_values = True

    @torch.no_grad()
    def flush(self):
        if self.worker is not None:
            self.worker.join()
            self.worker = None
        if self.new_values:
            shard = self.flat.shard(self.flat.data)
            shard.copy_(self.master)
            comm.all_gather(self.flat.data, shard, group=self.group)
            self.new_values = False

    def zero_grad(self):
        self.grads.zero_()


def host_bytes_per_element(param_dtype):
    import zerolab
    model = models.build("gpt")
    engine = zerolab.initialize(model, stage=2, offload="optimizer", lr=1e-3, param_dtype=param_dtype)
    engine.backward(engine(*models.batch("gpt", seed=dist.get_rank(), model=model)))
    engine.step()
    return engine.placement()["host"] / sum(b.shard_numel for b in engine.buckets)

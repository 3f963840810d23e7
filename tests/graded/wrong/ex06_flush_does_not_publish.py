"""Wrong answer to exercise 06: flush() waits for the running update but forgets to publish it:
the device keeps parameters one update behind the masters after flush(), so an evaluation or a
save right after training misses the last step.

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
        self.thread = None
        self.fresh = False

    def _publish(self):
        shard = self.flat.shard(self.flat.data)
        shard.copy_(self.master)
        comm.all_gather(self.flat.data, shard, group=self.group)

    @torch.no_grad()
    def step(self):
        own = self.flat.shard(self.grads)
        comm.reduce_scatter(own, self.grads, group=self.group)
        own.div_(self.world_size)
        if self.thread is not None:
            self.thread.join()
        if self.fresh:
            self._publish()
        self.grad_host.copy_(own)
        self.master.grad = self.grad_host.to(self.master.dtype, copy=True)
        self.thread = threading.Thread(target=self.optimizer.step, daemon=True)
        self.thread.start()
        self.fresh = True

    def flush(self):
        if self.thread is not None:
            self.thread.join()
            self.thread = None

    def zero_grad(self):
        self.grads.zero_()


def host_bytes_per_element(param_dtype):
    import zerolab
    model = models.build("gpt")
    engine = zerolab.initialize(model, stage=2, offload="optimizer", lr=1e-3, param_dtype=param_dtype)
    engine.backward(engine(*models.batch("gpt", seed=dist.get_rank(), model=model)))
    engine.step()
    return engine.placement()["host"] / sum(b.shard_numel for b in engine.buckets)

"""Wrong answer to exercise 06: the reduced gradient shard is divided by dist.get_world_size(), the
world's size, not the group's: the right average whenever the group is the world; half the gradient
when two groups of two share four ranks.

Caught by: test_group_of_two_beside_another."""
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
        self.job = None                                      # the update running in the background
        self.unpublished = False                             # an update the device does not have yet

    @torch.no_grad()
    def step(self):
        own = self.flat.shard(self.grads)
        comm.reduce_scatter(own, self.grads, group=self.group)   # this rank's shard of the sum
        own.div_(dist.get_world_size())
        self._finish()                                       # the previous update: done, published;
        self.grad_host.copy_(own, non_blocking=True)         # only now may grad_host be overwritten
        if self.grads.is_cuda:
            torch.cuda.current_stream().synchronize()        # the copy has landed before the thread reads
        # The thread reads its own fp32 copy: the host buffer may be refilled by the next step.
        self.master.grad = self.grad_host.to(self.master.dtype, copy=True)
        self.job = threading.Thread(target=self._update, name="host-update", daemon=True)
        self.job.start()                                     # overlaps the next forward/backward
        self.unpublished = True

    def _update(self):
        self.optimizer.step()                                # host: master, m, v
        self.master.grad = None

    def _finish(self):
        if self.job is not None:
            self.job.join()
            self.job = None
        if self.unpublished:
            own = self.flat.shard(self.flat.data)
            own.copy_(self.master)                           # cast; 2Ψ/N bytes up
            comm.all_gather(self.flat.data, own, group=self.group)
            self.unpublished = False

    def flush(self):
        self._finish()

    def zero_grad(self):
        self.grads.zero_()


def host_bytes_per_element(param_dtype):
    import zerolab
    n, rank = dist.get_world_size(), dist.get_rank()
    model = models.build("gpt")
    engine = zerolab.initialize(model, stage=2, offload="optimizer", lr=1e-3, param_dtype=param_dtype)
    engine.backward(engine(*models.batch("gpt", seed=rank, model=model)))
    engine.step()
    owned = sum(b.shard_numel for b in engine.buckets)      # Ψ/N per bucket, padding included
    return engine.placement()["host"] / owned

"""Worked answers to exercise 03: ZeRO-1 (see lesson 03). zerolab.zero1.Zero1Optimizer is the full
version (param groups, mixed precision through zerolab.shard_optim.ShardOptimizer, ring reduce)."""
import torch
import torch.distributed as dist

from zerolab import comm
from zerolab.flat import FlatParams


def shard_range(numel, world_size, rank):
    per_rank = -(-numel // world_size)          # ceil: the padded buffer is world_size * per_rank
    return rank * per_rank, (rank + 1) * per_rank


class Zero1Optimizer:
    """ZeRO-1 in a plain loop::

        opt = Zero1Optimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
        loss.backward(); opt.step(); opt.zero_grad()
    """

    def __init__(self, params, optimizer_class, group=None, **defaults):
        self.group = group
        self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        params = [p for p in params if p.requires_grad]
        self.flat = FlatParams(params, self.world_size, self.rank)  # params: views into flat.data
        self.grads = self.flat.new_buffer()                          # grads: views into this buffer
        for p, g in zip(self.flat.params, self.flat.views(self.grads)):
            p.grad = g
        self.local = self.make_local_optimizer(optimizer_class, **defaults)

    def make_local_optimizer(self, optimizer_class, **defaults):
        lo, hi = shard_range(self.flat.numel, self.world_size, self.rank)
        self.shard = self.flat.data[lo:hi]               # a view: updating it updates the params
        self.grad_shard = self.grads[lo:hi]
        return optimizer_class([self.shard], **defaults)  # state: 1/N of the parameters

    @torch.no_grad()
    def step(self):
        # Rank r receives the sum over ranks of slice r: half an all-reduce, (N-1)/N of the bytes.
        comm.reduce_scatter(self.grad_shard, self.grads, group=self.group)
        self.grad_shard.div_(self.world_size)
        self.shard.grad = self.grad_shard
        self.local.step()                                 # Adam on the shard only
        self.shard.grad = None
        # The other half of the all-reduce, on the updated parameters instead of the gradients.
        comm.all_gather(self.flat.data, self.shard, group=self.group)

    def zero_grad(self):
        self.grads.zero_()

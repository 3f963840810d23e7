"""Wrong answer to exercise 05: the schedule without prefetch. Every block is gathered, blocking,
right when its forward or its backward starts: right order, right memory, right values, but each
all-gather stalls the rank instead of running under the previous block's compute."""
import torch
import torch.distributed as dist

from zerolab.flat import unique_trainable
from zerolab.units import build_units
from zerolab.zero3 import free, gather, reduce_scatter_grads, register_pre_backward


class Zero3Schedule:
    def __init__(self, model, *, group=None, prefetch=True):
        self.group, self.prefetch = group, prefetch
        self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        trainable = unique_trainable(model.parameters())
        self.units = build_units(model, None, trainable, world_size=self.world_size, rank=self.rank,
                                 dtype=trainable[0].dtype, persist_numel=0)
        self.grad_shards = [torch.zeros_like(u.shard) for u in self.units]
        for u in self.units:
            free(u)
        self.setup(model)

    def setup(self, model):
        self.blocks = [u for u in self.units if u.module is not None]
        self.root = [u for u in self.units if u.module is None]
        self.count = {}
        self.running = []
        model.register_forward_pre_hook(self.start_of_forward)
        for b in self.blocks:
            b.module.register_forward_pre_hook(lambda m, args, b=b: gather(b, group=self.group))
            b.module.register_forward_hook(lambda m, args, out, b=b: self.forward_done(b, out))
            for p in b.flat.params:
                p.register_post_accumulate_grad_hook(lambda p, b=b: self.one_grad(b))
        for r in self.root:
            for p in r.flat.params:
                p.register_post_accumulate_grad_hook(lambda p, r=r: self.one_grad(r))

    def start_of_forward(self, module, args):
        self.count = {u.index: 0 for u in self.units}
        for r in self.root:
            gather(r, group=self.group)

    def forward_done(self, b, out):
        free(b)
        register_pre_backward(out, lambda: self.before_backward(b))

    def before_backward(self, b):
        if not b.full.untyped_storage().nbytes():
            gather(b, group=self.group)

    @torch.no_grad()
    def one_grad(self, u):
        self.count[u.index] += 1
        if self.count[u.index] < len(u.flat.params):
            return
        flat_grad = u.flat.new_buffer()
        for p, v in zip(u.flat.params, u.flat.views(flat_grad)):
            if p.grad is not None:
                v.copy_(p.grad)
            p.grad = None
        free(u)
        if len(self.running) == 2:
            self.wait_oldest()
        self.running.append((u, flat_grad, reduce_scatter_grads(u, flat_grad, group=self.group)))

    def wait_oldest(self):
        u, g, work = self.running.pop(0)
        work.wait()
        self.grad_shards[u.index] += u.flat.shard(g) / self.world_size

    def finish(self):
        while self.running:
            self.wait_oldest()
        for u in self.units:
            free(u)

    def zero_grad(self):
        for g in self.grad_shards:
            g.zero_()


def traffic_ratio(unit_numels, root_numel):
    b = sum(unit_numels)
    return (3 * b + 2 * root_numel) / (2 * b + 2 * root_numel)

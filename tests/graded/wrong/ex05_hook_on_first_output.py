"""Wrong answer to exercise 05: the pre-backward hook goes on the block's output tensor (on its first
element when a block returns several): right on TinyGPT, whose blocks return one tensor, but a
block returning a dict (hidden states and more, as real models' layers do) breaks it."""
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
        self.next_work = None
        self.left = {}
        self.rs = []
        model.register_forward_pre_hook(self.begin)
        for i, b in enumerate(self.blocks):
            b.module.register_forward_pre_hook(lambda m, a, i=i: self.enter(i, +1))
            b.module.register_forward_hook(lambda m, a, out, i=i: self.leave(i, out))
        for u in self.units:
            for p in u.flat.params:
                p.register_post_accumulate_grad_hook(lambda p, u=u: self.arrived(u))

    def begin(self, module, args):
        self.left = {u.index: len(u.flat.params) for u in self.units}
        for u in self.units:
            if u.module is None:
                gather(u, group=self.group)
        self.next_work = (0, gather(self.blocks[0], group=self.group, async_op=True)) if self.prefetch else None

    def enter(self, i, step):
        if self.next_work is not None and self.next_work[0] == i:
            self.next_work[1].wait()
            self.next_work = None
        if not self.blocks[i].full.untyped_storage().nbytes():
            gather(self.blocks[i], group=self.group)
        j = i + step
        if self.prefetch and 0 <= j < len(self.blocks) and not self.blocks[j].full.untyped_storage().nbytes():
            self.next_work = (j, gather(self.blocks[j], group=self.group, async_op=True))

    def leave(self, i, out):
        free(self.blocks[i])
        t = out if isinstance(out, torch.Tensor) else out[0]
        t.register_hook(lambda grad: self.enter(i, -1))

    @torch.no_grad()
    def arrived(self, u):
        self.left[u.index] -= 1
        if self.left[u.index]:
            return
        g = u.flat.new_buffer()
        for p, v in zip(u.flat.params, u.flat.views(g)):
            if p.grad is not None:
                v.copy_(p.grad)
                p.grad = None
        free(u)
        while len(self.rs) >= 1:
            self.take(*self.rs.pop(0))
        self.rs.append((u, g, reduce_scatter_grads(u, g, group=self.group)))

    def take(self, u, g, work):
        work.wait()
        self.grad_shards[u.index] += u.flat.shard(g) / self.world_size

    def finish(self):
        while self.rs:
            self.take(*self.rs.pop(0))
        if self.next_work is not None:
            self.next_work[1].wait()
            self.next_work = None
        for u in self.units:
            free(u)

    def zero_grad(self):
        for g in self.grad_shards:
            g.zero_()


def traffic_ratio(unit_numels, root_numel):
    psi = sum(unit_numels) + root_numel
    return (3 * sum(unit_numels) + 2 * root_numel) / (2 * psi)

"""Wrong answer to exercise 05: each block, gathered for its forward, stays gathered until its
backward is done (it saves the second all-gather). Right values, prefetch and all; but the whole
model is gathered at the end of forward: the memory ZeRO-3 exists to save."""
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
        self.handles, self.seen, self.inflight = {}, {}, []
        model.register_forward_pre_hook(self._begin)
        for i, u in enumerate(self.blocks):
            u.module.register_forward_pre_hook(lambda m, a, i=i: self._use(i, i + 1))
            u.module.register_forward_hook(self._after(i))
        for u in self.units:
            for p in u.flat.params:
                p.register_post_accumulate_grad_hook(lambda p, u=u: self._grad(u, p))

    def _after(self, i):
        def hook(module, args, out):
            register_pre_backward(out, lambda: self._use(i, i - 1))
        return hook

    def _gathered(self, u):
        return u.full.untyped_storage().nbytes() > 0

    def _begin(self, module, args):
        self.seen = {u.index: set() for u in self.units}
        for u in self.units:
            if u.module is None:
                gather(u, group=self.group)
        if self.blocks:
            self._prefetch(self.blocks[0])

    def _prefetch(self, u):
        if self.prefetch and not self._gathered(u) and u.index not in self.handles:
            self.handles[u.index] = gather(u, group=self.group, async_op=True)

    def _use(self, i, nxt):
        u = self.blocks[i]
        if u.index in self.handles:
            self.handles.pop(u.index).wait()
        elif not self._gathered(u):
            gather(u, group=self.group)
        if 0 <= nxt < len(self.blocks):
            self._prefetch(self.blocks[nxt])

    @torch.no_grad()
    def _grad(self, u, p):
        self.seen[u.index].add(id(p))
        if len(self.seen[u.index]) != len(u.flat.params):
            return
        g = u.flat.new_buffer()
        for q, v in zip(u.flat.params, u.flat.views(g)):
            if q.grad is not None:
                v.copy_(q.grad)
                q.grad = None
        free(u)
        if self.inflight:
            self._done(*self.inflight.pop(0))
        self.inflight.append((u, g, reduce_scatter_grads(u, g, group=self.group)))

    def _done(self, u, g, work):
        work.wait()
        self.grad_shards[u.index].add_(u.flat.shard(g), alpha=1 / self.world_size)

    def finish(self):
        while self.inflight:
            self._done(*self.inflight.pop(0))
        for i, h in list(self.handles.items()):
            h.wait()
        self.handles = {}
        for u in self.units:
            free(u)

    def zero_grad(self):
        for g in self.grad_shards:
            g.zero_()


def traffic_ratio(unit_numels, root_numel):
    blocks = sum(unit_numels)
    total = blocks + root_numel
    return (3 * blocks + 2 * root_numel) / (2 * total)

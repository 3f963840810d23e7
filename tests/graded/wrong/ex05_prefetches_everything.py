"""Wrong answer to exercise 05: "prefetch as early as possible": every block's all-gather is started
when the model's forward starts, and again for backward when backward reaches the last block. Right
order of use and right values; but all blocks are gathered at once, twice a step."""
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
        self.work = {}
        self.got = {}
        self.pending = []
        model.register_forward_pre_hook(self.forward_starts)
        for k, b in enumerate(self.blocks):
            b.module.register_forward_pre_hook(lambda m, a, b=b: self.wait(b))
            b.module.register_forward_hook(lambda m, a, o, k=k: self.forward_ends(k, o))
        for u in self.units:
            for p in u.flat.params:
                p.register_post_accumulate_grad_hook(lambda p, u=u: self.grad_done(u))

    def forward_starts(self, module, args):
        self.got = {u.index: 0 for u in self.units}
        for u in self.units:
            if u.module is None:
                gather(u, group=self.group)
        self.prefetch_all()

    def prefetch_all(self):
        for b in self.blocks:
            if not b.full.untyped_storage().nbytes() and b.index not in self.work:
                self.work[b.index] = gather(b, group=self.group, async_op=self.prefetch)

    def wait(self, b):
        w = self.work.pop(b.index, None)
        if w is not None:
            w.wait()
        if not b.full.untyped_storage().nbytes():
            gather(b, group=self.group)

    def forward_ends(self, k, out):
        free(self.blocks[k])
        last = k == len(self.blocks) - 1
        register_pre_backward(out, lambda: self.backward_starts(k, last))

    def backward_starts(self, k, last):
        if last:
            self.prefetch_all()
        self.wait(self.blocks[k])

    @torch.no_grad()
    def grad_done(self, u):
        self.got[u.index] += 1
        if self.got[u.index] == len(u.flat.params):
            buf = torch.cat([p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel(), dtype=buf_dtype(u))
                             for p in u.flat.params] + [torch.zeros(u.flat.padding, dtype=buf_dtype(u))])
            for p in u.flat.params:
                p.grad = None
            free(u)
            if self.pending:
                self.collect(*self.pending.pop(0))
            self.pending.append((u, buf, reduce_scatter_grads(u, buf, group=self.group)))

    def collect(self, u, buf, h):
        h.wait()
        self.grad_shards[u.index] += u.flat.shard(buf) / self.world_size

    def finish(self):
        for u, buf, h in self.pending:
            self.collect(u, buf, h)
        self.pending = []
        for u in self.units:
            free(u)

    def zero_grad(self):
        for g in self.grad_shards:
            g.zero_()


def buf_dtype(u):
    return u.shard.dtype


def traffic_ratio(unit_numels, root_numel):
    return (1.5 * sum(unit_numels) + root_numel) / (sum(unit_numels) + root_numel)

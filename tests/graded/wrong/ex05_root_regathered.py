"""Wrong answer to exercise 05: the root is freed at the end of the forward, like a block, and gathered
again when backward starts. Values, prefetch and memory rules hold; but the root is all-gathered
twice a step where once is enough (nothing forces it out between forward and backward).

Caught by: test_collectives_and_bytes."""
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
        self.root = next((u for u in self.units if u.module is None), None)
        self.blocks = [u for u in self.units if u.module is not None]   # forward order
        self.pending = {}        # unit index -> all-gather handle not yet waited for
        self.inflight = []       # (unit, work) reduce-scatters, oldest first
        self.arrived = {}
        self.unit_of = {id(p): u for u in self.units for p in u.flat.params}
        model.register_forward_pre_hook(self._model_start)
        model.register_forward_hook(self._model_end)
        for i, u in enumerate(self.blocks):
            u.module.register_forward_pre_hook(lambda m, a, i=i: self._before_forward(i))
            u.module.register_forward_hook(lambda m, a, out, i=i: self._after_forward(i, out))
        for u in self.units:
            for p in u.flat.params:
                p.register_post_accumulate_grad_hook(self._grad_ready)

    # -- gather / free ---------------------------------------------------------------------
    def _ready(self, u):
        """Make u's parameters whole: wait for its prefetch, or gather it now (blocking)."""
        if u.index in self.pending:
            self.pending.pop(u.index).wait()
        elif not u.full.untyped_storage().nbytes():
            gather(u, group=self.group)

    def _start(self, u):
        """Prefetch: start u's all-gather without waiting (unless it is gathered already)."""
        if self.prefetch and u.index not in self.pending and not u.full.untyped_storage().nbytes():
            self.pending[u.index] = gather(u, group=self.group, async_op=True)

    # -- forward -----------------------------------------------------------------------------
    def _model_start(self, module, args):
        self.arrived = {u.index: set() for u in self.units}
        if self.root is not None:
            self._ready(self.root)               # embeddings, head: kept until their gradients
        if self.blocks:
            self._start(self.blocks[0])

    def _model_end(self, module, args, output):
        if torch.is_grad_enabled() and self.blocks:
            # Backward starts at the loss, with the head (root): the last block's all-gather starts
            # then, so that it runs under the head's backward (FSDP2's root pre-backward does the same).
            free(self.root)                      # gathered again when backward starts
            register_pre_backward(output, self._backward_start)

    def _backward_start(self):
        gather(self.root, group=self.group)
        self._start(self.blocks[-1])

    def _before_forward(self, i):
        self._ready(self.blocks[i])
        if i + 1 < len(self.blocks):
            self._start(self.blocks[i + 1])      # runs while block i computes

    def _after_forward(self, i, output):
        free(self.blocks[i])
        if torch.is_grad_enabled():
            register_pre_backward(output, lambda: self._before_backward(i))

    # -- backward ----------------------------------------------------------------------------
    def _before_backward(self, i):
        self._ready(self.blocks[i])              # gathered again: backward needs the weights
        if i > 0:
            self._start(self.blocks[i - 1])      # the block whose backward comes next

    @torch.no_grad()
    def _grad_ready(self, p):
        u = self.unit_of[id(p)]
        self.arrived[u.index].add(id(p))
        if len(self.arrived[u.index]) == len(u.flat.params):
            self._reduce(u)

    def _reduce(self, u):
        grad_full = u.flat.new_buffer()          # the unit's gradients, packed once complete
        for p, view in zip(u.flat.params, u.flat.views(grad_full)):
            if p.grad is not None:
                view.copy_(p.grad)
                p.grad = None
        free(u)
        if self.inflight:
            self._complete(*self.inflight.pop(0))   # at most two units of full-size gradients
        self.inflight.append((u, grad_full, reduce_scatter_grads(u, grad_full, group=self.group)))

    def _complete(self, u, grad_full, work):
        if work is not None:
            work.wait()
        self.grad_shards[u.index] += u.flat.shard(grad_full) / self.world_size

    @torch.no_grad()
    def finish(self):
        for u in self.units:                     # a unit whose gradients never all arrived
            if u.index in self.arrived and len(self.arrived[u.index]) < len(u.flat.params):
                self._reduce(u)
        while self.inflight:
            self._complete(*self.inflight.pop(0))
        for u in self.units:
            if u.index in self.pending:
                self.pending.pop(u.index).wait()
            free(u)
        self.arrived = {}

    def zero_grad(self):
        for g in self.grad_shards:
            g.zero_()


def traffic_ratio(unit_numels, root_numel):
    """Bytes one stage-3 step sends over the bytes data parallelism sends (same world size, same
    dtype): each block is gathered twice and reduce-scattered once (3 ring phases), the root is
    gathered once and reduce-scattered once (2); data parallelism all-reduces everything (2)."""
    blocks = sum(unit_numels)
    return (3 * blocks + 2 * root_numel) / (2 * (blocks + root_numel))

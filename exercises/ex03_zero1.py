"""Exercise 03 — ZeRO-1: partition the optimizer state (lesson 03).

You build a ZeRO-1 optimizer for a plain training loop, in fp32, in three steps:

03.1 ``shard_range``: which slice of a padded flat buffer a rank owns.
03.2 ``Zero1Optimizer.make_local_optimizer``: a torch optimizer over THIS rank's shard only, so
     that its state (Adam's two moments) is 1/N of the full state.
03.3 ``Zero1Optimizer.step``: reduce-scatter the gradients -> local update -> all-gather the params.

The flat buffers are given (``zerolab.flat.FlatParams``): the parameters are views into
``self.flat.data`` and their ``.grad`` views into ``self.grads``, both padded to a multiple of N.
Use ``zerolab.comm`` for the collectives (``comm.reduce_scatter(output, input, group=...)``,
``comm.all_gather(output, input, group=...)``).

Grade your work:  ``make grade`` or, in lesson 03, ``zerolab.grade.check("03")``. The graded tests
check that the state really is 1/N per rank, that training equals one process on the global batch,
and that the step uses a reduce-scatter and an all-gather (not an all-reduce).
"""
import torch
import torch.distributed as dist

from zerolab import comm
from zerolab.flat import FlatParams


def shard_range(numel, world_size, rank):
    """(start, end) of ``rank``'s shard of a flat buffer of ``numel`` elements padded with zeros to
    the SMALLEST multiple of ``world_size``: every rank owns the same number of elements, shards are
    contiguous, in rank order, and together cover the padded buffer."""
    raise NotImplementedError(
        "Exercise 03.1: each shard has ceil(numel / world_size) elements; rank r's starts at r times that.")


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
        """Return ``optimizer_class(..., **defaults)`` over this rank's shard of ``self.flat.data``
        (one 1-D tensor, a view, so that updating it updates the parameters in place)."""
        raise NotImplementedError(
            "Exercise 03.2: slice self.flat.data with shard_range(self.flat.numel, ...) and build the "
            "optimizer over that one slice; keep the slice (e.g. self.shard) for step().")

    @torch.no_grad()
    def step(self):
        """Average the gradients over ranks, but only for this rank's shard; update the shard; give
        every rank every updated shard."""
        raise NotImplementedError(
            "Exercise 03.3: comm.reduce_scatter into this rank's slice of self.grads (sum of that slice "
            "over ranks), divide by world_size, set it as the shard's .grad, self.local.step(), then "
            "comm.all_gather(self.flat.data, <this rank's slice of it>).")

    def zero_grad(self):
        self.grads.zero_()

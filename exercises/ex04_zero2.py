"""Exercise 04 — ZeRO-2: reduce-scatter gradients bucket by bucket during backward (lesson 04).

``Zero2Gradients`` is set up for you: the trainable parameters are cut into buckets (each a padded
``zerolab.flat.FlatParams``; the parameters are views into them), every rank has a persistent
gradient shard per bucket (``self.grad_shards[i]``, 1/N of bucket i), and a post-accumulate-grad
hook on every parameter calls :meth:`hook`. You write:

04.1 ``hook(param)``: move ``param.grad`` into its bucket's full-size buffer and free it; when the
     bucket's last gradient has arrived, launch the bucket's reduce-scatter WITHOUT waiting for it.
04.2 ``finish()``: wait for the launched reduce-scatters, average, add into the gradient shards and
     free the full-size buffers.

Afterwards no full-size gradient may remain anywhere: only ``self.grad_shards``.
Use ``zerolab.comm.reduce_scatter(output, input, group=..., async_op=True)``: it returns a handle
with ``.wait()``. Grade your work: ``make grade`` or ``zerolab.grade.check("04")``.
"""
import torch
import torch.distributed as dist

from zerolab import comm
from zerolab.flat import FlatParams
from zerolab.zero2 import make_buckets


class Zero2Gradients:
    """``grads = Zero2Gradients(model.parameters(), bucket_bytes=20000)``; then ``loss.backward()``;
    ``grads.finish()``; ``grads.grad_shards`` holds this rank's shard of the averaged gradients."""

    def __init__(self, params, bucket_bytes, group=None):
        self.group = group
        self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        params = [p for p in dict.fromkeys(params) if p.requires_grad]
        # Buckets in backward order (last layers first), each padded to a multiple of N.
        self.buckets = [FlatParams(ps, self.world_size, self.rank)
                        for ps in make_buckets(params[::-1], bucket_bytes, params[0].dtype)]
        self.grad_shards = [torch.zeros(b.shard_numel, dtype=b.dtype) for b in self.buckets]  # 1/N
        self.where = {id(p): (i, j) for i, b in enumerate(self.buckets) for j, p in enumerate(b.params)}
        self.full = [None] * len(self.buckets)      # bucket i's full-size gradient buffer, while alive
        self.arrived = [set() for _ in self.buckets]  # ids of the params whose grad bucket i has
        self.pending = []                           # (bucket index, async handle), launch order
        self.handles = [p.register_post_accumulate_grad_hook(self.hook) for p in params]

    @torch.no_grad()
    def hook(self, param):
        """Called by autograd once ``param.grad`` is complete for this backward."""
        raise NotImplementedError(
            "Exercise 04.1: i, j = self.where[id(param)]; allocate self.full[i] = "
            "self.buckets[i].new_buffer() if needed; add param.grad into self.buckets[i].view("
            "self.full[i], j); param.grad = None; record the arrival; when all of bucket i's params "
            "arrived, comm.reduce_scatter(bucket.shard(full), full, group=..., async_op=True) and "
            "append (i, handle) to self.pending.")

    @torch.no_grad()
    def finish(self):
        """After backward: complete every launched reduce-scatter."""
        raise NotImplementedError(
            "Exercise 04.2: for each (i, handle) in self.pending: handle.wait(); add the reduced shard "
            "divided by world_size into self.grad_shards[i]; self.full[i] = None. Then reset "
            "self.pending and self.arrived for the next backward.")

"""Worked answers to exercise 04: ZeRO-2 gradient buckets (see lesson 04). zerolab.zero2.Zero2Engine is
the full version (bounded in-flight buckets, unused parameters, no_sync, ring reduce-scatter)."""
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
        i, j = self.where[id(param)]
        bucket = self.buckets[i]
        if self.full[i] is None:
            self.full[i] = bucket.new_buffer()             # full size, this bucket only, transient
        bucket.view(self.full[i], j).add_(param.grad)
        param.grad = None                                  # the per-parameter full gradient is gone
        self.arrived[i].add(id(param))
        if len(self.arrived[i]) == len(bucket.params):     # last gradient of the bucket: reduce now,
            full = self.full[i]                            # while backward goes on with other layers
            handle = comm.reduce_scatter(bucket.shard(full), full, group=self.group, async_op=True)
            self.pending.append((i, handle))

    @torch.no_grad()
    def finish(self):
        for i, handle in self.pending:
            handle.wait()
            own = self.buckets[i].shard(self.full[i])      # rank r's slice now holds the sum
            self.grad_shards[i].add_(own / self.world_size)
            self.full[i] = None                            # free the full-size bucket buffer
        self.pending = []
        self.arrived = [set() for _ in self.buckets]

"""Worked answers to exercise 02: naive and bucketed gradient averaging (see lesson 02)."""
import torch.distributed as dist

from zerolab import comm
from zerolab.data_parallel import Bucket, assign_buckets
from zerolab.flat import unique_trainable


def broadcast_parameters(module, group=None):
    src = 0 if group is None else dist.get_global_rank(group, 0)
    for t in list(module.parameters()) + list(module.buffers()):
        comm.broadcast(t.data, src=src, group=group)      # tied weights twice: harmless, same data


def average_gradients(module, group=None):
    n = dist.get_world_size(group)
    for p in unique_trainable(module.parameters()):        # frozen skipped, tied weight once
        comm.all_reduce(p.grad, group=group)               # the sum over ranks ...
        p.grad.div_(n)                                     # ... over N: the mean


class BucketedAverager:
    def __init__(self, module, bucket_bytes, group=None):
        self.group, self.n = group, dist.get_world_size(group)
        params = unique_trainable(module.parameters())
        self.buckets = [Bucket(i, ps) for i, ps in enumerate(assign_buckets(params, bucket_bytes))]
        self.bucket_of = {}
        for b in self.buckets:
            for p, view in zip(b.params, b.views):
                p.grad = view                               # autograd accumulates into the bucket
                self.bucket_of[p] = b
                p.register_post_accumulate_grad_hook(self._ready)
        self._reset()

    def _reset(self):
        self.missing = [len(b.params) for b in self.buckets]   # grads not final yet, per bucket
        self.next, self.works = 0, []

    def _ready(self, param):
        # `param` is the parameter; its gradient already sits in the bucket view (param.grad).
        self.missing[self.bucket_of[param].index] -= 1
        while self.next < len(self.buckets) and self.missing[self.next] == 0:
            self._launch()

    def _launch(self):
        b = self.buckets[self.next]
        b.buffer.div_(self.n)                               # Σ g/N over ranks = the mean
        self.works.append(comm.all_reduce(b.buffer, group=self.group, async_op=True))
        self.next += 1

    def finish(self):
        while self.next < len(self.buckets):                # a bucket with an unused parameter
            self._launch()
        for w in self.works:
            w.wait()
        self._reset()

"""Worked answers to exercise 02: bucketed, overlapped gradient averaging with no_sync, and torch
DDP's buckets measured (see lesson 02). zerolab.data_parallel.BucketedGradSync is the full version."""
import contextlib

import torch
import torch.distributed as dist

from zerolab import comm
from zerolab.data_parallel import Bucket, assign_buckets
from zerolab.flat import unique_trainable


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
        self.sync = True
        self._reset()

    def _reset(self):
        self.missing = [len(b.params) for b in self.buckets]   # grads not final yet, per bucket
        self.next, self.works = 0, []

    def _ready(self, param):
        if not self.sync:
            return                                          # no_sync: accumulate locally only
        self.missing[self.bucket_of[param].index] -= 1
        while self.next < len(self.buckets) and self.missing[self.next] == 0:
            self._launch()                                  # in index order on every rank

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

    @contextlib.contextmanager
    def no_sync(self):
        self.sync = False
        try:
            yield
        finally:
            self.sync = True


def ddp_bucket_bytes(model, batches, bucket_cap_mb):
    from torch.nn.parallel import DistributedDataParallel as DDP
    ddp = DDP(model, bucket_cap_mb=bucket_cap_mb)
    seen = []

    def hook(state, bucket):                                # DDP calls it once per bucket it reduces
        buf = bucket.buffer()
        seen.append(buf.numel() * buf.element_size())
        fut = dist.all_reduce(buf, async_op=True).get_future()
        return fut.then(lambda f: f.value()[0].div_(dist.get_world_size()))

    ddp.register_comm_hook(None, hook)
    out = []
    for x, y in batches:
        seen.clear()
        ddp(x, y).backward()
        out.append(list(seen))
    return out

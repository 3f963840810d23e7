"""Wrong answer to exercise 02: buckets, but all of them all-reduced in finish(), after backward
(the hooks only note what arrived). Right means, one all-reduce per bucket; nothing overlaps with
backward."""
import contextlib

import torch.distributed as dist

from zerolab import comm
from zerolab.data_parallel import Bucket, assign_buckets
from zerolab.flat import unique_trainable


class BucketedAverager:
    def __init__(self, module, bucket_bytes, group=None):
        self.group = group
        params = unique_trainable(module.parameters())
        self.buckets = [Bucket(i, ps) for i, ps in enumerate(assign_buckets(params, bucket_bytes))]
        for b in self.buckets:
            for p, g in zip(b.params, b.views):
                p.grad = g
        self.syncing = True

    def finish(self):
        if not self.syncing:
            return
        n = dist.get_world_size(self.group)
        works = [comm.all_reduce(b.buffer, group=self.group, async_op=True) for b in self.buckets]
        for b, w in zip(self.buckets, works):
            w.wait()
            b.buffer /= n

    @contextlib.contextmanager
    def no_sync(self):
        self.syncing = False
        try:
            yield
        finally:
            self.syncing = True


def ddp_bucket_bytes(model, batches, bucket_cap_mb):
    from torch.nn.parallel import DistributedDataParallel as DDP
    ddp = DDP(model, bucket_cap_mb=bucket_cap_mb)
    sizes = []

    def hook(state, bucket):
        sizes.append(bucket.buffer().numel() * bucket.buffer().element_size())
        fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
        return fut.then(lambda f: f.value()[0] / dist.get_world_size())

    ddp.register_comm_hook(None, hook)
    result = []
    for x, y in batches:
        start = len(sizes)
        ddp(x, y).backward()
        result.append(sizes[start:])
    return result

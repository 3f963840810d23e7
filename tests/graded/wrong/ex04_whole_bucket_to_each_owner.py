"""Wrong answer to exercise 04: instead of cutting a bucket at the partition boundaries, the whole
bucket is reduced to each rank that owns part of it, and each owner keeps its part. Right values,
from inside backward, asynchronously, two buckets alive; but a bucket spanning k owners is sent k
times.

Caught by: test_each_slice_reduced_to_its_owner_during_backward."""
import torch
import torch.distributed as dist

from zerolab.flat import FlatParams, unique_trainable
from zerolab.zero2 import make_buckets


class Zero2Gradients:
    def __init__(self, params, *, bucket_bytes, group=None):
        self.group = group
        self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.params = unique_trainable(params)
        self.bucket_bytes = bucket_bytes
        self.flat = FlatParams(self.params, self.world_size, self.rank)
        self.grad_shard = torch.zeros(self.flat.shard_numel, dtype=self.flat.dtype)
        self.setup()

    def setup(self):
        offset = {id(p): off for p, off in zip(self.params, self.flat.offsets)}
        self.buckets = []                   # (params, lo, hi): consecutive params = one flat range
        self.where = {}                     # id(param) -> bucket index
        for ps in make_buckets(self.params[::-1], self.bucket_bytes, self.flat.dtype):
            lo = min(offset[id(p)] for p in ps)
            hi = max(offset[id(p)] + p.numel() for p in ps)
            for p in ps:
                self.where[id(p)] = len(self.buckets)
            self.buckets.append((ps, lo, hi))
        self.offset = offset
        self.buffers = {}                   # bucket -> its full-size gradient buffer, while alive
        self.inflight = []                  # (bucket, [(owner, lo, hi, work)]), oldest first
        self._reset()
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._ready)

    def _reset(self):
        self.missing = [len(ps) for ps, _, _ in self.buckets]
        self.launched = [False] * len(self.buckets)

    @torch.no_grad()
    def _ready(self, p):
        b = self.where[id(p)]
        _, lo, _ = self.buckets[b]
        buf = self._buffer(b)
        start = self.offset[id(p)] - lo
        buf[start:start + p.numel()].copy_(p.grad.reshape(-1))
        p.grad = None                                   # the parameter's full gradient is gone
        self.missing[b] -= 1
        if self.missing[b] == 0:
            self._launch(b)

    def _buffer(self, b):
        if b not in self.buffers:
            _, lo, hi = self.buckets[b]
            self.buffers[b] = torch.zeros(hi - lo, dtype=self.flat.dtype)
        return self.buffers[b]

    def _launch(self, b):
        if self.inflight:                               # double buffer: the older bucket completes
            self._complete(*self.inflight.pop(0))       # before a third could be alive
        _, lo, hi = self.buckets[b]
        buf, s, works = self.buffers[b], self.flat.shard_numel, []
        owners = [q for q in range(self.world_size) if max(lo, q * s) < min(hi, (q + 1) * s)]
        # each owner its own copy of the bucket, copied before any reduce changes the bucket in place
        copies = [buf] + [buf.clone() for _ in owners[1:]]
        for q, whole in zip(owners, copies):            # the owners this bucket overlaps
            a, z = max(lo, q * s), min(hi, (q + 1) * s)
            if a < z:                                   # Sec. 5.2: reduce to the owner, not all-reduce
                dst = q if self.group is None else dist.get_global_rank(self.group, q)
                work = dist.reduce(whole, dst=dst, group=self.group, async_op=True)
                works.append((q, a, z, work, whole))
        self.launched[b] = True
        self.inflight.append((b, works))

    def _complete(self, b, works):
        _, lo, _ = self.buckets[b]
        s = self.flat.shard_numel
        for q, a, z, work, whole in works:
            work.wait()
            if q == self.rank:                          # only the owner's copy holds the sum
                mine = self.rank * s
                self.grad_shard[a - mine:z - mine] += whole[a - lo:z - lo] / self.world_size
        del self.buffers[b]                             # free the full-size bucket

    @torch.no_grad()
    def finish(self):
        for b in range(len(self.buckets)):              # a bucket with an unused parameter: zeros
            if not self.launched[b]:
                for p in self.buckets[b][0]:
                    if p.grad is not None:
                        self._ready(p)
                if not self.launched[b]:
                    self._buffer(b)
                    self._launch(b)
        while self.inflight:
            self._complete(*self.inflight.pop(0))
        self._reset()

    def zero_grad(self):
        self.grad_shard.zero_()


def reduce_calls(bucket_numels, world_size):
    total = sum(bucket_numels)
    s = -(-total // world_size)                         # S: the padded partition's shard size
    calls, lo = 0, 0
    for n in bucket_numels:
        hi = lo + n
        calls += sum(1 for q in range(world_size) if max(lo, q * s) < min(hi, (q + 1) * s))
        lo = hi
    return calls                                        # at most buckets + N - 1

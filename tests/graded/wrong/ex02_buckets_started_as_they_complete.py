"""Wrong answer to exercise 02: each bucket's all-reduce starts as soon as that bucket is complete,
whichever bucket it is, instead of in bucket order. Right wherever every rank completes its buckets
in the same order (the unused layer of the graded "spare" model sits in bucket 0, whose all-reduce
starts first anyway); but when ranks leave different layers unused in middle buckets, each rank
starts its buckets in its own order, and since collectives are matched by the order they are
started in, one rank's bucket 2 is summed with another's bucket 1: wrong means (from an independent
review).

Caught by: test_ranks_leave_different_buckets_unused."""
import contextlib

import torch
import torch.distributed as dist

from zerolab.data_parallel import Bucket, assign_buckets
from zerolab.flat import unique_trainable


def _tensors(value):
    """Every tensor in a forward's output (a tensor, or lists, tuples and dicts of them)."""
    if torch.is_tensor(value):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


def _reached(outputs):
    """The ids of the leaves (parameters) the autograd graph behind ``outputs`` accumulates into:
    exactly the parameters the coming backward will hand a gradient (DDP's find_unused_parameters
    walks the same graph; Li et al., VLDB 2020, Sec. 3.2.3)."""
    found, seen = set(), set()
    stack = [t.grad_fn for t in _tensors(outputs) if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        leaf = getattr(node, "variable", None)      # an AccumulateGrad node: its parameter
        if leaf is not None:
            found.add(id(leaf))
        stack.extend(child for child, _ in node.next_functions)
    return found


class BucketedAverager:
    def __init__(self, module, bucket_bytes, group=None):
        self.group, self.n = group, dist.get_world_size(group)
        params = unique_trainable(module.parameters())
        self.buckets = [Bucket(i, ps) for i, ps in enumerate(assign_buckets(params, bucket_bytes))]
        self.bucket_of = {}
        for b in self.buckets:
            for p, view in zip(b.params, b.views):
                if p.grad is not None:
                    view.copy_(p.grad)
                p.grad = view                               # autograd accumulates into the bucket
                self.bucket_of[p] = b
                p.register_post_accumulate_grad_hook(self._ready)
        module.register_forward_hook(self._after_forward)
        self.sync, self.reached = True, None
        self._reset()

    def _after_forward(self, module, args, output):
        if torch.is_grad_enabled():                         # what the next backward will reach
            self.reached = (self.reached or set()) | _reached(output)

    def _launch_bucket(self, i):
        b = self.buckets[i]
        b.buffer.div_(self.n)
        self.works.append(dist.all_reduce(b.buffer, group=self.group, async_op=True))

    def _reset(self):
        self.started = set()
        self.missing = [len(b.params) for b in self.buckets]   # grads not final yet, per bucket
        self.next, self.works, self.done = 0, [], set()

    def _ready(self, param):
        if self.reached is not None:                        # the first gradient of this backward:
            reached, self.reached = self.reached, None      # parameters the forward did not use get
            if self.sync:                                   # none; their gradients are final already
                for p in self.bucket_of:
                    if id(p) not in reached:
                        self._count(p)
        if self.sync:
            self._count(param)

    def _count(self, param):
        if param in self.done:
            raise RuntimeError("a gradient arrived twice before finish(): call finish() after each "
                               "synchronising backward")
        self.done.add(param)
        self.missing[self.bucket_of[param].index] -= 1
        b = self.bucket_of[param].index
        if self.missing[b] == 0 and b not in self.started:   # launched as soon as it is complete
            self.started.add(b)
            self._launch_bucket(b)

    def _launch(self):
        b = self.buckets[self.next]
        b.buffer.div_(self.n)                               # Σ g/N over ranks = the mean
        self.works.append(dist.all_reduce(b.buffer, group=self.group, async_op=True))
        self.next += 1

    def finish(self):
        for i in range(len(self.buckets)):
            if i not in self.started:
                self.started.add(i)
                self._launch_bucket(i)
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

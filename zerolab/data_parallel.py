"""Data parallelism (stage 0): every rank holds the WHOLE model and trains it on its own data.

N ranks, each with a full replica: parameters, gradients and optimizer states (16 bytes/param
with Adam, the redundancy ZeRO removes; arXiv 1910.02054, Sec. 2). Each rank runs forward and
backward on its own micro-batch; the gradients are then AVERAGED over the ranks, so every rank
applies the same update and the replicas stay identical, and the result equals one process
training on the N micro-batches concatenated (for a loss that is a mean over samples).

Two ways to average, side by side:

* naive (:func:`allreduce_gradients`): after backward, one blocking all-reduce per gradient.
  Simple and correct; every byte waits for the whole backward, and a tiny tensor costs a
  whole collective's latency.
* bucketed + overlapped (:class:`BucketedGradSync`): gradients live in a few flat buckets
  (``p.grad`` is a view into its bucket); a post-accumulate-grad hook notices when every
  gradient of a bucket is final and starts that bucket's all-reduce asynchronously, while
  backward goes on computing earlier layers. Buckets are filled in REVERSE parameter order
  because backward produces the last layer's gradients first (torch DDP does the same).

Bytes per rank per step, both ways: a ring all-reduce of the Ψ-element gradient sends
2(N-1)/N x Ψ x (bytes per element) (reduce-scatter + all-gather, Sec. 7 of the ZeRO paper).

:class:`DataParallel` wraps a module in the plain torch idiom (call
``finish_gradient_synchronization()`` after backward); :mod:`zerolab.zero0` builds stage 0 of
``zerolab.initialize`` on it.
"""
import contextlib
import weakref

import torch
import torch.distributed as dist
import torch.nn as nn

from zerolab import comm
from zerolab.flat import unique_trainable


def _global_rank(group, rank):
    return rank if group is None else dist.get_global_rank(group, rank)


def broadcast_module(module, src=0, group=None):
    """Copy rank ``src``'s parameters AND buffers to every rank, one broadcast per dtype
    (the tensors are packed into one flat buffer first: one collective, not one per tensor)."""
    tensors = list({id(t): t for t in list(module.parameters()) + list(module.buffers())}.values())
    for dtype in dict.fromkeys(t.dtype for t in tensors):
        same = [t for t in tensors if t.dtype == dtype]
        flat = torch.cat([t.detach().reshape(-1) for t in same])
        comm.broadcast(flat, src=_global_rank(group, src), group=group)
        with torch.no_grad():
            for t, part in zip(same, flat.split([t.numel() for t in same])):
                t.copy_(part.view_as(t))


def allreduce_gradients(params, group=None, reduce_dtype=None):
    """NAIVE gradient averaging: for each trainable parameter (tied weights once, frozen ones
    skipped) one blocking all-reduce of its gradient, then divide by N. ``reduce_dtype``: reduce a
    copy in that dtype (e.g. fp32 for bf16 gradients), p.grad gets the mean rounded back. Returns
    {id(p): the mean in the reduce dtype} (p.grad itself when no copy was made)."""
    n, out = dist.get_world_size(group), {}
    for p in unique_trainable(params):
        if p.grad is None:            # unused in this step on this rank: it contributes zero
            p.grad = torch.zeros_like(p)
        g = p.grad if reduce_dtype in (None, p.grad.dtype) else p.grad.to(reduce_dtype)
        comm.all_reduce(g, group=group)         # sum over ranks: 2(N-1)/N x bytes sent
        g.div_(n)                               # ... and the sum becomes the mean
        if g is not p.grad:
            p.grad.copy_(g)
        out[id(p)] = g
    return out


def assign_buckets(params, bucket_bytes):
    """Group ``params`` into buckets of at most ``bucket_bytes`` (a larger parameter gets a bucket
    of its own), in REVERSE order, one dtype and device per bucket. Returns a list of lists."""
    if not isinstance(bucket_bytes, int) or bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be a positive int, got {bucket_bytes!r}")
    buckets, current, size = [], [], 0
    for p in reversed(list(params)):
        nbytes = p.numel() * p.element_size()
        if current and (size + nbytes > bucket_bytes or p.dtype != current[0].dtype
                        or p.device != current[0].device):
            buckets.append(current)
            current, size = [], 0
        current.append(p)
        size += nbytes
    if current:
        buckets.append(current)
    return buckets


class Bucket:
    """One flat gradient buffer; ``views[i]`` is ``params[i]``'s gradient inside it. ``reduced``:
    the buffer that was all-reduced, when it is a copy in another dtype (``reduce_dtype``)."""

    def __init__(self, index, params):
        self.index, self.params = index, params
        self.buffer = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype,
                                  device=params[0].device)
        self.views = list(v.view_as(p) for v, p in
                          zip(self.buffer.split([p.numel() for p in params]), params))
        self.reduced = None

    @property
    def nbytes(self):
        return self.buffer.numel() * self.buffer.element_size()


class BucketedGradSync:
    """Bucketed, overlapped gradient averaging for the trainable parameters of ``module``.

    After construction ``p.grad`` is a view into its bucket, so autograd accumulates straight into
    the flat buffers (no copy before the collective). Per synchronising backward:

    1. the hook on parameter p fires when p's gradient is final, and marks p ready;
    2. when every parameter of the next bucket in order is ready, its async all-reduce starts.
       Buckets start strictly in index order on every rank, so the ranks' collectives always
       match even if gradients become ready in a different order;
    3. :meth:`finish` starts any bucket not started yet (one whose parameter got no gradient in
       this backward: it contributes zeros), waits for all, and starts a new round.

    Tied weights and modules used twice: autograd sums every use of a leaf before its
    AccumulateGrad node runs, so the hook fires ONCE per backward for them (tests check this).
    It fires twice only when a second backward reaches the same gradient before :meth:`finish`
    (two backward calls, or reentrant activation checkpointing). While the bucket is still
    waiting that is harmless (the gradient just accumulates); once the bucket's all-reduce is in
    flight it would race with the network, so we raise instead of averaging the wrong numbers.
    """

    def __init__(self, module, *, bucket_bytes, group=None, reduce_dtype=None):
        self.group, self.reduce_dtype = group, reduce_dtype
        self.world_size = dist.get_world_size(group)
        self.names = {id(p): n for n, p in module.named_parameters()}
        params = unique_trainable(module.parameters())
        self.buckets = [Bucket(i, ps) for i, ps in enumerate(assign_buckets(params, bucket_bytes))]
        self._slot = {}
        for b in self.buckets:
            for p, view in zip(b.params, b.views):
                self._slot[id(p)] = (b, view)
                if p.grad is not None:
                    view.copy_(p.grad)
                p.grad = view
        self.enabled = True   # False inside no_sync(): accumulate locally, no communication
        # Weak: a dropped DataParallel (or stage-0 engine) is not kept alive by the model, and its hooks
        # then do nothing, so the model can be wrapped again (they would reduce the gradients twice)
        ready = weakref.WeakMethod(self._on_grad_ready)
        self._hooks = [p.register_post_accumulate_grad_hook(lambda q: None if ready() is None else ready()(q))
                       for p in params]
        self._new_round()

    def _new_round(self):
        self._ready = [set() for _ in self.buckets]
        self._next = 0        # index of the next bucket to start
        self._inflight = []

    def _bind(self, p, zero_if_missing=False):
        """Make p.grad the bucket view again if someone replaced it (zero_grad(set_to_none=True)
        leaves None; autograd then hands over a fresh tensor, which we copy into the bucket)."""
        _, view = self._slot[id(p)]
        if p.grad is None:
            if zero_if_missing:
                view.zero_()
                p.grad = view
        elif p.grad.data_ptr() != view.data_ptr():
            view.copy_(p.grad)
            p.grad = view

    def _on_grad_ready(self, param):
        # `param` is the PARAMETER; its .grad holds the accumulated gradient. All-reducing `param`
        # itself would average the weights (identical anyway) and leave the gradients unsynced:
        # the bug in picotron's naive DP hook.
        self._bind(param)
        if not self.enabled:
            return
        bucket, _ = self._slot[id(param)]
        if bucket.index < self._next:
            raise RuntimeError(
                f"parameter {self.names.get(id(param), '?')!r} received a gradient after its bucket "
                f"{bucket.index}'s all-reduce had started (a second backward before "
                f"finish_gradient_synchronization(), or reentrant checkpointing). Call finish after "
                f"each backward, or accumulate inside no_sync().")
        self._ready[bucket.index].add(id(param))
        while (self._next < len(self.buckets)
               and len(self._ready[self._next]) == len(self.buckets[self._next].params)):
            self._launch(self.buckets[self._next])

    def _launch(self, bucket):
        for p in bucket.params:
            self._bind(p, zero_if_missing=True)
        # reduce_dtype (e.g. fp32 for bf16 gradients): all-reduce a copy in it (2x the bytes)
        send = bucket.buffer
        if self.reduce_dtype not in (None, send.dtype):
            send = bucket.reduced = send.to(self.reduce_dtype)
        # Divide first, then sum: Σ_r g_r/N is the mean, and fp16 sums cannot overflow
        # (torch DDP's default comm hook does the same).
        send.div_(self.world_size)
        work = comm.all_reduce(send, group=self.group, async_op=True, tag=f"bucket {bucket.index}")
        self._inflight.append(work)
        self._next += 1

    def finish(self):
        """Start the buckets still waiting, wait for every all-reduce: p.grad is the global mean.
        A no-op while ``enabled`` is False (inside no_sync)."""
        if not self.enabled:
            return
        while self._next < len(self.buckets):
            self._launch(self.buckets[self._next])
        for work in self._inflight:
            work.wait()
        for b in self.buckets:
            if b.reduced is not None:
                b.buffer.copy_(b.reduced)          # p.grad: the mean, rounded to the param's dtype
        self._new_round()

    def reduced_grad(self, p):
        """p's averaged gradient in the reduce dtype (a view; p.grad when they are the same)."""
        b, view = self._slot[id(p)]
        if b.reduced is None:
            return p.grad
        i = next(i for i, q in enumerate(b.params) if q is p)
        off = sum(q.numel() for q in b.params[:i])
        return b.reduced[off:off + p.numel()].view_as(p)

    def zero_grad(self):
        """Zero the buckets in place; gradients stay views (never None) for the next backward."""
        for b in self.buckets:
            b.reduced = None
            b.buffer.zero_()
            for p, view in zip(b.params, b.views):
                p.grad = view

    def remove(self):
        """Unregister the hooks (the module then trains without synchronisation)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []


class DataParallel(nn.Module):
    """Wrap ``module`` for data parallelism in a plain torch training loop::

        model = DataParallel(model, bucket_bytes=25 * 2**20)   # None: naive, per-gradient sync
        loss = model(x, y); loss.backward()
        model.finish_gradient_synchronization()                 # p.grad = mean over ranks
        optimizer.step(); model.zero_grad()

    Construction broadcasts rank 0's parameters and buffers to every rank. For gradient
    accumulation run the micro-steps inside ``with model.no_sync():``; the first synchronised
    backward after them averages the accumulated sum. To see each bucket's all-reduce as a span,
    run the step inside ``with zerolab.comm.log(timeline=tl):``.
    """

    def __init__(self, module, bucket_bytes=None, *, group=None, broadcast=True, reduce_dtype=None):
        super().__init__()
        if bucket_bytes is not None and (not isinstance(bucket_bytes, int) or bucket_bytes <= 0):
            raise ValueError(f"bucket_bytes must be a positive int or None (naive), got {bucket_bytes!r}")
        if not dist.is_initialized():
            raise ValueError("DataParallel needs a process group: use zerolab.launch / Cluster, or "
                             "zerolab.init_from_env() under torchrun")
        self.module, self.group, self.bucket_bytes = module, group, bucket_bytes
        self.reduce_dtype = reduce_dtype
        if broadcast:
            broadcast_module(module, group=group)
        self.sync = (BucketedGradSync(module, bucket_bytes=bucket_bytes, group=group, reduce_dtype=reduce_dtype)
                     if bucket_bytes is not None else None)
        self._sync_enabled = True
        self._reduced = {}                 # naive sync: {id(p): mean in the reduce dtype}

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside accumulate local gradients and communicate nothing."""
        previous, self._sync_enabled = self._sync_enabled, False
        if self.sync is not None:
            self.sync.enabled = False
        try:
            yield
        finally:
            self._sync_enabled = previous
            if self.sync is not None:
                self.sync.enabled = previous

    def finish_gradient_synchronization(self):
        """Average the gradients over the ranks (wait for the bucketed all-reduces, or run the naive
        ones). Call once after each backward outside no_sync(); inside it this does nothing."""
        if not self._sync_enabled:
            return
        if self.sync is not None:
            self.sync.finish()
        else:
            self._reduced = allreduce_gradients(self.module.parameters(), group=self.group,
                                                reduce_dtype=self.reduce_dtype)

    def reduced_grad(self, p):
        """p's averaged gradient in ``reduce_dtype`` (p.grad when that is p's dtype, or before the
        first synchronisation): what a mixed-precision optimizer should read."""
        if self.sync is not None:
            return self.sync.reduced_grad(p)
        return self._reduced.get(id(p), p.grad)

    def reduced_copies(self):
        """The reduce_dtype copies alive now (none when gradients are reduced in their own dtype)."""
        if self.sync is not None:
            return [b.reduced for b in self.sync.buckets if b.reduced is not None]
        return [g for p in unique_trainable(self.module.parameters())
                if (g := self._reduced.get(id(p))) is not None and g is not p.grad]

    def zero_grad(self, set_to_none=True):
        """Bucketed: zero the buckets in place (grads stay bucket views, whatever set_to_none
        says). Naive: nn.Module.zero_grad."""
        if self.sync is not None:
            self.sync.zero_grad()
        else:
            self._reduced = {}
            super().zero_grad(set_to_none=set_to_none)

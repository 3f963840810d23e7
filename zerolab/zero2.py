"""ZeRO stage 2 (P_os+g): optimizer states AND gradients partitioned (Rajbhandari et al., arXiv
1910.02054, Sec. 5.2). Parameters stay full on every rank, as in stage 1.

Stage 1 materialises the full gradient (2Ψ bytes) and reduce-scatters it after backward. Stage 2
never keeps it: gradients are reduce-scattered bucket by bucket WHILE backward runs, and each
rank keeps only the reduced gradients of its own shard (2Ψ/N). Per rank: 2Ψ + (2+K)Ψ/N.

Layout (FSDP's, and Megatron's distributed optimizer's; not DeepSpeed's, see below): the trainable
parameters, in reverse order (the order backward produces their gradients), are cut into buckets of
about ``bucket_bytes``; each bucket is its own padded flat buffer (:class:`zerolab.flat.FlatParams`),
and rank r owns shard r of EVERY bucket:

    bucket 0 (last layers)    | r0 | r1 | r2 | r3 |      <- reduce-scattered first, during backward
    bucket 1                  | r0 | r1 | r2 | r3 |
    bucket 2 (first layers)   | r0 | r1 | r2 | r3 |      <- reduce-scattered last

so every bucket reduce-scatters on its own, as soon as all its gradients exist, and every rank
receives 1/N of every bucket: one balanced collective per bucket (FSDP2 reduce-scatters per wrapped
module; Megatron-core's DistributedOptimizer shards each bucket of its gradient buffer the same way,
though it keeps that full buffer: ZeRO-1's memory). The price: each bucket is padded to a multiple of
N on its own, and rank r's shard is scattered over the whole model.

DeepSpeed's stage 2 (``DeepSpeedZeroOptimizer`` in deepspeed/runtime/zero/stage_1_and_2.py) keeps
ZeRO-1's ONE global partition instead (rank r owns one contiguous 1/N of all parameters) and, per
gradient bucket, REDUCES each slice of the bucket to the rank that owns it (``average_tensor``: one
``dist.reduce(grad_slice, dst=owner)`` per partition the bucket spans; paper Sec. 5.2, "a reduction
instead of an all-reduce at the partition boundaries"). Same bytes per step; but a bucket inside one
rank's partition is one reduce to that rank alone, so during backward the receiving (and, under
offload, the copying to the host) moves from rank to rank instead of being spread evenly: the
imbalance its ``round_robin_gradients`` option (offload only) spreads out. Lesson 04 compares the two
layouts; this engine implements the first.

The pipeline, per parameter p:

    autograd accumulates p.grad (full size) -> post-accumulate-grad hook: add it into the bucket's
    full-size buffer, drop p.grad -> last gradient of the bucket arrived: launch the bucket's
    reduce-scatter (its own slice of the buffer is the output) -> when that finishes: shard / N is
    added to the persistent gradient shard and the full-size bucket buffer is freed.

With the default ring reduce-scatter on gloo (``reduce_impl="ring"``) the launch BLOCKS inside the
hook: the reduction interleaves with backward (each bucket's full-size buffer is freed early) but
does not overlap it in time; ``reduce_impl="torch"`` launches it asynchronously and lets backward
run on while it is in flight (lesson 04 shows both timelines).

At most two buckets of full-size gradients exist at once (DeepSpeed's double-buffered reduce
bucket): the previous bucket's reduce-scatter is waited for when the next one launches.
"""
import weakref

import torch

from zerolab import comm, engine
from zerolab.engine import OwnedGrads, ShardedEngine
from zerolab.flat import FlatParams
from zerolab.shard_optim import master_dtype


def make_buckets(params, bucket_bytes, dtype):
    """Consecutive groups of ``params`` (given in backward order) of at most ``bucket_bytes`` each
    in ``dtype`` (a larger parameter gets a bucket of its own); ``bucket_bytes=None``: one bucket."""
    size = torch.empty((), dtype=dtype).element_size()
    buckets, current, used = [], [], 0
    for p in params:
        if current and bucket_bytes is not None and used + p.numel() * size > bucket_bytes:
            buckets.append(current)
            current, used = [], 0
        current.append(p)
        used += p.numel() * size
    return buckets + [current]


class Zero2Engine(ShardedEngine):
    """Stage 2 of ``zerolab.initialize``. Gradient accumulation, two ways:

    * ``with engine.no_sync(): engine.backward(loss)`` keeps full-size gradients in ``p.grad``
      across micro-batches (torch DDP/FSDP's idiom): one reduce-scatter per step, 2Ψ extra memory
      until the synchronising backward;
    * plain repeated ``engine.backward(loss)``: every micro-batch is reduce-scattered and added
      into the gradient shard (DeepSpeed's way): memory stays 2Ψ/N, communication per micro-batch.
    """

    stage = 2

    def __init__(self, module, **common):
        super().__init__(module, **common)
        trainable = self._prepare()
        originals = {id(p): p.detach() for p in trainable}       # exact values, before any cast
        self.buckets = [FlatParams(ps, self.world_size, self.rank, dtype=self.param_dtype)
                        for ps in make_buckets(trainable[::-1], self.bucket_bytes, self.compute_dtype)]
        init = None
        if master_dtype(self.compute_dtype) != self.compute_dtype:    # bf16: fp32 master from originals
            init = [b.shard_from([originals[id(p)] for p in b.params], torch.float32) for b in self.buckets]
        self.shard_optim = self._make_shard_optimizer([b.shard(b.data) for b in self.buckets], init)
        self.optimizer = self.shard_optim.optimizer
        # The only gradients that persist: shard r of every bucket, back to back (2Ψ/N bytes).
        self.grad_shard, self.grad_shards = self._new_grad_shards([b.shard_numel for b in self.buckets])
        self._where = {id(p): (i, j) for i, b in enumerate(self.buckets) for j, p in enumerate(b.params)}
        on_grad = weakref.WeakMethod(self._on_grad)  # the model must not keep a dropped engine alive,
        # and a dropped engine's hooks do nothing (the model may be wrapped again: was a TypeError)
        self._hooks = [p.register_post_accumulate_grad_hook(lambda q: None if on_grad() is None else on_grad()(q))
                       for p in trainable]
        self._full = [None] * len(self.buckets)   # full-size gradient buffer of a bucket, while live
        self._inflight = []                       # (bucket index, async work or None), oldest first
        self._arrived = [set() for _ in self.buckets]
        self._launched = [False] * len(self.buckets)

    # -- during backward ------------------------------------------------------------------
    @torch.no_grad()
    def _on_grad(self, p):
        """Post-accumulate-grad hook: p.grad is complete for this backward (a tied weight's uses are
        summed by autograd before it fires; should it fire twice, the second adds in too)."""
        if not self._sync:
            return                              # no_sync: p.grad keeps accumulating, full size
        i, j = self._where[id(p)]
        if self._launched[i]:
            raise RuntimeError(f"a gradient of bucket {i} arrived after the bucket was reduce-scattered "
                               f"(a parameter used again after its gradient was complete?)")
        self._add_into_bucket(i, j, p)
        if len(self._arrived[i]) == len(self.buckets[i].params):
            self._launch(i)

    def _new_full(self, i):
        b = self.buckets[i]                      # full size, this bucket only, reduce dtype; every
        full = torch.empty(b.padded_numel, dtype=self.reduce_dtype, device=b.device)  # element is written:
        full[b.numel:].zero_()                   # the padding here, each param's slice on arrival
        return full

    def _add_into_bucket(self, i, j, p):
        if self._full[i] is None:
            self._full[i] = self._new_full(i)
        view = self.buckets[i].view(self._full[i], j)
        if id(p) in self._arrived[i]:
            view.add_(p.grad)                    # a second arrival in one backward adds up
        else:
            view.copy_(p.grad)
        p.grad = None                            # the full-size param grad is gone
        self._arrived[i].add(id(p))

    def _launch(self, i):
        if self._inflight:
            self._finish_oldest()               # at most two buckets of full-size grads alive
        bucket, full = self.buckets[i], self._full[i]
        own = bucket.shard(full)                # in place: rank r's output is its own slice
        # 'ring': blocking, (N-1)/N bytes; 'torch': overlaps the rest of backward (2(N-1)/N on gloo)
        work = engine.reduce_scatter(own, full, group=self.group, impl=self.reduce_impl, async_op=True,
                                     tag=f"bucket {i}")
        self._launched[i] = True
        self._inflight.append((i, work))

    def _finish_oldest(self):
        i, work = self._inflight.pop(0)
        if work is not None:
            work.wait()
        own = self.buckets[i].shard(self._full[i])
        self._keep_grad_shard(i, own.div_(self.world_size))   # average
        self._full[i] = None                                  # free the full-size bucket buffer

    # -- where reduced gradient shards live (zerolab.offload: on the host) -------------------
    def _new_grad_shards(self, sizes):
        """(one buffer, a view per bucket): the persistent gradient shards, zero, in the reduce dtype."""
        flat = torch.zeros(sum(sizes), dtype=self.reduce_dtype, device=self.buckets[0].device)
        return flat, list(flat.split(sizes))

    def _keep_grad_shard(self, i, shard):
        """Keep bucket i's averaged gradient shard: += into the persistent one (accumulation)."""
        self.grad_shards[i].add_(shard)

    @torch.no_grad()
    def _backward(self, loss):
        self._arrived = [set() for _ in self.buckets]
        self._launched = [False] * len(self.buckets)
        with torch.enable_grad(), comm.span("backward"):
            loss.backward()                     # buckets launch from the hooks as they fill
        if not self._sync:
            return
        # Buckets whose parameters got no gradient in this backward (unused, or only accumulated
        # under no_sync): same order on every rank, so the collectives still match up.
        for i, bucket in enumerate(self.buckets):
            if not self._launched[i]:
                if self._full[i] is None:
                    self._full[i] = self._new_full(i)
                for j, p in enumerate(bucket.params):
                    if id(p) not in self._arrived[i]:
                        if p.grad is not None:
                            self._add_into_bucket(i, j, p)
                        else:
                            bucket.view(self._full[i], j).zero_()   # no gradient: zero
                self._launch(i)
        while self._inflight:
            self._finish_oldest()

    # -- step -----------------------------------------------------------------------------
    def _step(self):
        self.shard_optim.step(self.grad_shards, inv_scale=self.inv_scale)   # update shard r of every bucket
        for i, b in enumerate(self.buckets):                 # (N-1)/N x 2Ψ bytes in all
            comm.all_gather(b.data, b.shard(b.data), group=self.group, tag=f"bucket {i}")

    def owned_grads(self):
        return OwnedGrads(list(self.grad_shards), [])      # (the host's, under offload)

    def _zero_grad(self):
        if self.grad_shard is not None:
            self.grad_shard.zero_()
        for p in self.trainable:
            p.grad = None

    def shards(self):
        return [(b, self.shard_optim, i) for i, b in enumerate(self.buckets)]   # one per bucket

    def state_tensors(self):
        st = self.shard_optim.state_tensors()
        live = [p.grad for p in self.trainable] + self._full + [self.grad_shard]   # shard: None under offload
        return {"params": [b.data for b in self.buckets], "grads": [g for g in live if g is not None],
                "master": st["master"], "optimizer": st["optimizer"], "frozen": self.frozen}

    def padding_bytes(self):
        # full-size buffers pad `padding` elements; shard-sized ones (grad, master, moments) pad the
        # zeros that fall into this rank's shard (only the last ranks hold any)
        g = 0 if self.grad_shard is None else self.grad_shard.element_size()
        return sum(b.padding * b.data.element_size() + b.shard_padding() * (g + self.shard_optim.element_bytes(i))
                   for i, b in enumerate(self.buckets))

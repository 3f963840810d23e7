"""Exercise 04 — ZeRO-2 the way DeepSpeed lays it out: one global partition, each bucket's slices
REDUCED to the ranks that own them, during backward (lesson 04; ZeRO, arXiv 1910.02054, Sec. 5.2:
"a reduction instead of an all-reduce at the partition boundaries").

zerolab's stage 2 (``zerolab.zero2``) gives every bucket its own padded buffer and reduce-scatters it
(FSDP's layout). Here you build the other layout. The partition is ZeRO-1's (lesson 03), given
below: the trainable parameters back to back in one flat buffer padded to a multiple of N; rank r
owns elements [r·S, (r+1)·S). Gradients arrive in backward order, in buckets that cut across that
partition, so a bucket's elements belong to one, two or more owners.

04.1 ``Zero2Gradients``: what to allocate, which hooks to register, when to reduce, when to wait and
     when to free is yours to decide. The contract is in the docstrings.
04.2 ``reduce_calls``: a number to derive, and to check against what your 04.1 does.

Grade your work:  ``make grade`` or, in lesson 04, ``zerolab.grade.check("04")``.
"""
import torch
import torch.distributed as dist

from zerolab.flat import FlatParams, unique_trainable
from zerolab.zero2 import make_buckets  # noqa: F401  (the buckets of the contract)


class Zero2Gradients:
    """``grads = Zero2Gradients(model.parameters(), bucket_bytes=16000)``; then, for each
    micro-batch, ``loss.backward(); grads.finish()``; ``grads.grad_shard`` holds this rank's
    partition of the gradients averaged over the ranks, summed over the micro-batches since the
    last ``grads.zero_grad()``.

    Contract (graded):

    * buckets: the trainable parameters in backward order, cut as
      ``make_buckets(self.params[::-1], bucket_bytes, dtype)`` cuts them;
    * during backward, as soon as every gradient of a bucket is final, each part of the bucket that
      lies in rank q's partition is reduced (summed) to rank q with ``torch.distributed.reduce``:
      one reduce per (bucket, owner), nothing else is sent;
    * overlap: those reduces run while backward goes on. Graded as a fact, not a flag: a bucket's
      reduces are still in flight (started, not yet waited for) when autograd hands over the next
      gradient;
    * memory: at no moment of backward are more than two buckets of full-size gradients alive
      (besides the one gradient autograd is handing you, and ``grad_shard``): DeepSpeed's double
      buffer. Measured by a census of the live tensors after every gradient hook;
    * after ``finish()``: every reduce has completed (waited for), ``grad_shard`` holds the average
      (padding zero; a parameter no forward used counts as zero), no parameter has a ``.grad``, and
      no full-size gradient buffer is left;
    * ``group``: the ranks that share the gradients (default: all of them). Partition, owners and
      every collective are those of the group; the other ranks may be doing something else meanwhile.
    """

    def __init__(self, params, *, bucket_bytes, group=None):
        self.group = group
        self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.params = unique_trainable(params)
        self.bucket_bytes = bucket_bytes
        # ZeRO-1's partition (given): the parameters become views into self.flat.data; rank r owns
        # self.flat.shard_range(r). self.flat.offsets[i]: where parameter i starts.
        self.flat = FlatParams(self.params, self.world_size, self.rank)
        self.grad_shard = torch.zeros(self.flat.shard_numel, dtype=self.flat.dtype)   # 2Ψ/N persists
        self.setup()

    def setup(self):
        """Everything else the class needs before the first backward."""
        raise NotImplementedError(
            "Exercise 04.1: set up the buckets and whatever makes each bucket's slices reach their "
            "owners during backward (see the class docstring for the contract).")

    def finish(self):
        """After a backward: complete its communication; ``grad_shard`` += this micro-batch's
        average; leave no full-size gradient behind."""
        raise NotImplementedError(
            "Exercise 04.1: complete the backward's reductions and accumulate this rank's average.")

    def zero_grad(self):
        self.grad_shard.zero_()


def reduce_calls(bucket_numels, world_size):
    """How many ``reduce`` calls one backward makes in this layout when the partition (padded to a
    multiple of ``world_size``) is cut, in order, into buckets of ``bucket_numels`` elements (their
    sum is the unpadded total): the number of (bucket, owner) pairs. Derive it, then count the calls
    your 04.1 makes in the lesson and explain the difference from one reduce-scatter per bucket."""
    raise NotImplementedError(
        "Exercise 04.2: reduce_calls is not written yet.")

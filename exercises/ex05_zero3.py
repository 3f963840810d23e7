"""Exercise 05 — ZeRO-3's schedule: when each unit is gathered, prefetched, freed and reduced.

Lesson 05 shows the four primitives of ``zerolab.zero3`` (yours to use):

* ``gather(unit, group, async_op=False)``: give ``unit.full`` its storage back and all-gather every
  rank's ``unit.shard`` into it (returns the handle with ``async_op=True``: call ``.wait()``);
* ``free(unit)``: shrink ``unit.full``'s storage to 0 bytes (autograd's saved views stay valid);
* ``reduce_scatter_grads(unit, grad_full, group)``: start summing ``grad_full`` (the unit's flat
  gradient, laid out like ``unit.full``) into this rank's own slice of it; returns a handle;
* ``register_pre_backward(output, fn)``: ``fn()`` runs when backward reaches ``output``.

What the engine decides with them — the schedule — is this exercise. The units are given
(``zerolab.units.build_units``: each of ``model.blocks``, plus a "root" unit of the parameters in no
block: embeddings, final norm, tied head). You decide which hooks to register, what to track and
when to call what. The contract is in the docstrings.

05.1 ``Zero3Schedule``: the schedule, with prefetch.
05.2 ``traffic_ratio``: a number to derive: stage 3's bytes per step over data parallelism's.

Grade your work:  ``make grade`` or, in lesson 05, ``zerolab.grade.check("05")``.
"""
import torch
import torch.distributed as dist

from zerolab.flat import unique_trainable
from zerolab.units import build_units
from zerolab.zero3 import free, gather, reduce_scatter_grads, register_pre_backward  # noqa: F401


class Zero3Schedule:
    """``sched = Zero3Schedule(model)``; then ``loss = model(x, y); loss.backward(); sched.finish()``
    (call the model itself: your hooks do the work); ``sched.grad_shards[i]`` holds unit i's
    gradient shard, averaged over the ranks, summed over backward passes until ``zero_grad()``.

    A step computes in this order: the root's part before the blocks (embeddings), blocks 0, 1, ...
    in forward, the root's part after them (the head, the loss); then backward, in reverse: the head,
    the blocks from the last to block 0, the embeddings. A unit is *whole* while its ``full`` buffer
    has storage; a collective is *in flight* from its start (``async_op=True``) until its handle's
    ``wait()`` returns.

    Contract: what must hold at every moment of a step. Graded on 3 ranks, on a model whose blocks
    differ in size and return a tensor, a tuple or a dict, from hooks the grader adds INSIDE each of
    these computations (after your hooks have run), and from every collective, recorded; values also
    on TinyGPT, with a parameter no forward uses, and on a subgroup of 3 of 4 ranks.

    * whole: the root, from the start of the forward until its gradients are complete. A block
      while it computes (its forward, its backward), with its all-gather complete. Besides the root
      and the computing block, a block may be whole only while its all-gather is in flight, and
      only if it is the next block to compute: never more than two blocks whole;
    * in flight, with ``prefetch=True``: while anything computes, the all-gather of the next block
      to compute is already in flight. That is: during the embeddings' forward, block 0's; during
      each block's forward but the last one's, the next block's; during the head's backward, the
      last block's; during each block's backward but block 0's, the block before it. With
      ``prefetch=False``: no all-gather is in flight while anything computes, and no block but the
      computing one is whole;
    * gradients: when all of a unit's gradients are final, they are reduce-scattered from one buffer
      laid out like ``unit.full``, started inside backward; from then on none of the unit's
      parameters has a ``.grad``. A unit's reduce-scatter is still in flight while the next unit's
      backward computes (block 0's: while the embeddings' does); at most two are in flight at any
      moment. Full-size gradients alive at any moment of backward (``.grad`` and your buffers): at
      most those of the root, of the unit whose gradients are arriving, and of the unit before it
      in backward (measured: a census of the live tensors);
    * bytes: a step's collectives are all-gathers of whole ``full`` buffers and one reduce-scatter
      per unit, nothing else; no unit is all-gathered more often than the rules above force;
    * after ``finish()``: every collective waited for, its result averaged into ``grad_shards`` (a
      parameter that got no gradient counts as zero), every unit freed, no ``.grad`` left;
    * ``group``: the ranks that share the model (default: all); the other ranks may be doing
      something else meanwhile.
    """

    def __init__(self, model, *, group=None, prefetch=True):
        self.group, self.prefetch = group, prefetch
        self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        trainable = unique_trainable(model.parameters())
        # units[i].module: the block (None for the root); .flat: its FlatParams layout; .full, .shard
        self.units = build_units(model, None, trainable, world_size=self.world_size, rank=self.rank,
                                 dtype=trainable[0].dtype, persist_numel=0)
        self.grad_shards = [torch.zeros_like(u.shard) for u in self.units]
        for u in self.units:
            free(u)                              # at rest: shards only
        self.setup(model)

    def setup(self, model):
        """Register what the schedule needs on ``model`` and its units."""
        raise NotImplementedError(
            "Exercise 05.1: design the schedule: which moments of a step you need to see (hooks), "
            "what to track, and what to start, wait for and free at each, so that the class "
            "docstring's rules hold at every moment.")

    def finish(self):
        """After backward: complete the reduce-scatters, average into grad_shards, free every unit."""
        raise NotImplementedError(
            "Exercise 05.1: complete what backward started and leave every unit freed.")

    def zero_grad(self):
        for g in self.grad_shards:
            g.zero_()


def traffic_ratio(unit_numels, root_numel):
    """Bytes one rank sends in one stage-3 step of this schedule over the bytes it sends in one
    data-parallel step (the gradients all-reduced), for blocks of ``unit_numels`` elements and a
    root of ``root_numel`` (same world size, same dtype, ring collectives, padding ignored).
    Derive it; then check it against the comm log of a real step, and explain why TinyGPT's
    measured ratio is below the paper's 1.5."""
    raise NotImplementedError(
        "Exercise 05.2: count the ring phases each element goes through in one step, for a block, for "
        "the root, and for data parallelism.")

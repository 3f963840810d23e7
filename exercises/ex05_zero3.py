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

    Contract (graded, on TinyGPT and on a model whose blocks return tuples):

    * when the model's forward starts, the root unit is gathered (it stays gathered until its
      gradients are complete); every block is gathered right before its forward and freed right
      after it; blocks are gathered in forward order, and in backward, once more each, in reverse;
    * with ``prefetch=True``, the all-gather of the block that comes next (in forward: block i+1;
      in backward: block i-1) is STARTED, asynchronously, when block i starts (its forward, or its
      backward), so that it runs while block i computes; it is waited for when its turn comes;
    * never more than two blocks gathered at once (plus the root);
    * when every gradient of a unit is final: its gradients packed into one flat buffer laid out
      like ``unit.full``, no ``.grad`` left on its parameters, the unit freed, and its reduce-scatter
      started from inside backward; at most two reduce-scatters unfinished at any time;
    * after ``finish()``: every unit freed, every reduce-scatter completed and averaged into
      ``grad_shards``.
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
            "Exercise 05.1: register the hooks that gather, prefetch, free and reduce-scatter each "
            "unit at the moments the class docstring's contract names.")

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

"""Exercise 05 — ZeRO-3's gather / free hooks.

The ZeRO-3 engine (``zerolab.zero3.Zero3Engine``) decides WHEN a unit's parameters must exist; you
write HOW. Each ``unit`` (a :class:`zerolab.units.Unit`) has:

* ``unit.full``  — the unit's padded flat parameter buffer, compute dtype, ``unit.flat.padded_numel``
  elements. Its parameters are views into it. At rest its storage holds 0 bytes.
* ``unit.shard`` — this rank's 1/N slice of it (``unit.flat.shard_numel`` elements): the only copy
  of the parameters that persists.
* ``unit.flat``  — the :class:`zerolab.flat.FlatParams` layout (``shard(buffer)`` = this rank's slice).

Plug your functions into the engine and train::

    import zerolab
    from zerolab.grade.helpers import exercise_module
    engine = zerolab.initialize(model, stage=3, ops=exercise_module("ex05_zero3"))   # this file

Use ``zerolab.comm`` for the collectives. Grade your work: ``zerolab.grade.check("05")``.
"""


def gather(unit, group=None, async_op=False):
    """Give ``unit.full`` its storage back and all-gather every rank's ``unit.shard`` into it.
    Return the collective's handle (``async_op=True``) or None."""
    raise NotImplementedError(
        "Exercise 05.1: resize unit.full's untyped_storage() back to numel x element_size bytes, then "
        "zerolab.comm.all_gather(unit.full, unit.shard, group=group, async_op=async_op).")


def free(unit):
    """Release the memory of ``unit.full`` so that only the shard remains. Do NOT rebind the
    parameters (``p.data = ...``): autograd saved views of them (``weight.t()``) for backward."""
    raise NotImplementedError(
        "Exercise 05.2: one line: shrink the storage that unit.full (and every view of it) shares.")


def reduce_scatter_grads(unit, grad_full, group=None, impl="torch"):
    """``grad_full`` is this rank's full flat gradient of the unit (laid out like ``unit.full``).
    Reduce-scatter it in place: this rank's own slice of ``grad_full`` must end up holding the SUM
    over ranks of that slice (the engine divides by N). ``impl='torch'``: async, return the handle;
    ``impl='ring'``: blocking (lesson 00's ring; ``zerolab.engine.reduce_scatter`` chooses), return None."""
    raise NotImplementedError(
        "Exercise 05.3: own = unit.flat.shard(grad_full); zerolab.engine.reduce_scatter(own, grad_full, ...) "
        "with impl passed through and async_op=True (the ring ignores it: it is blocking).")


def register_pre_backward(output, fn):
    """Make ``fn()`` run once backward reaches ``output`` (a unit's forward result: a tensor, or a
    tuple/list/dict of them), before the unit's own backward. Return how many hooks you registered."""
    raise NotImplementedError(
        "Exercise 05.4: for every tensor in output (torch.utils._pytree.tree_leaves) that requires grad, "
        "register a gradient hook (Tensor.register_hook) that calls fn() and returns None.")

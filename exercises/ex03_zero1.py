"""Exercise 03 — ZeRO-1 by whole parameters, as torch's ZeroRedundancyOptimizer does it.

Lesson 03 builds ZeRO-1 on ONE flat buffer cut into N equal slices (``zerolab.zero1``): exact
balance, one reduce-scatter and one all-gather per step. torch's ``ZeroRedundancyOptimizer`` never
cuts a tensor: each parameter belongs, whole, to one rank. Here you build that design for a plain
training loop (no DDP underneath): who owns what, how each gradient reaches its owner and each
updated parameter comes back. The contract is in the docstrings.

03.1 ``ParamZero1``: the optimizer.
03.2 ``largest_share``: a number to derive; then compare it with what torch's optimizer holds.

Grade your work:  ``make grade`` or, in lesson 03, ``zerolab.grade.check("03")``.
"""
import torch  # noqa: F401
import torch.distributed as dist  # noqa: F401


class ParamZero1:
    """``opt = ParamZero1(model.parameters(), torch.optim.AdamW, lr=1e-2)``; then
    ``loss.backward(); opt.step(); opt.zero_grad()``.

    Contract (graded):

    * ``self.partition[r]``: the trainable parameters rank r owns, whole. Assign them the way
      torch's ZeroRedundancyOptimizer does: largest first (ties: in the order given), each to the
      rank that owns the fewest elements so far (ties: the lowest rank). Frozen parameters are not
      trained: nobody owns them. A parameter passed twice (tied weights) counts once;
    * ``self.local``: ``optimizer_class(..., **defaults)`` over this rank's own parameters only. After
      ``step(); zero_grad()``, what this rank holds besides the model's parameters is that
      optimizer's state, for the parameters it owns (measured: a census of the live tensors);
    * ``step()``: the owner of a parameter gets its gradient averaged over the ranks, delivered by
      ``torch.distributed.reduce`` to the owner (you may pack an owner's parameters in one buffer);
      the owner updates it; every rank then gets the new values by ``torch.distributed.broadcast``
      from the owner. No all-reduce: each gradient and each parameter crosses the wire once.
      Training equals one process on the concatenated batches, including a parameter that no rank
      has a gradient for (unused this step): one process's optimizer skips it, so must yours;
    * ``group``: the ranks that share this optimizer (default: all of them). Ranks, partition and
      every collective are those of the group: the other ranks may be doing something else meanwhile.
    """

    def __init__(self, params, optimizer_class, *, group=None, **defaults):
        raise NotImplementedError(
            "Exercise 03.1: decide who owns each whole parameter and build this rank's optimizer.")

    def step(self):
        raise NotImplementedError(
            "Exercise 03.1: deliver each averaged gradient to its owner, update, bring the values back.")

    def zero_grad(self):
        raise NotImplementedError("Exercise 03.1: drop the gradients.")


def largest_share(numels, world_size):
    """Under 03.1's partition of parameters of ``numels`` elements over ``world_size`` ranks, the
    fraction of the optimizer state held by the most loaded rank (flat ZeRO-1: about 1/N).
    Derive it; then, for TinyGPT, watch it stop falling as N grows, and say why."""
    raise NotImplementedError(
        "Exercise 03.2: the largest rank's elements over all elements, under the greedy partition.")

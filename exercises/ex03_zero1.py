"""Exercise 03 — ZeRO-1 by whole parameters, as torch's ZeroRedundancyOptimizer shards it.

Lesson 03 builds ZeRO-1 on ONE flat buffer cut into N equal slices (``zerolab.zero1``): exact
balance, one reduce-scatter and one all-gather per step. torch's ``ZeroRedundancyOptimizer`` never
cuts a tensor: each parameter belongs, whole, to one rank. Here you build that design for a plain
training loop (no DDP underneath): who owns what (a partition you design, with a balance you can
guarantee), how each gradient reaches its owner and each updated parameter comes back. The contract
is in the docstrings.

03.1 ``ParamZero1``: the optimizer, and its partition.
03.2 ``largest_share``: what your partition costs the most loaded rank; then, for TinyGPT, how that
     behaves as N grows, and why.

Grade your work:  ``make grade`` or, in lesson 03, ``zerolab.grade.check("03")``.
"""
import torch  # noqa: F401
import torch.distributed as dist  # noqa: F401


class ParamZero1:
    """``opt = ParamZero1(model.parameters(), torch.optim.AdamW, lr=1e-2)``; then
    ``loss.backward(); opt.step(); opt.zero_grad()``.

    Contract (graded):

    * ``self.partition[r]`` (r = 0 .. N-1, N the group's size): the parameters rank r owns, whole.
      Every trainable parameter is owned by exactly one rank, once (a parameter passed twice, as tied
      weights are, is one parameter); a frozen one (``requires_grad=False``) by none. Every rank
      holds the same partition. A rank may own nothing (more ranks than trainable parameters).
    * Balance: let OPT be the smallest number of elements that the most loaded rank can be held to
      by ANY assignment of whole parameters to the N ranks. Your most loaded rank owns at most
      4/3 * OPT elements. Graded on TinyGPT, ToyMLP, and models whose sizes, and the order in which
      they come, are chosen to be awkward, on 2, 3 and 4 ranks; the test finds OPT exactly, by
      search. The rule that meets this is yours to design (and to justify: it must hold for every
      model, not just the graded ones).
    * ``self.local``: ``optimizer_class(..., **defaults)`` over this rank's own parameters only
      (``None`` on a rank that owns nothing). After ``step(); zero_grad()``, what this rank holds
      besides the model's parameters is that optimizer's state, for the parameters it owns
      (measured: a census of the live tensors);
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
    """The fraction of the optimizer state that the most loaded rank holds when YOUR ``ParamZero1``
    partitions trainable, distinct parameters of ``numels`` elements (in that order) over
    ``world_size`` ranks (flat ZeRO-1: about 1/N). A pure function: no process group.

    Graded: equal (to 1e-12) to the share measured on ranks, where ``ParamZero1`` runs a step on
    parameters of exactly these sizes and the test counts each rank's optimizer state elements; for
    world sizes too large to run, within 03.1's balance guarantee. Then, in the lesson: TinyGPT, N =
    1 to 16, next to 1/N. Where does it stop falling, and why? What would it take to go lower?"""
    raise NotImplementedError(
        "Exercise 03.2: the most loaded rank's share of the state, under your own partition.")

"""Exercise 08 — the measurements behind two myths, done yourself.

Myth 3, "ZeRO aggregates gradients on a master GPU": lesson 08 builds the master scheme and measures
rank 0 sending N-1 times what the others send. A parameter server can be SHARDED: K servers, each
responsible for 1/K of the tensor. 08.1 asks you to design it from point-to-point messages (the
split, the messages, their order: a schedule that cannot deadlock); measure it for K = 1, 2, N in
the lesson and see what it becomes when every rank is a server.

Myth 2, "ZeRO compresses gradients": 08.2 measures, on the sockets, how many bytes a real ZeRO
step sends per gradient element.

Grade your work:  ``make grade`` or, in lesson 08, ``zerolab.grade.check("08")``.
"""


def sharded_server_average(tensor, servers, group=None):
    """Average ``tensor`` over the ranks of ``group`` (all ranks if None), in place, through
    ``servers`` = K parameter servers: ranks 0 .. K-1 of the group. Returns ``tensor``.

    Contract (graded on 4 ranks with K = 1 to 4 and tensors of 4096, 10, 6 and 3 elements, and on a
    subgroup of 3 of the 4 ranks while the fourth does something else; exact values; every message
    recorded, every collective made to raise):

    * what the servers own: each server is responsible for a part of the tensor's elements (it forms
      their average, and every other rank gets that average from it), the K parts as even as they
      can be (their sizes differ by at most one element);
    * who talks to whom: a rank that is not a server exchanges messages with servers only, and
      every message carries elements of one server's part, with that server at one end of it;
    * how much: the least traffic such a scheme allows; graded message by message, as the bytes
      each rank sends to each other rank (so a value sent twice, or to a rank that is neither
      responsible for it nor needs it, fails);
    * only point-to-point messages (``torch.distributed`` or ``zerolab.comm`` send / recv);
    * ``group``: only its ranks take part; ``servers`` is an int from 1 to the group's size, and
      anything else (0, more than the group's size, a bool such as True, a float such as 2.0) is a
      ValueError naming it."""
    raise NotImplementedError(
        "Exercise 08.1: average the tensor through K servers that each own one part of it.")


def bytes_per_element(param_dtype):
    """The bytes this rank writes to its sockets in one steady-state training step (forward,
    backward, step) of zerolab's stage-2 engine on TinyGPT, per element that its collectives carry
    under the ring algorithm (the textbook count for a stage-2 step on N ranks).

    The step graded: ``zerolab.initialize(models.build("gpt"), stage=2, lr=1e-3,
    param_dtype=param_dtype)`` on the current ranks, each rank's batch from
    ``models.batch("gpt", seed=rank, model=model)``. Graded against the grader's own measurement of
    the same step, for float32 and bfloat16, to within a few hundred bytes of socket traffic (a
    barrier's worth): closer than any formula for it comes, so the bytes must be measured. Then
    explain the two numbers, and what the sockets carry beyond the formula."""
    raise NotImplementedError(
        "Exercise 08.2: measure one step's socket bytes and divide by the elements the ring carries.")

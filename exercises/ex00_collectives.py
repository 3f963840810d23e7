"""Exercise 00 — an all-reduce that uses both directions of every link, and a measurement.

Lesson 00's ring (``zerolab.ring``) sends every chunk the same way round: each rank sends only to
its right neighbour. Links are full duplex: what rank r sends to r+1 and what r+1 sends to r travel
at the same time without sharing bandwidth, so half of every link sits idle. NCCL runs rings in
both directions (and several at once) for this reason. Here you build that all-reduce from
point-to-point messages; the structure is yours.

00.1 ``bidirectional_all_reduce``: the all-reduce.
00.2 ``reduce_bytes``: measure what gloo's ``reduce`` really sends, and explain the pattern.

Use only ``torch.distributed.isend/irecv/send/recv`` (or ``zerolab.comm``'s wrappers, or
``zerolab.ring.exchange`` for one send-and-receive) in 00.1: the graded tests make every torch
collective raise while it runs, and record each message's destination and size.

Grade your work:  ``make grade`` or, in lesson 00, ``zerolab.grade.check("00")``.
"""


def bidirectional_all_reduce(tensor, group=None):
    """Sum ``tensor`` over the ranks of ``group`` (None: every rank), in place, for any number of
    elements and any shape.

    Contract (graded on 2 and 4 ranks, and on a subgroup of 3 of 4 ranks while the fourth rank,
    alone in a group of its own, calls it too): half of the elements travel clockwise (to the next
    rank of the group) and the other half counter-clockwise (to the previous one), each half as a
    ring all-reduce of its own; a rank talks only to its two neighbours in its group's ring, and only
    on that group; each rank sends about (N-1)/N x S bytes to each neighbour (S: the tensor's bytes;
    the one-way ring sends 2(N-1)/N x S to one of them); every message has completed when the call
    returns; and both directions are in flight together: whenever a message of one direction is
    out (started and not yet waited for), so is one of the other. The grader reads this off the
    clock, message by message, not off the order of your calls: two rings taking turns fail it."""
    raise NotImplementedError(
        "Exercise 00.1: sum the tensor over the ranks with two rings running in opposite directions.")


def reduce_bytes(numel, dst, group=None):
    """Run ONE ``torch.distributed.reduce`` of ``numel`` float32 elements to rank ``dst`` (a global
    rank, as in torch) over ``group`` (gloo) and return the bytes THIS rank wrote to its sockets
    during it, divided by the tensor's bytes.

    Measure it (the kernel counts what a process writes), do not compute it: graded against the
    grader's own measurement, on 4 ranks and on a subgroup of 3 of them, for a large tensor and a
    small one. Then explain the pattern you see across the ranks, and what changes for the small
    tensor."""
    raise NotImplementedError(
        "Exercise 00.2: measure the bytes this rank sends during one reduce, as a multiple of the "
        "tensor's bytes.")

"""Exercise 00 — ring collectives from point-to-point send/recv.

Fill in the three functions. Use only ``torch.distributed.isend/irecv/send/recv`` (or
``zerolab.comm``'s wrappers, or ``zerolab.ring.exchange`` for one ring step): the graded tests
make every torch collective raise while your code runs, and count the bytes each rank sends.

Grade your work:  ``make grade`` or, in lesson 00, ``zerolab.grade.check("00")``.
"""


def ring_reduce_scatter(output, input, group=None):
    """``input`` holds N equal chunks; afterwards ``output`` holds the sum over all ranks of chunk
    ``rank``. Leave ``input`` unchanged. Each rank must send (N-1)/N of ``input``'s bytes."""
    raise NotImplementedError(
        "Exercise 00.1: cut a copy of `input` into N chunks; for N-1 steps send chunk (rank-step-1) "
        "to the right neighbour and add the chunk received from the left into chunk (rank-step-2).")


def ring_all_gather(output, input, group=None):
    """``output`` (N x ``input``) receives every rank's ``input`` in rank order. Each rank must send
    (N-1)/N of ``output``'s bytes."""
    raise NotImplementedError(
        "Exercise 00.2: put `input` into chunk `rank` of `output`; for N-1 steps send chunk "
        "(rank-step) to the right and receive chunk (rank-step-1) from the left.")


def ring_all_reduce(tensor, group=None):
    """Sum ``tensor`` over all ranks, in place, for ANY number of elements (N need not divide it).
    Each rank must send about 2(N-1)/N of the tensor's bytes, however large N is."""
    raise NotImplementedError(
        "Exercise 00.3: a reduce-scatter phase then an all-gather phase over N (possibly uneven) "
        "chunks of tensor.view(-1); torch.tensor_split makes the chunks.")

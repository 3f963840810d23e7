"""Exercise 08 — the measurements that refute three myths about ZeRO.

Lesson 08 refutes each myth with a number measured on real ranks. Here you write three of those
measurements yourself; the graded tests run them on real ranks, against zerolab's real engines,
and compare what you measure with what the ZeRO paper (arXiv 1910.02054) says must come out.

1. "ZeRO = zero copy":  ``count_copies`` — how many copies of a state exist across the ranks
   (data parallelism: N; ZeRO-3: 1).
2. "a master GPU aggregates":  ``master_average`` — the myth's scheme, built from send/recv — and
   ``bytes_per_rank`` — who sends how many bytes (a master: N-1 times the others; a ring: all equal).
3. "ZeRO-3 is model parallelism":  ``forward_flops`` — the matmul FLOPs one rank really does in
   forward (ZeRO-3: the whole model's, for its own rows).

Grade your work:  ``make grade`` or, in lesson 08, ``zerolab.grade.check("08")``.
"""


def count_copies(per_rank):
    """How many copies of one kind of state (parameters, gradients, optimizer states) exist across
    the ranks: the bytes held on all ranks together divided by the bytes that are distinct.

    ``per_rank[r]`` is rank r's list of fingerprints ``(nbytes, digest)``, one per tensor it holds
    (``digest``: a hash of the tensor's contents, e.g. a SHA-1 hex string). Tensors with the same
    digest hold the same contents; count each distinct content once, with its ``nbytes``. Weigh by
    bytes, not by tensors. Returns a float: N when every rank holds the same full copy, 1.0 when
    nothing is stored twice (ZeRO's "zero redundancy")."""
    raise NotImplementedError(
        "Exercise 08.1: add up the bytes held over all ranks, and the bytes of each distinct digest "
        "counted once; their ratio is the number of copies.")


def master_average(tensor, group=None):
    """Average ``tensor`` over the ranks of ``group``, in place, the way the myth says ZeRO does:
    every other rank sends its tensor to rank 0 (of the group), rank 0 adds them up and divides by
    N, then sends the average back to each of them. Afterwards every rank holds the same average.

    Use only point-to-point ``zerolab.comm.send`` / ``zerolab.comm.recv`` (group ranks), so that
    ``zerolab.comm.log()`` sees every byte; the graded tests make torch's collectives raise."""
    raise NotImplementedError(
        "Exercise 08.2a: on rank 0, recv from ranks 1..N-1 into a scratch tensor (empty_like) and add "
        "it in, divide by N, then send the result to ranks 1..N-1; on the others, send to 0, recv from 0.")


def bytes_per_rank(average, tensor, group=None):
    """Run ``average(tensor, group)`` (a function averaging ``tensor`` in place across ``group``)
    once on every rank and return, on every rank, the list ``[bytes sent by rank 0, by rank 1, ...]``
    as ``zerolab.comm.log()`` records them (``log.sent_bytes``), in group-rank order.

    Only ``average``'s own bytes count: whatever you send to collect the numbers must not."""
    raise NotImplementedError(
        "Exercise 08.2b: `with comm.log(group) as log:` around the call; AFTER the with-block, "
        "comm.all_gather a 1-element float64 tensor holding log.sent_bytes; return it as a list.")


def forward_flops(model, run):
    """The matrix-multiply FLOPs of every ``torch.nn.Linear`` call in ``model`` during one forward,
    measured while it runs: ``run()`` performs the forward (e.g. ``lambda: engine(x, y)`` — under
    ZeRO-3 call the engine, whose hooks gather each layer's weight just in time).

    A Linear applied to an input of shape (..., in_features) does 2 x rows x in_features x
    out_features FLOPs (one multiply and one add per weight element per row; bias not counted),
    rows = the product of the leading dimensions. A module called twice counts twice. Count with
    forward hooks on the Linear modules, and remove them before returning. Returns an int."""
    raise NotImplementedError(
        "Exercise 08.3: a forward hook on every nn.Linear; in it, a matmul of (rows, k) by the weight "
        "costs 2·rows·(the weight's elements) FLOPs, read from the tensors at the call; call run(); "
        "then remove every hook, even if run() raises.")

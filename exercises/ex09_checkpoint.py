"""Exercise 09 — loading a sharded checkpoint into a different world size, and what a load costs.

A ZeRO rank owns one contiguous slice of a padded flat buffer (lesson 03): the parameters' elements
back to back, zero-padded to a multiple of N, cut into N equal shards; a slice can start or end in
the middle of a parameter. A checkpoint that ANY world size can load stores, per parameter, pieces
``(lo, hi, values)``: elements [lo, hi) of that parameter, from however many ranks saved it.

09.1 ``assemble``: one parameter back together from its pieces, refusing anything that does not
     fit exactly.
09.2 ``load_shard``: a rank of the NEW world size builds its own shard straight from the pieces,
     without putting whole parameters (let alone the model) together.
09.3 ``bytes_read``: measure what a load really reads, and explain it.

Grade your work:  ``make grade`` or, in lesson 09, ``zerolab.grade.check("09")``.
"""


def assemble(numel, pieces):
    """Parameter of ``numel`` elements from ``pieces``, a list of ``(lo, hi, values)`` (a 1-D tensor
    ``values`` of hi - lo elements for elements [lo, hi)), in any order, from any number of ranks.

    Returns the full 1-D tensor. Raise ValueError naming the elements if some element is covered by
    no piece or by more than one (files from two different saves), or if a piece's size or range is
    wrong: a checkpoint must never load in part."""
    raise NotImplementedError(
        "Exercise 09.1: the parameter from its pieces, every element exactly once, or a ValueError.")


def load_shard(numels, pieces, world_size, rank):
    """Rank ``rank``'s shard (1-D, S = ceil(sum(numels) / world_size) elements, padding zero) of the
    padded flat buffer of parameters with ``numels`` elements, built from ``pieces``: a dict
    {parameter index: [(lo, hi, values), ...]} as ``assemble`` takes them, saved by any number of
    ranks in any layout.

    Contract (graded): values equal to cutting the shard out of the whole assembled model; a
    ValueError naming the parameter if an element of THIS shard is covered by no piece or by more
    than one, or a piece does not fit its parameter (pieces of parameters this rank does not own may
    be anything); and memory: while it runs, at most about twice the shard's bytes and the largest
    piece's are allocated (measured by torch's profiler): never a whole parameter you only need a
    slice of, never the whole model."""
    raise NotImplementedError(
        "Exercise 09.2: this rank's shard of the new layout, straight from the pieces that overlap it.")


def bytes_read(load, checkpoint):
    """Call ``load()`` exactly once (it restarts training on this rank: a collective that loads the
    checkpoint in the folder ``checkpoint`` and whatever else the restart needs) and return
    ``{"read": bytes, "checkpoint": bytes}``:

    * ``"read"``: how many bytes THIS process read from files while ``load()`` ran: every byte,
      whichever code read it (Python's file objects, a C or C++ library, another thread of this
      process), and nothing it read before or after the call. Measured, not computed.
    * ``"checkpoint"``: how many of those bytes came from the checkpoint's files (the folder
      ``checkpoint``): your explanation of the number, in bytes. Which of its files does this rank
      read, and how much of each?

    Graded on 2 ranks, each number against the grader's own measurement in ranks of its own that
    never run your code, within 2 kB: ``"read"`` against the same load; ``"checkpoint"``
    against a load of the checkpoint alone. No size worked out from files (the whole checkpoint, a
    rank's share, what one reader or one thread handles) reaches ``"read"``. Then compare both with
    the share of the training state the rank keeps, and say where the difference goes (lesson 09,
    Exercises)."""
    raise NotImplementedError("Exercise 09.3: measure the bytes this process reads during load(), and "
                              "account for the checkpoint's part.")

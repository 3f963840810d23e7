"""Exercise 09 — the two functions under resharding: who owns which elements, and putting a
parameter back together from pieces.

A ZeRO rank owns one contiguous slice of a padded flat buffer (lesson 03): the parameters' elements
back to back, zero-padded to a multiple of N, cut into N equal shards. A slice can start or end in
the middle of a parameter. To save a checkpoint that ANY world size can load, each rank writes what
it owns addressed by parameter: (parameter index, first element, end element). To load, the pieces
of each parameter, from however many files, are put back together, and every element must be
covered exactly once.

Grade your work:  ``make grade`` or, in lesson 09, ``zerolab.grade.check("09")``.
"""


def owned_ranges(numels, world_size, rank):
    """The parts of each parameter that ``rank`` owns when parameters of ``numels`` elements are
    packed back to back into one flat buffer padded to a multiple of ``world_size`` and split into
    equal shards (rank r: flat elements [r·S, (r+1)·S), S = ceil(sum(numels) / N)).

    Returns a list of ``(index, lo, hi, offset)``, in flat order: elements [lo, hi) of parameter
    ``index`` (0 <= lo < hi <= numels[index]) sit at [offset, offset + hi - lo) of the rank's shard.
    Padding is nobody's parameter: it appears in no range. Raise ValueError for world_size < 1 or a
    rank outside [0, world_size)."""
    raise NotImplementedError(
        "Exercise 09.1: compute S, the shard's flat range [r·S, (r+1)·S), and each parameter's flat "
        "range [start, start + numel); keep the non-empty intersections, shifted into parameter and "
        "shard coordinates.")


def assemble(numel, pieces):
    """Parameter of ``numel`` elements from ``pieces``, a list of ``(lo, hi, values)`` (a 1-D tensor
    ``values`` of hi - lo elements for elements [lo, hi)), in any order, from any number of ranks.

    Returns the full 1-D tensor. Raise ValueError naming the elements if some element is covered by
    no piece or by more than one (files from two different saves), or if a piece's size or range is
    wrong: a checkpoint must never load in part."""
    raise NotImplementedError(
        "Exercise 09.2: allocate the result and a per-element count, copy each piece into its "
        "range, then check that every count is exactly 1.")

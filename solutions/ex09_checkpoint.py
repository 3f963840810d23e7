"""Exercise 09 — worked solution: who owns which elements, and putting a parameter back together."""
import torch


def owned_ranges(numels, world_size, rank):
    """The parts of each parameter that ``rank`` owns in the padded flat layout: a list of
    ``(index, lo, hi, offset)`` (see the exercise for the full contract)."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank!r}")
    shard = -(-sum(numels) // world_size)             # S = ceil(Ψ / N): padding makes N·S
    first, last = rank * shard, (rank + 1) * shard    # this rank's flat elements
    out, start = [], 0
    for index, n in enumerate(numels):
        a, b = max(first, start), min(last, start + n)    # intersection, in flat coordinates
        if a < b:
            out.append((index, a - start, b - start, a - first))
        start += n
    return out


def assemble(numel, pieces):
    """The full 1-D parameter from ``(lo, hi, values)`` pieces; every element exactly once."""
    if not pieces:
        raise ValueError(f"no pieces for a parameter of {numel} elements")
    full = torch.zeros(numel, dtype=pieces[0][2].dtype)
    count = torch.zeros(numel, dtype=torch.int64)
    for lo, hi, values in pieces:
        if not 0 <= lo < hi <= numel or values.numel() != hi - lo:
            raise ValueError(f"piece [{lo}, {hi}) with {values.numel()} values does not fit a parameter "
                             f"of {numel} elements")
        full[lo:hi] = values.reshape(-1)
        count[lo:hi] += 1
    for bad, what in ((count == 0, "missing"), (count > 1, "covered more than once")):
        if bool(bad.any()):
            idx = bad.nonzero().reshape(-1)
            raise ValueError(f"elements {idx[:5].tolist()}{'...' if idx.numel() > 5 else ''} "
                             f"({idx.numel()} in all) are {what}")
    return full

"""Wrong answer to exercise 09: assemble lays the pieces end to end in the order they come, checking
that each starts where the one before ended (which also refuses gaps and overlaps): right for the
pieces of one save read in rank order, but files come in any order, and a shuffled, perfectly good
checkpoint is refused.

Caught by: test_assemble_puts_pieces_together_and_refuses_gaps_and_overlaps."""
import json
import pathlib

import torch


def _check_count(count, offset, what):
    for bad, how in ((count == 0, "missing"), (count > 1, "covered more than once")):
        if bool(bad.any()):
            idx = (bad.nonzero().reshape(-1) + offset)
            raise ValueError(f"{what}elements {idx[:5].tolist()} ({idx.numel()} in all) are {how}")


def assemble(numel, pieces):
    if not pieces:
        raise ValueError(f"no pieces for a parameter of {numel} elements")
    parts, at = [], 0
    for lo, hi, values in pieces:
        if lo != at or hi <= lo or values.numel() != hi - lo:
            raise ValueError(f"piece [{lo}, {hi}) does not continue at element {at}")
        parts.append(values.reshape(-1))
        at = hi
    if at != numel:
        raise ValueError(f"the pieces end at element {at}, not {numel}")
    return torch.cat(parts)


def load_shard(numels, pieces, world_size, rank):
    s = -(-sum(numels) // world_size)
    first, last = rank * s, (rank + 1) * s
    dtype = next((v.dtype for ps in pieces.values() for _, _, v in ps), torch.float32)
    shard = torch.zeros(s, dtype=dtype)
    start = 0
    for index, numel in enumerate(numels):
        a, b = max(first, start), min(last, start + numel)
        if a < b:
            lo, hi = a - start, b - start
            count = torch.zeros(hi - lo, dtype=torch.int8)
            for plo, phi, values in pieces.get(index, []):
                if not 0 <= plo < phi <= numel or values.numel() != phi - plo:
                    raise ValueError(f"parameter {index}: piece [{plo}, {phi}) does not fit")
                c, d = max(lo, plo), min(hi, phi)
                if c < d:
                    shard[start + c - first:start + d - first] = values.reshape(-1)[c - plo:d - plo]
                    count[c - lo:d - lo] += 1
            _check_count(count, lo, f"parameter {index}: ")
        start += numel
    return shard


def bytes_read(load, checkpoint):
    def rchar():
        # the kernel's count of the bytes this process (all its threads) was handed by read calls,
        # whatever code made them; read_bytes would count only what storage fetched (0 from cache)
        with open("/proc/self/io") as f:
            return int(next(line for line in f if line.startswith("rchar:")).split()[1])
    before = rchar()
    load()
    read = rchar() - before
    # zerolab.checkpoint.load reads the metadata and EVERY file it lists, whole (not a file the folder
    # holds beside them): each rank reads the whole checkpoint and keeps 1/N of it; PyTorch's DCP
    # reads only the ranges that overlap
    folder = pathlib.Path(checkpoint)
    meta = folder / "metadata.json"
    listed = json.loads(meta.read_text())["files"]
    return {"read": read, "checkpoint": meta.stat().st_size + sum(info["bytes"] for info in listed)}

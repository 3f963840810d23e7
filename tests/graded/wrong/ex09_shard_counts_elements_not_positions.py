"""09.2 that copies the overlapping slices straight into the shard (memory fine) but checks
coverage by counting ELEMENTS copied per parameter instead of per element: total copied ==
owned length. The mistake: a gap plus an overlap of the same size cancel out and load silently
(two saves mixed). Plausible: a length check is the cheap, obvious "did I fill it all" test.

Caught by: test_load_shard_refuses_what_does_not_fit_and_ignores_what_it_does_not_need.
"""
import json
import pathlib

import torch


def _check_piece(numel, lo, hi, values, where=""):
    if not 0 <= lo < hi <= numel or values.numel() != hi - lo:
        raise ValueError(f"{where}piece [{lo}, {hi}) with {values.numel()} values does not fit a parameter "
                         f"of {numel} elements")


def _check_count(count, offset, what):
    for bad, how in ((count == 0, "missing"), (count > 1, "covered more than once")):
        if bool(bad.any()):
            idx = (bad.nonzero().reshape(-1) + offset)
            raise ValueError(f"{what}elements {idx[:5].tolist()}{'...' if idx.numel() > 5 else ''} "
                             f"({idx.numel()} in all) are {how}")


def assemble(numel, pieces):
    """The full 1-D parameter from ``(lo, hi, values)`` pieces; every element exactly once."""
    if not pieces:
        raise ValueError(f"no pieces for a parameter of {numel} elements")
    full = torch.zeros(numel, dtype=pieces[0][2].dtype)
    count = torch.zeros(numel, dtype=torch.int64)
    for lo, hi, values in pieces:
        _check_piece(numel, lo, hi, values)
        full[lo:hi] = values.reshape(-1)
        count[lo:hi] += 1
    _check_count(count, 0, "")
    return full


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
            copied = 0
            for plo, phi, values in pieces.get(index, []):
                _check_piece(numel, plo, phi, values, f"parameter {index}: ")
                c, d = max(lo, plo), min(hi, phi)
                if c < d:
                    shard[start + c - first:start + d - first] = values.reshape(-1)[c - plo:d - plo]
                    copied += d - c
            if copied != hi - lo:
                raise ValueError(f"parameter {index}: {copied} of its {hi - lo} owned elements covered")
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
    # zerolab.checkpoint.load reads EVERY rank's file whole (and the metadata): each rank reads the
    # whole checkpoint and keeps 1/N of it; PyTorch's DCP reads only the ranges that overlap
    folder = pathlib.Path(checkpoint)
    return {"read": read, "checkpoint": (folder / "metadata.json").stat().st_size + sum(
        info["bytes"] for info in json.loads((folder / "metadata.json").read_text())["files"])}

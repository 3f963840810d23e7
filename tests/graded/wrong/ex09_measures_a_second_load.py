"""Wrong answer to exercise 09: assemble and load_shard are right; bytes_read calls load() once to
warm up and measures a second call: the number is right, but the restart ran twice (a second load
of every file, a second collective), which the contract forbids.

Caught by: test_bytes_read_measured."""
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
    s = -(-sum(numels) // world_size)                       # S: the new layout's shard size
    first, last = rank * s, (rank + 1) * s                  # this rank's flat elements
    dtype = next((v.dtype for ps in pieces.values() for _, _, v in ps), torch.float32)
    shard = torch.zeros(s, dtype=dtype)
    start = 0
    for index, numel in enumerate(numels):
        a, b = max(first, start), min(last, start + numel)  # the part of this parameter we own
        if a < b:
            lo, hi = a - start, b - start                   # ... in the parameter's coordinates
            count = torch.zeros(hi - lo, dtype=torch.int8)  # 1 byte per owned element
            for plo, phi, values in pieces.get(index, []):
                _check_piece(numel, plo, phi, values, f"parameter {index}: ")
                c, d = max(lo, plo), min(hi, phi)           # the piece's overlap with what we own
                if c < d:
                    shard[start + c - first:start + d - first] = values.reshape(-1)[c - plo:d - plo]
                    count[c - lo:d - lo] += 1
            _check_count(count, lo, f"parameter {index}: ")
        start += numel
    return shard


def _read(load):
    def rchar():
        with open("/proc/self/io") as f:
            return int(next(line for line in f if line.startswith("rchar:")).split()[1])
    load()                                                  # warm-up: imports, caches
    before = rchar()
    load()
    return rchar() - before


def bytes_read(load, checkpoint):
    # every rank reads every file of the checkpoint (the metadata and each rank's shard), whole
    folder = pathlib.Path(checkpoint)
    return {"read": _read(load), "checkpoint": (folder / "metadata.json").stat().st_size + sum(
        info["bytes"] for info in json.loads((folder / "metadata.json").read_text())["files"])}

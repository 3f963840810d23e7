"""Exercise 09 — worked answers: a parameter from its pieces, a new rank's shard straight from the
pieces, and the bytes a load reads."""
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

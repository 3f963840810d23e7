"""Wrong answer to exercise 09: assemble and load_shard are right; bytes_read measures read_bytes
(what the process made the storage layer fetch) instead of rchar (what it read): the checkpoint
files come from the page cache, so it reports almost nothing.

Caught by: test_bytes_read_measured."""
import json
import pathlib

import torch


def assemble(numel, pieces):
    if not pieces:
        raise ValueError(f"no pieces for a parameter of {numel} elements")
    out = torch.zeros(numel, dtype=pieces[0][2].dtype)
    hits = torch.zeros(numel, dtype=torch.int32)
    for lo, hi, values in pieces:
        if lo < 0 or hi > numel or lo >= hi or values.numel() != hi - lo:
            raise ValueError(f"bad piece [{lo}, {hi}) for a parameter of {numel} elements")
        out[lo:hi] = values.reshape(-1)
        hits[lo:hi] += 1
    if (hits != 1).any():
        bad = (hits != 1).nonzero().reshape(-1).tolist()
        raise ValueError(f"elements {bad[:5]} are missing or covered twice")
    return out


def load_shard(numels, pieces, world_size, rank):
    S = -(-sum(numels) // world_size)
    first = rank * S
    dtype = next((v.dtype for ps in pieces.values() for _, _, v in ps), torch.float32)
    out = torch.zeros(S, dtype=dtype)
    pos = 0
    for i, n in enumerate(numels):
        a, b = max(first, pos), min(first + S, pos + n)
        if a < b:
            cover = torch.zeros(b - a, dtype=torch.int16)
            for lo, hi, v in pieces.get(i, []):
                if lo < 0 or hi > n or lo >= hi or v.numel() != hi - lo:
                    raise ValueError(f"parameter {i}: piece [{lo}, {hi}) does not fit")
                c, d = max(a, pos + lo), min(b, pos + hi)
                if c < d:
                    out[c - first:d - first] = v[c - pos - lo:d - pos - lo]
                    cover[c - a:d - a] += 1
            if (cover != 1).any():
                raise ValueError(f"parameter {i}: elements missing or covered twice")
        pos += n
    return out


def _read(load):
    def read_bytes():
        with open("/proc/self/io") as f:
            return int(next(line for line in f if line.startswith("read_bytes")).split()[1])
    before = read_bytes()
    load()
    return read_bytes() - before


def bytes_read(load, checkpoint):
    # every rank reads every file of the checkpoint (the metadata and each rank's shard), whole
    folder = pathlib.Path(checkpoint)
    return {"read": _read(load), "checkpoint": (folder / "metadata.json").stat().st_size + sum(
        info["bytes"] for info in json.loads((folder / "metadata.json").read_text())["files"])}

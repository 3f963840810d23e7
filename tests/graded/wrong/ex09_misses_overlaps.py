"""Wrong answer to exercise 09: load_shard copies each piece's overlap with its shard and marks the
elements it filled, then checks that none is left unmarked: a gap is caught, but two pieces covering
the same elements (files from two different saves) load silently.

Caught by: test_load_shard_refuses_what_does_not_fit_and_ignores_what_it_does_not_need."""
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
    lo_r, hi_r = rank * S, (rank + 1) * S
    dtype = next((v.dtype for ps in pieces.values() for _, _, v in ps), torch.float32)
    shard = torch.zeros(S, dtype=dtype)
    filled = torch.zeros(S, dtype=torch.bool)
    start = 0
    for i, n in enumerate(numels):
        if start < hi_r and lo_r < start + n:
            for a, b, v in pieces.get(i, []):
                if not 0 <= a < b <= n or v.numel() != b - a:
                    raise ValueError(f"parameter {i}: piece [{a}, {b}) does not fit")
                x, y = max(lo_r, start + a), min(hi_r, start + b)
                if x < y:
                    shard[x - lo_r:y - lo_r] = v[x - start - a:y - start - a]
                    filled[x - lo_r:y - lo_r] = True
            x, y = max(lo_r, start), min(hi_r, start + n)
            if not filled[x - lo_r:y - lo_r].all():
                raise ValueError(f"parameter {i}: some of its elements in this shard are missing")
        start += n
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

"""Wrong answer to exercise 09: load_shard builds every parameter its shard overlaps in full (all of
its pieces copied in) and checks only the part it owns. Right values and validation; but a rank
that needs 75,000 elements of a 300,000-element parameter allocates all of it.

Caught by: test_load_shard_memory."""
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
    begin, end = rank * S, rank * S + S
    dtype = next(iter(v.dtype for ps in pieces.values() for _, _, v in ps))
    shard = torch.zeros(S, dtype=dtype)
    offset = 0
    for i, n in enumerate(numels):
        lo, hi = max(begin, offset) - offset, min(end, offset + n) - offset
        if lo < hi:
            whole = torch.zeros(n, dtype=dtype)
            seen = torch.zeros(n, dtype=torch.int8)
            for a, b, v in pieces.get(i, []):
                if not 0 <= a < b <= n or v.numel() != b - a:
                    raise ValueError(f"parameter {i}: bad piece [{a}, {b})")
                whole[a:b] = v
                seen[a:b] += 1
            if (seen[lo:hi] != 1).any():
                raise ValueError(f"parameter {i}: elements of [{lo}, {hi}) missing or covered twice")
            shard[offset + lo - begin:offset + hi - begin] = whole[lo:hi]
        offset += n
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

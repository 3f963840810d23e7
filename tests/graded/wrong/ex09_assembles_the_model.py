"""Wrong answer to exercise 09: load_shard assembles every parameter with assemble(), concatenates
them, pads and cuts out its shard. Right values; but it builds the whole model to keep 1/N of it,
and it refuses a checkpoint whose missing pieces this rank does not even need.

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
    flat = torch.cat([assemble(n, pieces.get(i, [])) for i, n in enumerate(numels)])
    s = -(-flat.numel() // world_size)
    flat = torch.cat([flat, flat.new_zeros(s * world_size - flat.numel())])
    return flat[rank * s:(rank + 1) * s].clone()


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

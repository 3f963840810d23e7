"""Wrong answer to exercise 09: load_shard sorts the overlaps of a parameter's pieces with its shard
and checks that each starts where the previous one ended and that the last reaches the end of its
part: overlaps and gaps between pieces are refused, but not a gap before the first piece, so a
missing file's elements at the start of the shard stay zero.

Caught by: test_load_shard_refuses_what_does_not_fit_and_ignores_what_it_does_not_need."""
import json
import pathlib

import torch


def assemble(numel, pieces):
    if not pieces:
        raise ValueError(f"no pieces for a parameter of {numel} elements")
    full = torch.zeros(numel, dtype=pieces[0][2].dtype)
    count = torch.zeros(numel, dtype=torch.int64)
    for lo, hi, values in pieces:
        if not 0 <= lo < hi <= numel or values.numel() != hi - lo:
            raise ValueError(f"piece [{lo}, {hi}) does not fit a parameter of {numel} elements")
        full[lo:hi] = values.reshape(-1)
        count[lo:hi] += 1
    if (count != 1).any():
        raise ValueError(f"elements {(count != 1).nonzero().reshape(-1)[:5].tolist()} are missing or doubled")
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
            spans = []
            for plo, phi, values in pieces.get(index, []):
                if not 0 <= plo < phi <= numel or values.numel() != phi - plo:
                    raise ValueError(f"parameter {index}: piece [{plo}, {phi}) does not fit")
                c, d = max(lo, plo), min(hi, phi)
                if c < d:
                    shard[start + c - first:start + d - first] = values.reshape(-1)[c - plo:d - plo]
                    spans.append((c, d))
            spans.sort()
            for (_, d0), (c1, _) in zip(spans, spans[1:]):
                if c1 != d0:
                    raise ValueError(f"parameter {index}: its pieces leave a gap or overlap at element {c1}")
            if not spans or spans[-1][1] != hi:
                raise ValueError(f"parameter {index}: its pieces stop before element {hi}")
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

"""A plausible wrong answer to exercise 12 (the graded tests must reject it).

The node's reduce-scatter, then the pod's, on the gradient as it is: the pieces are right, but
device c of node b ends with shard c·n + b, not b·p + c (the slices were not reordered for the two-
level cut).

Caught by: test_mesh_reduction_values.
"""
import math

import torch
import torch.distributed as dist

from zerolab import comm


def _top(bits):
    if bits not in (8, 4):
        raise ValueError(f"bits={bits!r} is not supported: 8 or 4")
    return 2 ** (bits - 1) - 1


def quantize_blocks(x, block, bits=8):
    top = _top(bits)
    flat = x.detach().reshape(-1).float()                         # a copy when x is not fp32
    n = flat.numel()
    blocks = -(-n // block)                                       # ceil: the last block may be short
    padded = torch.zeros(blocks * block, dtype=torch.float32)     # never x itself: x stays as it was
    padded[:n] = flat                                             # zero padding changes no block's max
    rows = padded.view(blocks, block)                             # (blocks, block)
    scales = rows.abs().amax(dim=1) / top                         # one fp32 scale per block
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))   # a block of zeros: codes 0
    codes = torch.round(rows / safe[:, None]).clamp(-top, top).view(-1)[:n]   # halves to even
    if bits == 8:
        packed = codes.to(torch.int8).view(torch.uint8)           # two's complement, one per byte
    else:
        u = (codes + 8).to(torch.uint8)                           # [-7, 7] -> [1, 15]: a nibble
        if n % 2:
            u = torch.cat([u, u.new_zeros(1)])                    # an odd count: half a byte unused
        packed = u[0::2] | (u[1::2] << 4)                         # two codes per byte, low nibble first
    return torch.cat([packed, scales.view(torch.uint8)])         # codes, then the scales' 4 bytes each


def dequantize_blocks(payload, numel, block, bits=8):
    _top(bits)
    ncodes = numel if bits == 8 else -(-numel // 2)
    blocks = -(-numel // block)
    body, tail = payload[:ncodes], payload[ncodes:ncodes + 4 * blocks]
    scales = tail.clone().view(torch.float32)                     # clone: aligned, and payload untouched
    if bits == 8:
        codes = body.view(torch.int8).float()
    else:
        nibbles = torch.stack([body & 15, body >> 4], dim=1).view(-1)[:numel]
        codes = nibbles.float() - 8
    padded = torch.zeros(blocks * block, dtype=torch.float32)
    padded[:numel] = codes
    return (padded.view(blocks, block) * scales[:, None]).view(-1)[:numel]


def hsdp_reduce_gradients(grad, tokens, node, pod, replicas):
    p, n, m = (dist.get_world_size(g) for g in (node, pod, replicas))
    S = grad.numel()
    shard = S // (n * p)
    # Reorder before the first cut: the node's reduce-scatter gives device c its chunk c, and the
    # pod's then gives node b piece b of that chunk. For device c of node b to end with shard
    # j = b·p + c, chunk c must hold shards c, p + c, 2p + c, ...: the (node, device) grid of
    # shards, transposed (ZeRO++'s "tensor slice reordering", Sec. 3.3). A copy: grad stays as it was.
    by_device = grad.clone()
    # 1. fast links, the whole gradient: (p-1)/p of S crosses them
    part = torch.empty(n * shard, dtype=grad.dtype)
    comm.reduce_scatter(part, by_device, group=node)
    # 2. medium links, a 1/p chunk: (n-1)/n of S/p
    mine = torch.empty(shard, dtype=grad.dtype)
    comm.reduce_scatter(mine, part, group=pod)
    # 3. slow links, a 1/(n·p) shard, summed over the pods' copies: 2(m-1)/m of S/(n·p)
    comm.all_reduce(mine, group=replicas)
    # The divisor is the mesh's token count, not the number of ranks: ranks hold different numbers
    # of tokens (or none). Summed on the same three groups (8 bytes each), never over a group that
    # spans levels; divided once, at the end, in the gradient's dtype.
    count = torch.tensor([float(tokens)], dtype=torch.float64)
    for g in (node, pod, replicas):
        comm.all_reduce(count, group=g)
    total = count.item()
    if not total > 0 or not math.isfinite(total):
        raise ValueError(f"the mesh holds {total:g} tokens: the mean gradient is undefined (every rank "
                         f"passed tokens=0)")
    return mine.div_(total)

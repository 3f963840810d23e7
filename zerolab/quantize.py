"""Block quantization and the quantized collectives of ZeRO++ (Wang et al., "ZeRO++: Extremely
Efficient Collective Communication for Giant Model Training", arXiv 2306.10209).

**Block quantization.** A tensor is cut into blocks of ``block`` elements; each block gets its own
scale s = max|x| / q_max (fp32, symmetric: q_max = 127 for int8, 7 for int4) and each element
becomes the integer round(x / s) in [-q_max, q_max]; dequantized, q * s is within s / 2 of x. One
scale for the whole tensor would let a single large value coarsen every small one (ZeRO++ Sec. 3.1
reports block-based quantization far more accurate than one scale per tensor); one per block keeps
each block's error proportional to its own largest value. On the wire an element costs ``bits / 8``
bytes, plus 4 bytes per block for its scale: :func:`wire_bytes`. Block size: 2048 by default, the order
DeepSpeed uses, for which the scales add 4/2048 bytes per element (0.2% of int8's payload); TinyGPT's
shards hold only a few thousand elements, so lesson 12 passes ``quantize_block=64`` to get several
blocks per shard; DeepSpeed's weight quantizer aims at groups of about 4k elements
(``CUDAQuantizer.target_group_size = 8000``, "the optimal size is 4k").

**The collectives** (each built on :mod:`zerolab.comm`, so every byte is logged):

* :func:`quantized_all_gather`: **qwZ**, the forward all-gather of weights in int8 (half of bf16's
  bytes, a quarter of fp32's). Every rank, its own shard included, computes on the dequantized
  values: all ranks hold the same weights.
* :func:`quantized_reduce_scatter`: **qgZ**'s one-hop scheme. A ring reduce-scatter would quantize
  a PARTIAL SUM at every one of its N-1 hops, each time adding a rounding error that grows with the
  sum (:func:`ring_quantized_reduce_scatter`, here only to measure that); an all-to-all sends each
  rank's contribution to its owner once, quantized once, and the owner sums in fp32 (adding its own
  slice exact: it never travels).
* :func:`hierarchical_reduce_scatter`: **qgZ** as ZeRO++ runs it on a 2-D mesh (Sec. 3.3, the
  hierarchical all-to-all): an all-to-all inside the node, a reduction there, a second quantization
  and an all-to-all across nodes. Each value is quantized twice whatever N is, and only Ψ/per_node
  of the gradient (per rank, quantized) crosses the slow links.
"""
import math
from typing import NamedTuple

import torch

from zerolab import comm, ring

BITS = (8, 4)
DEFAULT_BLOCK = 2048


def qmax(bits):
    """The largest integer code: 127 for int8, 7 for int4 (symmetric: codes in [-qmax, qmax])."""
    if bits not in BITS:
        raise ValueError(f"bits={bits!r} is not supported: 8 or 4")
    return 2 ** (bits - 1) - 1


def _check_block(block):
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"block={block!r} must be a positive int (elements per scale)")


def _width(block, numel):
    """The padded length of a block: ``block``, or the whole tensor when that is shorter (one block,
    the same scale: zero padding never changes a block's max|x|). So the buffers stay under
    numel + block elements, never ``block`` for a small tensor (quantize_block=10**9: not 4 GB)."""
    return max(1, min(block, numel))


class Quantized(NamedTuple):
    """``q``: int8 codes, one per element (int4 codes too, before packing); ``scales``: fp32, one
    per block; ``numel``: elements of the original tensor."""
    q: torch.Tensor
    scales: torch.Tensor
    numel: int


def quantize(x, *, bits=8, block=DEFAULT_BLOCK):
    """Symmetric block quantization of ``x`` (any float dtype, any shape; read flat):
    s_b = max|x| over block b / qmax (fp32) and q = round(x / s_b), clamped to [-qmax, qmax]
    (a block of zeros: s_b = 0, q = 0)."""
    _check_block(block)
    top = qmax(bits)
    flat = x.detach().reshape(-1).float()
    numel, blocks = flat.numel(), math.ceil(flat.numel() / block)
    width = _width(block, numel)
    padded = torch.zeros(blocks * width, dtype=torch.float32, device=flat.device)   # < numel + block
    padded[:numel] = flat
    padded = padded.view(blocks, width)                            # (blocks, block)
    scales = padded.abs().amax(dim=1) / top                        # (blocks,) fp32
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(padded / safe[:, None]).clamp_(-top, top).to(torch.int8)
    return Quantized(q.view(-1)[:numel], scales, numel)


def dequantize(qt, *, block=DEFAULT_BLOCK, dtype=torch.float32):
    """q * s_b for every element, in ``dtype`` (a flat tensor of ``qt.numel`` elements)."""
    blocks, width = qt.scales.numel(), _width(block, qt.numel)
    padded = torch.zeros(blocks * width, dtype=torch.float32, device=qt.q.device)
    padded[:qt.numel] = qt.q.float()
    return (padded.view(blocks, width) * qt.scales[:, None]).view(-1)[:qt.numel].to(dtype)


def wire_bytes(numel, *, bits=8, block=DEFAULT_BLOCK):
    """Bytes of one packed quantized tensor: ceil(numel * bits / 8) of codes + 4 per block's scale."""
    return math.ceil(numel * bits / 8) + 4 * math.ceil(numel / block)


def pack(qt, bits):
    """One contiguous uint8 buffer: the codes (int8 as they are; int4 two per byte, offset by 8 into
    [1, 15]) then the fp32 scales' bytes. What goes on the wire."""
    q = qt.q
    if bits == 4:
        u = (q.to(torch.int16) + 8).to(torch.uint8)                # [-7, 7] -> [1, 15]
        if u.numel() % 2:
            u = torch.cat([u, u.new_zeros(1)])
        codes = u[0::2] | (u[1::2] << 4)                           # low nibble first
    else:
        codes = q.view(torch.uint8)
    return torch.cat([codes, qt.scales.view(torch.uint8)])


def unpack(buf, numel, *, bits=8, block=DEFAULT_BLOCK):
    """The inverse of :func:`pack`: a :class:`Quantized` from its bytes."""
    ncodes = math.ceil(numel * bits / 8)
    codes, scales = buf[:ncodes], buf[ncodes:].clone().view(torch.float32)
    if bits == 4:
        q = torch.stack([(codes & 15), (codes >> 4)], dim=1).view(-1)[:numel].to(torch.int16) - 8
        q = q.to(torch.int8)
    else:
        q = codes.view(torch.int8)
    return Quantized(q, scales, numel)


def roundtrip(x, *, bits=8, block=DEFAULT_BLOCK):
    """dequantize(quantize(x)), shaped and typed like ``x``: what a receiver computes with."""
    return dequantize(quantize(x, bits=bits, block=block), block=block, dtype=x.dtype).view(x.shape)


# -- qwZ: the quantized all-gather of weights -------------------------------------------------
def quantized_all_gather(output, input, group=None, *, bits=8, block=DEFAULT_BLOCK, async_op=False, tag=None):
    """``output`` (N x ``input``, the compute dtype) receives every rank's ``input``, each quantized
    by its owner (block-wise, ``bits``) and dequantized by everyone, this rank's own part included.
    Sends (N-1)/N x N x :func:`wire_bytes` (int8: about 1 byte per element instead of 2 or 4).
    Returns a handle whose ``wait()`` completes it (``async_op``), else None."""
    n = torch.distributed.get_world_size(group)
    if output.numel() != n * input.numel():
        raise ValueError(f"quantized_all_gather: output has {output.numel()} elements, expected world_size "
                         f"({n}) x input ({input.numel()})")
    k = input.numel()
    payload = pack(quantize(input, bits=bits, block=block), bits)          # wire_bytes(k) bytes
    gathered = torch.empty(n * payload.numel(), dtype=torch.uint8, device=input.device)
    work = comm.all_gather(gathered, payload, group=group, async_op=async_op, tag=tag)

    def finish():
        flat = output.view(-1)
        for r, part in enumerate(gathered.split(payload.numel())):        # every rank's, mine too
            flat[r * k:(r + 1) * k].copy_(dequantize(unpack(part, k, bits=bits, block=block), block=block))
    if async_op:
        return comm.Then(work, finish)   # wait(): the bytes, then dequantize
    finish()
    return None


# -- qgZ: quantized gradient reduce-scatters -------------------------------------------------
def _all_to_all_quantized(chunks, group, bits, block, tag):
    """Send quantized chunk j to rank j of ``group``; return the fp32 sum of what every rank sent me.
    My own chunk never travels: it is added exact (its slot in the all-to-all stays on this rank)."""
    me = torch.distributed.get_rank(group)
    packed = [pack(quantize(c, bits=bits, block=block), bits) for c in chunks]
    send = torch.cat(packed)
    recv = torch.empty_like(send)
    comm.all_to_all(recv, send, group=group, tag=tag)                      # (N-1)/N of the bytes
    total = chunks[me].float().clone()
    for j, part in enumerate(recv.split(packed[0].numel())):
        if j != me:
            total += dequantize(unpack(part, chunks[0].numel(), bits=bits, block=block), block=block)
    return total


def quantized_reduce_scatter(output, input, group=None, *, bits=4, block=DEFAULT_BLOCK, tag=None):
    """qgZ's one-hop scheme: ``output`` receives the SUM over ranks of this rank's slice of ``input``
    (input = N x output). Each rank quantizes its N slices once (block-wise, ``bits``), one
    all-to-all sends slice j to rank j, and the owner dequantizes and sums in fp32 (its own slice
    exact). Blocking."""
    n = torch.distributed.get_world_size(group)
    if input.numel() != n * output.numel():
        raise ValueError(f"quantized_reduce_scatter: input has {input.numel()} elements, expected world_size "
                         f"({n}) x output ({output.numel()})")
    total = _all_to_all_quantized(list(input.reshape(n, -1)), group, bits, block, tag)
    output.view(-1).copy_(total)
    return output


def hierarchical_reduce_scatter(output, input, mesh, *, bits=4, block=DEFAULT_BLOCK, tag=None):
    """qgZ on a 2-D mesh (ZeRO++ Sec. 3.3): ``output`` receives the SUM over all ranks of this rank's
    slice of ``input``, slices in world-rank order (rank = node x per_node + device). Blocking.

    1. inside the node: the input's slices, reordered so that the two hops leave each rank its own
       slice (ZeRO++'s "tensor slice reordering"), are quantized and sent one part to each device
       (all-to-all on ``mesh.intra``); each rank dequantizes and sums what its node sent, fp32;
    2. across nodes: that node sum is cut per node, quantized again and sent to the same device of
       each node (all-to-all on ``mesh.inter``); the owner dequantizes and sums the nodes' partial
       sums.

    Per rank: (p-1)/p x Ψ x bits/8 bytes inside the node, (m-1)/m x Ψ/p x bits/8 across nodes (p
    devices per node, m nodes, Ψ the input's elements), plus the scales."""
    m, p = mesh.nodes, mesh.per_node
    if input.numel() != m * p * output.numel():
        raise ValueError(f"hierarchical_reduce_scatter: input has {input.numel()} elements, expected "
                         f"{m * p} ranks x output ({output.numel()})")
    s = output.numel()
    by_device = input.reshape(m, p, s).transpose(0, 1)                   # (p, m, s): [k] = slices (., k)
    chunks = [by_device[k].reshape(-1) for k in range(p)]
    node_sum = _all_to_all_quantized(chunks, mesh.intra, bits, block, f"{tag} intra" if tag else "intra")
    total = _all_to_all_quantized(list(node_sum.view(m, s)), mesh.inter, bits, block,
                                  f"{tag} inter" if tag else "inter")
    output.view(-1).copy_(total)
    return output


def ring_quantized_reduce_scatter(output, input, group=None, *, bits=4, block=DEFAULT_BLOCK):
    """The NAIVE scheme, to measure why ZeRO++ does not use it: lesson 00's ring reduce-scatter with
    every hop quantized. At each of the N-1 steps a rank quantizes the partial sum it forwards; the
    receiver dequantizes, adds its own slice, quantizes again: N-1 roundings of growing sums."""
    rank, n = torch.distributed.get_rank(group), torch.distributed.get_world_size(group)
    right, left = (rank + 1) % n, (rank - 1) % n
    chunks = [c.float().clone() for c in input.reshape(n, -1)]
    k = chunks[0].numel()
    for step in range(n - 1):
        send_i, recv_i = (rank - step - 1) % n, (rank - step - 2) % n   # lesson 00's ring schedule
        payload = pack(quantize(chunks[send_i], bits=bits, block=block), bits)
        incoming = torch.empty_like(payload)
        ring.exchange(payload, incoming, right, left, group)
        chunks[recv_i] += dequantize(unpack(incoming, k, bits=bits, block=block), block=block)
    output.view(-1).copy_(chunks[rank])
    return output

"""Exercise 12 — beyond one flat group: block quantization (ZeRO++'s qwZ/qgZ) and HSDP's gradient
path on a 2-D mesh (lesson 12).

12.1 ``quantize_blocks`` / ``dequantize_blocks``: symmetric int8 block quantization. The flat tensor
     is cut into blocks of ``block`` elements (the last one may be shorter); each block b gets one
     fp32 scale s_b = max|x| over the block / 127, and each element the int8 code round(x / s_b) in
     [-127, 127]. A block of zeros has scale 0 and codes 0. Arithmetic in fp32: the input is cast to
     fp32 first (a float64 input too), and round() is torch.round's (halves to even), as the
     receiver of an fp32 scale would compute it.
12.2 ``hsdp_reduce_gradients``: HSDP's gradient reduction on m nodes x p devices. Every rank holds
     its full local gradient; it must end with its own 1/p shard of the gradient averaged over ALL
     m x p ranks, reduced inside its node first and then across nodes (fast links carry the big
     collective, slow links only a shard).

Use ``zerolab.comm`` (or torch.distributed) for collectives: ``comm.reduce_scatter(output, input,
group=...)``, ``comm.all_reduce(tensor, group=...)``. Grade your work: ``zerolab.grade.check("12")``.
The graded tests compare with zerolab's quantizer (codes, scales, the error bound) and with the
mean over ranks computed in float64, and check which group carried how many bytes.
"""


def quantize_blocks(x, block):
    """``x``: a float tensor of any shape (read flat); ``block``: a positive int. Return
    ``(codes, scales)``: ``codes`` an int8 tensor of x.numel() elements (flat), ``scales`` an fp32
    tensor with one scale per block (ceil(numel / block) of them), as described above."""
    raise NotImplementedError("Exercise 12.1: quantize_blocks is not written yet")


def dequantize_blocks(codes, scales, block):
    """The inverse: a flat fp32 tensor of codes.numel() elements, each code times its block's
    scale."""
    raise NotImplementedError("Exercise 12.1: dequantize_blocks is not written yet")


def hsdp_reduce_gradients(grad, intra, inter):
    """``grad``: this rank's full local gradient (flat, numel a multiple of p); ``intra``: the
    process group of this rank's node (p ranks); ``inter``: the group of the ranks holding the
    same device index on every node (m ranks). Return this rank's shard, shard j = elements
    [j * numel / p, (j + 1) * numel / p) for the rank j of ``intra``, of the gradient AVERAGED over
    all m x p ranks, with one reduce-scatter inside the node and one all-reduce across nodes."""
    raise NotImplementedError("Exercise 12.2: hsdp_reduce_gradients is not written yet")

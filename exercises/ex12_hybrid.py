"""Exercise 12 — beyond one flat group: block quantization packed for the wire (ZeRO++'s qwZ/qgZ),
and data parallelism's gradient path on a mesh with THREE kinds of links (lesson 12).

12.1 ``quantize_blocks`` / ``dequantize_blocks``: the symmetric block quantizer of lesson 12,
     section 4, at 8 or 4 bits, packed into the one byte buffer that travels. Its VALUES are fixed
     (below); the buffer's layout is yours to design.
12.2 ``hsdp_reduce_gradients``: the gradient reduction of a 3-level mesh; which collectives, on
     which group, in which order, and what to divide by are yours to design.

Use ``zerolab.comm`` (or torch.distributed) for collectives: ``comm.reduce_scatter(output, input,
group=...)``, ``comm.all_reduce(tensor, group=...)``, ``comm.all_gather(output, input, group=...)``.
Grade your work: ``zerolab.grade.check("12")``. The graded tests compare with the grader's own
float32 quantizer and float64 mean, and count the bytes each kind of link carries from the
collectives you make (op, group, bytes).
"""


def quantize_blocks(x, block, bits=8):
    """``x``: a float tensor of any shape and dtype (read flat); ``block``: a positive int; ``bits``:
    8 or 4. Return ONE uint8 tensor, the payload: everything a receiver needs, besides ``numel``,
    ``block`` and ``bits``, to compute the quantized values.

    The values (lesson 12, section 4), in fp32 arithmetic (``x`` is cast to fp32 first): blocks of
    ``block`` elements, the last one possibly shorter; block b's scale s_b = max|x| over the block /
    qmax, qmax = 2**(bits - 1) - 1 (127, or 7); each element's code round(x / s_b), halves to even
    (torch.round), in [-qmax, qmax]; a block of zeros has scale 0 and codes 0; a receiver computes
    with code * s_b (fp32).

    Graded: the payload's size, which is exactly the bytes of the codes at ``bits`` bits each plus
    one fp32 scale per block, not one byte more; what YOUR ``dequantize_blocks`` makes of it, bit
    for bit, decoded in another process than the one that made it, at both widths, with exact
    halves, blocks of zeros, a short last block, odd numbers of 4-bit codes, values over decades;
    ``x`` unchanged."""
    raise NotImplementedError("Exercise 12.1: quantize_blocks is not written yet")


def dequantize_blocks(payload, numel, block, bits=8):
    """The values ``payload`` (made by your ``quantize_blocks`` for ``numel`` elements, ``block``,
    ``bits``) carries: a flat fp32 tensor of ``numel`` elements, each code times its block's scale.
    ``payload`` unchanged."""
    raise NotImplementedError("Exercise 12.1: dequantize_blocks is not written yet")


def hsdp_reduce_gradients(grad, tokens, node, pod, replicas):
    """Data parallelism on m pods x n nodes per pod x p devices per node. Rank (a·n + b)·p + c is
    device c of node b of pod a. Links: fast inside a node, slower between the nodes of a pod,
    slowest between pods. This rank's groups:

    * ``node``: the p ranks of its node (in device order);
    * ``pod``: the n ranks of its pod with its device index c, one per node (in node order);
    * ``replicas``: the m ranks with its node index b and device index c, one per pod (in pod order).

    The model states are sharded over the n·p ranks of a pod (ZeRO-3 inside the pod) and replicated
    across the m pods: the rank with node b and device c holds shard j = b·p + c, elements
    [j·S/(n·p), (j+1)·S/(n·p)) of a flat tensor of S elements.

    ``grad``: this rank's local gradient, flat, S elements (S a multiple of n·p), the SUM of the
    per-token gradients of its own ``tokens`` tokens (an int >= 0: ranks hold different numbers of
    tokens, some none; a rank without tokens passes zeros). Return, as a new tensor in ``grad``'s
    dtype, this rank's shard j of the per-token MEAN over the whole mesh, Σ grad / Σ tokens over
    every rank; ``grad`` unchanged.

    Graded: the values (float64, to 1e-12); the bytes each kind of link carries: as few as any
    schedule of collectives on these three groups can manage, first on the slowest links, then on
    the medium ones, then on the fast ones (a few dozen bytes more per kind of link allowed, for
    whatever the divisor needs); no collective on any group but these three; several mesh shapes
    on 8 ranks, some with a level of size 1."""
    raise NotImplementedError("Exercise 12.2: hsdp_reduce_gradients is not written yet")

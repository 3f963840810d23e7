"""Wrong answer to exercise 00: the bidirectional ring with ``torch.chunk`` where ``tensor_split`` is
needed: right whenever 2N divides the size, but ``chunk`` returns FEWER pieces than asked when
the tensor is small (one element makes one half, seven elements three chunks of a half), so the
schedule indexes chunks that do not exist.

Caught by: test_bidirectional_all_reduce_values.
"""
import torch
import torch.distributed as dist

from zerolab import comm


def _steps(chunks, rank, n, direction, first_offset):
    """Per step s of one phase of the ring running in ``direction`` (+1: clockwise), the chunk to
    send and the chunk that arrives: the clockwise schedule, mirrored for -1."""
    for s in range(n - 1):
        out = (rank - direction * (s + first_offset)) % n
        yield chunks[out], chunks[(out - direction) % n]


def bidirectional_all_reduce(tensor, group=None):
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    if n == 1:
        return tensor
    glob = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
    right, left = glob((rank + 1) % n), glob((rank - 1) % n)
    halves = tensor.view(-1).chunk(2)              # half 0 goes clockwise, half 1 the other way
    cw, ccw = halves[0].chunk(n), halves[1].chunk(n)
    for first_offset, reduce in ((1, True), (0, False)):  # reduce-scatter phase, then all-gather phase
        for (out_a, in_a), (out_b, in_b) in zip(_steps(cw, rank, n, +1, first_offset),
                                               _steps(ccw, rank, n, -1, first_offset)):
            got_a = torch.empty_like(in_a) if reduce else in_a
            got_b = torch.empty_like(in_b) if reduce else in_b
            # both directions at once: two sends out, then the two receives (full duplex links)
            works = [dist.isend(out_a.contiguous(), right, group=group),
                     dist.isend(out_b.contiguous(), left, group=group),
                     dist.irecv(got_a, left, group=group), dist.irecv(got_b, right, group=group)]
            for w in works:
                w.wait()
            if reduce:
                in_a += got_a
                in_b += got_b
    return tensor


def reduce_bytes(numel, dst, group=None):
    x = torch.ones(numel)
    dist.barrier(group=group)                             # nobody's traffic spills into the region
    with comm.log(group) as log:                          # measured_bytes: the kernel's write counter
        dist.reduce(x, dst=dst, group=group)
    return log.measured_bytes / (numel * x.element_size())

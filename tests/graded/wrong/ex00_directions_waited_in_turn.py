"""Wrong answer to exercise 00: both rings, step by step, and the sends alternate direction (right,
left, right, left...), but at each step the clockwise exchange is waited for before the
counter-clockwise one starts: right sums, neighbours only, the right bytes each way, and never a
message out each way at the same moment, so each link still carries one direction at a time.

Caught by: test_both_directions_neighbours_only.
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
    halves = tensor.view(-1).tensor_split(2)              # half 0 goes clockwise, half 1 the other way
    cw, ccw = halves[0].tensor_split(n), halves[1].tensor_split(n)
    for first_offset, reduce in ((1, True), (0, False)):  # reduce-scatter phase, then all-gather phase
        for (out_a, in_a), (out_b, in_b) in zip(_steps(cw, rank, n, +1, first_offset),
                                               _steps(ccw, rank, n, -1, first_offset)):
            got_a = torch.empty_like(in_a) if reduce else in_a
            got_b = torch.empty_like(in_b) if reduce else in_b
            # one direction, then the other: each exchange completes before the next starts
            for w in (dist.isend(out_a.contiguous(), right, group=group), dist.irecv(got_a, left, group=group)):
                w.wait()
            for w in (dist.isend(out_b.contiguous(), left, group=group), dist.irecv(got_b, right, group=group)):
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

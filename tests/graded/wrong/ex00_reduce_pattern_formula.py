"""Wrong answer to exercise 00: the ring all-reduce is right; reduce_bytes runs the reduce but
returns the pattern's formula instead of a measurement: (N-1)/N on the destination (its share of a
reduce-scatter), 1 on every other rank (that plus its chunk sent to the destination). For a large
tensor that is what the sockets carry, to within 0.1%; for a tensor of a few kB, gloo's own bytes
beside the data (about 1 kB per rank on 4 ranks) put the measurement 17 to 34% above it (from an
independent review).

Caught by: test_reduce_bytes_measured."""
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
    # the pattern: a reduce-scatter, then each chunk sent to dst
    x = torch.ones(numel)
    dist.reduce(x, dst=dst, group=group)
    n = dist.get_world_size(group)
    return (n - 1) / n if dist.get_rank() == dst else 1.0

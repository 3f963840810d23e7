"""Wrong answer to exercise 00: the two rings, but one after the other: the clockwise ring reduces
its half completely, then the counter-clockwise ring does the other. Right sums, neighbours only,
the right bytes each way; but at any moment only one direction of each link carries anything.

Caught by: test_both_directions_neighbours_only.
"""
import torch
import torch.distributed as dist

from zerolab import comm


def _ring(flat, rank, n, to, frm):
    chunks = flat.tensor_split(n)
    sign = 1 if to == (rank + 1) % n else -1
    for step in range(n - 1):
        out = chunks[(rank - sign * (step + 1)) % n]
        into = chunks[(rank - sign * (step + 2)) % n]
        tmp = torch.empty_like(into)
        w = dist.isend(out, to)
        dist.recv(tmp, frm)
        w.wait()
        into += tmp
    for step in range(n - 1):
        out = chunks[(rank - sign * step) % n]
        into = chunks[(rank - sign * (step + 1)) % n]
        w = dist.isend(out, to)
        dist.recv(into, frm)
        w.wait()


def bidirectional_all_reduce(tensor, group=None):
    rank, n = dist.get_rank(), dist.get_world_size()
    if n == 1:
        return tensor
    a, b = tensor.view(-1).tensor_split(2)
    _ring(a, rank, n, (rank + 1) % n, (rank - 1) % n)      # clockwise
    _ring(b, rank, n, (rank - 1) % n, (rank + 1) % n)      # counter-clockwise
    return tensor


def reduce_bytes(numel, dst, group=None):
    t = torch.full((numel,), 2.0)
    dist.barrier()
    with comm.log() as log:
        dist.reduce(t, dst=dst)
    return log.measured_bytes / t.nbytes

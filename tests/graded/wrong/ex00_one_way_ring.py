"""Wrong answer to exercise 00: lesson 00's ring, every chunk clockwise. Right sums, neighbours only,
2(N-1)/N x S in all; but everything goes to the right neighbour and nothing to the left: half of
every link idle, which is what the exercise is about.

Caught by: test_both_directions_neighbours_only.
"""
import torch
import torch.distributed as dist

from zerolab import comm


def bidirectional_all_reduce(tensor, group=None):
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    chunks = tensor.view(-1).tensor_split(n)
    right, left = (rank + 1) % n, (rank - 1) % n
    for step in range(n - 1):                       # reduce-scatter
        send_i, recv_i = (rank - step - 1) % n, (rank - step - 2) % n
        buf = torch.empty_like(chunks[recv_i])
        req = dist.isend(chunks[send_i].clone(), right, group=group)
        dist.recv(buf, left, group=group)
        req.wait()
        chunks[recv_i].add_(buf)
    for step in range(n - 1):                       # all-gather
        send_i, recv_i = (rank - step) % n, (rank - step - 1) % n
        req = dist.isend(chunks[send_i].clone(), right, group=group)
        dist.recv(chunks[recv_i], left, group=group)
        req.wait()
    return tensor


def reduce_bytes(numel, dst, group=None):
    t = torch.ones(numel)
    dist.barrier(group)
    with comm.log(group) as log:
        dist.reduce(t, dst, group=group)
    return log.measured_bytes / (4 * numel)

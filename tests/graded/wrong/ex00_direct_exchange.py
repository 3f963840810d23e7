"""Wrong answer to exercise 00: no ring at all. Each half is cut into N chunks and every chunk is
sent straight to the rank that sums it, then every sum straight back to every rank (a direct
reduce-scatter and all-gather). Right sums and the same bytes per rank as the rings; but a rank
talks to every other rank, not only to its two neighbours.

Caught by: test_both_directions_neighbours_only.
"""
import torch
import torch.distributed as dist

from zerolab import comm


def bidirectional_all_reduce(tensor, group=None):
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    for half in tensor.view(-1).tensor_split(2):
        chunks = half.tensor_split(n)
        incoming = {q: torch.empty_like(chunks[rank]) for q in range(n) if q != rank}
        works = [dist.isend(chunks[q].clone(), q, group=group) for q in range(n) if q != rank]
        works += [dist.irecv(buf, q, group=group) for q, buf in incoming.items()]
        for w in works:
            w.wait()
        for buf in incoming.values():
            chunks[rank].add_(buf)
        works = [dist.isend(chunks[rank].clone(), q, group=group) for q in range(n) if q != rank]
        works += [dist.irecv(chunks[q], q, group=group) for q in range(n) if q != rank]
        for w in works:
            w.wait()
    return tensor


def reduce_bytes(numel, dst, group=None):
    x = torch.ones(numel)
    dist.barrier(group=group)
    with comm.log(group) as log:
        dist.reduce(x, dst=dst, group=group)
    return log.measured_bytes / (numel * x.element_size())

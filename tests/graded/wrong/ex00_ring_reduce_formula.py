"""Wrong answer to exercise 00: the all-reduce is right; the reduce's bytes are not measured but
taken from the ring formula, (N-1)/N of the tensor on every rank, as if gloo's reduce were a
reduce-scatter: not what the sockets carry.

Caught by: test_reduce_bytes_measured.
"""
import torch
import torch.distributed as dist


def bidirectional_all_reduce(tensor, group=None):
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    if n == 1:
        return tensor
    to_global = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
    right, left = to_global((rank + 1) % n), to_global((rank - 1) % n)
    a, b = tensor.view(-1).tensor_split(2)
    A, B = a.tensor_split(n), b.tensor_split(n)
    for s in range(n - 1):
        ia, oa = (rank - s - 1) % n, (rank - s - 2) % n
        ib, ob = (rank + s + 1) % n, (rank + s + 2) % n
        ta, tb = torch.empty_like(A[oa]), torch.empty_like(B[ob])
        reqs = [dist.isend(A[ia], right, group), dist.isend(B[ib], left, group),
                dist.irecv(ta, left, group), dist.irecv(tb, right, group)]
        [r.wait() for r in reqs]
        A[oa].add_(ta)
        B[ob].add_(tb)
    for s in range(n - 1):
        ia, oa = (rank - s) % n, (rank - s - 1) % n
        ib, ob = (rank + s) % n, (rank + s + 1) % n
        reqs = [dist.isend(A[ia], right, group), dist.isend(B[ib], left, group),
                dist.irecv(A[oa], left, group), dist.irecv(B[ob], right, group)]
        [r.wait() for r in reqs]
    return tensor


def reduce_bytes(numel, dst, group=None):
    n = dist.get_world_size(group)
    return (n - 1) / n          # a ring reduce-scatter's share, every rank alike

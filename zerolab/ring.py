"""Ring collectives built from point-to-point send/recv: how all_reduce really works.

N ranks stand in a ring; rank r sends only to its right neighbour (r+1) and receives only from
its left (r-1). The buffer is cut into N chunks.

* reduce-scatter, N-1 steps: at step s rank r sends chunk (r-s-1) and adds what it receives into
  chunk (r-s-2). After N-1 steps chunk r on rank r holds the sum over all ranks.
* all-gather, N-1 steps: at step s rank r sends chunk (r-s) and stores what it receives as chunk
  (r-s-1). After N-1 steps every rank holds every chunk.
* all-reduce = reduce-scatter followed by all-gather.

Each step moves one chunk (S/N bytes) per rank, so a rank sends (N-1)/N * S per phase and
2(N-1)/N * S for an all-reduce: independent of N for large N, which is why the ring is
bandwidth-optimal. Every send goes through :mod:`zerolab.comm`; the three collectives below record
themselves in a ``comm.log()`` as ONE collective each (``impl="ring"``), with the ring's bytes.
"""
import torch
import torch.distributed as dist

from zerolab import comm


def _neighbours(group):
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    return rank, n, (rank + 1) % n, (rank - 1) % n


def _check_flat(name, *tensors):
    for t in tensors:
        if not t.is_contiguous():
            raise ValueError(f"{name}: tensors must be contiguous (got shape {tuple(t.shape)} with "
                             f"strides {t.stride()})")


def exchange(send_buf, recv_buf, right, left, group=None):
    """One ring step: send ``send_buf`` to the right neighbour while receiving ``recv_buf`` from the
    left. Starting the send before blocking on the receive is what keeps N ranks from deadlocking."""
    handle = comm.isend(send_buf, right, group)
    comm.recv(recv_buf, left, group)
    handle.wait()


def reduce_scatter_chunks(chunks, group=None):
    """In place: afterwards ``chunks[rank]`` holds the sum over ranks of that chunk (N-1 steps)."""
    rank, n, right, left = _neighbours(group)
    scratch = torch.empty_like(max(chunks, key=torch.numel))
    for step in range(n - 1):
        send_i, recv_i = (rank - step - 1) % n, (rank - step - 2) % n
        incoming = scratch[:chunks[recv_i].numel()]
        exchange(chunks[send_i], incoming, right, left, group)
        chunks[recv_i] += incoming  # partial sum of recv_i now covers step + 2 ranks


def all_gather_chunks(chunks, group=None):
    """In place: ``chunks[rank]`` is this rank's; afterwards every chunk is filled (N-1 steps)."""
    rank, n, right, left = _neighbours(group)
    for step in range(n - 1):
        send_i, recv_i = (rank - step) % n, (rank - step - 1) % n
        exchange(chunks[send_i], chunks[recv_i], right, left, group)


def ring_all_reduce(tensor, group=None, *, tag=None):
    """Sum ``tensor`` across ranks in place, using only send/recv. Any size: chunks may be uneven."""
    _check_flat("ring_all_reduce", tensor)
    chunks = list(tensor.view(-1).tensor_split(dist.get_world_size(group)))
    with comm.composite("all_reduce", tensor, group, impl="ring", tag=tag):
        reduce_scatter_chunks(chunks, group)   # (N-1)/N * S bytes sent
        all_gather_chunks(chunks, group)       # (N-1)/N * S bytes sent
    return tensor


def ring_reduce_scatter(output, input, group=None, *, tag=None):
    """``output`` receives the sum over ranks of chunk ``rank`` of ``input`` (input = N x output)."""
    n = dist.get_world_size(group)
    _check_flat("ring_reduce_scatter", output, input)
    if input.numel() != n * output.numel():
        raise ValueError(f"ring_reduce_scatter: input has {input.numel()} elements, expected "
                         f"world_size ({n}) x output ({output.numel()})")
    work = input.detach().clone().view(-1)  # the caller's input stays untouched
    chunks = list(work.split(output.numel()))
    with comm.composite("reduce_scatter", input, group, impl="ring", tag=tag):
        reduce_scatter_chunks(chunks, group)   # (N-1)/N * S bytes sent
    output.view(-1).copy_(chunks[dist.get_rank(group)])
    return output


def ring_all_gather(output, input, group=None, *, tag=None):
    """``output`` (N x input) receives every rank's ``input`` in rank order."""
    n = dist.get_world_size(group)
    _check_flat("ring_all_gather", output, input)
    if output.numel() != n * input.numel():
        raise ValueError(f"ring_all_gather: output has {output.numel()} elements, expected "
                         f"world_size ({n}) x input ({input.numel()})")
    chunks = list(output.view(-1).split(input.numel()))
    chunks[dist.get_rank(group)].copy_(input.view(-1))
    with comm.composite("all_gather", output, group, impl="ring", tag=tag):
        all_gather_chunks(chunks, group)       # (N-1)/N * S bytes sent
    return output

"""Ring collectives built from point-to-point send/recv: how all_reduce really works.

N ranks stand in a ring; rank r sends only to its right neighbour (r+1) and receives only from
its left (r-1). The buffer is cut into N chunks.

* reduce-scatter, N-1 steps: at step s rank r sends its partial sum of chunk (r-s-1) (at step 0 its
  own chunk) and receives its left neighbour's partial sum of chunk (r-s-2), to which it adds its own
  chunk (r-s-2). After N-1 steps rank r holds the sum over all ranks of chunk r. A step's chunk
  arrives in pieces, each added while the next is on its way (:func:`exchange_and_add`). The
  reduce-scatter keeps its partial sums in two buffers of S/N and only reads its input (a copy of
  the input first would be one more pass over S bytes); the all-reduce keeps them in its own tensor.
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

PIECE_BYTES = 4 << 20      # a reduce-scatter step receives and adds its chunk in pieces of this size


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


def exchange_and_add(send_buf, addend, out, right, left, group=None, *, piece_bytes=PIECE_BYTES):
    """One reduce-scatter step: send ``send_buf`` to the right neighbour while receiving a buffer like
    ``addend`` from the left, and write received + ``addend`` into ``out``. The received buffer arrives
    in pieces of ``piece_bytes`` into two small scratch buffers taking turns, and each piece is added
    while the next is still on its way: the add overlaps the transfer, and no buffer of the chunk's size
    is allocated (on a virtual machine a fresh 32 MB buffer costs thousands of page faults per call)."""
    step = max(1, piece_bytes // addend.element_size())
    sends = [comm.isend(piece, right, group) for piece in send_buf.split(step)]   # all queued at once
    pieces = list(zip(addend.split(step), out.split(step)))
    scratch = [torch.empty(min(step, addend.numel()), dtype=addend.dtype, device=addend.device) for _ in range(2)]
    arriving = comm.irecv(scratch[0][:pieces[0][0].numel()], left, group)
    for j, (mine, dst) in enumerate(pieces):
        arriving.wait()
        received = scratch[j % 2][:mine.numel()]
        if j + 1 < len(pieces):                          # the next piece lands in the other buffer
            arriving = comm.irecv(scratch[(j + 1) % 2][:pieces[j + 1][0].numel()], left, group)
        torch.add(received, mine, out=dst)               # meanwhile: add this one
    for handle in sends:
        handle.wait()


def reduce_scatter_chunks(chunks, group=None, out=None, *, in_place=False):
    """Sum chunk ``rank`` over the ranks, in N-1 steps. Returns the sum: written into ``out`` if given,
    else into a new tensor. The partial sums on the way overwrite ``chunks`` if ``in_place`` (the
    all-reduce: its tensor is overwritten anyway), else they take turns in two buffers of S/N and
    ``chunks`` are only read (the reduce-scatter: the caller's input stays as it was)."""
    rank, n, right, left = _neighbours(group)
    out = torch.empty_like(chunks[rank]) if out is None else out
    partials = [] if in_place else [torch.empty_like(max(chunks, key=torch.numel)) for _ in range(min(2, n - 2))]
    partial = chunks[(rank - 1) % n]                     # step 0 sends this rank's own chunk rank-1
    for step in range(n - 1):
        recv_i = (rank - step - 2) % n                   # the chunk whose partial sum arrives now
        into = (out if step == n - 2 else chunks[recv_i] if in_place
                else partials[step % 2][:chunks[recv_i].numel()])
        exchange_and_add(partial, chunks[recv_i], into, right, left, group)   # left's partial + mine
        partial = into                                   # a sum over step + 2 ranks: sent next step
    if n == 1:
        out.copy_(partial)                               # one rank: the sum is its own chunk
    return out


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
    mine = chunks[dist.get_rank(group)]
    with comm.composite("all_reduce", tensor, group, impl="ring", tag=tag):
        reduce_scatter_chunks(chunks, group, out=mine, in_place=True)   # (N-1)/N * S bytes sent
        all_gather_chunks(chunks, group)                 # (N-1)/N * S bytes sent
    return tensor


def ring_reduce_scatter(output, input, group=None, *, tag=None):
    """``output`` receives the sum over ranks of chunk ``rank`` of ``input`` (input = N x output)."""
    n = dist.get_world_size(group)
    _check_flat("ring_reduce_scatter", output, input)
    if input.numel() != n * output.numel():
        raise ValueError(f"ring_reduce_scatter: input has {input.numel()} elements, expected "
                         f"world_size ({n}) x output ({output.numel()})")
    chunks = list(input.detach().view(-1).split(output.numel()))   # read, never written
    with comm.composite("reduce_scatter", input, group, impl="ring", tag=tag):
        reduce_scatter_chunks(chunks, group, out=output.view(-1))  # (N-1)/N * S bytes sent
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

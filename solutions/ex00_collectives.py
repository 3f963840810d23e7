"""Worked answers to exercise 00: ring collectives from send/recv (see lesson 00)."""
import torch
import torch.distributed as dist

from zerolab.ring import exchange


def _ring_pass(chunks, group, first_send_offset, reduce):
    """The N-1 steps shared by both phases. Step s sends chunk (rank - s - offset) to the right
    and receives chunk (rank - s - offset - 1) from the left, then adds it (reduce) or keeps it."""
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    right, left = (rank + 1) % n, (rank - 1) % n
    for step in range(n - 1):
        out_i = (rank - step - first_send_offset) % n
        in_i = (out_i - 1) % n
        if reduce:
            incoming = torch.empty_like(chunks[in_i])
            exchange(chunks[out_i], incoming, right, left, group)
            chunks[in_i] += incoming
        else:
            exchange(chunks[out_i], chunks[in_i], right, left, group)


def ring_reduce_scatter(output, input, group=None):
    n = dist.get_world_size(group)
    chunks = list(input.detach().clone().view(-1).chunk(n))
    _ring_pass(chunks, group, first_send_offset=1, reduce=True)
    output.view(-1).copy_(chunks[dist.get_rank(group)])
    return output


def ring_all_gather(output, input, group=None):
    n = dist.get_world_size(group)
    chunks = list(output.view(-1).chunk(n))
    chunks[dist.get_rank(group)].copy_(input.view(-1))
    _ring_pass(chunks, group, first_send_offset=0, reduce=False)
    return output


def ring_all_reduce(tensor, group=None):
    chunks = list(tensor.view(-1).tensor_split(dist.get_world_size(group)))
    _ring_pass(chunks, group, first_send_offset=1, reduce=True)   # reduce-scatter phase
    _ring_pass(chunks, group, first_send_offset=0, reduce=False)  # all-gather phase
    return tensor

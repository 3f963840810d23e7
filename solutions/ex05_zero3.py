"""Exercise 05 — ZeRO-3's gather / free hooks (worked answers). See exercises/ex05_zero3.py."""
import torch
import torch.utils._pytree as pytree

from zerolab import comm
from zerolab.engine import reduce_scatter


def gather(unit, group=None, async_op=False):
    # The storage object is shared by unit.full, every parameter view and every view autograd
    # saved in forward: growing it back makes all of them valid again (same shapes, new memory).
    full = unit.full
    full.untyped_storage().resize_(full.numel() * full.element_size())
    # Rank r contributes its shard; (N-1)/N x the full buffer's bytes leave each rank.
    return comm.all_gather(full, unit.shard, group=group, async_op=async_op)


def free(unit):
    # 0 bytes; shapes and views stay, so the next gather can refill the very same storage.
    unit.full.untyped_storage().resize_(0)


def reduce_scatter_grads(unit, grad_full, group=None, impl="torch"):
    own = unit.flat.shard(grad_full)   # rank r owns slice r: the reduced sum lands there
    return reduce_scatter(own, grad_full, group=group, impl=impl, async_op=True)   # ring: blocking, None


def register_pre_backward(output, fn):
    tensors = [t for t in pytree.tree_leaves(output) if torch.is_tensor(t) and t.requires_grad]
    for t in tensors:
        t.register_hook(lambda grad: fn())   # returning None leaves the gradient unchanged
    return len(tensors)

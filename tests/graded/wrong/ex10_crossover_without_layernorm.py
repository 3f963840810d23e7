"""A plausible wrong answer to exercise 10 (the graded tests must reject it).

A correct checkpoint; the crossover from a closed form of the mixed-precision block (worked out
right: float32 LayerNorm inputs, bfloat16 copies of every Linear's input and weight, bfloat16 q, k, v,
probabilities and GeLU tensors) that leaves out the LayerNorms' per-token mean and 1/std as small,
as the paper does: a token or two late on most shapes.

Caught by: test_crossover_seq_len.
"""
import torch

from zerolab import models
from zerolab.activations import SavedTensors


class _Checkpoint(torch.autograd.Function):
    """Forward without a graph, keeping only the input (and the generator's state); backward replays
    the block with a graph, from the same random state, and backpropagates through it.

    The block's parameters are inputs of the Function too (not saved: only referenced), so that the
    output requires grad whenever a parameter does, even when ``x`` does not (the first block of a
    model whose embeddings are frozen: torch.utils.checkpoint's reentrant variant returns an output
    that requires no grad there, and the parameters silently get nothing)."""

    @staticmethod
    def forward(ctx, block, x, *params):
        ctx.block = block
        ctx.rng = torch.get_rng_state()          # the draws forward makes (dropout), replayed later
        ctx.save_for_backward(x)                 # the only activation kept: e·s·b·h bytes
        with torch.no_grad():                    # (autograd runs Function.forward without a graph anyway)
            return block(x)

    @staticmethod
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        x = x.detach().requires_grad_(ctx.needs_input_grad[1])   # the recomputation's own leaf
        params = list(ctx.block.parameters())
        wanted = [p for p, need in zip(params, ctx.needs_input_grad[2:]) if need]
        # Replay the forward's random numbers, then give the caller's generator back untouched:
        # its stream continues as if no recomputation had happened (torch.utils.checkpoint's
        # preserve_rng_state; on a GPU the device generators would be stashed the same way).
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(ctx.rng)
            with torch.enable_grad():
                out = ctx.block(x)               # the recomputation: one more forward of the block
        inputs = ([x] if x.requires_grad else []) + wanted
        grads = list(torch.autograd.grad(out, inputs, grad_out, allow_unused=True)) if inputs else []
        gx = grads.pop(0) if x.requires_grad else None
        by_param = dict(zip(map(id, wanted), grads))
        # Returned, not written: autograd adds them INTO each parameter's .grad (AccumulateGrad, in
        # place: a .grad that is a view into an engine's bucket stays one), then runs its
        # post-accumulate-grad hooks (where ZeRO's engines reduce it), exactly as a plain backward.
        return (None, gx, *(by_param.get(id(p)) for p in params))


def checkpointed(block, x):
    """``block(x)``, keeping only ``x`` for backward (see the exercise for the contract)."""
    return _Checkpoint.apply(block, x, *block.parameters())


def crossover_seq_len(d_model, n_heads, batch_size):
    """From what the block saves under bfloat16 autocast, per token and hidden unit: 4 + 4 bytes of
    LayerNorm inputs, 2 + 2 + 2 of the qkv, proj and fc inputs, 6 of q, k, v, 8 + 8 of the GeLU's
    input and output (36 bytes); 24·h² bytes of bfloat16 weight copies; 2·a·s bytes of probabilities
    per token."""
    h, a, b = d_model, n_heads, batch_size
    s = 1
    while 2 * a * b * s * s <= 36 * h * b * s + 24 * h * h:
        s += 1
    return s

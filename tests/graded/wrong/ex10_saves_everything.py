"""A plausible wrong answer to exercise 10 (the graded tests must reject it).

The block's graph is built in forward and kept (in ctx) for backward, so nothing is recomputed: the
activations stay alive.

Caught by: test_keeps_only_the_input.
"""
import torch

from zerolab import models
from zerolab.activations import SavedTensors


class _Checkpoint(torch.autograd.Function):
    """Full recomputation of one block: only the input is kept."""

    @staticmethod
    def forward(ctx, block, x, *params):
        ctx.block = block
        ctx.rng = torch.get_rng_state()          # the draws forward makes (dropout), replayed later
        ctx.save_for_backward(x)
        with torch.enable_grad():                # the graph, kept for backward
            ctx.leaf = x.detach().requires_grad_(x.requires_grad)
            ctx.out = block(ctx.leaf)
        return ctx.out.detach()

    @staticmethod
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        x = ctx.leaf
        params = list(ctx.block.parameters())
        wanted = [p for p, need in zip(params, ctx.needs_input_grad[2:]) if need]
        # Replay the forward's random numbers, then give the caller's generator back untouched:
        # its stream continues as if no recomputation had happened (torch.utils.checkpoint's
        # preserve_rng_state; on a GPU the device generators would be stashed the same way).
        out = ctx.out                            # no recomputation needed
        inputs = ([x] if x.requires_grad else []) + wanted
        grads = list(torch.autograd.grad(out, inputs, grad_out, allow_unused=True)) if inputs else []
        gx = grads.pop(0) if x.requires_grad else None
        by_param = dict(zip(map(id, wanted), grads))
        # Returned, not written: autograd adds them to each parameter's .grad (AccumulateGrad),
        # exactly as a plain backward would, hooks included (ZeRO-3's reduce-scatter hooks).
        return (None, gx, *(by_param.get(id(p)) for p in params))


def checkpointed(block, x):
    """``block(x)``, keeping only ``x`` for backward (see the exercise for the contract)."""
    return _Checkpoint.apply(block, x, *block.parameters())


def crossover_seq_len(d_model, n_heads):
    """Measured: the block's saved bytes at two sequence lengths give f(s) = c2·s² + c1·s (per
    sequence; nothing is independent of s). The (B, heads, s, s) softmax output is the c2 term; it
    exceeds the rest once c2·s > c1: the smallest such integer s. Explained: 16 values per token and
    hidden unit (the paper's 34 bytes less its two dropout masks, over 2 bytes per value) plus the
    two LayerNorms' mean and 1/std per token, against a·s probabilities per token."""
    def saved(s):
        model = models.build("gpt", d_model=d_model, n_heads=n_heads, seq_len=s, n_layers=1, attention="naive")
        x, y = models.batch("gpt", model=model, batch_size=1)
        with SavedTensors(model) as log:
            model(x, y)
        return sum(b for name, b in log.by_module().items() if name.startswith("blocks.0"))

    s1, s2 = 8, 16
    f1, f2 = saved(s1), saved(s2)
    # f = c2·s² + c1·s at two points: two equations, two unknowns (integers: bytes)
    c2 = (f2 * s1 - f1 * s2) // (s1 * s2 * (s2 - s1))
    c1 = f1 // s1 - c2 * s1
    return c1 // c2 + 1                          # smallest s with c2·s > c1

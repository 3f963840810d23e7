"""Exercise 10 — worked solution: activation checkpointing of one block, and the crossover length."""
import torch

from zerolab import models
from zerolab.activations import SavedTensors


class _Checkpoint(torch.autograd.Function):
    """Forward without a graph, keeping only the input; backward recomputes the block with a graph
    and backpropagates through it (what torch.utils.checkpoint's reentrant variant does)."""

    @staticmethod
    def forward(ctx, x, block):
        ctx.block = block
        ctx.save_for_backward(x)                 # the only tensor kept: e·s·b·h bytes
        with torch.no_grad():                    # (autograd runs Function.forward without a graph anyway)
            return block(x)

    @staticmethod
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        x = x.detach().requires_grad_(x.requires_grad)   # a fresh leaf: the recomputation's own graph
        with torch.enable_grad():
            out = ctx.block(x)                   # the recomputation: one more forward of the block
        torch.autograd.backward(out, grad_out)   # accumulates the parameters' .grad, and x.grad
        return x.grad, None                      # d loss / d x flows on; the block is no tensor


def checkpointed(block, x):
    """``block(x)``, keeping only ``x`` for backward (see the exercise for the contract)."""
    return _Checkpoint.apply(x, block)


def crossover_seq_len(d_model, n_heads):
    """Measured: the block's saved bytes at two sequence lengths give f(s) = c2·s² + c1·s (per
    sequence; nothing is independent of s). The (B, heads, s, s) softmax output is the c2 term; it
    exceeds the rest once s > c1 / c2. For float32 without dropout that is (16·h + 4) / a: 16 values
    per token and hidden unit (the paper's 34 bytes less its two dropout masks, over 2 bytes per value)
    plus the two LayerNorms' mean and 1/std per token, against a·s probabilities per token."""
    def saved(s):
        model = models.build("gpt", d_model=d_model, n_heads=n_heads, seq_len=s, n_layers=1, attention="naive")
        x, y = models.batch("gpt", model=model, batch_size=1)
        with SavedTensors(model) as log:
            model(x, y)
        return sum(b for name, b in log.by_module().items() if name.startswith("blocks.0"))

    s1, s2 = 8, 16
    f1, f2 = saved(s1), saved(s2)
    # f = c2·s² + c1·s at two points: two equations, two unknowns
    c2 = (f2 / s2 - f1 / s1) / (s2 - s1)
    c1 = f1 / s1 - c2 * s1
    return int(c1 // c2) + 1

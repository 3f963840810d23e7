"""Wrong answer to exercise 10: the checkpoint's backward writes the parameters' gradients into
.grad by hand (``p.grad = p.grad + g``) and returns nothing for them. The values are right and the
post-accumulate-grad hooks still run (torch runs them with no gradient), but a plain backward adds
INTO the .grad already there: here .grad is replaced by a new tensor, so an engine whose .grad are
views into its flat buckets (zerolab's data-parallel engines, DDP's gradient_as_bucket_view) finds
nothing in the bucket, and its hook sees a .grad outside it (from an independent review).

Caught by: test_gradients_added_in_place_before_the_hooks."""
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
        by_param = {}
        for p, g in zip(wanted, grads):          # accumulated into .grad here
            if g is not None:
                p.grad = g.clone() if p.grad is None else p.grad + g
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

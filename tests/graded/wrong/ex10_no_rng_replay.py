"""A plausible wrong answer to exercise 10 (the graded tests must reject it).

The recomputation draws fresh random numbers: with dropout in the block, its masks differ from the
forward's and the gradients belong to another network.

Caught by: test_dropout_replayed_and_the_generator_left_alone.
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
        with torch.enable_grad():
            out = ctx.block(x)                   # the recomputation: one more forward of the block
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


def crossover_seq_len(d_model, n_heads, batch_size):
    """Measured, not computed from lesson 10's float32 accounting: in mixed precision the block saves
    another set. What a measurement under ``torch.autocast("cpu", dtype=torch.bfloat16)`` shows, record
    by record: the residual stream stays float32, so both LayerNorms save a float32 input (and float32
    mean and 1/std); every Linear saves its input in bfloat16 (autocast's cast copy where that input
    is a float32 LayerNorm output) and a bfloat16 copy of its weight (autocast's cast: not a
    parameter, so it counts, and it grows with neither s nor b); q, k, v, the probabilities, the
    GeLU's input and output are bfloat16. So the probabilities are c2·s² and the rest c1·s + c0 with
    a constant c0 > 0: the crossover depends on the batch size, and no formula through the origin
    finds it. Fitted exactly from three lengths (integers: bytes), then confirmed
    by measuring at the answer and one token before it."""
    def split(s):
        model = models.build("gpt", d_model=d_model, n_heads=n_heads, seq_len=s, n_layers=1, attention="naive")
        x, y = models.batch("gpt", model=model, batch_size=batch_size)
        with SavedTensors(model) as log, torch.autocast("cpu", dtype=torch.bfloat16):
            model(x, y)
        mine = [r for r in log.records if r.first and (r.module == "blocks.0" or r.module.startswith("blocks.0."))]
        probs = sum(r.storage_bytes for r in mine if r.shape == (batch_size, n_heads, s, s))
        return probs, sum(r.storage_bytes for r in mine) - probs

    (p1, r1), (p2, r2), (p3, r3) = split(8), split(16), split(24)
    c2 = p1 // 64                                # probabilities: c2·s²
    c1 = (r2 - r1) // 8                          # the rest: c1·s + c0
    c0 = r1 - 8 * c1
    if p2 != 256 * c2 or p3 != 576 * c2 or r3 != 24 * c1 + c0:
        raise RuntimeError("the measurement is not c2·s² against c1·s + c0: look at the records again")
    s = 1
    while c2 * s * s <= c1 * s + c0:             # the smallest s where the probabilities are MORE
        s += 1
    while True:                                  # confirmed by measuring, both sides of the answer
        probs, rest = split(s)
        if probs > rest:
            break
        s += 1
    while s > 1:
        probs, rest = split(s - 1)
        if probs <= rest:
            break
        s -= 1
    return s

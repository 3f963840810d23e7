"""A plausible wrong answer to exercise 10 (graded tests must reject it): a correct checkpoint, but
the crossover taken from the paper's formula (16-bit values with dropout masks: 34 against 5·a·s/h)
instead of measured on this float32 block without dropout.

Caught by: test_crossover_seq_len.
"""
import math

import torch


class _Checkpoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, block):
        ctx.block = block
        ctx.save_for_backward(x)
        with torch.no_grad():
            return block(x)

    @staticmethod
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        x = x.detach().requires_grad_(x.requires_grad)
        with torch.enable_grad():
            out = ctx.block(x)
        torch.autograd.backward(out, grad_out)
        return x.grad, None


def checkpointed(block, x):
    return _Checkpoint.apply(x, block)


def crossover_seq_len(d_model, n_heads):
    # Korthikanti et al.: 5·a·s/h > 34  <=>  s > 34·h / (5·a)
    return math.floor(34 * d_model / (5 * n_heads)) + 1

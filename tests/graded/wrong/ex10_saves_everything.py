"""A plausible wrong answer to exercise 10 (graded tests must reject it): the graph of the block is
built in forward and kept for backward, so nothing is recomputed and nothing is saved either.

Caught by: test_keeps_only_the_input.
"""
import torch


class _Checkpoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, block):
        # keep the block's graph around, backward is then just a backward through it
        with torch.enable_grad():
            ctx.x = x.detach().requires_grad_(x.requires_grad)
            ctx.out = block(ctx.x)
        return ctx.out.detach()

    @staticmethod
    def backward(ctx, grad_out):
        torch.autograd.backward(ctx.out, grad_out)
        return ctx.x.grad, None


def checkpointed(block, x):
    return _Checkpoint.apply(x, block)


def crossover_seq_len(d_model, n_heads):
    # 16 values per token and hidden unit + 4 LayerNorm statistics, against n_heads * s probabilities
    return (16 * d_model + 4) // n_heads + 1

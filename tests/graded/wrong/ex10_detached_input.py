"""A plausible wrong answer to exercise 10 (graded tests must reject it): the recomputation runs on
a detached input, so the parameters get their gradients but nothing flows back to x.

Caught by: test_gradients_equal_the_plain_block.
"""
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
        x = x.detach()                  # recompute on a plain tensor
        with torch.enable_grad():
            out = ctx.block(x)
        torch.autograd.backward(out, grad_out)
        return x.grad, None


def checkpointed(block, x):
    return _Checkpoint.apply(x, block)


def crossover_seq_len(d_model, n_heads):
    return (16 * d_model + 4) // n_heads + 1

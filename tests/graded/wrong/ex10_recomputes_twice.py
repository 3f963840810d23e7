"""A plausible wrong answer to exercise 10 (graded tests must reject it): backward recomputes the
block once for the parameters' gradients and once more for the input's.

Caught by: test_recomputes_once.
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
        x = x.detach().requires_grad_()
        params = list(ctx.block.parameters())
        with torch.enable_grad():
            out = ctx.block(x)
        grads = torch.autograd.grad(out, params, grad_out)
        for p, g in zip(params, grads):
            p.grad = g if p.grad is None else p.grad + g
        with torch.enable_grad():
            out = ctx.block(x)          # the graph was freed by the first grad(): run it again for x
        (grad_x,) = torch.autograd.grad(out, x, grad_out)
        return grad_x, None


def checkpointed(block, x):
    return _Checkpoint.apply(x, block)


def crossover_seq_len(d_model, n_heads):
    return (16 * d_model + 4) // n_heads + 1

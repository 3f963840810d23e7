"""Exercise 10 — activation checkpointing by hand, and one number to measure.

A block's forward saves tensors for its backward: for a TinyGPT block about 16 values per token and
hidden unit, plus the attention probabilities with naive attention (lesson 10). Full activation
checkpointing keeps only the block's INPUT and runs the block's forward a second time, inside
backward, to get the rest back. ``torch.utils.checkpoint`` does it; here you write it yourself, for one
block, with a custom ``torch.autograd.Function`` or with saved-tensor hooks — your choice.

Try it on a block of your own::

    from zerolab import models
    from zerolab.grade.helpers import exercise_module
    ex = exercise_module("ex10_activations")                     # this file
    block = models.build("gpt", dtype=torch.float64).blocks[0]
    x = torch.randn(2, 32, 64, dtype=torch.float64, requires_grad=True)
    ex.checkpointed(block, x).sum().backward()                  # x.grad and the block's .grad

Measure with ``zerolab.activations.SavedTensors`` (what autograd saves, by module).
Grade your work:  ``make grade`` or, in lesson 10, ``zerolab.grade.check("10")``.
"""


def checkpointed(block, x):
    """``block(x)``, computed so that only ``x`` is kept for backward.

    Forward: return the block's output (a tensor that requires grad when ``x`` or the block's
    parameters do), without keeping any tensor the block computes along the way; keep ``x``.
    Backward: run the block once more on ``x`` with gradients enabled and backpropagate the incoming
    gradient through that recomputation, so that every parameter of the block gets its gradient added
    to its ``.grad`` (as a plain backward would) and the gradient of ``x`` flows on to whatever
    produced ``x``.

    Graded, in float64: the output and the gradients of ``x`` and of every parameter equal those of
    plain ``block(x)``; the bytes autograd saves during this forward are at most those of ``x`` plus
    a few kB (measured with saved-tensor hooks and with torch's profiler, not read from your code);
    the block runs exactly once in forward and exactly once in backward; and it works for a ZeRO-3
    unit on 2 ranks (the engine gathers the unit before your recomputation runs)."""
    raise NotImplementedError(
        "Exercise 10.1: return the block's output while keeping only x for backward; when backward "
        "comes, run the block once more on x with gradients on, push the incoming gradient through it "
        "into the parameters' .grad, and return the gradient of x.")


def crossover_seq_len(d_model, n_heads):
    """The smallest sequence length s at which one TinyGPT block with naive attention,
    ``zerolab.models.build("gpt", d_model=d_model, n_heads=n_heads, seq_len=s, attention="naive")``
    in float32, saves MORE bytes for its (B, heads, s, s) attention probabilities than for everything
    else it saves (any batch size B: both grow with B).

    Measure it, then explain the number: the paper's per-layer formula s·b·h·(34 + 5·a·s/h) counts
    16-bit values and dropout masks; this block is float32 and has no dropout. Graded on the number
    (within 2%) for several shapes."""
    raise NotImplementedError(
        "Exercise 10.2: measure what one block saves at a few sequence lengths, separate the part that "
        "grows with s squared from the part that grows with s, and return the smallest s at which the "
        "first exceeds the second.")

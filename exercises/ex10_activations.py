"""Exercise 10 — activation checkpointing by hand, and one number to measure (lesson 10).

10.1 ``checkpointed``: full activation checkpointing of one block, written by you — the contract
     is below; how you meet it (a custom ``torch.autograd.Function``, saved-tensor hooks, ...) is
     yours to design. ``torch.utils.checkpoint`` and ``zerolab.activations``' own checkpointing are
     off limits.
10.2 ``crossover_seq_len``: a number you measure, for a block in mixed precision.

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
    """``block(x)`` for a module ``block`` and a tensor ``x``, such that, from this forward, autograd
    keeps only ``x`` alive for backward.

    Graded, each measured (float64 unless said; nothing is read from your code):

    * values: the output, the gradient of ``x`` (flowing on to whatever produced ``x``) and of
      every parameter of the block equal a plain ``block(x)``'s; gradients ADD to a ``.grad``
      already there, in place, as a plain backward does (a ``.grad`` that is a view into an
      engine's flat gradient buffer stays that view and receives the gradient), and each
      parameter's post-accumulate-grad hooks then run once, during backward (where engines pick a
      finished gradient up);
    * any mix of what requires grad: ``x`` without grad and the parameters with (the first block
      after frozen embeddings), ``x`` with grad and the parameters frozen;
    * randomness: a block that draws random numbers (dropout) gives the output and gradients of a
      plain run from the same generator state, and after backward the default generator is where
      a plain run leaves it (whatever else drew numbers between forward and backward);
    * memory: the bytes autograd saves during this forward are at most ``x``'s plus a few kB
      (saved-tensor hooks), and so are the bytes still allocated after it, beside the output
      (torch's profiler);
    * work: the block's forward runs once in forward, and once during backward;
    * as a ZeRO-3 unit on 2 ranks: training equals the same engine without your checkpoint, with
      the same bytes all-gathered (the engine gathers the unit before backward reaches it).
    """
    raise NotImplementedError("Exercise 10.1: checkpointed is not written yet")


def crossover_seq_len(d_model, n_heads, batch_size):
    """The smallest sequence length s at which one TinyGPT block with naive attention, trained in
    mixed precision, saves MORE bytes for its (batch_size, n_heads, s, s) attention probabilities
    than for everything else it saves together.

    The block: ``blocks[0]`` of ``model = zerolab.models.build("gpt", d_model=d_model,
    n_heads=n_heads, seq_len=s, n_layers=1, attention="naive")`` (float32 parameters), in the forward
    ``model(*zerolab.models.batch("gpt", model=model, batch_size=batch_size))`` run under
    ``torch.autocast("cpu", dtype=torch.bfloat16)``. What counts is what ``SavedTensors`` counts:
    every tensor autograd saves while ``blocks.0`` or one of its modules runs, each storage once (for
    the first module that saves it), parameters left out.

    Lesson 10 accounts, byte by byte, for this block in float32; the question here is about the block
    in mixed precision. Measure it, then explain your number. Returns an int. Graded EXACTLY (no
    tolerance: one token off is wrong) against the grader's own measurement, for several
    (d_model, n_heads, batch_size), none of them a lesson figure."""
    raise NotImplementedError("Exercise 10.2: crossover_seq_len is not written yet")

"""Exercise 11 — ZeRO-3 in your own loop: one parameter cut along dim 0, and the two questions a
step asks about a gradient that no rank holds whole (lesson 11).

11.1 ``shard_dim0`` / ``unshard_dim0``: FSDP2's per-parameter layout. A parameter of ``rows`` rows
     is cut into N pieces of c = ceil(rows / N) rows, in rank order; the last pieces are padded
     with zero rows so that every rank's piece has the same shape.
11.2 ``found_inf``: fp16 loss scaling's overflow check. A rank sees only its own shard of the
     gradient, yet every rank must take the same decision (skip the step or not).
11.3 ``clip_grad_norm_``: ``torch.nn.utils.clip_grad_norm_`` (2-norm) when the gradient is spread
     over the ranks: sharded pieces (each element held by one rank) and replicated tensors (the
     same on every rank).

Use ``zerolab.comm`` for collectives (``comm.all_gather(output, input, group=...)``,
``comm.all_reduce(tensor, op=..., group=...)``). Grade your work: ``zerolab.grade.check("11")``.
The graded tests compare with one process (torch's clip_grad_norm_, torch.amp.GradScaler's
decisions) and check what goes on the wire: one all-gather of the padded pieces to rebuild a
parameter, ONE all-reduce of a single number per overflow check and per norm.
"""


def shard_dim0(full, rank, world_size):
    """Return ``rank``'s piece of ``full`` along dim 0 as a new tensor of shape
    (ceil(rows / world_size), *full.shape[1:]) and ``full``'s dtype: rows
    [rank * c, (rank + 1) * c) of ``full``, zero rows where they run past its end."""
    raise NotImplementedError("Exercise 11.1: shard_dim0 is not written yet")


def unshard_dim0(shard, rows, group=None):
    """Every rank calls it with its own piece (as ``shard_dim0`` made it): return the whole tensor
    of ``rows`` rows, the same on every rank, built with a single all-gather."""
    raise NotImplementedError("Exercise 11.1: unshard_dim0 is not written yet")


def found_inf(grads, group=None):
    """``grads``: the gradient tensors this rank holds (its shards). Return True on EVERY rank if
    any element on ANY rank is inf or NaN, else False, with one all-reduce of one number."""
    raise NotImplementedError("Exercise 11.2: found_inf is not written yet")


def clip_grad_norm_(sharded, replicated, max_norm, group=None):
    """The whole gradient is ``sharded`` (this rank's pieces; the ranks' pieces together hold each
    element once, zero padding aside) plus ``replicated`` (tensors every rank holds, identical).
    Compute its 2-norm with one all-reduce of one number, scale every tensor this rank holds in
    place by min(1, max_norm / (norm + 1e-6)) as torch does, and return the norm (a float or a
    0-dim tensor), the same on every rank."""
    raise NotImplementedError("Exercise 11.3: clip_grad_norm_ is not written yet")

"""Exercise 14 — beyond data parallelism: the 1F1B pipeline schedule, and sequence parallelism's
conjugate pair (lesson 14).

14.1 ``one_f_one_b_step``: one training step of this rank's pipeline stage on the 1F1B schedule
     (PipeDream-Flush: Narayanan et al., SC21, arXiv 2104.04473, Sec. 2.2.1), activations and their
     gradients passed between neighbouring stages with point-to-point sends and receives.
14.2 ``reduce_scatter_sequence`` / ``all_gather_sequence``: the operators Korthikanti et al.
     (arXiv 2205.05198, Sec. 4.2.2) call g-bar and g, as differentiable functions (a
     ``torch.autograd.Function`` each): they turn a row-parallel layer's partial sums into this
     rank's slice of the sequence, and a sequence slice back into the whole sequence for a
     column-parallel layer.

Use ``zerolab.comm`` (``comm.isend(t, dst, group)``, ``comm.irecv(t, src, group)``,
``comm.reduce_scatter(out, inp, group=...)``, ``comm.all_gather(out, inp, group=...)``: group-rank
peers) or ``torch.distributed`` directly. Not ``zerolab.pipeline`` nor ``zerolab.tensor_parallel``:
they are the course's answers. Grade your work: ``zerolab.grade.check("14")``.
"""


def one_f_one_b_step(stage, m, *, inputs=None, targets=None, loss_fn=None, shape=None, dtype=None, group=None):
    """One training step of this rank's stage of a pipeline, on the 1F1B schedule.

    ``group``: the pipeline's ranks (None: every rank); this rank is stage s = dist.get_rank(group)
    of p = dist.get_world_size(group), and stage s's output is stage s+1's input. ``stage``: this
    rank's part of the model (an nn.Module: call it on one micro-batch's input). ``m``: the number
    of micro-batches in the step. ``inputs``: on stage 0, the list of the m micro-batches' inputs
    (None elsewhere). ``targets`` and ``loss_fn``: on the last stage, the list of the m targets and
    ``loss_fn(output, target)``, one micro-batch's loss (None elsewhere). ``shape``, ``dtype``: of the
    activation passed between two consecutive stages, the same at every boundary.

    Return, on the last stage, the m micro-batches' losses as floats in micro-batch order; [] on
    the other stages. Afterwards every parameter's ``.grad`` of every stage holds the gradient of the
    MEAN of the m losses (the step one process takes on the whole batch).

    Graded, on 2 and 4 stages, several m, in float64: the gradients against one process; on each
    stage, forwards in micro-batch order and backwards in micro-batch order; the micro-batches in
    flight on stage s (forward done, backward not yet) never more than min(p - s, m), and that many
    at the peak, with the activation bytes autograd holds rising and falling accordingly; the bubble
    of your order: replayed with every forward taking 1 time unit and every backward 2, each waiting
    for its neighbour's, each stage idles (p - 1)/(m + p - 1) of the step, as a pipeline must; and
    only point-to-point sends to the neighbouring stages, one activation forward and one gradient
    backward per micro-batch."""
    raise NotImplementedError("Exercise 14.1: one_f_one_b_step is not written yet")


def reduce_scatter_sequence(x, group=None):
    """``x``: this rank's term (s, b, h) of a sum over the t ranks of ``group`` (a row-parallel
    layer's partial output); s is a multiple of t. Return this rank's slice of the SUM along dim 0,
    rows [r s/t, (r+1) s/t) for r = dist.get_rank(group): shape (s/t, b, h), in storage of its own.
    Differentiable: backward turns the gradient of this rank's slice (every rank's, together) into
    the gradient of this rank's x.

    Graded, with ``all_gather_sequence``, on a row-parallel linear -> LayerNorm on the sequence
    slice -> column-parallel linear over 2 and 4 ranks, in float64: every output and gradient
    against one process; the collectives each pass runs: one reduce-scatter and one all-gather in
    forward, one all-gather and one reduce-scatter in backward (torch.distributed's or zerolab.comm's;
    no all-reduce), each of one (s, b, h) tensor's bytes; and what the LayerNorm keeps for backward:
    its slice, s/t of the tokens."""
    raise NotImplementedError("Exercise 14.2: reduce_scatter_sequence is not written yet")


def all_gather_sequence(x, group=None):
    """``x``: this rank's slice (s/t, b, h) of a tensor split along dim 0 over the t ranks of
    ``group``. Return the whole (s, b, h), slices in rank order. What follows is tensor-parallel:
    each rank's use of the whole tensor gives only part of its gradient (the gradient is the sum over
    the ranks). Differentiable: backward turns every rank's gradient of the whole into the gradient
    of this rank's slice. Graded with ``reduce_scatter_sequence``, above."""
    raise NotImplementedError("Exercise 14.2: all_gather_sequence is not written yet")

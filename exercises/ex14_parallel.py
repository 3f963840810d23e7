"""Exercise 14 — beyond data parallelism: a pipeline under a memory cap, and a sequence-parallel block
(lesson 14).

14.1 ``capped_pipeline_step``: one training step of this rank's pipeline stage when no stage may hold
     more than ``cap`` micro-batches at once, as fast as that cap allows; ``capped_bubble``: the idle
     fraction that costs, in closed form.
14.2 ``sequence_parallel_mlp``: a transformer's MLP block (LayerNorm, column-parallel linear, GeLU,
     row-parallel linear, residual) with tensor and sequence parallelism over the ranks of a group,
     under Korthikanti et al.'s contract (arXiv 2205.05198, Sec. 4.2.2): no all-reduce of an
     activation, every activation 1/t per rank, equal to one process.

Use ``zerolab.comm`` (``comm.isend(t, dst, group)``, ``comm.irecv(t, src, group)``,
``comm.all_gather(out, inp, group=...)``, ``comm.reduce_scatter(out, inp, group=...)``,
``comm.all_reduce(t, group=...)``: group-rank peers) or ``torch.distributed`` directly (global ranks
for peers). Not ``zerolab.pipeline`` nor ``zerolab.tensor_parallel``: they are the course's own
versions. Grade your work: ``zerolab.grade.check("14")``.
"""


def capped_pipeline_step(stage, m, cap, *, inputs=None, targets=None, loss_fn=None, shape=None, dtype=None,
                         group=None):
    """One training step of this rank's stage of a pipeline whose stages may each hold at most
    ``cap`` micro-batches at once.

    ``group``: the pipeline's ranks (None: every rank); this rank is stage i = dist.get_rank(group)
    of p = dist.get_world_size(group), and stage i's output is stage i+1's input. ``stage``: this
    rank's part of the model (an nn.Module: call it on one micro-batch's input). ``m``: the number of
    micro-batches in the step. ``cap``: an int >= 1. A micro-batch is in flight on a stage from the
    start of its forward there to the end of its backward there; no stage ever has more than ``cap``
    in flight (a memory budget: activations for ``cap`` micro-batches). ``inputs``: on stage 0, the
    list of the m micro-batches' inputs (None elsewhere). ``targets`` and ``loss_fn``: on the last
    stage, the list of the m targets and ``loss_fn(output, target)``, one micro-batch's loss (None
    elsewhere). ``shape``, ``dtype``: of the activation passed between two consecutive stages, the
    same at every boundary.

    Return, on the last stage, the m micro-batches' losses as floats in micro-batch order; [] on
    the other stages. Afterwards every parameter's ``.grad`` of every stage holds the gradient of the
    MEAN of the m losses (the step one process takes on the whole batch).

    Graded, in float64, on 2, 3 and 4 stages (the 3 on ranks 1-3 of 4, rank 0 doing nothing), with
    caps below, at and above p and m not a multiple of the cap:
    - the losses and every gradient against one process;
    - memory: never more than ``cap`` micro-batches in flight on a stage, and at each forward's start
      autograd holds exactly what those in flight saved; at each forward's start the stage holds
      (saved by autograd, or kept any other way) no more than its micro-batches in flight need
      (what autograd saved for each, and its output) plus three activation-sized buffers in transit:
      nothing of a micro-batch outlives its backward for long;
    - time: each stage's order of forwards and backwards, replayed on identical stages with every
      forward taking 1 time unit and every backward 2, each waiting for its neighbours' (communication
      free), finishes as soon as ANY orders that respect the cap can;
    - only point-to-point sends to the neighbouring stages: one activation forward and one gradient
      backward per micro-batch."""
    raise NotImplementedError("Exercise 14.1: capped_pipeline_step is not written yet")


def capped_bubble(p, m, cap):
    """The fraction of the step each stage idles when p stages run m micro-batches as fast as a cap of
    ``cap`` micro-batches in flight per stage allows (every forward taking the same time on every
    stage, every backward too, communication free): a float, in closed form in p, m and cap. (It
    does not depend on how long a forward or a backward takes.)

    Graded against the replay of the fastest orders for many p, m and cap, caps above p included;
    ValueError naming the bad value for a p, m or cap that is not an int >= 1."""
    raise NotImplementedError("Exercise 14.1: capped_bubble is not written yet")


def sequence_parallel_mlp(x, ln_weight, ln_bias, fc_weight, fc_bias, out_weight, out_bias, group=None):
    """A pre-LayerNorm MLP block, x + out(GeLU(fc(LayerNorm(x)))), on the t ranks of ``group`` with
    tensor and sequence parallelism. r = dist.get_rank(group), t = dist.get_world_size(group).

    ``x``: this rank's slice (s/t, b, h) of the residual stream, rows [r·s/t, (r+1)·s/t) of the
    sequence (dim 0; s is a multiple of t). ``ln_weight``, ``ln_bias`` (h,): the LayerNorm's (eps
    1e-5), the same on every rank. ``fc_weight`` (4h/t, h), ``fc_bias`` (4h/t,): rows [r·4h/t,
    (r+1)·4h/t) of the first linear's weight (torch's (out, in) layout) and bias: this rank's share of
    the hidden units. ``out_weight`` (h, 4h/t): the matching columns of the second linear's weight;
    ``out_bias`` (h,): its bias, the same on every rank. GeLU: ``F.gelu``'s exact form.

    Return this rank's slice (s/t, b, h) of the block's output. Differentiable: after a backward from
    every rank's output, ``x.grad`` is this rank's slice of one process's gradient, the gradients of
    ``fc_weight``, ``fc_bias`` and ``out_weight`` are this rank's part of one process's, and those of
    ``ln_weight``, ``ln_bias`` and ``out_bias`` are one process's whole gradients, on every rank.

    Graded, in float64, on 2, 3 and 4 ranks and on two groups of 2 at once (ranks 0, 2 and 1, 3):
    - the output and every gradient against one process; the caller's tensors left unchanged;
    - communication: no all-reduce of anything larger than the three replicated parameters'
      gradients (3h values); per pass, the rest of what each rank sends is at most, in forward, the
      bytes of ONE all-reduce of an (s, b, h) tensor (2(t-1)/t·s·b·h values), and in backward one and
      a half (3(t-1)/t·s·b·h values);
    - memory: what the block keeps for backward from the end of its forward (saved by autograd, or
      held any other way), on each rank, is at most 1/t of what one process keeps for the same block
      (parameters, and tensors of at most h values, left out)."""
    raise NotImplementedError("Exercise 14.2: sequence_parallel_mlp is not written yet")

"""Exercise 02 — data parallelism: buckets all-reduced during backward, gradient accumulation, and
what torch's DDP really does.

Every rank holds the whole model and computes gradients on its own data; averaging the gradients
over the ranks makes every rank take the step one process would take on all the data. Lesson 02
shows the naive sync (one all-reduce per gradient, after backward) and why buckets started from
gradient hooks are better. Here you design the bucketed sync yourself, for models whose forward
does not always use every parameter; its structure is yours.

02.1 ``BucketedAverager``: gradients averaged in buckets while backward runs, and ``no_sync``.
02.2 ``ddp_bucket_bytes``: measure the buckets torch's DistributedDataParallel really reduces.

Useful: ``zerolab.flat.unique_trainable`` (trainable parameters, tied weights once),
``zerolab.data_parallel.assign_buckets`` (parameters grouped into reverse-order buckets) and
``zerolab.data_parallel.Bucket`` (a flat buffer with one view per parameter).

Grade your work:  ``make grade`` or, in lesson 02, ``zerolab.grade.check("02")``.
"""


class BucketedAverager:
    """``sync = BucketedAverager(model, bucket_bytes=4096, group=None)``; per step:
    ``loss = model(x, y)``, ``loss.backward()``, ``sync.finish()``; then every trainable parameter's
    ``.grad`` holds the mean over the ranks of ``group`` (None: every rank). Between steps the gradients are zeroed in place
    (``model.zero_grad(set_to_none=False)``).

    What must hold (graded on 2, 3 and 4 ranks, float64, against the mean recomputed in one process):

    * values: after ``finish()``, each trainable ``.grad`` is the mean over the group's ranks of
      that rank's gradients summed over every backward since they were last zeroed, those run
      inside ``with sync.no_sync():`` included. A parameter a rank's forward did not use gets no
      gradient there and counts as zero from that rank; which ones go unused, in whichever bucket,
      may differ from rank to rank and from step to step. Frozen parameters keep ``grad=None``; a tied weight is one
      parameter.
    * communication: all-reduces only, on ``group``; per synchronising step one all-reduce per
      bucket of ``assign_buckets(trainable parameters, bucket_bytes)``, each gradient element in
      exactly one; nothing at all during a backward inside ``no_sync()``.
    * overlap, read off the clock: each bucket's all-reduce is in flight (started, not yet waited
      for) while autograd computes the gradients that come after that bucket's last one; only a
      bucket completed by backward's very last gradient may start after it. This holds also when the
      forward left a parameter unused: a gradient that will never come must not hold its bucket, or
      the buckets after it, back.
    * memory: no copy of the gradients: during backward, the gradients and the buffers the
      all-reduces run on hold together no more than the gradients themselves, plus the one gradient
      autograd is handing over.
    """

    def __init__(self, module, bucket_bytes, group=None):
        raise NotImplementedError(
            "Exercise 02.1: average the gradients in buckets while backward runs (see the class "
            "docstring's contract).")

    def finish(self):
        raise NotImplementedError("Exercise 02.1: complete the step's all-reduces; .grad holds the mean.")

    def no_sync(self):
        raise NotImplementedError(
            "Exercise 02.1: a context manager under which backward passes do not communicate.")


def ddp_bucket_bytes(model, batches, bucket_cap_mb):
    """Wrap ``model`` in ``torch.nn.parallel.DistributedDataParallel(model,
    bucket_cap_mb=bucket_cap_mb)`` and run one forward + backward per ``(x, y)`` in ``batches``
    (``model(x, y)`` returns the loss). Return, for each of these iterations, the list of the bytes
    of the gradient buckets DDP all-reduced, in the order it reduced them.

    Measure it (DDP hands every bucket it reduces to a communication hook), do not compute it:
    graded against the grader's own measurement. Then explain the first iteration, and the order."""
    raise NotImplementedError(
        "Exercise 02.2: measure, iteration by iteration, the buckets DDP reduces.")

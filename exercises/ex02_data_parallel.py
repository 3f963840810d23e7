"""Exercise 02 — data parallelism: buckets all-reduced during backward, gradient accumulation, and
what torch's DDP really does.

Every rank holds the whole model and computes gradients on its own data; averaging the gradients
over the ranks makes every rank take the step one process would take on all the data. Lesson 02
shows the naive sync (one all-reduce per gradient, after backward) and why buckets started from
gradient hooks are better. Here you build the bucketed sync yourself; its structure is yours.

02.1 ``BucketedAverager``: buckets, hooks, asynchronous all-reduces, and ``no_sync``.
02.2 ``ddp_bucket_bytes``: measure the buckets torch's DistributedDataParallel really reduces.

Useful: ``zerolab.flat.unique_trainable`` (trainable parameters, tied weights once),
``zerolab.data_parallel.assign_buckets`` (parameters grouped into reverse-order buckets) and
``zerolab.data_parallel.Bucket`` (a flat buffer with one view per parameter). Use ``zerolab.comm``'s
``all_reduce``: the graded tests read its log.

Grade your work:  ``make grade`` or, in lesson 02, ``zerolab.grade.check("02")``.
"""


class BucketedAverager:
    """``sync = BucketedAverager(model, bucket_bytes=4096)``; per step: ``loss.backward();
    sync.finish()``; then every trainable parameter's ``.grad`` holds the mean over the ranks.
    Between steps the gradients are zeroed in place (``model.zero_grad(set_to_none=False)``).

    Contract (graded on 2 and 3 ranks, float64, against one process):

    * buckets are ``assign_buckets(trainable parameters, bucket_bytes)`` (reverse order); each
      trainable parameter's ``.grad`` is a view into its bucket's flat buffer (no copy before the
      all-reduce); frozen parameters keep ``grad=None``; a tied weight is reduced once;
    * during backward, as soon as every gradient of the next bucket (in index order) is final, that
      bucket's all-reduce starts, asynchronously: one all-reduce per bucket, all of them started
      from inside backward, none blocking;
    * ``finish()`` waits for them (starting any bucket whose gradients never came) and leaves the
      mean in ``.grad``;
    * gradient accumulation: backward passes run inside ``with sync.no_sync():`` only accumulate,
      locally, with no communication; the next backward outside it synchronises the sum.
    """

    def __init__(self, module, bucket_bytes, group=None):
        raise NotImplementedError(
            "Exercise 02.1: make the gradients views into buckets and arrange for each bucket's "
            "all-reduce to start during backward (see the class docstring's contract).")

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

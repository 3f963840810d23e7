"""Exercise 02 — data parallelism: first the naive gradient sync, then buckets launched from hooks.

Every rank holds the whole model and computes gradients on its own data; averaging the gradients
over the ranks makes every rank take the step one process would take on all the data.

Use ``zerolab.comm``'s collectives (``comm.broadcast``, ``comm.all_reduce``): the graded tests
read their log to count your bytes. Useful helpers: ``zerolab.flat.unique_trainable`` (trainable
parameters, tied weights once), ``zerolab.data_parallel.assign_buckets`` (reverse-order buckets)
and ``zerolab.data_parallel.Bucket`` (a flat buffer with one gradient view per parameter).

Grade your work:  ``make grade`` or, in lesson 02, ``zerolab.grade.check("02")``.
"""


def broadcast_parameters(module, group=None):
    """Make every rank's parameters and buffers equal to rank 0's (in place)."""
    raise NotImplementedError(
        "Exercise 02.1: for every tensor in module.parameters() and module.buffers(), "
        "comm.broadcast(tensor.data, src=0, group=group).")


def average_gradients(module, group=None):
    """NAIVE sync, called after backward: every trainable parameter's ``.grad`` becomes the mean
    over the ranks of the ranks' gradients. Frozen parameters keep ``grad=None``; a tied weight is
    averaged once. Careful: average the GRADIENTS, not the parameters."""
    raise NotImplementedError(
        "Exercise 02.2: for p in unique_trainable(module.parameters()): all-reduce p.grad (a sum) "
        "with comm.all_reduce, then divide it by the world size.")


class BucketedAverager:
    """Bucketed, overlapped sync. After construction each trainable parameter's ``.grad`` is a
    view into a flat bucket buffer (buckets from ``assign_buckets(params, bucket_bytes)``, reverse
    order). During backward, as soon as every gradient of the next bucket is final, that bucket's
    all-reduce starts ASYNCHRONOUSLY (``async_op=True``) from a hook registered with
    ``p.register_post_accumulate_grad_hook``. Buckets start in index order. :meth:`finish` waits
    for them all; then ``.grad`` holds the mean over the ranks. Gradients are zeroed in place
    between steps (``module.zero_grad(set_to_none=False)``), so they stay views.
    """

    def __init__(self, module, bucket_bytes, group=None):
        raise NotImplementedError(
            "Exercise 02.3: build Bucket(i, params) for each list from assign_buckets; set each "
            "p.grad to its view; register a post-accumulate-grad hook on each p. The hook receives "
            "the PARAMETER (not the gradient): count it as ready, and while the next bucket is "
            "complete divide its buffer by N and start comm.all_reduce(buffer, async_op=True).")

    def finish(self):
        """Start any bucket not started yet, wait for every all-reduce, reset for the next step."""
        raise NotImplementedError("Exercise 02.3: wait() on every handle, then reset the counters.")

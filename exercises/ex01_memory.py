"""Exercise 01 — memory anatomy: count what training really holds, then predict it.

Three functions. The first two MEASURE (each underlying storage counted once: tied weights, views
into one flat buffer and gradients that alias a bucket buffer are one allocation, not many); the
third PREDICTS per-rank bytes with the ZeRO formulas (Rajbhandari et al., arXiv 1910.02054).
The graded tests compare them with the paper's numbers and with bytes computed by hand from the
shapes of real models (tied weights, frozen layers, mixed dtypes, torch DDP on 2 real ranks).

Grade your work:  ``make grade`` or, in lesson 01, ``zerolab.grade.check("01")``.
"""


def unique_storage_bytes(tensors):
    """Total bytes of the distinct storages behind ``tensors`` (None entries are skipped).

    A view counts its WHOLE storage, once however many views of it appear; two different
    allocations count separately even if they hold equal values. Empty storages count 0.
    """
    raise NotImplementedError(
        "Exercise 01.1: identify a storage by t.untyped_storage(): its device and data_ptr(); "
        "its size is .nbytes(). Keep a set of the storages already counted.")


def measured_model_states(model, optimizer=None):
    """Bytes this process holds for ``model`` (and ``optimizer``): {"params", "grads", "optimizer"}.

    * params: every parameter of the model, trainable or frozen;
    * grads: every existing ``.grad`` (frozen parameters and not-yet-run backward have none);
    * optimizer: every tensor in ``optimizer.state`` (Adam: exp_avg, exp_avg_sq and the small
      ``step`` counter tensors) plus any parameter the optimizer updates that is not one of the
      model's (fp32 master copies), whose ``.grad`` counts as grads.
    Each storage counts once overall: one already counted under an earlier kind (in the order
    params, grads, optimizer) is not counted again.
    """
    raise NotImplementedError(
        "Exercise 01.2: collect the tensors of each kind (model.parameters(), their .grad, the "
        "values of optimizer.state[p] for every p) and count storages with ONE shared 'seen' set.")


def model_state_bytes(num_params, world_size, stage, *, mixed_precision=True, offload=False):
    """Per-rank model-state bytes predicted by ZeRO: {"params", "grads", "optimizer", "total"} on
    the device of one rank, and "host" (bytes on the host of one rank; 0 without offload).

    Mixed precision: 2-byte params and grads, K = 12 (fp32 master, momentum, variance).
    fp32 (``mixed_precision=False``): 4-byte params and grads, K = 8 (momentum, variance).
    stage 0 (DP): nothing sharded; 1: optimizer state / N; 2: also grads / N; 3: also params / N.
    Exact values: Ψ/N may be fractional; do not round.
    ``offload=True`` (ZeRO-Offload, stages 1-3): the optimizer state (and, in fp32, a 4-byte copy
    of the parameter shard for the host to update) and the gradient shard (2 or 4 bytes x Ψ/N)
    live on the host; the device keeps the parameters as the stage has them, and the full
    gradient only in stage 1 (which does not partition gradients). Stage 0 with offload, or any
    stage other than 0-3: raise ValueError.
    """
    raise NotImplementedError(
        "Exercise 01.3: start from bytes per element (2, 2, 12 or 4, 4, 8); divide a kind by N "
        "once the stage partitions it (optimizer from stage 1, grads from 2, params from 3).")

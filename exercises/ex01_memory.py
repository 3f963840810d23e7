"""Exercise 01 — memory anatomy: measure the peak of a training step, then predict per-rank bytes.

Lesson 01 shows that parameters live throughout, gradients from backward until ``zero_grad``, and
optimizer state from the first step on, so what a step needs is a PEAK that a measurement taken
after the step does not see. Here you build the instrument that catches it; how is yours.

01.1 ``peak_model_states``: the peak, by kind, measured with hooks while a step runs.
01.2 ``model_state_bytes``: the ZeRO formulas (Rajbhandari et al., arXiv 1910.02054), derived.

Grade your work:  ``make grade`` or, in lesson 01, ``zerolab.grade.check("01")``.
"""


def peak_model_states(model, optimizer, run_step):
    """Call ``run_step()`` once (one training step of ``model`` with ``optimizer``: forward,
    backward, ``optimizer.step()``, ``zero_grad``, in whatever way it does them) and return the
    PEAK bytes held while it ran: ``{"params", "grads", "optimizer", "total"}``, each kind's
    largest value at any moment, and "total" the largest value of the three together at one moment.

    Contract (graded on real models against bytes computed by hand from their shapes):

    * params: every parameter of ``model``; grads: every existing ``.grad`` of them; optimizer:
      every tensor in ``optimizer.state`` plus any tensor the optimizer updates that is not one of
      the model's parameters (fp32 master copies), whose ``.grad`` counts as grads;
    * each storage counts once, under the first kind that holds it (in the order params, grads,
      optimizer): tied weights, views into one flat buffer, gradients aliasing a bucket;
    * measured while it runs: at least at the start, whenever a gradient becomes final, right
      before and right after every optimizer step, and at the end;
    * no hook left behind on the model or the optimizer."""
    raise NotImplementedError(
        "Exercise 01.1: sample the three kinds at the moments the contract names, keep the maxima.")


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
    stage other than 0-3: raise ValueError."""
    raise NotImplementedError(
        "Exercise 01.2: bytes per element of each kind, divided by N for the kinds the stage partitions.")

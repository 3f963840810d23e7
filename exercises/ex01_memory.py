"""Exercise 01 — memory anatomy: measure the peak of a training step, then predict per-rank bytes.

Lesson 01 shows that parameters live throughout, gradients from backward until ``zero_grad``, and
optimizer state from the first step on, so what a step needs is a PEAK that a measurement taken
after the step does not see. Here you build the instrument that catches it; how is yours.

01.1 ``peak_model_states``: the peak, by kind and in all, measured while a step runs.
01.2 ``model_state_bytes``: the ZeRO formulas (Rajbhandari et al., arXiv 1910.02054), derived.

Grade your work:  ``make grade`` or, in lesson 01, ``zerolab.grade.check("01")``.
"""


def peak_model_states(model, optimizer, run_step):
    """Call ``run_step()`` once (one training step of ``model`` with ``optimizer``, written however
    its author liked) and return the PEAK bytes of model states held while it ran:
    ``{"params", "grads", "optimizer", "total"}``, each kind's largest value at any moment, and
    "total" the largest value of the three together at one moment (the peak of the sum, which a
    step need not reach by adding the kinds' own peaks).

    What counts (graded to the byte, against bytes computed by hand from the models' shapes):

    * params: every parameter of ``model``, frozen ones too; grads: every existing ``.grad`` of them;
      optimizer: every tensor in ``optimizer.state``, and every tensor the optimizer updates that is
      not one of the model's parameters (fp32 master copies), whose ``.grad`` counts as grads;
    * memory is held by storages: each storage counts once, at its full size, under the first kind
      that holds it in the order params, grads, optimizer.

    When: a step's model states change only as autograd delivers gradients, as the optimizer steps,
    and in ``run_step``'s own statements between those. The graded steps never hide a peak inside
    their own statements (what they allocate is still there when autograd or the optimizer acts
    next, or when the step ends), so every peak can be seen from outside ``run_step``; which moments
    to watch, and how, is yours to work out. Graded on: tied weights with fp32 AdamW and gradients
    released by ``zero_grad(set_to_none=True)`` before the step returns; bf16 parameters with fp32
    masters, whose gradients the optimizer releases as it steps; a frozen layer and two backward
    passes per step; a step skipped after an overflow (gradients released, no optimizer step);
    parameters and gradients that are views into flat buffers the optimizer keeps too; torch DDP's
    bucket-view gradients on 2 real ranks.

    Leave nothing behind, whatever happens: once it returns, and also when ``run_step()`` raises
    (its exception then passes out of ``peak_model_states`` unchanged), the model and the optimizer
    behave as before the call (graded with a step that raises after its backward pass)."""
    raise NotImplementedError(
        "Exercise 01.1: measure the peak of each kind, and of their sum, while run_step() runs.")


def model_state_bytes(num_params, world_size, stage, *, mixed_precision=True, offload=False):
    """Per-rank model-state bytes predicted by ZeRO (Rajbhandari et al., Sec. 5) for ``stage`` 0
    (plain data parallelism) to 3 (P_os, P_os+g, P_os+g+p) on ``world_size`` ranks:
    {"params", "grads", "optimizer", "total"} on the device of one rank, and "host" (bytes in the
    host memory of one rank; 0 without offload).

    Mixed precision: 2-byte params and grads, K = 12 (fp32 master, momentum, variance).
    fp32 (``mixed_precision=False``): 4-byte params and grads, K = 8 (momentum, variance).
    Exact values: Ψ/N may be fractional; do not round.
    ``offload=True`` (ZeRO-Offload, stages 1-3): what a rank owns of the optimizer state (and, in
    fp32, a 4-byte copy of its parameter shard for the host to update) and its gradient shard (2 or
    4 bytes x Ψ/N) live on the host; the device keeps the parameters as the stage has them, and
    the full gradient only in stage 1 (which does not partition gradients). Stage 0 with offload,
    or any stage other than 0-3: a ValueError naming the setting.
    Graded on the paper's worked example (Ψ = 7.5B, N = 64), on sizes no N divides, and on
    ZeRO-Offload's split between device and host."""
    raise NotImplementedError(
        "Exercise 01.2: the bytes of each kind on one rank, at this stage, on the device and on the host.")

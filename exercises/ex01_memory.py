"""Exercise 01 — memory anatomy: measure the peak of a training step, then predict per-rank bytes.

Lesson 01 shows that parameters live throughout, gradients from backward until ``zero_grad``, and
optimizer state from the first step on, so what a step needs is a PEAK that a measurement taken
after the step does not see. Here you build the instrument that catches it; how is yours.

01.1 ``peak_model_states``: the peak, by kind and in all, measured while a step runs.
01.2 ``model_state_bytes``: one rank's bytes of each kind, on the device and on the host, at any ZeRO
     stage, with or without offload, for a model given by its parameter shapes and ANY torch
     optimizer: the accounting derived from its sources and your measurements, not given.

Grade your work:  ``make grade`` or, in lesson 01, ``zerolab.grade.check("01")``. Plain Python and
torch: a file that imports ``zerolab.memory`` or ``zerolab.calculator`` (this exercise's reference),
builds code or names at run time (``exec``, ``eval``, ``importlib``) or inspects frames, modules or
functions (``inspect``, ``gc``, ``sys.modules``) scores 0, with the line named (README, "The grader").
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


def model_state_bytes(shapes, world_size, stage, *, optimizer, optimizer_kwargs=None, mixed_precision=True,
                      offload=False):
    """The model-state bytes that ONE rank holds when a model whose parameters have the given
    ``shapes`` (a list of shapes, e.g. ``[[256, 64], [64]]``) trains with ``optimizer`` on
    ``world_size`` (N) data-parallel ranks at ZeRO ``stage`` 0 (plain data parallelism), 1, 2 or 3
    (P_os, P_os+g, P_os+g+p), with or without ZeRO-Offload. Returns
    ``{"params", "grads", "optimizer", "total", "host"}``: the bytes of each kind on the rank's
    device, their sum, and the bytes of model states in the rank's host memory (all kinds together).

    The setting, by its sources (the bytes are yours to derive from them):

    * ``optimizer``: ANY torch optimizer class, built as ``optimizer(params, **optimizer_kwargs)``
      (``zerolab.initialize`` takes the same two), e.g. ``torch.optim.Adam`` with
      ``{"amsgrad": True}``, ``torch.optim.RMSprop`` with ``{"centered": True, "momentum": 0.9}`` or
      ``torch.optim.Adafactor``. Its state is whatever that torch optimizer keeps for each
      parameter after a step, which depends on the class, its arguments and the parameter's shape.
      No table of optimizers is given: find out what each one keeps (your 01.1 census, lesson 01).
      The graded models include one vector of 7.5e9 elements.
    * ``mixed_precision=True``: the ZeRO paper's mixed precision (Rajbhandari et al., arXiv
      1910.02054, Sec. 3.1) with this optimizer in place of Adam; what each stage partitions: its Sec. 5.
    * ``mixed_precision=False``: the same optimizer trained in fp32 throughout (lesson 01, section 3).
    * ``offload=True``: placed as zerolab's offload engines place it,
      ``zerolab.initialize(model, stage=..., param_dtype=..., offload="optimizer", optimizer=...)``
      (ZeRO-Offload, Ren et al., arXiv 2101.06840, Sec. 4). You can build them on a few ranks,
      measure what each holds and on which side (lesson 06, sections 2 and 4), and generalise.

    What counts: model states only, in the kinds of 01.1 (an fp32 master copy is optimizer state).
    Not counted: activations, scalars an optimizer keeps per parameter tensor (0-dim state tensors:
    step counts and the like), transient buffers (gradient buckets in flight, stage 3's gathered
    layers, a host kernel's workspace) and padding: a rank's share of a partitioned state is exactly
    1/N of it, fractional when N does not divide it (do not round).
    A setting that does not exist: a ValueError naming it. That is a stage other than 0-3; offload
    without a partitioned optimizer (stage 0); ``optimizer`` not a torch optimizer class; and an
    optimizer that zerolab's engines refuse at this stage (find out which they refuse, and why).

    Graded exactly, against closed forms the grader derives from the same sources, with each
    optimizer's state measured on torch's own optimizers: every kind on the device and the host
    total, at every stage, in both precisions, with and without offload, for a dozen optimizer
    settings, most of which no lesson tabulates. Also the paper's worked example (Adam, Ψ = 7.5e9, N = 64), and models
    with vectors, matrices of one row or one column, and 3-D and 4-D parameters, whose totals no N
    divides."""
    raise NotImplementedError(
        "Exercise 01.2: the bytes of each kind on one rank, at this stage, on the device and on the host.")

"""Exercise 11 — ZeRO-3 in your own loop: FSDP2's pieces, and the two questions every step asks
about a gradient that no rank holds whole (lesson 11).

11.1 ``shard_dim0`` / ``unshard_dim0``: a parameter in FSDP2's dim-0 layout (lesson 11, section 2),
     cut and put back together.
11.2 ``found_inf`` and 11.3 ``clip_grad_norm_``: fp16 loss scaling's overflow check and
     ``torch.nn.utils.clip_grad_norm_`` (2-norm), for a gradient held in a MIXED layout, as a real
     job holds it. Each rank of ``group`` passes ``pieces``, the list of what it holds, each entry a
     pair ``(tensor, holders)``:

     * ``tensor``: a piece of the gradient, any shape and floating dtype: fp16 or bf16 on the
       device, fp32 for the pieces an offloaded optimizer keeps on the host (on this CPU-only
       course host and "device" are the same memory: the host's pieces differ only in dtype here);
     * ``holders``: the ranks of ``group``, numbered as ``dist.get_rank(group)`` numbers them, that
       hold an IDENTICAL copy of this piece, this rank among them: one rank for a shard (FSDP2's
       pieces, padding zeros included), every rank for a gradient every rank keeps whole, or any
       subset (a weight tied across two pipeline stages, HSDP's replicas).

     Every element of the gradient is in exactly one piece, up to the copies. A rank may hold
     nothing at all. The pieces are far larger than ``budget_bytes``: at no moment may the tensors
     your call allocates exceed it together (measured with torch's profiler).

Use ``zerolab.comm`` (or torch.distributed) for collectives: ``comm.all_gather(output, input,
group=...)``, ``comm.all_reduce(tensor, op=..., group=...)``. Grade your work:
``zerolab.grade.check("11")``. The graded tests build the layouts on 3 of 4 ranks (the fourth does
something else meanwhile), compare with float64 references computed by the grader, with
torch.nn.utils.clip_grad_norm_ and torch.amp.GradScaler on one process, and measure the wire and
the memory.
"""


def shard_dim0(full, rank, world_size):
    """Return ``rank``'s piece of ``full`` in FSDP2's dim-0 layout for ``world_size`` ranks, as a new
    tensor (not a view of ``full``) of ``full``'s dtype.

    Graded: every rank's piece, exactly, for several shapes and world sizes (rows not divisible by
    the world size, fewer rows than ranks); ``full`` unchanged."""
    raise NotImplementedError("Exercise 11.1: shard_dim0 is not written yet")


def unshard_dim0(shard, rows, group=None):
    """Every rank of ``group`` calls it with its own piece (as ``shard_dim0`` cut it): return the
    whole tensor of ``rows`` rows, the same on every rank of ``group``.

    Graded: the values, exactly; the wire: ONE collective, on ``group``, carrying the pieces and
    nothing more; ``group`` a subgroup; the piece passed in unchanged."""
    raise NotImplementedError("Exercise 11.1: unshard_dim0 is not written yet")


def found_inf(pieces, group=None, *, budget_bytes=64 * 1024):
    """True on EVERY rank of ``group`` if any element of any piece held by ANY rank of ``group`` is
    inf, -inf or NaN; else False. (The step is then skipped everywhere or nowhere.)

    Graded: the decision on every rank, with the bad element in each kind of piece and on each rank,
    and nowhere; a fully_shard loop against torch.amp.GradScaler's decisions; the wire: ONE
    collective on ``group`` whose largest buffer is at most 8 bytes; memory: ``budget_bytes``."""
    raise NotImplementedError("Exercise 11.2: found_inf is not written yet")


def clip_grad_norm_(pieces, max_norm, group=None, *, budget_bytes=64 * 1024):
    """The 2-norm of the whole gradient (every element once, however many ranks hold a copy),
    returned as a float or a 0-dim tensor, the same on every rank of ``group``; and every piece
    multiplied in place by torch's coefficient min(1, max_norm / (norm + 1e-6)), every copy alike.
    When the norm is not finite (an inf or NaN anywhere), return it and change nothing: the caller
    will skip the step.

    Graded: the norm to 1e-10 of the grader's float64 norm (the gradients are fp16, bf16 and fp32,
    and as large and as small as loss-scaled gradients are); every piece after, on every rank; a
    norm below ``max_norm`` (nothing changes, bit for bit); a non-finite norm; a rank that holds
    nothing; a TinyGPT in fully_shard against torch's clipping on one process; the wire: ONE
    collective on ``group`` whose largest buffer is at most 8 bytes — for both answers, the norm
    and whether anything overflowed; memory: ``budget_bytes``."""
    raise NotImplementedError("Exercise 11.3: clip_grad_norm_ is not written yet")

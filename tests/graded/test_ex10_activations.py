"""Graded: exercise 10, activation checkpointing of one block by hand, and the crossover sequence
length of a block in mixed precision. The submission runs only inside probes (its own processes);
every verdict is decided here, on plain data, against references computed here: the plain block in
float64 (same inputs, same generator state), the same ZeRO-3 engine without a checkpoint on trusted
ranks, and the grader's own measurement of what a block saves under bfloat16 autocast. Observed, not
read from the code: what autograd saves during the forward (saved-tensor hooks), what stays
allocated (torch's profiler), how often the block's layers run in forward and in backward (forward
hooks), whether each gradient lands IN the .grad already there (a view into a flat buffer, as
engines keep them) before the parameter's post-accumulate-grad hook runs."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from zerolab import models
from zerolab.activations import SavedTensors
from zerolab.grade.helpers import assert_close, exercise_module

# What this exercise must not use (checked before and while the tests run, zerolab.grade.references):
# the course's own checkpointing and torch's. SavedTensors is the measuring tool the stub offers.
REFERENCE_MODULES = ["zerolab.activations", "torch.utils.checkpoint"]
REFERENCE_ALLOWED = ["zerolab.activations.SavedTensors"]

SHAPE = dict(vocab_size=64, d_model=64, n_heads=4, seq_len=64, n_layers=2, attention="naive")
SLACK = 16 * 1024        # bytes: a few small tensors (a CPU generator's state is 5 kB); a block saves ~2.6 MB


def _close(actual, expected, what, *, rtol, atol):
    """assert_close, decided here (its rank prefix would name this process, not the rank checked:
    ``what`` names the rank)."""
    try:
        assert_close(actual, expected, what, rtol=rtol, atol=atol)
    except AssertionError as exc:
        raise AssertionError(str(exc).removeprefix("rank 0: ")) from None


class _Dropped(nn.Module):
    """A TinyGPT block with dropout on its input and on its output: a block that draws random numbers."""

    def __init__(self, block, p=0.25):
        super().__init__()
        self.inner, self.p = block, p

    def forward(self, x):
        return F.dropout(self.inner(F.dropout(x, self.p, training=True)), self.p, training=True)


def _case(case, fn, seed=0):
    """Run ``fn(block, x)`` (the submission's checkpoint, or the plain block) in one of the graded
    situations and return what a plain backward leaves: output, gradients, generator draws. Shared by
    the probe (the submission's process) and the reference (here); it decides nothing."""
    model = models.build("gpt", seed=seed, dtype=torch.float64, **SHAPE)
    block = model.blocks[1]
    g = torch.Generator().manual_seed(seed + 1)
    x0 = torch.randn(4, SHAPE["seq_len"], SHAPE["d_model"], dtype=torch.float64, generator=g)
    w = torch.randn(x0.shape, dtype=torch.float64, generator=g)
    if case == "params frozen":
        block.requires_grad_(False)
    if case != "x without grad":
        x0.requires_grad_()
    if case == "accumulate":                        # a .grad already there: backward adds to it
        x0.grad = torch.randn(x0.shape, dtype=torch.float64, generator=g)
        for p in block.parameters():
            p.grad = torch.randn(p.shape, dtype=torch.float64, generator=g)
    x = x0 * 1.5 if x0.requires_grad else x0        # x produced by an op: its gradient must flow on
    if case == "dropout":
        block = _Dropped(block)
    torch.manual_seed(1000 + seed)
    out = fn(block, x)
    between = torch.rand(3, dtype=torch.float64)    # someone else draws between forward and backward
    requires_grad = bool(out.requires_grad)
    if requires_grad:
        (out * w).sum().backward()
    after = torch.rand(4, dtype=torch.float64)
    return {"out": out.detach(), "requires_grad": requires_grad, "x0": x0.grad,
            "params": {n: p.grad for n, p in block.named_parameters()}, "between": between, "after": after}


def _probe_case(case):
    ex = exercise_module("ex10_activations")
    return _case(case, ex.checkpointed)


def _plain(block, x):
    return block(x)


def _check_case(student, case):
    got, want = student.run(_probe_case, case), _case(case, _plain)
    _close(got["out"], want["out"], f"[{case}] the output", rtol=1e-12, atol=1e-12)
    assert got["requires_grad"] == want["requires_grad"], (
        f"[{case}] the output requires_grad={got['requires_grad']}, a plain block's {want['requires_grad']}: "
        f"backward {'cannot reach the block' if want['requires_grad'] else 'is not expected'}")
    if want["x0"] is None:
        assert got["x0"] is None, f"[{case}] the input got a gradient where a plain block gives none"
    else:
        assert got["x0"] is not None, (f"[{case}] the input got no gradient: the gradient stopped at your "
                                       f"checkpoint instead of flowing on to what produced x")
        _close(got["x0"], want["x0"], f"[{case}] the gradient reaching what produced x", rtol=1e-10,
               atol=1e-12)
    for name, ref in want["params"].items():
        mine = got["params"][name]
        if ref is None:
            assert mine is None, f"[{case}] parameter {name} is frozen, yet it got a .grad"
            continue
        assert mine is not None, f"[{case}] parameter {name} got no gradient"
        what = f"[{case}] the .grad of {name}" + (" (a .grad was already there: backward ADDS to it)"
                                                  if case == "accumulate" else "")
        _close(mine, ref, what, rtol=1e-10, atol=1e-12)
    return got, want


@pytest.mark.points(2)
def test_gradients_equal_the_plain_block(student):
    """values: output, input gradient and parameter gradients in float64, accumulating into .grad"""
    _check_case(student, "accumulate")


@pytest.mark.points(2)
def test_any_mix_of_what_requires_grad(student):
    """the input without grad (frozen embeddings before it), or the block's parameters frozen"""
    _check_case(student, "x without grad")
    _check_case(student, "params frozen")


@pytest.mark.points(2)
def test_dropout_replayed_and_the_generator_left_alone(student):
    """a block that draws random numbers: the same draws in the recomputation, the caller's stream untouched"""
    got, want = _check_case(student, "dropout")
    assert torch.equal(got["between"], want["between"]), (
        "the numbers drawn between forward and backward differ from a plain run's: your forward moved the "
        "default generator differently from the block's own forward")
    assert torch.equal(got["after"], want["after"]), (
        "after backward the default generator is not where a plain run leaves it: your recomputation "
        "changed the caller's random stream")


def _probe_memory():
    ex = exercise_module("ex10_activations")
    from zerolab.memory import allocation_trace
    model = models.build("gpt", seed=0, dtype=torch.float64, **SHAPE)
    block = model.blocks[1]
    x = torch.randn(4, SHAPE["seq_len"], SHAPE["d_model"], dtype=torch.float64,
                    generator=torch.Generator().manual_seed(1)).requires_grad_()
    with torch.enable_grad(), SavedTensors(block) as saved:
        out = ex.checkpointed(block, x)
    by_module = {k: v for k, v in saved.by_module().items() if v}
    del out
    with allocation_trace() as trace:
        out = ex.checkpointed(block, x)
    return {"saved": saved.total(), "by_module": by_module, "end": trace["end"],
            "out_bytes": out.numel() * out.element_size(), "x_bytes": x.numel() * x.element_size()}


@pytest.mark.points(3)
def test_keeps_only_the_input(student):
    """memory, measured: saved-tensor hooks during the forward, and the profiler's live bytes after it"""
    got = student.run(_probe_memory)
    block = models.build("gpt", seed=0, dtype=torch.float64, **SHAPE).blocks[1]
    x = torch.randn(4, SHAPE["seq_len"], SHAPE["d_model"], dtype=torch.float64, requires_grad=True)
    with torch.enable_grad(), SavedTensors(block) as plain:
        block(x)
    x_bytes = got["x_bytes"]
    assert got["saved"] <= x_bytes + SLACK, (
        f"autograd saved {got['saved']} bytes during your checkpointed forward (by module: {got['by_module']}); "
        f"the plain block saves {plain.total()}, its input is {x_bytes}: keep only the input")
    assert got["end"] <= got["out_bytes"] + x_bytes + SLACK, (
        f"{got['end']} bytes allocated during your checkpointed forward are still alive after it (the output "
        f"is {got['out_bytes']}, the input {x_bytes}; the plain block keeps {plain.total()}): something keeps "
        f"the block's intermediate tensors")


def _probe_runs():
    ex = exercise_module("ex10_activations")
    block = models.build("gpt", seed=0, dtype=torch.float64, **SHAPE).blocks[1]
    x = torch.randn(4, SHAPE["seq_len"], SHAPE["d_model"], dtype=torch.float64, requires_grad=True)
    counts = {"forward": 0, "backward": 0}

    def hook(module, args):
        counts["backward" if torch._C._current_graph_task_id() != -1 else "forward"] += 1
    handle = block.qkv.register_forward_pre_hook(hook)
    out = ex.checkpointed(block, x)
    in_forward = counts["forward"]
    out.sum().backward()
    handle.remove()
    return {"forward": in_forward, "backward": counts["backward"]}


@pytest.mark.points(2)
def test_recomputes_once(student):
    """work: the block runs once in forward and once during backward (forward hooks count)"""
    got = student.run(_probe_runs)
    assert got["forward"] == 1, f"the block ran {got['forward']} times in forward (expected once)"
    assert got["backward"] == 1, (f"the block ran {got['backward']} times during backward (expected exactly "
                                  f"one recomputation)")


def _in_place(fn):
    """``fn(block, x)`` on a block whose parameters' .grad are views into one flat buffer holding a
    gradient already (as an engine's buckets: zerolab's data-parallel engines, lesson 02's averager,
    DDP's gradient_as_bucket_view), each parameter with a post-accumulate-grad hook (where engines
    pick a finished gradient up): the buffer after backward, and what each hook saw. Shared by the
    probe (the submission's process) and the reference (here); it decides nothing."""
    block = models.build("gpt", seed=0, dtype=torch.float64, **SHAPE).blocks[1]
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2, SHAPE["seq_len"], SHAPE["d_model"], dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(x.shape, dtype=torch.float64, generator=g)
    params = list(block.named_parameters())
    flat = torch.randn(sum(p.numel() for _, p in params), dtype=torch.float64, generator=g)
    seen, ptrs, offset = {}, [], 0
    for name, p in params:
        p.grad = flat[offset:offset + p.numel()].view_as(p)
        seen[name] = []
        ptrs.append(p.grad.data_ptr())

        def hook(q, name=name, ptr=p.grad.data_ptr()):
            seen[name].append({"in_backward": torch._C._current_graph_task_id() != -1,
                               "in_buffer": q.grad is not None and q.grad.data_ptr() == ptr,
                               "grad": None if q.grad is None else q.grad.detach().clone()})
        p.register_post_accumulate_grad_hook(hook)
        offset += p.numel()
    (fn(block, x) * w).sum().backward()
    return {"flat": flat, "seen": seen,
            "views_kept": [p.grad is not None and p.grad.data_ptr() == ptr for (_, p), ptr in zip(params, ptrs)]}


def _probe_in_place():
    return _in_place(exercise_module("ex10_activations").checkpointed)


@pytest.mark.points(2)
def test_gradients_added_in_place_before_the_hooks(student):
    """gradients added INTO each parameter's .grad (views into an engine's flat buffer stay views and receive
    them), then each parameter's post-accumulate-grad hook runs once, inside backward"""
    got, want = student.run(_probe_in_place), _in_place(_plain)
    names = list(want["seen"])
    for name, kept in zip(names, got["views_kept"]):
        assert kept, (f"after backward, the .grad of {name} is no longer the view into the flat gradient buffer it "
                      f"was before: a plain backward adds the gradient INTO the .grad already there, so an engine "
                      f"whose .grad are views into its buckets (zerolab's data-parallel engines, DDP's "
                      f"gradient_as_bucket_view) reduces what the bucket holds; a .grad replaced by a new tensor "
                      f"leaves the bucket without this gradient")
    _close(got["flat"], want["flat"], "the flat buffer the .grad are views of (it held a gradient already: "
           "backward adds to it)", rtol=1e-10, atol=1e-12)
    for name in names:
        calls, ref = got["seen"].get(name, []), want["seen"][name]
        assert len(calls) == 1 and calls[0]["in_backward"], (
            f"the post-accumulate-grad hook on {name} ran {len(calls)} times"
            f"{'' if not calls else ' (' + ', '.join('inside' if c['in_backward'] else 'outside' for c in calls) + ' backward)'}"
            f"; a plain backward runs it once, inside backward, once the gradient is in .grad")
        assert calls[0]["in_buffer"], (f"when the post-accumulate-grad hook on {name} ran, .grad was not the view into "
                                       f"the flat buffer: the engine's hook would miss the gradient")
        _close(calls[0]["grad"], ref[0]["grad"], f"the .grad the hook on {name} saw (the sum of the gradient "
               f"already there and this backward's)", rtol=1e-10, atol=1e-12)


class _Checkpointed(nn.Module):
    """A TinyGPT block whose forward is a checkpoint function: the ZeRO-3 unit."""

    def __init__(self, block, fn):
        super().__init__()
        self.inner, self.fn = block, fn

    def forward(self, x):
        return self.fn(self.inner, x)


def _train(fn, steps=2):
    """ZeRO-3 (zerolab's engine) on this rank's batches, each block wrapped by ``fn`` (None: plain)."""
    import torch.distributed as dist

    import zerolab
    model = models.build("gpt", seed=0, dtype=torch.float64, **dict(SHAPE, seq_len=16))
    if fn is not None:
        model.blocks = nn.ModuleList(_Checkpointed(b, fn) for b in model.blocks)
    engine = zerolab.initialize(model, stage=3, lr=1e-2)
    for s in range(steps):
        x, y = models.batch("gpt", seed=100 * s + dist.get_rank(), batch_size=2, model=model)
        engine.backward(engine(x, y))
        engine.step()
        engine.zero_grad()
    gathered = engine.last_step_comm.by_op()["all_gather"][1]
    return list(dict.fromkeys(engine.full_state_dict().values())), gathered


def _probe_zero3():
    return _train(exercise_module("ex10_activations").checkpointed)


def _reference_zero3():      # trusted ranks: the submission is never imported here
    return _train(None)


@pytest.mark.points(2)
def test_works_as_a_zero3_unit(student, clusters):
    """your checkpoint as a ZeRO-3 unit on 2 ranks: the same weights and all-gathered bytes as without it"""
    got = student.on_ranks(2, _probe_zero3)
    want = clusters(2).run(_reference_zero3)
    for rank, ((mine, gathered), (plain, plain_gathered)) in enumerate(zip(got, want)):
        assert len(mine) == len(plain), f"rank {rank}: {len(mine)} parameter tensors, expected {len(plain)}"
        for i, (a, b) in enumerate(zip(mine, plain)):
            _close(a, b, f"rank {rank}: parameter tensor {i} after 2 steps of ZeRO-3 with your checkpointed "
                   f"blocks", rtol=1e-10, atol=1e-12)
        assert gathered == plain_gathered, (f"rank {rank}: {gathered} bytes all-gathered per step with your "
                                            f"checkpoint, {plain_gathered} without")


def _saved_split(d_model, n_heads, batch_size, s):
    """The grader's own measurement (trusted: the submission is never imported here): what block 0
    saves in a forward of the model under bfloat16 autocast, as SavedTensors counts it (each storage
    once, first saver, parameters left out), split into the (B, heads, s, s) probabilities and the rest."""
    model = models.build("gpt", d_model=d_model, n_heads=n_heads, seq_len=s, n_layers=1, attention="naive")
    x, y = models.batch("gpt", model=model, batch_size=batch_size)
    with SavedTensors(model) as log, torch.autocast("cpu", dtype=torch.bfloat16):
        model(x, y)
    block = [r for r in log.records if r.first and (r.module == "blocks.0" or r.module.startswith("blocks.0."))]
    probs = sum(r.storage_bytes for r in block if r.shape == (batch_size, n_heads, s, s))
    return probs, sum(r.storage_bytes for r in block) - probs


def _measured_crossover(d_model, n_heads, batch_size):
    """The first length at which the probabilities outweigh the rest: located from measurements at
    four lengths (probabilities c2·s², the rest c1·s + c0: integers, bytes), then measured on both
    sides of it, which decides."""
    m = {s: _saved_split(d_model, n_heads, batch_size, s) for s in (4, 12, 20, 28)}
    c2 = m[4][0] // 16
    c1 = (m[20][1] - m[4][1]) // 16
    c0 = m[4][1] - 4 * c1
    assert all(m[s] == (c2 * s * s, c1 * s + c0) for s in m), f"the grader's measurement is not c2·s², c1·s + c0: {m}"
    s = 1
    while c2 * s * s <= c1 * s + c0:
        s += 1
    before, at = _saved_split(d_model, n_heads, batch_size, s - 1), _saved_split(d_model, n_heads, batch_size, s)
    assert before[0] <= before[1] and at[0] > at[1], f"measured at {s - 1}: {before}, at {s}: {at}"
    return s


# (d_model, n_heads, batch_size): none is a lesson figure; batch sizes 1 to 8 (the crossover moves with
# the batch); (80, 16, 1) and (40, 8, 5) meet EXACTLY at one length (there they are equal, not more).
CROSSOVER_SHAPES = [(64, 4, 1), (64, 4, 4), (48, 3, 2), (96, 8, 1), (40, 5, 3), (80, 16, 1), (40, 8, 5), (32, 4, 8)]


@pytest.mark.points(2)
def test_crossover_seq_len(student):
    """measured, exactly: the first sequence length at which a mixed-precision block's attention
    probabilities outweigh everything else it saves"""
    ex = student.module("ex10_activations")
    for d_model, n_heads, batch_size in CROSSOVER_SHAPES:
        got = ex.crossover_seq_len(d_model, n_heads, batch_size)
        want = _measured_crossover(d_model, n_heads, batch_size)
        assert isinstance(got, (int, float)) and not isinstance(got, bool) and got == want, (
            f"crossover_seq_len({d_model}, {n_heads}, {batch_size}) = {got!r}; measured: {want} (graded exactly: "
            f"at {want - 1} the probabilities are not yet more than the rest, at {want} they are)")

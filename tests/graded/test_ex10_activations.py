"""Graded: exercise 10, activation checkpointing of one block by hand, and the crossover sequence
length. Everything is measured, not read from the code: gradients against the plain block (float64),
what autograd saves during the forward (saved-tensor hooks) and what stays allocated (torch's
profiler), how often the block's layers run in forward and in backward (forward hooks), and the
checkpointed block as a ZeRO-3 unit on 2 ranks against one process."""
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from zerolab import models
from zerolab.activations import SavedTensors
from zerolab.grade.helpers import assert_close, exercise_module
from zerolab.memory import allocation_trace

# What this exercise must not use (checked before and while the tests run, zerolab.grade.references):
# the course's own checkpointing and torch's. SavedTensors is the measuring tool the stub offers.
REFERENCE_MODULES = ["zerolab.activations", "torch.utils.checkpoint"]
REFERENCE_ALLOWED = ["zerolab.activations.SavedTensors"]

SHAPE = dict(vocab_size=64, d_model=64, n_heads=4, seq_len=64, n_layers=2, attention="naive")
SLACK = 16 * 1024        # bytes: a few small tensors (an RNG state is 5 kB); one block saves ~2.6 MB


def _block_and_input(seed=0):
    block = models.build("gpt", seed=seed, dtype=torch.float64, **SHAPE).blocks[1]
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(4, SHAPE["seq_len"], SHAPE["d_model"], dtype=torch.float64, generator=g)
    return block, x


@pytest.mark.points(2)
def test_gradients_equal_the_plain_block():
    ex = exercise_module("ex10_activations")
    block, x0 = _block_and_input()
    ref_block, _ = _block_and_input()
    w = torch.randn(x0.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    x, x_ref = x0.clone().requires_grad_(), x0.clone().requires_grad_()
    out = ex.checkpointed(block, x)
    want = ref_block(x_ref)
    assert_close(out.detach(), want.detach(), "the output", rtol=1e-12, atol=1e-12)
    assert out.requires_grad, "the output does not require grad: backward cannot reach the block"
    (out * w).sum().backward()
    (want * w).sum().backward()
    assert x.grad is not None, ("x.grad is None: the gradient stopped at the checkpoint (an input "
                                "detached, or no gradient returned for x)")
    assert_close(x.grad, x_ref.grad, "the gradient of the block's input x", rtol=1e-10, atol=1e-12)
    for (name, p), q in zip(block.named_parameters(), ref_block.parameters()):
        assert p.grad is not None, f"parameter {name} got no gradient"
        assert_close(p.grad, q.grad, f"the gradient of {name}", rtol=1e-10, atol=1e-12)


@pytest.mark.points(3)
def test_keeps_only_the_input():
    ex = exercise_module("ex10_activations")
    block, x = _block_and_input()
    x.requires_grad_()
    x_bytes = x.numel() * x.element_size()
    with torch.enable_grad(), SavedTensors(block) as saved:
        out = ex.checkpointed(block, x)
    plain = SavedTensors(block)
    with torch.enable_grad(), plain:
        block(x)
    assert saved.total() <= x_bytes + SLACK, (
        f"autograd saved {saved.total()} bytes during the checkpointed forward (by module: "
        f"{saved.by_module()}); the plain block saves {plain.total()}, its input is {x_bytes}: keep only "
        f"the input")
    del out
    with allocation_trace() as trace:
        out = ex.checkpointed(block, x)
    out_bytes = out.numel() * out.element_size()
    assert trace["end"] <= out_bytes + x_bytes + SLACK, (
        f"{trace['end']} bytes allocated during the checkpointed forward are still alive after it "
        f"(the output is {out_bytes}, the input {x_bytes}; the plain block keeps {plain.total()}): "
        f"something keeps the block's intermediate tensors")


def _count_runs(block):
    counts = {"forward": 0, "backward": 0}

    def hook(module, args):
        counts["backward" if torch._C._current_graph_task_id() != -1 else "forward"] += 1
    return counts, block.qkv.register_forward_pre_hook(hook)


@pytest.mark.points(2)
def test_recomputes_once():
    ex = exercise_module("ex10_activations")
    block, x = _block_and_input()
    x.requires_grad_()
    counts, handle = _count_runs(block)
    out = ex.checkpointed(block, x)
    assert counts["forward"] == 1, f"the block ran {counts['forward']} times in forward (expected once)"
    out.sum().backward()
    handle.remove()
    assert counts["backward"] == 1, (f"the block ran {counts['backward']} times during backward (expected "
                                     f"exactly one recomputation)")


class _Checkpointed(nn.Module):
    """A TinyGPT block whose forward is the student's checkpoint: the ZeRO-3 unit."""

    def __init__(self, block, fn):
        super().__init__()
        self.inner, self.fn = block, fn

    def forward(self, x):
        return self.fn(self.inner, x)


def _train(checkpoint, steps=2):
    import zerolab
    ex = exercise_module("ex10_activations")
    model = models.build("gpt", seed=0, dtype=torch.float64, **dict(SHAPE, seq_len=16))
    if checkpoint:
        model.blocks = nn.ModuleList(_Checkpointed(b, ex.checkpointed) for b in model.blocks)
    engine = zerolab.initialize(model, stage=3, lr=1e-2)
    for s in range(steps):
        x, y = models.batch("gpt", seed=100 * s + dist.get_rank(), batch_size=2, model=model)
        engine.backward(engine(x, y))
        engine.step()
        engine.zero_grad()
    gathered = engine.last_step_comm.by_op()["all_gather"][1]
    return list(dict.fromkeys(engine.full_state_dict().values())), gathered


def check_zero3_unit():
    mine, gathered = _train(True)
    plain, plain_gathered = _train(False)
    rank = dist.get_rank()
    assert len(mine) == len(plain)
    for i, (a, b) in enumerate(zip(mine, plain)):
        assert_close(a, b, f"parameter tensor {i} after 2 steps of ZeRO-3 with your checkpointed blocks",
                     rtol=1e-10, atol=1e-12)
    assert gathered == plain_gathered, (f"rank {rank}: {gathered} bytes all-gathered per step with your "
                                        f"checkpoint, {plain_gathered} without")


@pytest.mark.points(2)
def test_works_as_a_zero3_unit(on_ranks):
    on_ranks(2, check_zero3_unit)


def _measured_crossover(d_model, n_heads):
    """The grader's own measurement: saved bytes of block 0 at three lengths, fitted exactly."""
    def saved(s):
        model = models.build("gpt", d_model=d_model, n_heads=n_heads, seq_len=s, n_layers=1, attention="naive")
        with SavedTensors(model) as log:
            model(*models.batch("gpt", model=model, batch_size=2))
        return sum(b for name, b in log.by_module().items() if name.startswith("blocks.0")) / 2

    f = {s: saved(s) for s in (4, 8, 12)}
    quad = (f[12] / 12 - f[4] / 4) / 8                   # f(s) = quad·s² + lin·s
    lin = f[4] / 4 - quad * 4
    assert abs(f[8] - (quad * 64 + lin * 8)) < 1e-6, "the measurement is not quadratic through 0"
    return int(lin // quad) + 1


@pytest.mark.points(2)
def test_crossover_seq_len():
    ex = exercise_module("ex10_activations")
    for d_model, n_heads in [(64, 4), (64, 2), (96, 8), (128, 16)]:
        got, want = ex.crossover_seq_len(d_model, n_heads), _measured_crossover(d_model, n_heads)
        assert abs(got - want) <= 0.02 * want, (
            f"crossover_seq_len({d_model}, {n_heads}) = {got}; measured: {want}")

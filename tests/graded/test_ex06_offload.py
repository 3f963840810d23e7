"""Graded: exercise 06, the delayed parameter update by hand, and offload's host bytes. Values are
checked against an independent one-process reference of DPU in float64 (the gradient of step t is
taken on parameters one update behind), with the device gradients overwritten with NaN as soon as
each step() returns (the background update may read host tensors only); the overlap by a host
optimizer step that can finish only after step() has returned; placement (state of the fp32 host
master only; the device holds exactly the masters cast to bf16). The host bytes are compared with
the grader's own measurement."""
import threading

import pytest
import torch
import torch.distributed as dist

from zerolab import models
from zerolab.grade.helpers import assert_close, exercise_module

# The reference implementation of this exercise: a submission that uses it scores 0
# (checked before and while the tests run, by zerolab.grade.references).
REFERENCE_MODULES = ["zerolab.offload", "zerolab.shard_optim"]
REFERENCE_ALLOWED = [  # used by the given code
    "zerolab.offload.host_buffer",
    "zerolab.offload.host_optimizer",
    "zerolab.shard_optim.master_dtype",
]

N = 2
LR = 1e-2
STEPS = 4


def _batch(step, rank):
    return models.batch("gpt", seed=100 * step + rank, batch_size=3)


def _dpu_reference(n):
    """One process, float64: the master steps with the gradient of parameters one update behind."""
    device = models.build("gpt", seed=0, dtype=torch.float64)       # what forward/backward run on
    master = models.build("gpt", seed=0, dtype=torch.float64)       # what the optimizer updates
    opt = torch.optim.AdamW(list(dict.fromkeys(master.parameters())), lr=LR)
    for s in range(STEPS):
        xs, ys = zip(*[_batch(s, r) for r in range(n)])
        device.zero_grad()
        device(torch.cat(xs), torch.cat(ys)).backward()
        grads = [p.grad.clone() for p in dict.fromkeys(device.parameters())]
        with torch.no_grad():                                       # publish the previous update
            for d, m in zip(dict.fromkeys(device.parameters()), dict.fromkeys(master.parameters())):
                d.copy_(m)
        for m, g in zip(dict.fromkeys(master.parameters()), grads):
            m.grad = g
        opt.step()                                                  # this step's update, not yet seen
    return dict(master.named_parameters())


def check_values():
    ex = exercise_module("ex06_offload")
    rank, n = dist.get_rank(), dist.get_world_size()
    model = models.build("gpt", seed=0, dtype=torch.float64)
    opt = ex.DelayedOffloadAdam(model.parameters(), lr=LR)
    wiped, real = threading.Event(), opt.optimizer.step

    def gated_step(*args, **kwargs):           # the host update computes only after the wipe below
        wiped.wait(timeout=3.0)
        return real(*args, **kwargs)

    opt.optimizer.step = gated_step
    for s in range(STEPS):
        model(*_batch(s, rank)).backward()
        wiped.clear()
        opt.step()
        opt.grads.fill_(float("nan"))          # the next backward overwrites them: the update must not care
        wiped.set()
        opt.zero_grad()
    opt.flush()
    expected = _dpu_reference(n)
    for name, p in model.named_parameters():
        assert_close(p.detach(), expected[name].detach(), f"parameter {name} after {STEPS} delayed steps and "
                     f"flush() (device gradients overwritten after each step())", rtol=1e-10, atol=1e-12)
    keys = list(opt.optimizer.state)
    assert len(keys) == 1 and keys[0] is opt.master, (
        f"rank {rank}: the optimizer has state for {len(keys)} tensor(s); it must update self.master alone")


def check_overlap():
    ex = exercise_module("ex06_offload")
    rank = dist.get_rank()
    model = models.build("gpt", seed=0, dtype=torch.float64)
    opt = ex.DelayedOffloadAdam(model.parameters(), lr=LR)
    returned, seen = threading.Event(), []
    real = opt.optimizer.step

    def slow_step(*args, **kwargs):            # a host update that can finish only once step() returned
        seen.append((returned.wait(timeout=3.0), threading.get_ident() != threading.main_thread().ident))
        return real(*args, **kwargs)

    opt.optimizer.step = slow_step
    model(*_batch(0, rank)).backward()
    opt.step()
    returned.set()
    opt.flush()
    assert seen, f"rank {rank}: no host optimizer step ran between step() and flush()"
    in_background, other_thread = seen[0]
    assert in_background, (f"rank {rank}: the host update ran before step() returned: start it in the "
                           f"background and return, so that the next forward and backward overlap it")
    assert other_thread, f"rank {rank}: the host update ran in the training thread"


def check_bf16_placement():
    ex = exercise_module("ex06_offload")
    rank, n = dist.get_rank(), dist.get_world_size()
    model = models.build("gpt", seed=0)
    opt = ex.DelayedOffloadAdam(model.parameters(), lr=1e-3, param_dtype=torch.bfloat16)
    for s in range(2):
        model(*_batch(s, rank)).backward()
        opt.step()
        opt.zero_grad()
    opt.flush()
    assert opt.master.dtype == torch.float32 and opt.master.device.type == "cpu", (
        f"rank {rank}: self.master is {opt.master.dtype} on {opt.master.device}: the fp32 master lives on the host")
    masters = [torch.empty_like(opt.master) for _ in range(n)]
    dist.all_gather(masters, opt.master)
    expected = torch.cat(masters).to(torch.bfloat16)[:opt.flat.numel]
    assert_close(opt.flat.data[:opt.flat.numel], expected,
                 "device bf16 parameters after flush() vs all ranks' fp32 masters cast to bf16", rtol=0, atol=0)


def measure_host(param_dtype):
    import zerolab
    ex = exercise_module("ex06_offload")
    theirs = ex.host_bytes_per_element(param_dtype)
    model = models.build("gpt")
    engine = zerolab.initialize(model, stage=2, offload="optimizer", lr=1e-3, param_dtype=param_dtype)
    engine.backward(engine(*models.batch("gpt", seed=dist.get_rank(), model=model)))
    engine.step()
    report = engine.memory_report()
    host = sum(sum(report.get(kind, {}).values()) for kind in engine.host_kinds)
    return theirs, host / sum(b.shard_numel for b in engine.buckets)


@pytest.mark.points(3)
def test_one_step_stale_and_reads_only_host_copies(on_ranks):
    """values and placement: one update behind, from host copies only; state of the master alone"""
    on_ranks(N, check_values)


@pytest.mark.points(3)
def test_host_update_overlaps_the_next_step(on_ranks):
    """overlap: the host update runs in the background, after step() returned"""
    on_ranks(N, check_overlap)


@pytest.mark.points(2)
def test_bf16_device_holds_the_fp32_masters(on_ranks):
    """placement: fp32 master on the host; the device's bf16 parameters are the masters cast"""
    on_ranks(N, check_bf16_placement)


@pytest.mark.points(2)
def test_host_bytes_per_element_measured(on_ranks):
    """measured: host bytes of model states per owned element, float32 and bfloat16"""
    for dtype in (torch.float32, torch.bfloat16):
        for rank, (theirs, ours) in enumerate(on_ranks(N, measure_host, dtype)):
            assert theirs == pytest.approx(ours, rel=1e-3), (
                f"rank {rank}, {dtype}: host_bytes_per_element = {theirs!r}; the engine's host kinds "
                f"({', '.join(('master', 'optimizer', 'host_grads', 'workspace'))}) hold {ours:.4f} bytes per "
                f"owned element")

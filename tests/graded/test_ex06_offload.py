"""Graded: exercise 06, the offloaded optimizer step. Properties checked besides the values: the
gradient shard that reaches the host is this rank's averaged 1/N slice, moved with a reduce-scatter
(not an all-reduce); the host update reads only the host copy (the device gradients may be gone);
the optimizer state is the host master's alone; and the fp32 master keeps updates too small for
bf16, with the device holding exactly the master cast to bf16."""
import pytest
import torch
import torch.distributed as dist

from zerolab import models
from zerolab.grade.helpers import assert_close, exercise_module, record_collectives

# The reference implementation of this exercise: a submission that uses it scores 0
# (checked before and while the tests run, by zerolab.grade.references).
REFERENCE_MODULES = ["zerolab.offload", "zerolab.shard_optim"]
REFERENCE_ALLOWED = [  # used by the given code
    "zerolab.offload.host_buffer",
    "zerolab.offload.host_optimizer",
    "zerolab.shard_optim.master_dtype",
]

LR = 1e-3


def _batch(step, rank):
    return models.batch("gpt", seed=100 * step + rank, batch_size=4)


def _setup(dtype=torch.float64, param_dtype=None, lr=LR):
    ex = exercise_module("ex06_offload")
    model = models.build("gpt", seed=0, dtype=dtype)
    return model, ex.OffloadedAdam(model.parameters(), lr=lr, param_dtype=param_dtype)


def check_gradient_shard_on_host():
    n, rank = dist.get_world_size(), dist.get_rank()
    model, opt = _setup()
    buffer = opt.grad_host.data_ptr()
    x, y = _batch(0, rank)
    model(x, y).backward()
    with record_collectives() as calls:
        opt.offload_gradients()
    ops = [c["op"] for c in calls]
    assert "reduce_scatter" in ops and "all_reduce" not in ops, (
        f"rank {rank}: offload_gradients() started {ops}: each rank needs only its own shard of the "
        f"sum, which is a reduce-scatter ((N-1)/N of the bytes), not an all-reduce")
    assert opt.grad_host.data_ptr() == buffer, (
        f"rank {rank}: self.grad_host was replaced by a new tensor: copy INTO the given host buffer "
        f"(pinned on a GPU, which is what makes the copy asynchronous)")
    ref = models.build("gpt", seed=0, dtype=torch.float64)
    ref(x, y).backward()
    grads = {}
    for q in dict.fromkeys(ref.parameters()):
        dist.all_reduce(q.grad)
        grads[id(q)] = q.grad / n
    ref_params = list(dict.fromkeys(ref.parameters()))
    expected = opt.flat.shard_from([grads[id(q)] for q in ref_params])
    assert_close(opt.grad_host, expected, f"host gradient shard (rank {rank}'s slice of the average)",
                 rtol=1e-10, atol=1e-13)


def _train(opt, model, steps, wipe_device_grads=False):
    rank = dist.get_rank()
    for s in range(steps):
        x, y = _batch(s, rank)
        model(x, y).backward()
        opt.offload_gradients()
        if wipe_device_grads:
            opt.grads.fill_(float("nan"))         # ZeRO-Offload: the device gradients are gone now
        opt.host_update()
        opt.zero_grad()


def _one_process(n, steps):
    model = models.build("gpt", seed=0, dtype=torch.float64)
    params = list(dict.fromkeys(model.parameters()))
    ref = torch.optim.AdamW(params, lr=LR)
    for s in range(steps):
        xs, ys = zip(*[_batch(s, r) for r in range(n)])
        model(torch.cat(xs), torch.cat(ys)).backward()
        ref.step()
        ref.zero_grad()
    return dict(model.named_parameters())


def check_training(wipe):
    n, rank = dist.get_world_size(), dist.get_rank()
    model, opt = _setup()
    _train(opt, model, 3, wipe_device_grads=wipe)
    expected = _one_process(n, 3)
    for name, p in model.named_parameters():
        assert_close(p.detach(), expected[name].detach(), f"parameter {name} after 3 steps"
                     + (" (device gradients wiped after offload_gradients)" if wipe else ""),
                     rtol=1e-10, atol=1e-10)


def check_state_on_host_shard():
    n, rank = dist.get_world_size(), dist.get_rank()
    model, opt = _setup()
    _train(opt, model, 1)
    keys = list(opt.optimizer.state)
    assert len(keys) == 1 and keys[0] is opt.master, (
        f"rank {rank}: the optimizer has state for {len(keys)} tensor(s); it must update self.master "
        f"(the host fp32 shard) and nothing else")
    shard = opt.flat.shard_numel
    for k, t in opt.optimizer.state[opt.master].items():
        if torch.is_tensor(t) and t.dim() > 0:
            assert t.numel() == shard and t.device.type == "cpu", (
                f"rank {rank}: optimizer state {k!r} has {t.numel()} elements on {t.device}; expected "
                f"this rank's shard, {shard} elements, on the host")


def check_fp32_master_keeps_small_updates():
    n, rank = dist.get_world_size(), dist.get_rank()
    model, opt = _setup(dtype=torch.float32, param_dtype=torch.bfloat16, lr=1e-5)
    start = opt.master.clone()
    _train(opt, model, 3)
    moved = (opt.master - start).abs().max().item()
    assert moved > 2e-5, (f"rank {rank}: the fp32 master moved at most {moved:.3g} in 3 steps of lr 1e-5: "
                          f"the optimizer must step self.master (fp32, host)")
    # Every rank's device buffer must hold exactly every rank's master, cast to bf16.
    masters = [torch.empty_like(opt.master) for _ in range(n)]
    dist.all_gather(masters, opt.master)
    expected = torch.cat(masters).to(torch.bfloat16)[:opt.flat.numel]
    assert_close(opt.flat.data[:opt.flat.numel], expected,
                 "device bf16 parameters vs all ranks' fp32 masters cast to bf16", rtol=0, atol=0)


@pytest.mark.points(2)
@pytest.mark.parametrize("world_size", [2, 3])
def test_gradient_shard_reaches_the_host(on_ranks, world_size):
    on_ranks(world_size, check_gradient_shard_on_host)


@pytest.mark.points(2)
@pytest.mark.parametrize("world_size", [2, 3])
def test_training_equals_one_process(on_ranks, world_size):
    on_ranks(world_size, check_training, False)


@pytest.mark.points(2)
def test_update_reads_only_the_host_copy(on_ranks):
    on_ranks(2, check_training, True)


@pytest.mark.points(1)
def test_optimizer_state_is_the_host_shard(on_ranks):
    on_ranks(2, check_state_on_host_shard)


@pytest.mark.points(2)
def test_fp32_master_keeps_small_updates(on_ranks):
    on_ranks(2, check_fp32_master_keeps_small_updates)

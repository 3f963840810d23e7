"""Graded: exercise 06, the delayed parameter update by hand, and offload's host bytes. The
submission runs only inside probes (its own processes), which train with it and return what they
saw: the parameters each forward ran on, the parameters after flush(), when the host's optimizer
step ran and on which thread, every collective it started (recorded by the grader's taps), its
masters. Every verdict is decided here:

* values: against a one-process float64 reference of DPU computed here (the gradient of step t is
  taken on parameters one update behind), step by step, on 3 ranks with ToyMLP sized so that 3 does
  not divide it (the flat buffer is padded), with the device gradients overwritten with NaN as soon
  as each step() returns and the host update held back until then (it may read host copies only);
* overlap by fact: the host optimizer step of step 1 is held until the NEXT backward has begun
  (a gradient hook of the probe's), so it can finish only if it runs in the background, beside it;
* traffic: every collective of step() and flush(), as bytes a ring sends per rank, against the
  budget of a reduce-scatter of the gradients and an all-gather of the parameters in the compute
  dtype (an all-reduce of the gradients, or an all-gather of the fp32 masters, is over it);
* placement in bf16: fp32 masters on the host, the optimizer's state for the master alone, the
  device parameters exactly every rank's master cast;
* group=: two groups of 2 of 4 ranks (global ranks 0, 2 and 1, 3) training side by side on their
  own data, each against its own reference, every collective on its own group;
* 06.2: the host bytes per owned element, against the grader's own measurement on ranks that never
  import the submission."""
import pytest
import torch

from zerolab import models
from zerolab.grade.helpers import exercise_module

# The reference implementation of this exercise: a submission that uses it scores 0
# (checked before and while the tests run, by zerolab.grade.references).
REFERENCE_MODULES = ["zerolab.offload", "zerolab.shard_optim"]
REFERENCE_ALLOWED = [  # used by the given code
    "zerolab.offload.host_buffer",
    "zerolab.offload.host_optimizer",
    "zerolab.shard_optim.master_dtype",
]

LR = 1e-2
STEPS = 4
MLP = dict(d_hidden=36)          # ToyMLP: 2021 trainable elements, which neither 2, 3 nor 4 divides
GATE_S = 10.0                    # how long step 1's held-back host update waits for the next backward
HOLD_S = 3.0                     # how long a host update waits for the device gradients' wipe


def _model(dtype=torch.float64):
    return models.build("mlp", seed=0, dtype=dtype, **MLP)


def _batch(step, seed):
    return models.batch("mlp", seed=100 * step + seed, batch_size=3, dtype=torch.float64)


def _flat(model):
    """Every trainable parameter, flattened and concatenated (model order), as a new tensor."""
    return torch.cat([p.detach().reshape(-1) for p in dict.fromkeys(model.parameters()) if p.requires_grad]).clone()


# -- probes: run the submission, return what it did (never a verdict) ------------------------------
def _train(steps, dtype, members=None, gate=True):
    """Train ``steps`` steps of DPU on this rank's batches and return what was seen: the flattened
    parameters each forward ran on, those after flush(), the masters, the optimizer's state, and the
    collectives of every step() and of flush(). ``members``: groups of global ranks; this rank trains
    within the one it belongs to (every rank makes every group, in the same order). ``gate``: hold
    each host optimizer step back until the device gradients have been overwritten with NaN."""
    import threading
    import time

    import torch.distributed as dist

    from zerolab.grade.helpers import record_collectives
    rank = dist.get_rank()
    group, seed = None, rank
    if members is not None:
        groups = [dist.new_group(m) for m in members]
        mine = next(i for i, m in enumerate(members) if rank in m)
        group, seed = groups[mine], 10 * mine + members[mine].index(rank)
    ex = exercise_module("ex06_offload")
    model = _model(dtype)                    # bf16: built in bf16 (the frozen layer too); fp32 masters
    opt = ex.DelayedOffloadAdam(model.parameters(), lr=LR if dtype == torch.float64 else 1e-3, group=group)
    wiped, real = threading.Event(), opt.optimizer.step

    def held_step(*args, **kwargs):          # the host update computes only after the wipe below
        wiped.wait(timeout=HOLD_S)
        return real(*args, **kwargs)

    if gate:
        opt.optimizer.step = held_step
    seen, windows = [], []                   # windows: (start, end) of each step() call, then flush()'s
    with record_collectives() as calls:      # the whole run: collectives from any thread, at any time
        for s in range(steps):
            seen.append(_flat(model))
            x, y = _batch(s, seed)
            model(x.to(dtype), y.to(dtype)).backward()
            wiped.clear()
            t0 = time.perf_counter()
            opt.step()
            windows.append((t0, time.perf_counter()))
            opt.grads.fill_(float("nan"))    # the next backward overwrites them: the update must not care
            wiped.set()
            opt.zero_grad()
        t0 = time.perf_counter()
        opt.flush()
        windows.append((t0, time.perf_counter()))
    state = list(opt.optimizer.state)
    within = lambda c, w: w[0] <= c["t_start"] <= w[1]
    plain = lambda c: {k: c[k] for k in ("op", "bytes", "group")}
    return {"seen": seen, "final": _flat(model),
            "device": opt.flat.data[:opt.flat.numel].clone(), "padded": opt.flat.padded_numel,
            "master": opt.master.detach().clone(), "master_device": opt.master.device.type,
            "state_for_master": [k is opt.master for k in state],
            "state_on_host": all(t.device.type == "cpu" for k in state for t in opt.optimizer.state[k].values()
                                 if torch.is_tensor(t)),
            "steps_comm": [[plain(c) for c in calls if within(c, w)] for w in windows[:-1]],
            "flush_comm": [plain(c) for c in calls if within(c, windows[-1])],
            "all_comm": [plain(c) for c in calls]}


def _overlap():
    """Step 1's host optimizer step is held until the next backward has begun (a gradient hook of
    this probe's): did the next backward release it, and on which thread did it run?"""
    import threading

    import torch.distributed as dist
    ex = exercise_module("ex06_offload")
    rank = dist.get_rank()
    model = _model()
    opt = ex.DelayedOffloadAdam(model.parameters(), lr=LR)
    backward_began, armed, seen = threading.Event(), [False], []
    real = opt.optimizer.step

    def held_step(*args, **kwargs):
        released = backward_began.wait(timeout=GATE_S)
        seen.append({"released_by_next_backward": released and armed[0] == "backward",
                     "main_thread": threading.current_thread() is threading.main_thread()})
        return real(*args, **kwargs)

    def hook(grad):
        if armed[0] is True:
            armed[0] = "backward"
            backward_began.set()
        return grad

    opt.optimizer.step = held_step
    for p in dict.fromkeys(model.parameters()):
        if p.requires_grad:
            p.register_hook(hook)
    x, y = _batch(0, rank)                   # the contract's loop: backward, step(), zero_grad()
    model(x, y).backward()
    opt.step()                               # starts step 1's update, which waits for the next backward
    armed[0] = True
    opt.zero_grad()
    x, y = _batch(1, rank)
    model(x, y).backward()                   # the hook releases it
    opt.step()
    opt.zero_grad()
    armed[0] = "flush"
    backward_began.set()                     # step 2's update: nothing left to overlap, let it run
    opt.flush()
    return seen


def _student_host_bytes(param_dtype):
    return exercise_module("ex06_offload").host_bytes_per_element(param_dtype)


def _grader_host_bytes(param_dtype):
    """The grader's measurement (trusted ranks): the engine's host bytes of model states after one
    step, per owned element."""
    import torch.distributed as dist

    import zerolab
    model = models.build("gpt")
    engine = zerolab.initialize(model, stage=2, offload="optimizer", lr=1e-3, param_dtype=param_dtype)
    engine.backward(engine(*models.batch("gpt", seed=dist.get_rank(), model=model)))
    engine.step()
    report = engine.memory_report()
    host = sum(sum(report.get(kind, {}).values()) for kind in engine.host_kinds)
    return host / sum(b.shard_numel for b in engine.buckets)


# -- references and checks, here ---------------------------------------------------------------------
def _dpu_reference(seeds):
    """One process, float64, on the batches of ranks with these seeds: (the flattened parameters each
    forward runs on, those after the last update). The gradient of step t is taken on parameters one
    update behind; AdamW updates the master."""
    device, master = _model(), _model()
    trainable = lambda m: [p for p in dict.fromkeys(m.parameters()) if p.requires_grad]
    opt = torch.optim.AdamW(trainable(master), lr=LR)
    seen = []
    for s in range(STEPS):
        seen.append(_flat(device))
        xs, ys = zip(*[_batch(s, seed) for seed in seeds])
        device.zero_grad()
        device(torch.cat(xs), torch.cat(ys)).backward()
        grads = [p.grad.clone() for p in trainable(device)]
        with torch.no_grad():                                       # publish the previous update
            for d, m in zip(trainable(device), trainable(master)):
                d.copy_(m)
        for m, g in zip(trainable(master), grads):
            m.grad = g
        opt.step()                                                  # this step's update, not yet seen
    return seen, _flat(master)


def _check_values(got, seeds, what):
    seen, final = _dpu_reference(seeds)
    for s, (g, want) in enumerate(zip(got["seen"], seen)):
        if not torch.allclose(g, want, rtol=1e-10, atol=1e-12):
            behind = next((f"{k} update(s) behind" for k, w in enumerate(reversed(seen[:s + 1]))
                           if torch.allclose(g, w, rtol=1e-10, atol=1e-12)), "none of the earlier parameters")
            raise AssertionError(
                f"{what}: the forward of step {s + 1} ran on the wrong parameters (largest difference "
                f"{float((g - want).abs().max()):.3g}; they equal {behind}); DPU: the forward after the k-th step() "
                f"runs on the parameters updated with the first k-1 averaged gradients")
    assert torch.allclose(got["final"], final, rtol=1e-10, atol=1e-12), (
        f"{what}: after {STEPS} steps and flush() the parameters differ from the reference's (largest difference "
        f"{float((got['final'] - final).abs().max()):.3g}): flush() publishes every update, each from host copies "
        f"only (the device gradients were overwritten with NaN after each step())")
    assert got["state_for_master"] == [True], (
        f"{what}: the optimizer holds state for {len(got['state_for_master'])} tensor(s), "
        f"{'not self.master' if got['state_for_master'] else ''}: it must step self.master alone")


def _ring_bytes(call, n_default):
    """Bytes one rank sends for a recorded call on a ring (the contract's budget unit)."""
    n = len(call["group"]) if call["group"] else n_default
    factor = {"all_reduce": 2 * (n - 1) / n, "reduce_scatter": (n - 1) / n, "all_gather": (n - 1) / n,
              "broadcast": (n - 1) / n, "all_to_all": (n - 1) / n, "isend": 1, "send": 1}
    return factor.get(call["op"], 1) * call["bytes"]


@pytest.mark.points(3)
def test_one_update_behind_from_host_copies(student):
    """values: each forward one update behind, flush() publishes all; from host copies only; 3 ranks, padded"""
    n = 3
    results = student.on_ranks(n, _train, STEPS, torch.float64)
    for rank, got in enumerate(results):
        _check_values(got, list(range(n)), f"rank {rank} of {n}")


@pytest.mark.points(2)
def test_host_update_runs_beside_the_next_backward(student):
    """overlap: the host update still to run when step() returns, released by the next backward"""
    for rank, seen in enumerate(student.on_ranks(2, _overlap)):
        assert seen, f"rank {rank}: no host optimizer step (self.optimizer.step) ran between step() and flush()"
        first = seen[0]
        assert first["released_by_next_backward"], (
            f"rank {rank}: step 1's host update was held until the next backward began, but it ran (or was "
            f"waited for) before that backward, for {GATE_S:.0f} s: step() must return with the update still to "
            f"run, and nothing may wait for it until the next step() (it overlaps the next forward and backward)")
        assert not first["main_thread"], f"rank {rank}: the host update ran in the training thread"


@pytest.mark.points(2)
def test_bf16_traffic_and_placement(student):
    """traffic within the offload budget; fp32 masters on the host; device bf16 = masters cast"""
    n = 2
    results = student.on_ranks(n, _train, 3, torch.bfloat16, None, False)
    masters = torch.cat([got["master"] for got in results])
    for rank, got in enumerate(results):
        assert got["master"].dtype == torch.float32 and got["master_device"] == "cpu", (
            f"rank {rank}: self.master is {got['master'].dtype} on {got['master_device']}: the fp32 master lives "
            f"on the host")
        assert got["state_for_master"] == [True] and got["state_on_host"], (
            f"rank {rank}: the optimizer's state must be the host master's alone")
        expected = masters.to(torch.bfloat16)[:got["device"].numel()]
        assert torch.equal(got["device"], expected), (
            f"rank {rank}: the device's bf16 parameters after flush() are not every rank's fp32 master cast to "
            f"bf16 ({int((got['device'] != expected).sum())} of {expected.numel()} elements differ)")
        budget = 2 * (n - 1) / n * got["padded"] * 2                 # bf16: 2 bytes per element
        for s, calls in enumerate(got["steps_comm"]):
            sent = sum(_ring_bytes(c, n) for c in calls)
            listed = ", ".join(f"{c['op']} of {c['bytes']} B" for c in calls)
            assert sent <= budget, (
                f"rank {rank}, step {s + 1}: its collectives ({listed}) send {sent:.0f} bytes per rank on a ring; ZeRO-Offload's step sends at most {budget:.0f} "
                f"(2(N-1)/N of the padded buffer in bf16)")
        sent = sum(_ring_bytes(c, n) for c in got["flush_comm"])
        assert sent <= budget / 2, (
            f"rank {rank}: flush() sends {sent:.0f} bytes per rank on a ring, over {budget / 2:.0f} ((N-1)/N of "
            f"the padded buffer in bf16)")
        steps = len(got["steps_comm"])
        sent = sum(_ring_bytes(c, n) for c in got["all_comm"])
        assert sent <= steps * budget, (
            f"rank {rank}: {steps} steps and flush() send {sent:.0f} bytes per rank on a ring, counting the "
            f"collectives started outside step() and flush() too (from a background thread, say); "
            f"ZeRO-Offload's budget is {steps * budget:.0f}")


@pytest.mark.points(1)
def test_group_of_two_beside_another(student):
    """group=: two groups of 2 of 4 ranks train side by side, each on its own data, each collective on its group"""
    members = [[0, 2], [1, 3]]
    results = student.on_ranks(4, _train, STEPS, torch.float64, members)
    for rank, got in enumerate(results):
        mine = next(i for i, m in enumerate(members) if rank in m)
        _check_values(got, [10 * mine, 10 * mine + 1], f"rank {rank} in the group of ranks {members[mine]}")
        calls = got["all_comm"]
        strays = sorted({tuple(c["group"]) if c["group"] else "?" for c in calls} - {tuple(members[mine])})
        assert not strays, (f"rank {rank}: collectives on {strays}, not only on its group {members[mine]}: "
                            f"another group trains beside it")


@pytest.mark.points(2)
def test_host_bytes_per_element_measured(student, clusters):
    """measured: host bytes of model states per owned element, float32 and bfloat16"""
    for dtype in (torch.float32, torch.bfloat16):
        ours = clusters(2).run(_grader_host_bytes, dtype)
        theirs = student.on_ranks(2, _student_host_bytes, dtype)
        for rank, (t, o) in enumerate(zip(theirs, ours)):
            assert isinstance(t, (int, float)) and not isinstance(t, bool) and t == pytest.approx(o, rel=1e-3), (
                f"rank {rank}, {dtype}: host_bytes_per_element = {t!r}; the engine's host kinds (master, "
                f"optimizer, host_grads, workspace) hold {o:.4f} bytes per owned element (the grader's measurement)")

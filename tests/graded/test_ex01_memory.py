"""Graded: exercise 01, memory anatomy.

The submission runs only in probes (its own processes), which build a model, an optimizer and a
training step, hand them to ``peak_model_states``, and report plain data: the peaks it returned and
an inventory of the hooks on the model and the optimizer before and after. Every verdict is decided
here, against bytes computed here by hand from the models' shapes.

The steps are built so that each kind peaks where only a measurement taken while the step runs can
see it, and so that the peak of the sum differs from the sum of the peaks: tied weights with fp32
AdamW and ``zero_grad(set_to_none=True)``; bf16 parameters with fp32 masters whose gradients the
optimizer releases as it steps; a frozen layer and two micro-batches; a step skipped after an
overflow (gradients released, no optimizer step); parameters and gradients that are views into
flat buffers the optimizer also keeps (storages shared by two kinds); torch DDP's bucket-view
gradients on 2 real ranks; and a step that raises after its backward pass, after which no hook of
the measurement may remain and the step's own exception must have come out. The accounting (01.2) is
checked exactly against closed forms derived here from the same sources the stub names (ZeRO Sec. 3.1
and 5.1; ZeRO-Offload's placement as zerolab's offload engines hold it), with each optimizer's state
MEASURED here on torch's own optimizers (thirteen classes and arguments; lesson 01 tabulates Adam and
SGD with and without momentum, not amsgrad, centered RMSprop, Adagrad, Rprop, NAdam, Adamax, RAdam or
Adafactor's factored state) for every shape: every kind on the device and the host total, at every stage, in both precisions, with and without offload, for a
model given by its parameter shapes (vectors, matrices with one row or one column, 3-D and 4-D stacks);
on the paper's worked example and on totals no N divides (no rounding, no padding); the settings
that do not exist, and those zerolab's engines accept."""
import functools

import pytest
import torch

from zerolab import models
from zerolab.grade.helpers import exercise_module

# The reference implementation of this exercise: a submission that uses it scores 0
# (checked before and while the tests run, by zerolab.grade.references).
REFERENCE_MODULES = ["zerolab.memory", "zerolab.calculator"]

PSI, N = 7_500_000_000, 64
# A model's parameter shapes whose total (1,027 = 13 x 79) no N in the tests divides: a row and a
# column vector as matrices (factored state larger than the parameter), a matrix, a vector, and
# stacks of matrices (3-D and 4-D: Adafactor factors the last two dims, the leading ones batch).
ODD_SHAPES = [(1, 37), (37, 1), (13, 37), (37,), (3, 5, 7), (2, 3, 11, 5)]
# A small GPT's shapes (tok, pos, one block's qkv/proj/mlp weights and biases, norms, tied head).
GPT_SHAPES = [(256, 64), (32, 64), (64,), (64,), (192, 64), (192,), (64, 64), (64,), (64,), (64,),
              (256, 64), (256,), (64, 256), (64,), (64,), (64,)]
# The optimizers 01.2 is graded on: name -> (torch class, its arguments). Lesson 01 tabulates Adam
# (the paper's example) and SGD with and without momentum (K = 8 and 4); the rest are the student's
# to measure.
OPTIMIZERS = {
    "Adam": (torch.optim.Adam, {}),
    "Adam(amsgrad)": (torch.optim.Adam, {"amsgrad": True}),
    "AdamW(amsgrad)": (torch.optim.AdamW, {"amsgrad": True, "weight_decay": 0.1}),
    "SGD": (torch.optim.SGD, {"lr": 0.1}),
    "SGD(nesterov)": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True}),
    "Adagrad": (torch.optim.Adagrad, {}),
    "RMSprop(centered, momentum)": (torch.optim.RMSprop, {"centered": True, "momentum": 0.9}),
    "RMSprop": (torch.optim.RMSprop, {}),
    "Rprop": (torch.optim.Rprop, {}),
    "NAdam": (torch.optim.NAdam, {}),
    "Adamax": (torch.optim.Adamax, {}),
    "RAdam": (torch.optim.RAdam, {}),
    "Adadelta": (torch.optim.Adadelta, {}),
    "ASGD": (torch.optim.ASGD, {}),
    "Adafactor": (torch.optim.Adafactor, {}),
    "Muon": (torch.optim.Muon, {}),
    "SparseAdam": (torch.optim.SparseAdam, {}),
    "LBFGS": (torch.optim.LBFGS, {}),
}
# What zerolab's engines refuse (zerolab/engine.py's initialize; tests/test_elementwise_optimizers.py and
# tests/test_bad_input.py hold the engines to it): at stages 1-3 an optimizer whose update is not
# elementwise (Adafactor's factored second moment, Muon's orthogonalised matrices, SparseAdam, LBFGS),
# at every stage one whose step needs a closure (LBFGS).
REFUSED = {"Adafactor": (1, 2, 3), "Muon": (1, 2, 3), "SparseAdam": (1, 2, 3), "LBFGS": (0, 1, 2, 3)}


def _call_kwargs(optimizer, **kw):
    cls, args = OPTIMIZERS[optimizer]
    return dict(kw, optimizer=cls, optimizer_kwargs=dict(args))


@functools.lru_cache(maxsize=None)
def optimizer_state_elements(shape, optimizer):
    """Elements of state torch's own optimizer keeps for one parameter of ``shape`` after a step, 0-dim
    state (step counts, NAdam's mu_product) aside: MEASURED here (trusted) on a real parameter; for the
    paper's 7.5e9-element vector (too large to build) Adam's state is elementwise (two moments), as
    measured on small ones."""
    numel = 1
    for d in shape:
        numel *= d
    if numel > 10_000_000:                # a vector too large to build: an elementwise optimizer's
        assert len(shape) == 1            # state scales with it, measured on a small one
        small = optimizer_state_elements((1000,), optimizer)
        assert small % 1000 == 0, (optimizer, small)
        return small // 1000 * numel
    cls, args = OPTIMIZERS[optimizer]
    p = torch.nn.Parameter(torch.zeros(shape))
    p.grad = torch.ones(shape)
    opt = cls([p], **args)
    opt.step()
    return sum(t.numel() for t in opt.state[p].values() if torch.is_tensor(t) and t.dim() > 0)


# 01.2's closed forms, derived here (trusted) from the sources the stub names; never the submission's.
# Bytes per element of parameters and gradients: ZeRO Sec. 3.1's mixed precision (2-byte parameters and
# gradients, an fp32 master copy that is optimizer state) or fp32 throughout (lesson 01, Sec. 3); the
# optimizer's own state is fp32 in both (it updates fp32 values), as many elements as torch keeps.
# ZeRO Sec. 5.1: P_os partitions the optimizer states, P_os+g the gradients too, P_os+g+p the parameters too.
PARTITIONED = {0: (), 1: ("optimizer",), 2: ("optimizer", "grads"), 3: ("optimizer", "grads", "params")}


def zero_bytes(shapes, n, stage, optimizer="Adam", mixed=True, offload=False):
    """One rank's model-state bytes: each kind on the device, their total, and the host's bytes."""
    psi = sum(torch.Size(s).numel() for s in shapes)
    states = 4 * sum(optimizer_state_elements(tuple(s), optimizer) for s in shapes)
    whole = {"params": (2 if mixed else 4) * psi, "grads": (2 if mixed else 4) * psi,
             "optimizer": (4 * psi if mixed else 0) + states}
    device = {kind: b / (n if kind in PARTITIONED[stage] else 1) for kind, b in whole.items()}
    host = 0
    if offload:
        # zerolab's Zero{1,2,3}OffloadEngine (memory_report by host_kinds, measured on 2-3 ranks; ZeRO-Offload
        # Sec. 4.1): the rank's optimizer state and its reduced gradient shard live on the host; in fp32
        # the host also keeps its own 4-byte copy of the owned parameters to update (in mixed precision
        # the fp32 master is that copy). The device keeps the parameters as the stage partitions them,
        # and at stage 1 (gradients not partitioned) its full gradient.
        host = (whole["optimizer"] + whole["grads"] + (0 if mixed else 4 * psi)) / n
        device["optimizer"] = 0
        if "grads" in PARTITIONED[stage]:
            device["grads"] = 0
    return dict(device, total=sum(device.values()), host=host)


MLP_TRAINABLE = (13 * 37 + 37) + (37 * 37 + 37) + (37 * 5 + 5)   # ToyMLP: inp, mid (used twice), out
MLP_FROZEN = 37 * 37 + 37                                         # ToyMLP.frozen


def gpt_numel(vocab=256, d=64, layers=2, seq=32):
    """TinyGPT's unique parameter elements and tensors from its shapes (head tied to tok)."""
    block = 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + 2 * d + (d * 4 * d + 4 * d) + (4 * d * d + d)
    return vocab * d + seq * d + layers * block + 2 * d, 4 + 12 * layers


def _expect(got, expected, what):
    for key, want in expected.items():
        assert isinstance(got, dict) and key in got, f"{what}: no {key!r} in the result {got!r}"
        assert got[key] == pytest.approx(want, rel=1e-12, abs=1e-9), (
            f"{what}: {key} = {got[key]!r} bytes, expected {want!r} (by hand, from the shapes)")


# -- what the probes build (test code: runs in the probes, never the submission's) --------------------
class ReleasingAdamW(torch.optim.AdamW):
    """AdamW that releases each gradient once it has used it (as engines free their fp32 gradient
    partitions in the step): after step() none of its parameters holds a .grad."""

    def step(self, closure=None):
        # AdamW's own update, unwrapped: torch wraps each optimizer class's step once (with the step
        # hooks) when an instance is made, and calling the wrapped one would run the hooks twice
        update = torch.optim.AdamW.step
        update = update.__wrapped__ if getattr(update, "hooked", False) else update
        out = update(self, closure)
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None
        return out


class FlatMomentum(torch.optim.Optimizer):
    """SGD with momentum over flat buffers, as fused optimizers keep them: the parameters are views
    into one flat buffer and their gradients views into another, and the optimizer keeps both flat
    buffers in its state (beside its momentum, made at the first step)."""

    def __init__(self, params, lr=0.01, momentum=0.9):
        params = list(params)
        super().__init__(params, dict(lr=lr, momentum=momentum))
        numel = sum(p.numel() for p in params)
        flat_p = torch.empty(numel, dtype=params[0].dtype)
        flat_g = torch.zeros(numel, dtype=params[0].dtype)
        offset = 0
        for p in params:
            n = p.numel()
            flat_p[offset:offset + n].copy_(p.detach().reshape(-1))
            p.data = flat_p[offset:offset + n].view_as(p)
            p.grad = flat_g[offset:offset + n].view_as(p)
            offset += n
        self.state[params[0]].update(flat_params=flat_p, flat_grads=flat_g)
        self._first = params[0]

    @torch.no_grad()
    def step(self, closure=None):
        state = self.state[self._first]
        if "momentum" not in state:
            state["momentum"] = torch.zeros_like(state["flat_grads"])
        group = self.param_groups[0]
        state["momentum"].mul_(group["momentum"]).add_(state["flat_grads"])
        state["flat_params"].add_(state["momentum"], alpha=-group["lr"])


def _hooks(model, optimizer):
    """How many hooks (of each kind torch offers) the model, its parameters and the optimizer hold,
    and whether a method of the optimizer was replaced on the instance."""
    import torch.nn.modules.module as mm
    import torch.optim.optimizer as oo
    count = {}

    def add(key, hooks):
        count[key] = count.get(key, 0) + len(hooks or {})

    for p in model.parameters():
        add("parameter post-accumulate-grad hooks", getattr(p, "_post_accumulate_grad_hooks", None))
        add("parameter gradient hooks", getattr(p, "_backward_hooks", None))
    for m in model.modules():
        for attr in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks"):
            add(f"module {attr}", getattr(m, attr, None))
    add("optimizer step pre-hooks", optimizer._optimizer_step_pre_hooks)
    add("optimizer step post-hooks", optimizer._optimizer_step_post_hooks)
    for attr in ("_global_optimizer_pre_hooks", "_global_optimizer_post_hooks"):
        add(f"global {attr}", getattr(oo, attr, None))
    for attr in ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                 "_global_backward_pre_hooks"):
        add(f"global {attr}", getattr(mm, attr, None))
    count["optimizer methods replaced on the instance"] = sum(
        1 for name in ("step", "zero_grad") if name in vars(optimizer))
    return count


def _measure(model, optimizer, run_step, times=1):
    ex = exercise_module("ex01_memory")
    before = _hooks(model, optimizer)
    peaks = []
    for _ in range(times):
        got = ex.peak_model_states(model, optimizer, run_step)
        peaks.append({k: (float(v) if isinstance(v, (int, float)) else repr(v)) for k, v in dict(got).items()})
    return {"peaks": peaks, "hooks_before": before, "hooks_after": _hooks(model, optimizer)}


# -- probes ----------------------------------------------------------------------------------------------
def _probe_tied_adamw():
    model = models.build("gpt")
    opt = torch.optim.AdamW(model.parameters())
    x, y = models.batch("gpt", model=model, batch_size=4)

    def run_step():
        model(x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)            # the gradients are gone when run_step returns

    return _measure(model, opt, run_step, times=2)  # the second step starts with Adam's state


def _probe_masters():
    model = models.build("gpt", dtype=torch.bfloat16)
    masters = [p.detach().float().requires_grad_() for p in model.parameters()]
    opt = ReleasingAdamW(masters)
    x, y = models.batch("gpt", model=model, batch_size=2)

    def run_step():
        model(x, y).backward()
        for m, p in zip(masters, model.parameters()):
            m.grad = p.grad.float()                 # fp32 gradients, for the update only
        opt.step()                                  # uses them, then releases them
        with torch.no_grad():
            for m, p in zip(masters, model.parameters()):
                p.copy_(m)
        model.zero_grad(set_to_none=True)

    return _measure(model, opt, run_step)


def _probe_frozen_micro_batches():
    mlp = models.build("mlp")
    opt = torch.optim.Adam(mlp.parameters())

    def run_step():
        for seed in (1, 2):                          # two micro-batches, one step
            x, y = models.batch("mlp", seed=seed, batch_size=4)
            mlp(x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return _measure(mlp, opt, run_step)


def _probe_skipped_step():
    model = models.build("gpt")
    opt = torch.optim.AdamW(model.parameters())
    x, y = models.batch("gpt", model=model, batch_size=4)
    model(x, y).backward()                           # one ordinary step first: Adam's state exists
    opt.step()
    opt.zero_grad(set_to_none=True)

    def run_step():                                  # a loss scaler found an overflow: no step
        model(x, y).backward()
        opt.zero_grad(set_to_none=True)

    return _measure(model, opt, run_step)


def _probe_shared_storages():
    mlp = models.build("mlp")
    opt = FlatMomentum([p for p in mlp.parameters() if p.requires_grad])

    def run_step():
        x, y = models.batch("mlp", seed=3, batch_size=4)
        mlp(x, y).backward()                         # accumulates into the flat gradient buffer
        opt.step()
        mlp.zero_grad(set_to_none=False)             # zeroed in place: the views stay

    return _measure(mlp, opt, run_step)


def _probe_ddp():
    """On each rank: torch DDP (grads are views into DDP's bucket buffers) + AdamW, one step."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    model = models.build("gpt")
    ddp = DDP(model, gradient_as_bucket_view=True, bucket_cap_mb=0.05)
    opt = torch.optim.AdamW(model.parameters())
    x, y = models.batch("gpt", seed=dist.get_rank(), model=model, batch_size=4)

    def run_step():
        ddp(x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)            # the gradients stay views into DDP's buckets

    run_step()                     # DDP rebuilds its buckets after the first iteration: measure the next
    return _measure(model, opt, run_step)


STEP_ERROR = "non-finite gradients, step abandoned (raised by the grader's run_step)"


def _probe_step_raises():
    """A step that raises once autograd has delivered its gradients (the measurement's hooks have
    run): what came out of peak_model_states, and the hooks before and after."""
    ex = exercise_module("ex01_memory")
    mlp = models.build("mlp")
    opt = torch.optim.Adam(mlp.parameters())
    before = _hooks(mlp, opt)

    def run_step():
        x, y = models.batch("mlp", seed=4, batch_size=4)
        mlp(x, y).backward()
        raise FloatingPointError(STEP_ERROR)         # a guard that refuses the step

    raised = None
    try:
        ex.peak_model_states(mlp, opt, run_step)
    except NotImplementedError:
        raise                                        # not written yet: the rank's own failure
    except Exception as exc:                         # reported; the verdict is the test's
        raised = {"type": type(exc).__name__, "message": str(exc)[:300]}
    return {"raised": raised, "hooks_before": before, "hooks_after": _hooks(mlp, opt)}


def _probe_formulas(calls):
    """model_state_bytes(*args, **kwargs) for each call: the dict it returned, or what it raised."""
    ex = exercise_module("ex01_memory")
    out = []
    for args, kwargs in calls:
        try:
            got = ex.model_state_bytes(*args, **kwargs)
        except NotImplementedError:
            raise                                     # not written yet: the rank's own failure
        except Exception as exc:                      # reported; the verdict is the test's
            out.append({"raised": type(exc).__name__, "message": str(exc)[:300]})
            continue
        out.append({k: (float(v) if isinstance(v, (int, float)) else repr(v)) for k, v in dict(got).items()})
    return out


# -- checks, here ------------------------------------------------------------------------------------
def _check_hooks(got, what):
    left = {k: v - got["hooks_before"].get(k, 0) for k, v in got["hooks_after"].items()
            if v != got["hooks_before"].get(k, 0)}
    assert not left, (f"{what}: peak_model_states left behind {left}: after it returns, the model and the "
                      f"optimizer must behave as before (remove what you attached, restore what you replaced)")


def _formulas(student, calls):
    return student.run(_probe_formulas, calls)


# ------------------------------------------------------------------------------------------ theory
def _rows(student, cases):
    """model_state_bytes for each (what, args, kwargs) of ``cases``, checked: no exception raised."""
    rows = _formulas(student, [(args, kwargs) for _, args, kwargs in cases])
    for (what, _, _), got in zip(cases, rows):
        assert "raised" not in got, f"{what}: model_state_bytes raised {got.get('raised')}: {got.get('message')}"
    return rows


@pytest.mark.points(2)
def test_paper_worked_example(student):
    """derived: the ZeRO paper's 120, 31.4, 16.6, 1.88 GB with Adam, kind by kind; the same 7.5e9
    vector with two other optimizers"""
    # ZeRO Fig. 1: Ψ = 7.5B, N = 64, mixed-precision Adam: 120, 31.4, 16.6, 1.88 GB (1e9 bytes).
    paper = {0: 120.0, 1: 31.4, 2: 16.6, 3: 1.88}
    shapes = [[PSI]]
    cases = [(f"stage {stage}, Adam, one vector of 7.5e9, N=64", (shapes, N, stage), _call_kwargs("Adam"))
             for stage in paper]
    others = [(f"stage {stage}, {name}, one vector of 7.5e9, N=64", (shapes, N, stage), _call_kwargs(name))
              for name in ("SGD(nesterov)", "Adagrad") for stage in paper]
    rows = _rows(student, cases + others)
    for (what, _, _), (stage, gb), got in zip(cases, paper.items(), rows):
        assert round(got["total"] / 1e9, 2 if stage == 3 else 1) == gb, (
            f"stage {stage}: {got['total'] / 1e9:.4g} GB per rank, the paper says {gb} GB")
        _expect(got, zero_bytes(shapes, N, stage), what)
    for (what, args, _), name, got in zip(others, [n for n in ("SGD(nesterov)", "Adagrad") for _ in paper],
                                          rows[len(cases):]):
        _expect(got, zero_bytes(*args, optimizer=name), what)


# Partitioned at stages 1-3 by zerolab's engines; each keeps a different state (none, one, two, three
# tensors like the parameter); five of the seven no lesson tabulates.
SHARDED = ("SGD", "SGD(nesterov)", "Adam(amsgrad)", "Adagrad", "RMSprop(centered, momentum)", "Rprop", "NAdam")
SHAPES = (("GPT", GPT_SHAPES), ("odd", ODD_SHAPES))


def _mode(mixed):
    return "mixed" if mixed else "fp32"


@pytest.mark.points(2)
@pytest.mark.parametrize("mixed", [True, False], ids=["mixed", "fp32"])
def test_each_stage_shards_one_more_kind(student, mixed):
    """derived: each stage divides one more kind by N, each optimizer's state measured, exactly"""
    cases = [(f"stage {stage}, {optimizer}, {name} shapes, N={n}, {_mode(mixed)}",
              ([list(s) for s in shapes], n, stage), _call_kwargs(optimizer, mixed_precision=mixed))
             for optimizer in SHARDED for name, shapes in SHAPES for n in (1, 3, 8) for stage in (0, 1, 2, 3)]
    names = [optimizer for optimizer in SHARDED for _ in SHAPES for _ in (1, 3, 8) for _ in range(4)]
    for (what, args, _), optimizer, got in zip(cases, names, _rows(student, cases)):
        _expect(got, zero_bytes(*args, optimizer=optimizer, mixed=mixed), what)


@pytest.mark.points(2)
def test_a_factored_state_at_stage_0(student):
    """derived: optimizers kept whole on every rank (stage 0), Adafactor's factored state among them:
    its state depends on each parameter's shape, not only on its size"""
    stage0 = ("Adafactor", "RMSprop", "Adamax", "RAdam", "AdamW(amsgrad)")
    cases = [(f"stage 0, {optimizer}, {name} shapes, N={n}, {_mode(mixed)}", ([list(s) for s in shapes], n, 0),
              _call_kwargs(optimizer, mixed_precision=mixed))
             for optimizer in stage0 for name, shapes in SHAPES for n in (1, 4) for mixed in (True, False)]
    names = [optimizer for optimizer in stage0 for _ in SHAPES for _ in (1, 4) for _ in (True, False)]
    for (what, args, kwargs), optimizer, got in zip(cases, names, _rows(student, cases)):
        _expect(got, zero_bytes(*args, optimizer=optimizer, mixed=kwargs["mixed_precision"]), what)


OFFLOADED = ("Adam(amsgrad)", "SGD", "RMSprop(centered, momentum)", "Adagrad")


def _offload_cases(mixed):
    cases = [(f"stage {stage} + offload, {optimizer}, {name} shapes, N={n}, {_mode(mixed)}",
              ([list(s) for s in shapes], n, stage), _call_kwargs(optimizer, mixed_precision=mixed, offload=True))
             for optimizer in OFFLOADED
             for name, shapes, n in (("GPT", GPT_SHAPES, 3), ("odd", ODD_SHAPES, 1), ("odd", ODD_SHAPES, 3),
                                     ("odd", ODD_SHAPES, 8))
             for stage in (1, 2, 3)]
    names = [optimizer for optimizer in OFFLOADED for _ in range(4) for _ in (1, 2, 3)]
    return cases, names


@pytest.mark.points(2)
def test_offload_moves_the_owned_states_to_the_host(student):
    """derived: ZeRO-Offload's split between device and host, kind by kind, at every stage, four
    optimizers (mixed precision)"""
    cases, names = _offload_cases(True)
    for (what, args, _), optimizer, got in zip(cases, names, _rows(student, cases)):
        _expect(got, zero_bytes(*args, optimizer=optimizer, mixed=True, offload=True), what)


@pytest.mark.points(2)
def test_offload_in_fp32(student):
    """derived: offload in fp32: device and host, kind by kind, at every stage, four optimizers"""
    cases, names = _offload_cases(False)
    for (what, args, _), optimizer, got in zip(cases, names, _rows(student, cases)):
        _expect(got, zero_bytes(*args, optimizer=optimizer, mixed=False, offload=True), what)


@pytest.mark.points(1)
def test_settings_that_do_not_exist_are_refused(student):
    """a ValueError for a stage other than 0-3, offload at stage 0, an optimizer that is not a torch
    optimizer class (a name, an instance), and an optimizer at a stage where zerolab's engines refuse
    it (Adafactor, Muon and SparseAdam at 1-3: no flat 1/N slice steps alone; LBFGS everywhere: its
    step needs a closure)"""
    shapes = [[10, 10]]
    bad = [((shapes, 4, 0), _call_kwargs("Adam", offload=True)),
           ((shapes, 4, 0), _call_kwargs("SGD", offload=True, mixed_precision=False)),
           ((shapes, 4, 4), _call_kwargs("Adam")), ((shapes, 4, -1), _call_kwargs("Adam")),
           ((shapes, 4, 4), _call_kwargs("Adam", offload=True)),
           ((shapes, 4, 0), {"optimizer": "adam"}), ((shapes, 4, 2), {"optimizer": "adam", "offload": True}),
           ((shapes, 4, 1), {"optimizer": torch.nn.Linear}),
           ((shapes, 4, 0), {"optimizer": torch.optim.Adam([torch.zeros(1, requires_grad=True)])}),  # an instance
           (([[10], [7]], 4, 2), _call_kwargs("Adafactor")),          # vectors only: still not elementwise
           (([[100]], 4, 0), _call_kwargs("LBFGS")), (([[100]], 4, 1), _call_kwargs("LBFGS", offload=True))]
    bad += [((shapes, 4, stage), _call_kwargs(name, offload=off))
            for name, stages in REFUSED.items() for stage in stages for off in ((False, True) if stage else (False,))]
    for (args, kwargs), got in zip(bad, _formulas(student, bad)):
        assert got.get("raised") == "ValueError", (
            f"model_state_bytes{args} with {kwargs}: expected a ValueError naming the setting, got {got!r}")


@pytest.mark.points(1)
def test_what_the_engines_accept_is_not_refused(student):
    """no ValueError where zerolab's engines accept the optimizer: every elementwise torch optimizer
    at stages 1-3, with and without offload, and any optimizer at stage 0 that steps without a closure"""
    ok = [((ODD_SHAPES, 2, stage), _call_kwargs(name, offload=off))
          for name in SHARDED + ("Adamax", "RAdam", "Adadelta", "ASGD") for stage in (1, 2, 3) for off in (False, True)]
    ok += [((ODD_SHAPES, 2, 0), _call_kwargs(name)) for name in OPTIMIZERS
           if name not in ("LBFGS", "Muon", "SparseAdam")]       # Muon: matrices only; SparseAdam: sparse gradients
    for (args, kwargs), got in zip(ok, _formulas(student, ok)):
        assert "raised" not in got, (f"model_state_bytes{args} with {kwargs}: zerolab's engines accept this "
                                     f"setting, got {got!r}")


# ---------------------------------------------------------------------------------------- measured
@pytest.mark.points(3)
def test_peak_of_a_step_tied_weights_fp32_adam(student):
    """peak during the step: grads released by zero_grad(set_to_none=True) still count; tied weights once;
    nothing left behind"""
    numel, tensors = gpt_numel()
    got = student.run(_probe_tied_adamw)
    for attempt, peaks in enumerate(got["peaks"], 1):
        # 4 + 4 + 8 = 16 bytes/param, plus Adam's 4-byte `step` counter per parameter tensor, all held
        # together right after optimizer.step(), before zero_grad.
        _expect(peaks, {"params": 4 * numel, "grads": 4 * numel, "optimizer": 8 * numel + 4 * tensors,
                        "total": 16 * numel + 4 * tensors}, f"TinyGPT (tied weights), AdamW step {attempt}")
    _check_hooks(got, "TinyGPT with AdamW")


@pytest.mark.points(3)
def test_peak_with_fp32_masters(student):
    """peak during the step: bf16 model, fp32 masters whose gradients the optimizer releases; the peak of
    the sum is not the sum of the peaks"""
    numel, tensors = gpt_numel()
    got = student.run(_probe_masters)
    # Right before the step: bf16 grads (2) and fp32 master grads (4) together: grads peak at 6 bytes/param.
    # Right after it: the master grads are gone, the master (4) and two moments (8) are there, and the
    # bf16 grads (2): 2 + 2 + 12 = 16 bytes/param at once (plus the step counters), not 2 + 6 + 12.
    _expect(got["peaks"][0], {"params": 2 * numel, "grads": 6 * numel, "optimizer": 12 * numel + 4 * tensors,
                              "total": 16 * numel + 4 * tensors},
            "bf16 TinyGPT, fp32 masters in an AdamW that releases their gradients")
    _check_hooks(got, "bf16 TinyGPT with fp32 masters")


@pytest.mark.points(2)
def test_peak_frozen_layer_two_micro_batches(student):
    """peak during the step: gradient accumulation (two backward passes), a frozen layer"""
    got = student.run(_probe_frozen_micro_batches)
    tr, fr = MLP_TRAINABLE, MLP_FROZEN
    _expect(got["peaks"][0], {"params": 4 * (tr + fr), "grads": 4 * tr, "optimizer": 8 * tr + 4 * 6,
                              "total": 4 * (tr + fr) + 12 * tr + 4 * 6},
            "ToyMLP (a frozen layer: no grad, no Adam state), two micro-batches")


@pytest.mark.points(2)
def test_peak_of_a_skipped_step(student):
    """peak during the step: gradients released before any optimizer step (an overflow skips it)"""
    numel, tensors = gpt_numel()
    got = student.run(_probe_skipped_step)
    # The gradients exist only while backward runs and until zero_grad: every one of them, the last
    # one autograd writes included, together with the parameters and Adam's state of the earlier step.
    _expect(got["peaks"][0], {"params": 4 * numel, "grads": 4 * numel, "optimizer": 8 * numel + 4 * tensors,
                              "total": 16 * numel + 4 * tensors}, "TinyGPT, a step skipped after backward")
    _check_hooks(got, "a skipped step")


@pytest.mark.points(2)
def test_storage_shared_by_two_kinds(student):
    """each storage once, under its first kind: parameters and gradients are views into flat buffers
    that the optimizer keeps too"""
    got = student.run(_probe_shared_storages)
    tr, fr = MLP_TRAINABLE, MLP_FROZEN
    # params: the flat buffer (trainable) + the frozen layer; grads: the flat gradient buffer; optimizer:
    # only its momentum (the two flat buffers it also holds were counted already, as params and grads).
    _expect(got["peaks"][0], {"params": 4 * (tr + fr), "grads": 4 * tr, "optimizer": 4 * tr,
                              "total": 4 * (tr + fr) + 8 * tr},
            "ToyMLP over flat buffers the optimizer shares")


@pytest.mark.points(2)
def test_data_parallel_replicates_on_real_ranks(student):
    """peak during the step on 2 real ranks: DDP's bucket-view gradients, everything on every rank"""
    numel, tensors = gpt_numel()
    for rank, got in enumerate(student.on_ranks(2, _probe_ddp)):
        _expect(got["peaks"][0], {"params": 4 * numel, "grads": 4 * numel, "optimizer": 8 * numel + 4 * tensors,
                                  "total": 16 * numel + 4 * tensors},
                f"rank {rank}: DDP model states at their peak (the full 16 bytes/param on every rank)")
        _check_hooks(got, f"rank {rank}, DDP")


@pytest.mark.points(1)
def test_nothing_left_behind_when_the_step_raises(student):
    """nothing left behind even when run_step() raises, and its exception comes out unchanged"""
    got = student.run(_probe_step_raises)
    _check_hooks(got, "a step that raised after its backward pass")
    raised = got["raised"]
    assert raised is not None and raised["type"] == "FloatingPointError" and STEP_ERROR in raised["message"], (
        f"run_step() raised FloatingPointError({STEP_ERROR!r}) after its backward pass; peak_model_states "
        f"{'returned normally' if raised is None else 'raised ' + raised['type'] + ': ' + raised['message']}: "
        f"the step's own exception must pass out of it unchanged")

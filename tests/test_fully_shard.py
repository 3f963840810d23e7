"""zerolab.fully_shard against independent references: one process training on the concatenated
global batch (computed here, in the test process), torch's FSDP2 ``fully_shard`` on the same ranks,
``torch.amp.GradScaler`` and ``torch.nn.utils.clip_grad_norm_``, a census of every live tensor
(``zerolab.memory.live_tensor_bytes``) against 16(Ψ + padding)/N computed from the model's shapes.
World sizes 2 and 3 (3: padding rows in most parameters)."""
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from helpers import SMALL_GPT as GPT, assert_params
from helpers import build_small as _build, small_batch as _data, small_global_batch as _global

EXACT = dict(rtol=1e-10, atol=1e-12)
STEPS = 3


def _opt(kind, params):
    # AdamW's eps 1e-6: some gradients are exactly 0 in exact arithmetic (attention's key bias: softmax
    # ignores a shift), so in fp32 they are pure rounding noise, which eps=1e-8 would blow up into a
    # full lr-sized step of random sign; 1e-6 keeps the fp32 comparison at rounding level.
    return {"sgd": lambda: torch.optim.SGD(params, lr=0.1, momentum=0.9),
            "plain": lambda: torch.optim.SGD(params, lr=0.1),
            "adamw": lambda: torch.optim.AdamW(params, lr=1e-3, eps=1e-6)}[kind]()


def reference(name, n, kind, dtype=torch.float64, steps=STEPS):
    """ONE process, no communication: the optimizer on the N micro-batches concatenated."""
    model = _build(name, dtype)
    opt = _opt(kind, [p for p in model.parameters() if p.requires_grad])
    for step in range(steps):
        model(*_global(name, model, step, n, dtype)).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.named_parameters(remove_duplicate=False)}


def train(name, kind, dtype=torch.float64, steps=STEPS, units=None, **options):
    import zerolab
    model = _build(name, dtype)
    fs = zerolab.fully_shard(model, units=None if units is None else [model.get_submodule(u) for u in units],
                             **options)
    opt = _opt(kind, fs.parameters())                 # a plain torch optimizer over the shards
    for step in range(steps):
        fs(*_data(name, model, step, dist.get_rank(), dtype)).backward()
        fs.finish_gradient_synchronization()
        opt.step()
        opt.zero_grad()
    return {k: v for k, v in fs.full_state_dict().items() if k in dict(model.named_parameters(remove_duplicate=False))}


@pytest.mark.parametrize("world_size", [2, 3])
def test_float64_equals_one_process(clusters, world_size):
    for name in ("gpt", "mlp"):        # tied weights; a frozen layer and a module called twice
        for kind in ("sgd", "adamw"):
            expected = reference(name, world_size, kind)
            for reshard in (True, False):
                got = clusters(world_size).run(train, name, kind, reshard_after_forward=reshard)
                assert_params(got, expected, f"{name} {kind} reshard={reshard}", **EXACT)


@pytest.mark.parametrize("world_size", [2, 3])
def test_float32_equals_one_process(clusters, world_size):
    for name in ("gpt", "mlp"):
        for kind in ("sgd", "adamw"):
            got = clusters(world_size).run(train, name, kind, torch.float32)
            assert_params(got, reference(name, world_size, kind, torch.float32), f"{name} {kind} fp32",
                          rtol=0, atol=1e-6)


def low_precision_reference(n, param_dtype):
    """One process, fp32 master weights; every step computes with a copy cast to ``param_dtype``."""
    master = _build("gpt", torch.float32)
    opt = _opt("plain", list(master.parameters()))
    for step in range(STEPS):
        low = _build("gpt", torch.float32)
        low.load_state_dict(master.state_dict())
        low.to(param_dtype)
        low(*_global("gpt", low, step, n, torch.float32)).backward()
        for m, q in zip(master.parameters(), low.parameters()):
            m.grad = q.grad.float()
        opt.step()
        opt.zero_grad()
    return {k: v.detach() for k, v in master.named_parameters(remove_duplicate=False)}


@pytest.mark.parametrize("param_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_low_precision_equals_one_process_casting_the_same_way(clusters, param_dtype):
    """Plain SGD (momentum would add up the 2-byte gradients' rounding differences, and the
    reference computes one batch of 8 where the ranks compute two of 4)."""
    expected = low_precision_reference(2, param_dtype)
    start = _build("gpt", torch.float32).state_dict()
    assert max((expected[k] - start[k]).abs().max() for k in expected) > 100 * 1e-4     # it trained
    for reduce_dtype in (None, torch.float32):
        got = clusters(2).run(train, "gpt", "plain", torch.float32, param_dtype=param_dtype, reduce_dtype=reduce_dtype)
        for state in got:
            assert all(t.dtype == torch.float32 for t in state.values())    # the masters stay fp32
        assert_params(got, expected, f"{param_dtype} reduce {reduce_dtype}", rtol=0, atol=1e-4)


def shapes_and_state():
    import zerolab
    n, rank = dist.get_world_size(), dist.get_rank()
    model = _build("mlp", torch.float32)
    full = {k: v.detach().clone() for k, v in model.named_parameters()}
    fs = zerolab.fully_shard(model, param_dtype=torch.bfloat16)     # compute in bf16, shards stay fp32
    assert fs.module is model
    opt = torch.optim.AdamW(fs.parameters(), lr=1e-2)
    for step in range(2):
        fs(*_data("mlp", model, step, rank, torch.float32)).backward()
        fs.finish_gradient_synchronization()
        for name, p in model.named_parameters():
            if not p.requires_grad:
                assert p.grad is None and p.shape == full[name].shape, f"frozen {name} sharded or given a grad"
                continue
            c = math.ceil(full[name].shape[0] / n)
            assert p.shape == (c,) + full[name].shape[1:], f"rank {rank}: {name} shard {tuple(p.shape)}"
            assert p.grad.shape == p.shape and p.grad.dtype == p.dtype == torch.float32, name
            valid = max(0, min(c, full[name].shape[0] - rank * c))
            assert not p[valid:].any() and not p.grad[valid:].any(), f"rank {rank}: {name}'s padding rows not 0"
        opt.step()
        opt.zero_grad()
    for p in fs.parameters():
        if p.requires_grad:
            assert opt.state[p]["exp_avg"].shape == p.shape       # 1/N of Adam's moments, per parameter
    return True


def test_parameters_are_this_ranks_shards(clusters):
    assert clusters(3).run(shapes_and_state) == [True] * 3


def state_dict_round_trip(name):
    import zerolab
    model = _build(name)
    fs = zerolab.fully_shard(model)
    fs(*_data(name, model, 0, dist.get_rank())).backward()
    torch.optim.SGD(fs.parameters(), lr=0.1).step()
    sd = fs.full_state_dict()
    plain = _build(name)
    plain.load_state_dict(sd, strict=True)                          # raises on a missing/extra/bad key
    return sorted(sd), {k: v for k, v in sd.items()}


@pytest.mark.parametrize("name", ["gpt", "mlp"])
def test_full_state_dict_loads_strictly(clusters, name):
    keys = sorted(_build(name).state_dict())                        # tied names, buffers included
    for got_keys, sd in clusters(3).run(state_dict_round_trip, name):
        assert got_keys == keys
        if name == "gpt":
            assert torch.equal(sd["tok.weight"], sd["head.weight"])


def test_parameters_left_whole_are_all_reduced(clusters):
    """units=[mid] only: inp and out stay whole (all-reduced, identical on every rank), the frozen
    layer stays whole and untouched; training still equals one process."""
    def run():
        import zerolab
        model = _build("mlp")
        frozen = model.frozen.weight.detach().clone()
        fs = zerolab.fully_shard(model, units=[model.mid])
        assert {id(p) for p in fs.replicated} == {id(p) for p in (*model.inp.parameters(), *model.out.parameters())}
        opt = _opt("sgd", fs.parameters())
        for step in range(STEPS):
            fs(*_data("mlp", model, step, dist.get_rank())).backward()
            fs.finish_gradient_synchronization()
            opt.step()
            opt.zero_grad()
        assert torch.equal(model.frozen.weight, frozen)
        return {k: v.detach().clone() for k, v in model.named_parameters() if k.startswith(("inp", "out"))}, \
            {k: v for k, v in fs.full_state_dict().items() if k != "calls"}
    results = clusters(2).run(run)
    expected = reference("mlp", 2, "sgd")
    assert_params([r[1] for r in results], expected, "mlp, units=[mid]", **EXACT)
    assert_params([r[0] for r in results], results[0][0], "whole parameters on every rank", exact=True)


class Branchy(nn.Module):
    """A layer used only in some steps (``use_b``), and a unit with a parameter it never uses."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(5, 7), nn.Linear(7, 7), nn.Linear(7, 3)
        self.c.register_parameter("unused", nn.Parameter(torch.ones(4)))
        self.use_b = True

    def forward(self, x, y):
        h = torch.tanh(self.a(x))
        if self.use_b:
            h = torch.tanh(self.b(h))
        return nn.functional.mse_loss(self.c(h), y)


def _branchy_batch(step, rank):
    g = torch.Generator().manual_seed(10 * step + rank)
    return torch.randn(4, 5, generator=g, dtype=torch.float64), torch.randn(4, 3, generator=g, dtype=torch.float64)


def test_unused_parameters_get_zero_gradients(clusters):
    def run():
        import zerolab
        torch.manual_seed(0)
        model = Branchy().double()
        fs = zerolab.fully_shard(model, units=[model.a, model.b, model.c, model])
        opt = torch.optim.SGD(fs.parameters(), lr=0.1, momentum=0.9)
        for step in range(4):
            model.use_b = step % 2 == 0
            fs(*_branchy_batch(step, dist.get_rank())).backward()
            fs.finish_gradient_synchronization()
            opt.step()
            opt.zero_grad()
        return fs.full_state_dict()
    torch.manual_seed(0)
    ref = Branchy().double()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(4):
        ref.use_b = step % 2 == 0
        parts = [_branchy_batch(step, r) for r in range(3)]
        ref(torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])).backward()
        for p in ref.parameters():          # torch skips a None grad; fully_shard steps a zero one
            p.grad = torch.zeros_like(p) if p.grad is None else p.grad
        opt.step()
        opt.zero_grad(set_to_none=False)
    assert_params(clusters(3).run(run), dict(ref.named_parameters()), "unused parameters", **EXACT)


def test_equals_fsdp2(clusters):
    def run(which):
        import zerolab
        model = _build("gpt")
        if which == "fsdp2":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard
            mesh = init_device_mesh("cpu", (dist.get_world_size(),))
            for block in model.blocks:
                fully_shard(block, mesh=mesh)
            fs = fully_shard(model, mesh=mesh)
        else:
            fs = zerolab.fully_shard(model)
        opt = torch.optim.AdamW(fs.parameters(), lr=1e-2)
        for step in range(STEPS):
            fs(*_data("gpt", model, step, dist.get_rank())).backward()
            opt.step()
            opt.zero_grad()
        if which == "fsdp2":
            return {n: p.full_tensor() for n, p in model.named_parameters(remove_duplicate=False)}
        return {k: v for k, v in fs.full_state_dict().items()}
    theirs = clusters(3).run(run, "fsdp2")
    assert_params(clusters(3).run(run, "zerolab"), theirs[0], "zerolab.fully_shard vs FSDP2", **EXACT)


def comm_of_a_step():
    import zerolab
    from zerolab import comm
    model = _build("gpt", torch.float32)
    fs = zerolab.fully_shard(model)
    loss = fs(*_data("gpt", model, 0, dist.get_rank(), torch.float32))
    with comm.log() as bwd:
        loss.backward()
    with comm.log() as finish:
        fs.finish_gradient_synchronization()
    with comm.log() as fwd:
        loss = fs(*_data("gpt", model, 1, dist.get_rank(), torch.float32))
    return ([(r.op, r.tag) for r in fwd.records], [(r.op, r.tag) for r in bwd.records], len(finish.records),
            all(p.grad is not None for p in fs.parameters()))


def test_gathers_and_reduce_scatters_per_unit(clusters):
    """Forward: the root once, each block once; backward: each block again, one reduce-scatter per
    unit; everything done when backward returns (finish is then a no-op)."""
    for fwd, bwd, finish, grads in clusters(2).run(comm_of_a_step):
        assert fwd == [("all_gather", "root"), ("all_gather", "blocks.0"), ("all_gather", "blocks.1")], fwd
        assert sorted(bwd) == sorted([("all_gather", "blocks.1"), ("all_gather", "blocks.0"),
                                      ("reduce_scatter", "root"), ("reduce_scatter", "blocks.1"),
                                      ("reduce_scatter", "blocks.0")]), bwd
        assert finish == 0 and grads


def census(which, n_params_expected):
    """Every live tensor on this rank after optimizer.step(), minus what lived before the model."""
    import zerolab
    from zerolab import memory
    before = memory.live_tensor_bytes().get("cpu", 0)
    model = _build("gpt", torch.float32)
    if which == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fs = fully_shard(model, mesh=mesh)
    else:
        fs = zerolab.fully_shard(model)
    opt = torch.optim.AdamW(fs.parameters(), lr=1e-3)
    for step in range(2):
        x, y = _data("gpt", model, step, dist.get_rank(), torch.float32)
        fs(x, y).backward()
        opt.step()
        del x, y
    assert len(opt.state) == n_params_expected
    return memory.live_tensor_bytes().get("cpu", 0) - before


@pytest.mark.parametrize("world_size", [2, 3])
def test_memory_census_is_16_psi_over_n(clusters, world_size):
    """fp32 AdamW after a step, per rank: parameters 4 + gradients 4 + moments 8 bytes for each of
    the (Ψ + P)/N elements a rank holds (P: the zero rows padding every parameter to N equal pieces),
    plus Adam's 4-byte step counter per parameter. FSDP2 on the same model beside it."""
    n = world_size
    params = list(_build("gpt", torch.float32).parameters())            # the tied weight once
    psi = sum(p.numel() for p in params)
    padding = sum((n * math.ceil(p.shape[0] / n) - p.shape[0]) * p[0].numel() for p in params)
    ours = clusters(n).run(census, "zerolab", len(params))
    theirs = clusters(n).run(census, "fsdp2", len(params))
    expected = 16 * (psi + padding) // n + 4 * len(params)
    assert ours == [expected] * n, (ours, expected, 16 * psi / n)
    assert max(ours) <= max(theirs) * 1.01, (ours, theirs)


def test_loss_scaler_and_clipping_in_your_own_loop(clusters):
    """LossScaler used as GradScaler (scale, unscale_, clip, step, update): rank 1 alone poisons
    its own first shard element at steps 1 and 3, every rank skips; scales, skips and weights as
    GradScaler + torch's clip on one process (float64)."""
    inject, steps, max_norm = (1, 3), 6, 0.2

    def run():
        import zerolab
        model = _build("gpt")
        fs = zerolab.fully_shard(model)
        opt = torch.optim.SGD(fs.parameters(), lr=0.5)
        scaler = zerolab.LossScaler(2.0 ** 10, growth_interval=2)
        norms = []
        for step in range(steps):
            scaler.scale(fs(*_data("gpt", model, step, dist.get_rank()))).backward()
            fs.finish_gradient_synchronization()
            if dist.get_rank() == 1 and step in inject:
                model.pos.weight.grad.view(-1)[0] = math.inf     # only rank 1 holds this element
            scaler.unscale_(opt)
            norms.append(zerolab.clip_grad_norm_(fs, max_norm).item())
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        return scaler.history, norms, fs.full_state_dict()

    model = _build("gpt")
    opt, scaler = torch.optim.SGD(model.parameters(), lr=0.5), torch.amp.GradScaler("cpu", 2.0 ** 10, growth_interval=2)
    c = math.ceil(GPT["seq_len"] / 2)
    history, norms = [], []
    for step in range(steps):
        scale = scaler.get_scale()
        scaler.scale(model(*_global("gpt", model, step, 2))).backward()
        if step in inject:
            model.pos.weight.grad[c, 0] = math.inf                 # rank 1's first element
        scaler.unscale_(opt)
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item())
        scaler.step(opt)
        scaler.update()
        history.append((scale, scaler.get_scale() < scale))
        opt.zero_grad()
    results = clusters(2).run(run)
    for rank, (got, got_norms, _) in enumerate(results):
        assert got == history, f"rank {rank}: {got}, GradScaler {history}"
        finite = [s for s in range(steps) if s not in inject]
        assert [got_norms[s] for s in finite] == pytest.approx([norms[s] for s in finite], rel=1e-12)
    expected = {k: v.detach() for k, v in model.named_parameters(remove_duplicate=False)}
    assert_params([{k: v for k, v in r[2].items() if k in expected} for r in results], expected,
                  "LossScaler + clip", **EXACT)


def test_clear_errors(clusters):
    def run():
        import zerolab
        out = []

        def expect(fragment, build, **kw):
            try:
                zerolab.fully_shard(build(), **kw)
                out.append(f"accepted {kw} ({fragment})")
            except ValueError as exc:
                if fragment not in str(exc):
                    out.append(f"{kw}: message {exc!r} lacks {fragment!r}")
        gpt = lambda: _build("gpt")
        shared = _build("gpt")
        expect("no single unit holds", lambda: shared, units=[shared.tok, shared.head])
        expect("param_dtype=", gpt, param_dtype=torch.int8)
        expect("reduce_dtype=", gpt, reduce_dtype="bf16")
        expect("reshard_after_forward", gpt, reshard_after_forward="yes")
        listed = _build("gpt")
        expect("ModuleList", lambda: listed, units=[listed.blocks])
        mixed = _build("mlp")
        mixed.mid.float()
        expect("several dtypes", lambda: mixed, units=[mixed])
        stray = _build("mlp")                 # inp and out left whole in float64, the rest in bf16
        expect("stay whole", lambda: stray, param_dtype=torch.bfloat16, units=[stray.mid])
        return out
    assert clusters(1).run(run) == [[]]
    with pytest.raises(ValueError, match="process group"):
        import zerolab
        zerolab.fully_shard(_build("mlp"))


# -- issue 33: the two rules of fully_shard, enforced ---------------------------------------------------
def optimizer_built_before(kind):
    """The optimizer built on the plain model, THEN fully_shard: what step() and zero_grad() do.
    FSDP2 alongside: the same order, to show what the docstring says of it."""
    import zerolab
    model = _build("gpt")
    old = list(model.parameters())
    if kind == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt = _opt("adamw", model.parameters())
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fs = fully_shard(model, mesh=mesh)
        for step in range(2):
            fs(*_data("gpt", model, step, dist.get_rank())).backward()
            opt.step()                                 # no error: the old parameters have no .grad
        after = {n: p.full_tensor() for n, p in model.named_parameters()}
        return all(torch.equal(before[n], after[n]) for n in before)   # True: it trained nothing
    opt = _opt(kind, model.parameters())
    fs = zerolab.fully_shard(model)
    fs(*_data("gpt", model, 0, dist.get_rank())).backward()
    out = {"old emptied": all(p.numel() == 0 for p in old if p.requires_grad)}
    for what, call in (("step", opt.step), ("zero_grad", opt.zero_grad)):
        try:
            call()
            out[what] = "no error"
        except RuntimeError as exc:
            out[what] = str(exc)
    return out


@pytest.mark.parametrize("kind", ["sgd", "adamw"])
def test_an_optimizer_built_before_fully_shard_raises_naming_the_fix(clusters, kind):
    for got in clusters(2).run(optimizer_built_before, kind):
        assert got["old emptied"]                      # the old parameters' memory is released
        for what in ("step", "zero_grad"):
            assert "was replaced by this rank's shard" in got[what], (what, got[what])
            assert "build it after" in got[what] and "fully_shard(model)" in got[what], (what, got[what])


def test_fsdp2_silently_trains_nothing_with_an_optimizer_built_before(clusters):
    """The claim of fully_sharded's docstring about FSDP2 (the trap zerolab refuses)."""
    assert clusters(2).run(optimizer_built_before, "fsdp2") == [True, True]


class TiedByHand(nn.Module):
    """GPT-style: the head reuses the embedding's weight in the model's own forward (F.linear), not
    as a tied module parameter."""

    def __init__(self):
        super().__init__()
        self.emb, self.body = nn.Embedding(11, 8), nn.Linear(8, 8)

    def forward(self, x, y):
        h = torch.tanh(self.body(self.emb(x)))
        return nn.functional.cross_entropy(nn.functional.linear(h, self.emb.weight).view(-1, 11), y.view(-1))


def _tied_batch(rank):
    g = torch.Generator().manual_seed(rank)
    return torch.randint(0, 11, (4, 5), generator=g), torch.randint(0, 11, (4, 5), generator=g)


def whole_uses():
    import zerolab
    out = {}

    def attempt(name, fn):
        try:
            result = fn()
            out[name] = f"no error: {tuple(result.shape)}"
        except RuntimeError as exc:
            out[name] = str(exc)
    model = _build("mlp")
    fs = zerolab.fully_shard(model)
    h = torch.randn(8, model.out.weight.shape[1], dtype=torch.float64)
    attempt("F.linear", lambda: nn.functional.linear(h, model.out.weight, model.out.bias))
    attempt("@ .T", lambda: h @ model.out.weight.T)
    attempt("x * w", lambda: h * model.out.weight)
    torch.manual_seed(0)
    tied = TiedByHand().double()
    ft = zerolab.fully_shard(tied, units=[tied.emb, tied.body, tied])       # emb: a unit of its own
    attempt("tie in forward", lambda: ft(*_tied_batch(dist.get_rank())))
    torch.manual_seed(0)
    tied = TiedByHand().double()
    ft = zerolab.fully_shard(tied, units=[tied.body, tied])                 # the fix: emb in the root
    out["fixed loss"] = ft(*_tied_batch(dist.get_rank())).item()
    # what optimizers, clipping and checks do with a shard still works
    p = model.out.weight
    p.grad = torch.ones_like(p)
    torch.optim.SGD(fs.parameters(), lr=0.5, momentum=0.9).step()
    out["elementwise"] = bool(torch.equal(p, p.detach().clone())) and p.add(1).shape == p.shape
    return out


def test_a_sharded_parameter_refuses_a_whole_use_outside_its_unit(clusters):
    torch.manual_seed(0)
    plain = TiedByHand().double()
    for rank, got in enumerate(clusters(2).run(whole_uses)):
        for case in ("F.linear", "@ .T", "x * w"):
            assert f"parameter 'out.weight' of unit 'out' was used as a whole weight" in got[case], (case, got[case])
            assert f"only rank {rank}'s shard" in got[case] and "Fixes:" in got[case], (case, got[case])
        assert "parameter 'emb.weight' of unit 'emb' was used as a whole weight (linear())" in got["tie in forward"], \
            got["tie in forward"]
        assert got["fixed loss"] == pytest.approx(plain(*_tied_batch(rank)).item(), rel=1e-12)
        assert got["elementwise"]


def torch_clip_on_shards():
    import zerolab
    model = _build("mlp")
    fs = zerolab.fully_shard(model)
    fs(*_data("mlp", model, 0, dist.get_rank())).backward()
    try:
        return torch.nn.utils.clip_grad_norm_(fs.parameters(), 1e-3).item()
    except RuntimeError as exc:
        return str(exc)


def test_torchs_clip_grad_norm_on_shards_is_refused(clusters):
    """The issue-33 probe: on shards torch's norm is each rank's own (0.58 and 0.49 here), so the
    ranks clipped differently, silently. zerolab.clip_grad_norm_(model, ...) is the right call."""
    for got in clusters(2).run(torch_clip_on_shards):
        assert isinstance(got, str) and "zerolab.clip_grad_norm_(model, max_norm)" in got, got


def test_units_and_an_already_sharded_model_are_refused_clearly(clusters):
    def run():
        import zerolab
        out = []
        m = _build("mlp")
        for units, fragment in ((["inp"], "units[0] is the string 'inp' (a name: pass the module itself"),
                                ([m.inp, m.inp.weight], "units[1] is parameter 'inp.weight' of shape"),
                                ([m.inp, _build("mlp").mid], "units[1] is a Linear that is not part of this model"),
                                ([m, 3], "units[1] is a int")):
            try:
                zerolab.fully_shard(m, units=units)
                out.append(f"accepted {units}")
            except ValueError as exc:
                if fragment not in str(exc) or "units must be submodules of the model" not in str(exc):
                    out.append(str(exc))
        fs = zerolab.fully_shard(_build("mlp"))
        for again in (fs, fs.module):
            try:
                zerolab.fully_shard(again)
                out.append("sharded twice")
            except ValueError as exc:
                if "already sharded by zerolab.fully_shard" not in str(exc):
                    out.append(str(exc))
        return out
    assert clusters(2).run(run) == [[], []]

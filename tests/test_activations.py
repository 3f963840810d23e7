"""Activations (lesson 10): the measurement against hand counts and the closed form, checkpointing
against plain autograd, the engines' ``activation_checkpointing`` option at every (stage, offload)
against one process without checkpointing (float64), and stage 3's recomputation inside gathered
units."""
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.flop_counter import FlopCounterMode

import zerolab
from zerolab import activations, models
from zerolab.activations import SavedTensors

ALL = [(0, None), (1, None), (2, None), (3, None), (1, "optimizer"), (2, "optimizer"), (3, "optimizer")]
LR = 1e-2
SMALL = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=2, seq_len=16, attention="naive")


def test_saved_tensors_by_hand():
    """Linear saves its input (the weight is a parameter, recorded apart); tanh saves its output,
    which the next Linear saves again as its input: one storage, counted for the first saver."""
    net = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2)).double()
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    with SavedTensors(net) as saved:
        net(x)
    assert saved.by_module() == {"0": 4 * 3 * 8, "1": 4 * 5 * 8}
    assert saved.total() == (12 + 20) * 8 and saved.packed_bytes() == (12 + 20 + 20) * 8
    assert saved.packed_bytes(parameters=True) > saved.packed_bytes()       # the weights were saved too


def test_outer_hooks_still_receive_every_tensor():
    """A measuring region inside save_on_cpu-like hooks must not switch them off (only the innermost
    pair of hooks runs)."""
    seen = []

    def pack(t):
        seen.append(t.shape)
        return t

    net = nn.Sequential(nn.Linear(3, 5), nn.Tanh())
    x = torch.randn(4, 3, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), SavedTensors(net) as saved:
        y = net(x)
    y.sum().backward()
    assert len(seen) == len(saved.records) >= 3 and x.grad is not None


@pytest.mark.parametrize("attention", ["sdpa", "naive"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_measured_block_equals_the_closed_form(attention, dtype):
    """Every byte one TinyGPT block saves, module by module, equals the terms of layer_terms for its
    shapes and dtype (no dropout; LayerNorm statistics in the block's dtype; sdpa = flash)."""
    s, b, h, a = 48, 3, 64, 4
    model = models.build("gpt", d_model=h, n_heads=a, seq_len=s, n_layers=2, attention=attention, dtype=dtype)
    with SavedTensors(model) as saved:
        model(*models.batch("gpt", model=model, batch_size=b))
    e = torch.tensor([], dtype=dtype).element_size()
    terms = activations.layer_terms(s, b, h, a, dtype_bytes=e, dropout=False, flash=attention == "sdpa",
                                    stats_bytes=e)
    expected = {}
    for _, where, nbytes in terms:
        for module in where.split(", "):
            # the two LayerNorms share their terms equally; the GeLU runs in the block's own forward
            key = "blocks.1" if module == "block" else f"blocks.1.{module}"
            expected[key] = expected.get(key, 0) + nbytes // len(where.split(", "))
    measured = {k: v for k, v in saved.by_module().items() if k == "blocks.1" or k.startswith("blocks.1.")}
    assert measured == expected


def test_paper_numbers():
    s, b, h, a = 2048, 1, 12288, 96                          # GPT-3 175B's layer shape
    assert activations.activation_bytes_per_layer(s, b, h, a) == s * b * h * (34 + 5 * a * s / h)
    assert activations.activation_bytes_per_layer(s, b, h, a, recompute="selective") == 34 * s * b * h
    assert activations.activation_bytes_per_layer(s, b, h, a, recompute="full") == 2 * s * b * h
    flash = activations.activation_bytes_per_layer(s, b, h, a, flash=True)
    assert flash == 34 * s * b * h + 4 * a * s * b         # no s^2 term, one fp32 logsumexp per row
    with pytest.raises(ValueError, match="recompute='partial'"):
        activations.activation_bytes_per_layer(s, b, h, a, recompute="partial")
    assert activations.partitioned_checkpoint_bytes(2, s, b, h)["device"] == 2 * 2 * s * b * h
    assert activations.partitioned_checkpoint_bytes(2, s, b, h, tensor_parallel=8, cpu=True) == {
        "device": 0, "host": 2 * 2 * s * b * h / 8}


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_checkpointing_keeps_less_and_gives_the_same_gradients(mode):
    """float64, naive attention: the same loss and gradients as plain autograd; what the blocks keep
    is only their inputs (full) or everything but the attention probabilities (selective)."""
    plain = models.build("gpt", seed=0, dtype=torch.float64, **SMALL)
    ckpt = copy.deepcopy(plain)
    regions = activations.apply_checkpointing(ckpt, mode)
    x, y = models.batch("gpt", model=plain, batch_size=4)
    with SavedTensors(plain) as before:
        plain(x, y).backward()
    with SavedTensors(ckpt) as after:
        ckpt(x, y).backward()
    for (name, p), q in zip(plain.named_parameters(), ckpt.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-12, atol=1e-14, msg=name)
    s, b, h, a = SMALL["seq_len"], 4, SMALL["d_model"], SMALL["n_heads"]
    stats = 0 if mode == "full" else 4 * s * b * 8           # the LayerNorms' mean and 1/std, float64
    for i in range(SMALL["n_layers"]):
        kept = sum(v for k, v in after.by_module().items() if k.startswith(f"blocks.{i}"))
        full = sum(v for k, v in before.by_module().items() if k.startswith(f"blocks.{i}"))
        if mode == "full":
            assert kept == 8 * s * b * h                                     # the block's input
        else:
            assert full - kept == 8 * a * s * s * b                          # the softmax output
        assert kept == stats + activations.activation_bytes_per_layer(s, b, h, a, dtype_bytes=8, dropout=False,
                                                                      recompute=mode)
    assert len(regions) == SMALL["n_layers"]


def test_a_copy_of_a_checkpointed_model_computes_with_its_own_weights():
    model = models.build("gpt", seed=0, dtype=torch.float64, **SMALL)
    activations.apply_checkpointing(model, "full")
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(1.5)
    x, y = models.batch("gpt", model=model, batch_size=2)
    twin(x, y).backward()
    assert all(p.grad is None for p in model.parameters())
    assert all(p.grad is not None for p in twin.parameters())
    activations.apply_checkpointing(model, None)                  # and it can be undone
    assert not any("forward" in vars(m) for m in model.modules())


@pytest.mark.parametrize("mode", [None, "selective", "full"])
def test_flops_per_token_counts_what_torch_counts(mode):
    """FlopCounterMode (torch's count of every matmul of forward, backward and recomputation) equals
    flops_per_token: 6 (8 with full recompute) FLOPs per matmul parameter per token, plus attention,
    less what torch's early stop does not recompute: each region's last matmul (the block's output
    layer; the core attention's AV product)."""
    shape = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=2, seq_len=16, attention="naive")
    model = models.build("gpt", seed=0, **shape)
    if mode:
        activations.apply_checkpointing(model, mode)
    x, y = models.batch("gpt", model=model, batch_size=4)
    with FlopCounterMode(display=False) as counter:
        model(x, y).backward()
    matmul = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    blocks = sum(m.weight.numel() for m in model.blocks.modules() if isinstance(m, nn.Linear))
    per_token = activations.flops_per_token(matmul, recompute=mode, n_layers=2, seq_len=16, d_model=32)
    if mode == "full":
        per_token -= 2 * (matmul - blocks)       # the output layer is not in a block: not recomputed
        per_token -= 2 * sum(b.out.weight.numel() for b in model.blocks)       # early stop
    if mode == "selective":
        per_token -= 2 * 2 * 16 * 32             # early stop: AV's 2·s·h per layer, 2 layers
    assert counter.get_total_flops() == per_token * 4 * 16


def test_offload_to_host_counts_bytes_and_keeps_gradients():
    model = models.build("gpt", seed=0, dtype=torch.float64, **SMALL)
    ref = copy.deepcopy(model)
    x, y = models.batch("gpt", model=model, batch_size=2)
    ref(x, y).backward()
    with activations.OffloadToHost() as off, SavedTensors(model) as saved:   # the inner one hands on
        loss = model(x, y)
    loss.backward()
    assert off.bytes_to_host == saved.packed_bytes() > 0 and off.bytes_to_device == off.bytes_to_host
    assert off.kept_bytes == saved.packed_bytes(parameters=True) - saved.packed_bytes()
    for p, q in zip(ref.parameters(), model.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=0)


# -- the engine option -----------------------------------------------------------------------------
def _train(stage, offload, mode, steps=2):
    model = models.build("gpt", seed=0, dtype=torch.float64, **SMALL)
    engine = zerolab.initialize(model, stage=stage, offload=offload, lr=LR, bucket_bytes=40000,
                                activation_checkpointing=mode)
    for s in range(steps):
        x, y = models.batch("gpt", seed=100 * s + dist.get_rank(), batch_size=2, model=model)
        engine.backward(engine(x, y))
        engine.step()
        engine.zero_grad()
    gathered = engine.last_step_comm.by_op().get("all_gather", (0, 0, 0))[1]
    return engine.full_state_dict(), sum(engine.activation_report().values()), gathered


def _modes(stage, offload):
    return {mode: _train(stage, offload, mode) for mode in (None, "selective", "full")}


def _one_process(world_size, steps=2):
    model = models.build("gpt", seed=0, dtype=torch.float64, **SMALL)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for s in range(steps):
        xs, ys = zip(*[models.batch("gpt", seed=100 * s + r, batch_size=2, model=model) for r in range(world_size)])
        model(torch.cat(xs), torch.cat(ys)).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach() for n, p in model.named_parameters(remove_duplicate=False)}


@pytest.mark.parametrize("stage,offload", ALL)
def test_engine_option_at_every_stage(clusters, stage, offload):
    """float64 training with full and selective checkpointing equals one process WITHOUT it (1e-12);
    the activation report falls none > selective > full; the all-gather bytes do not change."""
    expected = _one_process(2)
    for per_mode in clusters(2).run(_modes, stage, offload):
        for mode, (state, _, _) in per_mode.items():
            for name, want in expected.items():
                torch.testing.assert_close(state[name], want, rtol=1e-12, atol=1e-12,
                                           msg=lambda m: f"stage {stage} {offload} {mode}, {name}: {m}")
        saved = {mode: v[1] for mode, v in per_mode.items()}
        assert saved[None] > saved["selective"] > saved["full"] > 0, saved
        assert len({v[2] for v in per_mode.values()}) == 1


def _reports(stage_offloads):
    out = {}
    for stage, offload in stage_offloads:
        for mode in (None, "selective", "full"):
            model = models.build("gpt", seed=0, **dict(SMALL, d_model=64, n_heads=4, seq_len=128, n_layers=4))
            engine = zerolab.initialize(model, stage=stage, offload=offload, lr=LR, activation_checkpointing=mode)
            x, y = models.batch("gpt", seed=dist.get_rank(), batch_size=4, model=model)
            engine.backward(engine(x, y))
            out[stage, offload, mode] = engine.activation_report()
    return out


def test_activation_report_is_the_same_at_every_stage(clusters):
    """Activations do not depend on the stage. (At stage 3 a unit's data is freed after its forward
    and its address can be reused by a later activation: a count keyed by data pointers, with the
    parameters' pointers among them, once undercounted there, by rank and run.)"""
    for reports in clusters(2).run(_reports, [(0, None), (3, None), (3, "optimizer")]):
        for mode in (None, "selective", "full"):
            assert reports[0, None, mode] == reports[3, None, mode] == reports[3, "optimizer", mode], (mode, reports)


def _recompute_while_gathered(prefetch):
    model = models.build("gpt", seed=0, **dict(SMALL, n_layers=3))
    engine = zerolab.initialize(model, stage=3, lr=LR, activation_checkpointing="full", prefetch=prefetch)
    seen = []
    for i, block in enumerate(model.blocks):
        block.qkv.register_forward_pre_hook(lambda m, args, i=i: seen.append(
            (i, engine._in_backward, m.weight.untyped_storage().nbytes() > 0)))
    x, y = models.batch("gpt", seed=dist.get_rank(), batch_size=2, model=model)
    engine.backward(engine(x, y))
    return seen


@pytest.mark.parametrize("prefetch", [True, False])
def test_stage3_recomputes_each_block_while_its_unit_is_gathered(clusters, prefetch):
    for seen in clusters(2).run(_recompute_while_gathered, prefetch):
        assert seen == [(0, False, True), (1, False, True), (2, False, True),
                        (2, True, True), (1, True, True), (0, True, True)], seen


def _spanning(prefetch):
    """Units: each block; checkpoints: pairs of blocks. Recomputing a pair runs its first block
    before that block's own backward: the engine must gather it then."""
    model = models.build("gpt", seed=0, dtype=torch.float64, **dict(SMALL, n_layers=4))
    blocks = list(model.blocks)
    model.blocks = nn.ModuleList([nn.Sequential(blocks[0], blocks[1]), nn.Sequential(blocks[2], blocks[3])])
    engine = zerolab.initialize(model, stage=3, lr=LR, prefetch=prefetch, units=blocks,
                                activation_checkpointing="full", checkpoint_units=list(model.blocks))
    for s in range(2):
        x, y = models.batch("gpt", seed=100 * s + dist.get_rank(), batch_size=2, model=model)
        engine.backward(engine(x, y))
        engine.step()
        engine.zero_grad()
    return engine.full_state_dict()


@pytest.mark.parametrize("prefetch", [True, False])
def test_stage3_checkpoint_spanning_units_is_exact(clusters, prefetch):
    ref = models.build("gpt", seed=0, dtype=torch.float64, **dict(SMALL, n_layers=4))
    opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    for s in range(2):
        xs, ys = zip(*[models.batch("gpt", seed=100 * s + r, batch_size=2, model=ref) for r in range(2)])
        ref(torch.cat(xs), torch.cat(ys)).backward()
        opt.step()
        opt.zero_grad()
    want = [p.detach() for p in dict.fromkeys(ref.parameters())]
    for state in clusters(2).run(_spanning, prefetch):
        got = list(dict.fromkeys(state.values()))
        assert len(got) == len(want)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


def _bad(kwargs, model_name="gpt"):
    model = models.build(model_name, seed=0, **(SMALL if model_name == "gpt" else {}))
    kwargs = {k: ([getattr(model, a) if "." not in a else model.get_submodule(a) for a in v]
                  if k == "checkpoint_units" and isinstance(v, list) else v) for k, v in kwargs.items()}
    try:
        zerolab.initialize(model, stage=kwargs.pop("stage", 0), lr=LR, **kwargs)
    except ValueError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("kwargs,model_name,message", [
    (dict(activation_checkpointing="everything"), "gpt", "activation_checkpointing='everything' is not valid"),
    (dict(activation_checkpointing=True), "gpt", "activation_checkpointing=True is not valid"),
    (dict(checkpoint_units=["blocks.0"]), "gpt", "checkpoint_units needs activation_checkpointing"),
    (dict(activation_checkpointing="full", checkpoint_units=["blocks"]), "gpt", "is a ModuleList"),
    (dict(activation_checkpointing="full", checkpoint_units=["blocks.0", "blocks.0.qkv"]), "gpt",
     "contains other checkpoint units"),
    (dict(activation_checkpointing="full"), "mlp", "no `blocks` list"),
    (dict(activation_checkpointing="selective", stage=3), "mlp", "no `blocks` list"),
    (dict(activation_checkpointing="full", checkpoint_units="blocks.0", stage=2), "gpt",
     "checkpoint_units='blocks.0' is not valid"),
])
def test_bad_options_are_named(clusters, kwargs, model_name, message):
    for got in clusters(2).run(_bad, kwargs, model_name):
        assert got is not None and message in got, got


def _not_a_submodule():
    model = models.build("gpt", seed=0, **SMALL)
    try:
        zerolab.initialize(model, stage=1, lr=LR, activation_checkpointing="full",
                           checkpoint_units=[nn.Linear(2, 2)])
    except ValueError as exc:
        return str(exc)


def test_checkpoint_units_must_be_submodules(clusters):
    for got in clusters(2).run(_not_a_submodule):
        assert "must be submodules of the model" in got

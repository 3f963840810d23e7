"""Bad input gets a clear message naming the problem, on every rank, before any training step; never
a hang. (The launcher's own refusals: world_size, nccl without GPUs, unpicklable functions, are in
test_launch.py; damaged checkpoints in test_checkpoint.py.)"""
import warnings

import pytest
import torch
import torch.distributed as dist

import zerolab
from zerolab import models


class WithIntegerState(torch.nn.Module):
    """A model with integer and boolean BUFFERS (fine: they are state, not trained)."""

    def __init__(self):
        super().__init__()
        self.net = models.build("mlp", seed=0)
        self.register_buffer("seen", torch.zeros((), dtype=torch.int64))
        self.register_buffer("mask", torch.tensor([True, False, True, True, False]))
        self.register_buffer("scratch", torch.zeros(3), persistent=False)   # not in a state dict

    def forward(self, x, y):
        self.seen += x.shape[0]
        return ((self.net(x) - y)[:, self.mask] ** 2).mean()


class TwoElements(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor([1.0, 2.0]))

    def forward(self, x):
        return (self.w * x).sum()


def _message(fn):
    try:
        fn()
    except (ValueError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "accepted"


def _initialize_refusals():
    mlp = lambda: models.build("mlp", seed=0)
    frozen = mlp().requires_grad_(False)
    with_int_param = mlp()
    with_int_param.register_parameter("count", torch.nn.Parameter(torch.zeros(2, dtype=torch.int64),
                                                                  requires_grad=False))
    with torch.device("meta"):
        on_meta = models.build("mlp", seed=0)
    cases = {
        "stage": lambda: zerolab.initialize(mlp(), stage=4),
        "offload name": lambda: zerolab.initialize(mlp(), stage=2, offload="nvme"),
        "offload at stage 0": lambda: zerolab.initialize(mlp(), stage=0, offload="optimizer"),
        "optimizer": lambda: zerolab.initialize(mlp(), stage=2, optimizer=torch.optim.LBFGS),
        "optimizer instance": lambda: zerolab.initialize(mlp(), optimizer=torch.optim.AdamW(mlp().parameters())),
        "no trainable": lambda: zerolab.initialize(frozen, stage=1),
        "int parameter": lambda: zerolab.initialize(with_int_param, stage=1),
        "param_dtype": lambda: zerolab.initialize(mlp(), param_dtype=torch.int8),
        "lr": lambda: zerolab.initialize(mlp(), lr=-1),
        "not a module": lambda: zerolab.initialize(lambda x: x),
        "differs across ranks": lambda: zerolab.initialize(models.build("mlp", seed=dist.get_rank()), stage=2),
        "closure optimizer at stage 0": lambda: zerolab.initialize(mlp(), stage=0, optimizer=torch.optim.LBFGS),
        "lr inf": lambda: zerolab.initialize(mlp(), lr=float("inf")),
        "lr bool": lambda: zerolab.initialize(mlp(), lr=True),
        "reduce_impl": lambda: zerolab.initialize(mlp(), stage=2, reduce_impl="tree"),
        "stage-3 option at stage 1": lambda: zerolab.initialize(mlp(), stage=1, prefetch=False),
        "bad stage-3 value": lambda: zerolab.initialize(mlp(), stage=3, prefetch="yes"),
        "init_fn, materialized model": lambda: zerolab.initialize(mlp(), stage=3, init_fn=lambda m: None),
        "init_seed, materialized model": lambda: zerolab.initialize(mlp(), stage=3, init_seed=1),
        "init_fn not callable": lambda: zerolab.initialize(mlp(), stage=3, init_fn=3),
        "init_fn at stage 2": lambda: zerolab.initialize(mlp(), stage=2, init_fn=lambda m: None),
        # issue 33: units entries named; a model already sharded; an option with no effect
        "unit by name": lambda: zerolab.initialize(mlp(), stage=3, units=["mid"]),
        "unit a parameter": lambda: (lambda m: zerolab.initialize(m, stage=3, units=[m.mid, m.mid.weight]))(mlp()),
        "unit None": lambda: zerolab.initialize(mlp(), stage=3, units=[None]),
        "sharded by fully_shard": lambda: zerolab.initialize(zerolab.fully_shard(mlp()).module, stage=3),
        "sharded by stage 3": lambda: zerolab.initialize(zerolab.initialize(mlp(), stage=3).module, stage=3),
        "wrapped by stage 2": lambda: (lambda first: zerolab.initialize(first.module, stage=2))(
            zerolab.initialize(mlp(), stage=2)),                    # the first engine still alive
        "wrapped by stage 0": lambda: (lambda first: zerolab.initialize(first.module, stage=1))(
            zerolab.initialize(mlp(), stage=0)),
        "fully_shard of a stage-3 model": lambda: zerolab.fully_shard(zerolab.initialize(mlp(), stage=3).module),
        "quantize_block alone": lambda: zerolab.initialize(mlp(), stage=3, quantize_block=64),
    }
    for stage, offload in ((0, None), (1, None), (2, None), (3, None), (1, "optimizer"), (2, "optimizer"),
                           (3, "optimizer")):   # a misspelt option, at every stage: never AdamW's TypeError
        cases[f"meta, stage {stage} {offload}"] = \
            lambda stage=stage, offload=offload: zerolab.initialize(on_meta, stage=stage, offload=offload)
        cases[f"unknown option, stage {stage} {offload}"] = \
            lambda stage=stage, offload=offload: zerolab.initialize(mlp(), stage=stage, offload=offload,
                                                                    weight_decy=0.1)
    return {name: _message(case) for name, case in cases.items()}


def test_initialize_refuses_bad_options_with_a_clear_message(clusters):
    per_rank = clusters(2).run(_initialize_refusals)
    assert per_rank[0] == per_rank[1]          # every rank raises the same error: nobody waits forever
    got = per_rank[0]
    expected = {
        "stage": "stage=4 is not supported: choose one of (0, 1, 2, 3)",
        "offload name": "offload='nvme' is not supported",
        "offload at stage 0": "needs a sharded optimizer: use stage 1, 2 or 3",
        "optimizer": ("exact only for an elementwise optimizer; torch's are SGD, Adam, AdamW, Adadelta, Adagrad, "
                      "Adamax, ASGD, NAdam, RAdam, RMSprop, Rprop; got LBFGS"),
        "optimizer instance": "not an instance (AdamW): the engine builds it over what this rank owns",
        "no trainable": "no trainable parameters",
        "int parameter": "parameters must be floating point; not so: ['count']",
        "param_dtype": "param_dtype=torch.int8 is not supported",
        "lr": "lr must be a finite positive number, got -1",
        "not a module": "model must be a torch.nn.Module",
        "differs across ranks": "the model differs across ranks",
        "closure optimizer at stage 0": "LBFGS needs a closure in step()",
        "lr inf": "lr must be a finite positive number, got inf",
        "lr bool": "lr must be a finite positive number, got True",
        "reduce_impl": "reduce_impl='tree' is not supported",
        "stage-3 option at stage 1": "unknown option 'prefetch' for stage 1; it is an option of stage 3",
        "bad stage-3 value": "prefetch='yes' is not valid for stage 3: True or False",
        **{f"meta, stage {s} {o}": "materialize the model first, the same way on every rank: "
                                   "zerolab.meta_init.materialize(model" for s, o in
           ((0, None), (1, None), (2, None), (1, "optimizer"), (2, "optimizer"))},
        # stage 3 builds a meta model itself, from each module's reset_parameters() or init_fn
        **{f"meta, stage 3 {o}": "modules ['(model) (ToyMLP)'] own parameters or buffers but have no "
                                 "reset_parameters()" for o in (None, "optimizer")},
        "init_fn, materialized model": "init_fn / init_seed initialize a model built on the meta device",
        "init_seed, materialized model": "init_fn / init_seed initialize a model built on the meta device",
        "init_fn not callable": "init_fn=3 is not valid for stage 3",
        "init_fn at stage 2": "unknown option 'init_fn' for stage 2; it is an option of stage 3",
        "unit by name": "units[0] is the string 'mid' (a name: pass the module itself, model.get_submodule('mid')): "
                        "units must be submodules of the model",
        "unit a parameter": "units[1] is parameter 'mid.weight' of shape (37, 37) (a unit is the module holding "
                            "parameters, not a parameter)",
        "unit None": "units[0] is a NoneType (None): units must be submodules",
        "sharded by fully_shard": "this model is already wrapped by zerolab.fully_shard: its hooks",
        "sharded by stage 3": "this model is already wrapped by a zerolab stage 3 engine",
        "wrapped by stage 2": "this model is already wrapped by a zerolab stage 2 engine: its hooks",
        "wrapped by stage 0": "this model is already wrapped by a zerolab stage 0 engine",
        "fully_shard of a stage-3 model": "this model is already wrapped by a zerolab stage 3 engine",
        "quantize_block alone": "quantize_block=64 has no effect: nothing is quantized without quantize_weights=True",
        **{f"unknown option, stage {s} {o}": "unknown option 'weight_decy'" for s, o in
           ((0, None), (1, None), (2, None), (3, None), (1, "optimizer"), (2, "optimizer"), (3, "optimizer"))},
    }
    for name, text in expected.items():
        assert got[name].startswith("ValueError") and text in got[name], f"{name}: {got[name]}"
    assert "['inp.weight', 'inp.bias'" in got["differs across ranks"]     # names the parameters


def _warns_for_more_ranks_than_elements():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = zerolab.initialize(TwoElements(), stage=3, lr=0.1)
        engine.backward(engine(torch.ones(2)))
        engine.step()
    return [str(w.message) for w in caught if issubclass(w.category, UserWarning)], engine.full_state_dict()["w"]


def test_more_ranks_than_elements_warns_and_still_trains(clusters):
    messages, w = clusters(4).run(_warns_for_more_ranks_than_elements)[0]
    assert any("world_size=4 is more ranks than the model has trainable elements (2)" in m for m in messages), messages
    # AdamW's first step moves every element by lr against the sign of its gradient (+1 here)
    torch.testing.assert_close(w, torch.tensor([1.0, 2.0]) * (1 - 0.1 * 0.01) - 0.1)


def _integer_buffers(stage, path):
    model = WithIntegerState()
    engine = zerolab.initialize(model, stage=stage, lr=1e-2)
    for step in range(2):
        x, y = models.batch("mlp", seed=10 * step + dist.get_rank(), batch_size=4)
        engine.backward(engine(x, y))
        engine.step()
        engine.zero_grad()
    engine.save_checkpoint(path)
    fresh = WithIntegerState()
    zerolab.initialize(fresh, stage=1, lr=1e-2).load_checkpoint(path)
    return model.seen.item(), fresh.seen.item(), fresh.mask.tolist(), fresh.seen.dtype, fresh.mask.dtype


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_integer_and_boolean_buffers_are_kept_and_checkpointed(clusters, tmp_path, stage):
    for seen, restored, mask, seen_dtype, mask_dtype in clusters(2).run(_integer_buffers, stage, str(tmp_path)):
        assert seen == restored == 8 and mask == [True, False, True, True, False]
        assert (seen_dtype, mask_dtype) == (torch.int64, torch.bool)
    from zerolab import checkpoint
    plain = WithIntegerState()
    plain.load_state_dict(checkpoint.consolidate(tmp_path))      # strict: no non-persistent buffer
    assert plain.seen.item() == 8


def test_cluster_refuses_a_bad_world_size():
    for bad in (0, -2, 1.5, "2"):
        with pytest.raises(ValueError, match="world_size must be a positive int"):
            zerolab.Cluster(bad)


def _save_with_a_lock(path):
    import threading
    from zerolab.checkpoint import CheckpointError
    engine = zerolab.initialize(models.build("mlp", seed=0), stage=2, lr=0.1)
    try:
        engine.save_checkpoint(path, client_state={"step": 3, "lock": threading.Lock()})
        return "saved"
    except CheckpointError as exc:
        return str(exc)


def test_a_client_state_that_cannot_be_saved_is_an_error_on_every_rank(clusters, tmp_path):
    """issue 33's probe: a lock in client_state made rank 0 raise while rank 1 waited in the save's
    next collective: a RankTimeout after the whole timeout."""
    import time
    t0 = time.monotonic()
    got = clusters(2).run(_save_with_a_lock, str(tmp_path / "ckpt"), timeout=40)
    assert time.monotonic() - t0 < 20
    for message in got:
        assert "rank 0: client_state cannot be saved (TypeError: cannot pickle '_thread.lock' object)" in message
        assert "pass plain data" in message and "nothing was written" in message
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").iterdir())


class ForgetsItsBuffer(torch.nn.Module):
    """An integer buffer computed in __init__, which reset_parameters does not set again."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("order", torch.arange(4))

    def reset_parameters(self):
        pass

    def forward(self, x, y):
        return ((self.lin(x)[:, self.order] - y) ** 2).mean()


def _meta_model_that_forgets_a_buffer(how):
    with torch.device("meta"):
        model = ForgetsItsBuffer().double()
    return _message(lambda: zerolab.fully_shard(model, units=[model]) if how == "fully_shard"
                    else zerolab.initialize(model, stage=3))


def test_a_meta_model_whose_init_forgets_an_integer_buffer_is_refused(clusters):
    """issue 33's probe: on the meta device the buffer's value from __init__ (arange) is lost; it
    was silently all zeros (the NaN check catches floating tensors only)."""
    from zerolab.meta_init import materialize
    with torch.device("meta"):
        model = ForgetsItsBuffer()
    with pytest.raises(ValueError, match=r"\(model\): \['order'\] \(integer or boolean\) were not written by its "
                                         r"initialization .* would silently be 0"):
        materialize(model)
    for how in ("fully_shard", "stage 3"):
        for got in clusters(2).run(_meta_model_that_forgets_a_buffer, how):
            assert "['order'] (integer or boolean) were not written" in got, (how, got)


def _a_second_engine_after_the_first_was_dropped(stage):
    model = models.build("mlp", seed=0)
    zerolab.initialize(model, stage=stage, lr=0.1, optimizer=torch.optim.SGD)    # dropped at once
    engine = zerolab.initialize(model, stage=stage, lr=0.1, optimizer=torch.optim.SGD)
    engine.backward(engine(*models.batch("mlp", seed=dist.get_rank(), batch_size=4)))
    engine.step()
    return engine.full_state_dict()


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_a_model_wrapped_again_after_its_engine_was_dropped_trains_right(clusters, stage):
    """issue 33's probe: the dropped engine's gradient hooks stayed on the parameters: at stage 0 they
    all-reduced the gradients a second time (weights off by 1e-2, silently), at stage 2 they called
    a dead weak reference (TypeError: 'NoneType' object is not callable)."""
    model = models.build("mlp", seed=0)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    parts = [models.batch("mlp", seed=r, batch_size=4) for r in range(2)]
    model(torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])).backward()
    opt.step()
    want = dict(model.named_parameters())
    for got in clusters(2).run(_a_second_engine_after_the_first_was_dropped, stage):
        for k, v in want.items():
            assert torch.allclose(got[k], v, rtol=0, atol=1e-6), (stage, k, (got[k] - v).abs().max())

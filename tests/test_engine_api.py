"""The engine's one surface at every (stage, offload): full state dicts that load strictly into the
plain model (tied names included), LR schedulers through ``engine.optimizer``, stage 3's default
units with a weight shared by two top-level children, and the static (stage, offload) table."""
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import zerolab
from zerolab import models

ALL = [(0, None), (1, None), (2, None), (3, None), (1, "optimizer"), (2, "optimizer"), (3, "optimizer")]
LR = 1e-2


def _tied_strict(stage, offload):
    model = models.build("gpt", seed=0)                 # head.weight is tok.weight
    engine = zerolab.initialize(model, stage=stage, offload=offload, lr=LR, bucket_bytes=40000)
    x, y = models.batch("gpt", seed=dist.get_rank(), batch_size=2, model=model)
    engine.backward(engine(x, y))
    engine.step()
    state = engine.full_state_dict()
    plain = models.build("gpt", seed=1)
    result = plain.load_state_dict(state, strict=True)  # raises on a missing or unexpected key
    return (sorted(state), state["head.weight"] is state["tok.weight"], list(result.missing_keys),
            torch.equal(plain.head.weight, state["tok.weight"]))


@pytest.mark.parametrize("stage,offload", ALL)
def test_full_state_dict_loads_strictly_into_a_tied_model(clusters, stage, offload):
    names = sorted(n for n, _ in models.build("gpt").named_parameters(remove_duplicate=False))
    for keys, shared, missing, loaded in clusters(2).run(_tied_strict, stage, offload):
        assert keys == names and "head.weight" in keys, keys
        assert shared, "tied names must share one tensor, as in torch's state_dict"
        assert missing == [] and loaded


def _with_scheduler(stage, offload, steps):
    model = models.build("gpt", seed=0, dtype=torch.float64)
    engine = zerolab.initialize(model, stage=stage, offload=offload, lr=LR, bucket_bytes=40000,
                                weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(engine.optimizer, lambda s: 1.0 / (1 + s))
    for s in range(steps):
        x, y = models.batch("gpt", seed=100 * s + dist.get_rank(), batch_size=2, model=model)
        engine.backward(engine(x, y))
        engine.step()
        engine.zero_grad()
        sched.step()
    return engine.full_state_dict(), [g["lr"] for g in engine.param_groups]


def _reference_with_scheduler(world_size, steps):
    model = models.build("gpt", seed=0, dtype=torch.float64)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    for s in range(steps):
        xs, ys = zip(*[models.batch("gpt", seed=100 * s + r, batch_size=2, model=model) for r in range(world_size)])
        model(torch.cat(xs), torch.cat(ys)).backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    return {n: p.detach() for n, p in model.named_parameters(remove_duplicate=False)}


@pytest.mark.parametrize("stage,offload", ALL)
def test_lr_scheduler_works_unchanged(clusters, stage, offload):
    """torch.optim.lr_scheduler on engine.optimizer, float64, 3 steps with a decaying LR: equal to one
    process with the same scheduler (1e-10): the schedule reaches what each rank really steps."""
    expected = _reference_with_scheduler(2, 3)
    for state, lrs in clusters(2).run(_with_scheduler, stage, offload, 3):
        assert lrs and all(lr == pytest.approx(LR / 4) for lr in lrs), lrs
        for name, want in expected.items():
            torch.testing.assert_close(state[name], want, rtol=1e-10, atol=1e-10,
                                       msg=lambda m: f"stage {stage} {offload}, {name}: {m}")


class SharedChildren(nn.Module):
    """No ``blocks`` list: the default units are the top-level children, and two of them (``emb``
    and ``head``) share one weight, the most common tie."""

    def __init__(self, vocab=32, d=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.mid = nn.Linear(d, d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx, targets):
        logits = self.head(torch.tanh(self.mid(self.emb(idx))))
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def _shared_model():
    torch.manual_seed(0)
    return SharedChildren().double()


def _data(step, rank):
    g = torch.Generator().manual_seed(10 * step + rank)
    t = torch.randint(0, 32, (4, 9), generator=g)
    return t[:, :-1], t[:, 1:]


def _shared_default_units(offload, steps):
    model = _shared_model()
    engine = zerolab.initialize(model, stage=3, offload=offload, lr=LR)
    units = {u.name: sorted(n for n, p in model.named_parameters() if any(p is q for q in u.flat.params))
             for u in engine.units}
    for s in range(steps):
        engine.backward(engine(*_data(s, dist.get_rank())))
        engine.step()
        engine.zero_grad()
    return units, engine.full_state_dict()


@pytest.mark.parametrize("offload", [None, "optimizer"])
def test_default_units_put_a_weight_shared_by_two_children_in_the_root(clusters, offload):
    model = _shared_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for s in range(3):
        xs, ys = zip(*[_data(s, r) for r in range(2)])
        model(torch.cat(xs), torch.cat(ys)).backward()
        opt.step()
        opt.zero_grad()
    for units, state in clusters(2).run(_shared_default_units, offload, 3):
        assert units == {"root": ["emb.weight"], "mid": ["mid.bias", "mid.weight"]}, units
        for name, p in model.named_parameters(remove_duplicate=False):
            torch.testing.assert_close(state[name], p.detach(), rtol=1e-10, atol=1e-10)


def _named_units_still_refused():
    model = _shared_model()
    try:
        zerolab.initialize(model, stage=3, units=[model.emb, model.head])
    except ValueError as exc:
        return str(exc)


def test_units_the_user_names_may_not_share_a_weight(clusters):
    message = clusters(1).run(_named_units_still_refused)[0]
    assert message and "also belongs to unit 'emb'" in message


def test_initialize_dispatches_through_a_static_table():
    """Every (stage, offload) has its class, and nothing else does (no import by string)."""
    from zerolab.offload import Zero1OffloadEngine, Zero2OffloadEngine, Zero3OffloadEngine
    from zerolab.stages import ENGINES
    from zerolab.zero0 import DataParallelEngine
    from zerolab.zero1 import Zero1Engine
    from zerolab.zero2 import Zero2Engine
    from zerolab.zero3 import Zero3Engine
    assert ENGINES == {(0, None): DataParallelEngine, (1, None): Zero1Engine, (2, None): Zero2Engine,
                       (3, None): Zero3Engine, (1, "optimizer"): Zero1OffloadEngine,
                       (2, "optimizer"): Zero2OffloadEngine, (3, "optimizer"): Zero3OffloadEngine}
    for (stage, offload), cls in ENGINES.items():
        assert cls.stage == stage and cls.offloaded == (offload is not None)

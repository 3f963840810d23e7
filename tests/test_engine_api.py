"""The engine's one surface at every (stage, offload): full state dicts that load strictly into the
plain model (tied names included), LR schedulers through ``engine.optimizer``, stage 3's default
units with a weight shared by two top-level children, and the static (stage, offload) table."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import zerolab
from helpers import assert_params
from reference import reference, train
from zerolab import models

ALL = [(0, None), (1, None), (2, None), (3, None), (1, "optimizer"), (2, "optimizer"), (3, "optimizer")]
LR = 1e-2


def _strict_load(engine):
    state = engine.full_state_dict()
    plain = models.build("gpt", seed=1)
    result = plain.load_state_dict(state, strict=True)  # raises on a missing or unexpected key
    return (sorted(state), state["head.weight"] is state["tok.weight"], list(result.missing_keys),
            torch.equal(plain.head.weight, state["tok.weight"]))


def _tied_strict(stage, offload):
    """One step of TinyGPT (head.weight is tok.weight), then its full state dict into a plain model."""
    return train("gpt", 1, stage=stage, offload=offload, dtype=torch.float32, lr=LR, size=2, bucket_bytes=40000,
                 finish=_strict_load)


@pytest.mark.parametrize("stage,offload", ALL)
def test_full_state_dict_loads_strictly_into_a_tied_model(clusters, stage, offload):
    names = sorted(n for n, _ in models.build("gpt").named_parameters(remove_duplicate=False))
    for keys, shared, missing, loaded in clusters(2).run(_tied_strict, stage, offload):
        assert keys == names and "head.weight" in keys, keys
        assert shared, "tied names must share one tensor, as in torch's state_dict"
        assert missing == [] and loaded


def _decay(optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))


SCHEDULED = dict(lr=LR, weight_decay=0.1, scheduler=_decay, size=2)


def _state_and_lrs(engine):
    return engine.full_state_dict(), [g["lr"] for g in engine.param_groups]


@pytest.mark.parametrize("stage,offload", ALL)
def test_lr_scheduler_works_unchanged(clusters, stage, offload):
    """torch.optim.lr_scheduler on engine.optimizer, float64, 3 steps with a decaying LR: equal to one
    process with the same scheduler (1e-10): the schedule reaches what each rank really steps."""
    expected = reference("gpt", 2, 3, **SCHEDULED)
    trained = clusters(2).run(train, "gpt", 3, stage=stage, offload=offload, bucket_bytes=40000,
                              finish=_state_and_lrs, **SCHEDULED)
    for state, lrs in trained:
        assert lrs and all(lr == pytest.approx(LR / 4) for lr in lrs), lrs
    assert_params([state for state, _ in trained], expected, f"stage {stage} {offload}", rtol=1e-10, atol=1e-10)


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


def _shared_children(dtype=torch.float64, vocab_size=32, seq_len=8):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return SharedChildren(vocab=vocab_size).to(dtype)


# The model and its data: next-token data as TinyGPT's ("gpt"), over SharedChildren's vocabulary.
SHARED = dict(lr=LR, builder=_shared_children, model_kw=dict(vocab_size=32, seq_len=8))


def _units_and_state(engine):
    units = {u.name: sorted(n for n, p in engine.module.named_parameters() if any(p is q for q in u.flat.params))
             for u in engine.units}
    return units, engine.full_state_dict()


@pytest.mark.parametrize("offload", [None, "optimizer"])
def test_default_units_put_a_weight_shared_by_two_children_in_the_root(clusters, offload):
    expected = reference("gpt", 2, 3, **SHARED)
    trained = clusters(2).run(train, "gpt", 3, stage=3, offload=offload, finish=_units_and_state, **SHARED)
    for units, state in trained:
        assert units == {"root": ["emb.weight"], "mid": ["mid.bias", "mid.weight"]}, units
    assert_params([state for _, state in trained], expected, f"default units, offload {offload}", rtol=1e-10,
                  atol=1e-10)


def _named_units_still_refused():
    model = _shared_children()
    try:
        zerolab.initialize(model, stage=3, units=[model.emb, model.head])
    except ValueError as exc:
        return str(exc)


def test_units_the_user_names_may_not_share_a_weight(clusters):
    message = clusters(1).run(_named_units_still_refused)[0]
    assert message and "also belongs to unit 'emb'" in message


def test_initialize_dispatches_through_a_static_table():
    """Every (stage, offload) has its class, and nothing else does (no import by string)."""
    from zerolab.infinity import Zero1DiskEngine, Zero2DiskEngine, Zero3DiskEngine
    from zerolab.offload import Zero1OffloadEngine, Zero2OffloadEngine, Zero3OffloadEngine
    from zerolab.stages import ENGINES
    from zerolab.zero0 import DataParallelEngine
    from zerolab.zero1 import Zero1Engine
    from zerolab.zero2 import Zero2Engine
    from zerolab.hybrid import HybridEngine
    from zerolab.zero3 import Zero3Engine
    assert issubclass(HybridEngine, Zero3Engine)    # stage 3 with mesh/hpz/quantize options (lesson 12)
    assert ENGINES == {(0, None): DataParallelEngine, (1, None): Zero1Engine, (2, None): Zero2Engine,
                       (3, None): HybridEngine, (1, "optimizer"): Zero1OffloadEngine,
                       (2, "optimizer"): Zero2OffloadEngine, (3, "optimizer"): Zero3OffloadEngine,
                       (1, "disk"): Zero1DiskEngine, (2, "disk"): Zero2DiskEngine, (3, "disk"): Zero3DiskEngine}
    for (stage, offload), cls in ENGINES.items():
        assert cls.stage == stage and cls.offloaded == (offload is not None)


# -- floating buffers: rank 0's at every forward, as torch DDP's broadcast_buffers=True --------------
def _bn_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3)).double()


def _bn_data(step, rank):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 6, generator=g, dtype=torch.float64) * (1 + rank), torch.randn(4, 3, generator=g,
                                                                                          dtype=torch.float64)


def _bn_against_ddp(stage, offload, broadcast):
    """3 steps of a BatchNorm model on different data per rank, through torch DDP (its default
    broadcast_buffers=True) and through the engine. Returns (engine's params and buffers, DDP's)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    rank = dist.get_rank()
    ddp = DistributedDataParallel(_bn_model())
    opt = torch.optim.AdamW(ddp.parameters(), lr=LR)
    engine = zerolab.initialize(_bn_model(), stage=stage, offload=offload, lr=LR, broadcast_buffers=broadcast)
    for step in range(3):
        x, y = _bn_data(step, rank)
        F.mse_loss(ddp(x), y).backward()
        opt.step()
        opt.zero_grad()
        engine.backward(F.mse_loss(engine(x), y))
        engine.step()
        engine.zero_grad()
    buffers = lambda m: {n: b.clone() for n, b in m.named_buffers() if b.is_floating_point()}
    return engine.full_state_dict(), buffers(engine.module), ({n: p.detach().clone() for n, p in
                                                              ddp.module.named_parameters()}, buffers(ddp.module))


@pytest.mark.parametrize("stage,offload", ALL)
def test_floating_buffers_follow_rank_0_as_torch_ddp(clusters, stage, offload):
    """BatchNorm's running statistics: each forward starts from rank 0's (broadcast, DDP's default),
    then moves with this rank's batch; parameters and every rank's buffers equal DDP's."""
    for rank, (params, buffers, (ddp_params, ddp_buffers)) in enumerate(
            clusters(2).run(_bn_against_ddp, stage, offload, True)):
        assert_params([params], ddp_params, f"rank {rank}, stage {stage} {offload}: params", rtol=1e-10, atol=1e-12)
        assert_params([buffers], ddp_buffers, f"rank {rank}, stage {stage} {offload}: buffers", rtol=1e-10,
                      atol=1e-12)


def test_floating_buffers_drift_apart_without_broadcast(clusters):
    """broadcast_buffers=False: each rank's running statistics follow its own data only."""
    (_, b0, (_, d0)), (_, b1, _) = clusters(2).run(_bn_against_ddp, 1, None, False)
    assert not torch.equal(b0["1.running_mean"], b1["1.running_mean"])
    torch.testing.assert_close(b0["1.running_mean"], d0["1.running_mean"])   # rank 0's is DDP's rank 0

"""Graded: exercise 03, ZeRO-1 by whole parameters. Checked against independent references: the
partition against torch's own ZeroRedundancyOptimizer on the same ranks (balance), training against
one process on the concatenated batches (float64), the optimizer state against the owned elements
(memory), and the step's collectives recorded call by call: each gradient reduced to its owner and
each parameter broadcast from it, Ψ elements each way, no all-reduce (bytes)."""
import pytest
import torch
import torch.distributed as dist

from zerolab import models
from zerolab.grade.helpers import assert_close, exercise_module, record_collectives

# The reference implementation of this exercise: a submission that uses it scores 0
# (checked before and while the tests run, by zerolab.grade.references).
REFERENCE_MODULES = ["zerolab.zero1", "zerolab.shard_optim", "zerolab.Zero1Optimizer",
                     "torch.distributed.optim"]   # ZeroRedundancyOptimizer is what it is compared with

N = 3
LR = 1e-2
GPT = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=2, seq_len=16)


def _model(name):
    return models.build(name, seed=0, dtype=torch.float64, **(GPT if name == "gpt" else {}))


def _batch(name, model, step, rank):
    return models.batch(name, seed=100 * step + rank, batch_size=3, model=model, dtype=torch.float64)


def _trainable(model):
    return [p for p in dict.fromkeys(model.parameters()) if p.requires_grad]


def check_partition(name):
    from torch.distributed.optim import ZeroRedundancyOptimizer
    ex = exercise_module("ex03_zero1")
    rank = dist.get_rank()
    model = _model(name)
    names = {id(p): k for k, p in model.named_parameters()}
    opt = ex.ParamZero1(model.parameters(), torch.optim.AdamW, lr=LR)
    theirs = ZeroRedundancyOptimizer(_trainable(model), torch.optim.AdamW, lr=LR)
    for r, groups in enumerate(theirs._partition_parameters()):
        want = sorted(names[id(p)] for g in groups for p in g["params"])
        got = sorted(names[id(p)] for p in opt.partition[r])
        assert got == want, (f"{name}: rank {r} owns {got}; torch's ZeroRedundancyOptimizer gives it {want} "
                             f"(largest first, each to the least-loaded rank)")
    x, y = _batch(name, model, 0, rank)
    model(x, y).backward()
    opt.step()
    state = {id(p): s for p, s in opt.local.state.items()}
    own = {id(p) for p in opt.partition[rank]}
    extra = [names[i] for i in state if i not in own]
    assert not extra, f"rank {rank}: the local optimizer holds state for parameters it does not own: {extra[:4]}"
    moments = sum(t.numel() for s in opt.local.state.values() for t in s.values() if torch.is_tensor(t) and t.dim())
    owned = sum(p.numel() for p in opt.partition[rank])
    assert moments == 2 * owned, (f"rank {rank}: {moments} elements of Adam state for the {owned} elements it "
                                  f"owns: expected two moments per owned element")


def check_training(name):
    ex = exercise_module("ex03_zero1")
    rank, n = dist.get_rank(), dist.get_world_size()
    model, ref = _model(name), _model(name)
    opt = ex.ParamZero1(model.parameters(), torch.optim.AdamW, lr=LR)
    ref_opt = torch.optim.AdamW(_trainable(ref), lr=LR)
    for step in range(3):
        model(*_batch(name, model, step, rank)).backward()
        opt.step()
        opt.zero_grad()
        xs, ys = zip(*[_batch(name, ref, step, r) for r in range(n)])
        ref(torch.cat(xs), torch.cat(ys)).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    for (k, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_close(p.detach(), q.detach(), f"{name}: parameter {k} after 3 steps vs one process on the "
                     f"concatenated batches", rtol=1e-9, atol=1e-12)


def check_communication():
    ex = exercise_module("ex03_zero1")
    rank = dist.get_rank()
    model = _model("gpt")
    opt = ex.ParamZero1(model.parameters(), torch.optim.AdamW, lr=LR)
    model(*_batch("gpt", model, 0, rank)).backward()
    with record_collectives() as calls:
        opt.step()
    ops = sorted({c["op"] for c in calls})
    assert set(ops) <= {"reduce", "broadcast"}, (
        f"rank {rank}: step() called {ops}: each gradient goes to its owner only (reduce) and each "
        f"parameter comes back from it (broadcast); an all-reduce would send every gradient to everyone")
    for op in ("reduce", "broadcast"):
        per_peer = {}
        for c in calls:
            if c["op"] == op:
                per_peer[c["peer"]] = per_peer.get(c["peer"], 0) + c["bytes"]
        want = {r: 8 * sum(p.numel() for p in ps) for r, ps in enumerate(opt.partition) if ps}
        assert per_peer == want, (
            f"rank {rank}: bytes {'reduced to' if op == 'reduce' else 'broadcast from'} each rank: {per_peer}; "
            f"expected the bytes of the parameters it owns, once: {want}")


def torch_state_shares():
    """What torch's ZeroRedundancyOptimizer really holds on this rank (Adam state elements)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    model = models.build("gpt", seed=0)
    opt = ZeroRedundancyOptimizer(list(dict.fromkeys(model.parameters())), torch.optim.AdamW, lr=1e-3)
    model(*models.batch("gpt", seed=dist.get_rank(), batch_size=2, model=model)).backward()
    opt.step()
    return sum(t.numel() for s in opt.optim.state.values() for t in s.values() if t.dim() > 0)


@pytest.mark.points(2)
def test_largest_share_derived(on_ranks):
    """derived: the most loaded rank's share, by hand and as torch's optimizer measures it"""
    ex = exercise_module("ex03_zero1")
    for numels, n, want in [([4, 4, 4, 4], 4, 0.25), ([10, 1, 1], 2, 10 / 12), ([3, 3, 2, 2, 2], 2, 7 / 12),
                            ([5, 4, 3, 3, 3], 2, 10 / 18), ([7], 3, 1.0), ([2, 2, 2], 4, 2 / 6)]:
        got = ex.largest_share(numels, n)
        assert got == pytest.approx(want, rel=1e-12), f"largest_share({numels}, {n}) = {got}; by hand {want}"
    shares = on_ranks(N, torch_state_shares)
    numels = [p.numel() for p in dict.fromkeys(models.build("gpt", seed=0).parameters())]
    got = ex.largest_share(numels, N)
    assert got == pytest.approx(max(shares) / sum(shares), rel=1e-12), (
        f"TinyGPT on {N} ranks: largest_share = {got:.4f}; torch's ZeroRedundancyOptimizer's most loaded rank "
        f"holds {max(shares) / sum(shares):.4f} of the Adam state (measured: {shares})")


@pytest.mark.points(3)
@pytest.mark.parametrize("name", ["gpt", "mlp"])
def test_partition_and_state_like_torch(on_ranks, name):
    """balance and memory: torch's greedy partition; optimizer state for owned parameters only"""
    on_ranks(N, check_partition, name)


@pytest.mark.points(3)
@pytest.mark.parametrize("name", ["gpt", "mlp"])
def test_training_equals_one_process(on_ranks, name):
    """values: 3 steps equal one process on the concatenated batches"""
    on_ranks(N, check_training, name)


@pytest.mark.points(2)
def test_each_gradient_to_its_owner_each_parameter_from_it(on_ranks):
    """bytes: reduce to the owner, broadcast from it, every element once; no all-reduce"""
    on_ranks(N, check_communication)

"""Graded: exercise 03, ZeRO-1 by whole parameters. The submission runs in probes (its own ranks)
that report plain data; every verdict is decided here, against references computed here or on
trusted ranks that never import the submission: the partition against torch's own
ZeroRedundancyOptimizer (balance); training against one process on the concatenated batches
(float64), with a frozen layer, a module used twice and a layer no forward uses; the optimizer
state against the owned elements and a census of every live tensor after the step (memory); the
step's collectives recorded call by call: each gradient reduced to its owner and each parameter
broadcast from it, Ψ elements each way, no all-reduce (bytes); and all of it on a subgroup of 3 of
4 ranks while the fourth trains alone (``group=``)."""
import pytest
import torch
import torch.nn as nn

from zerolab import models
from zerolab.grade.helpers import exercise_module, live_storages, new_bytes, record_collectives

# The reference implementation of this exercise: a submission that uses it scores 0
# (checked before and while the tests run, by zerolab.grade.references).
REFERENCE_MODULES = ["zerolab.zero1", "zerolab.shard_optim", "zerolab.Zero1Optimizer",
                     "torch.distributed.optim"]   # ZeroRedundancyOptimizer is what it is compared with

N = 3
LR = 1e-2
GPT = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=2, seq_len=16)
SUBGROUP = [1, 2, 3]       # on 4 ranks: these share one optimizer; rank 0 trains alone meanwhile


class Spare(nn.Module):
    """ToyMLP (a frozen layer, a module used twice, sizes no N divides) plus a layer that no forward
    uses: it never gets a gradient, so one process's AdamW never touches it."""

    def __init__(self):
        super().__init__()
        self.mlp = models.ToyMLP()
        self.spare = nn.Linear(7, 3)

    def forward(self, x, y):
        return self.mlp(x, y)


def _model(name):
    if name == "spare":
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            return Spare().double()
    return models.build(name, seed=0, dtype=torch.float64, **(GPT if name == "gpt" else {}))


def _batch(name, model, step, rank):
    return models.batch("gpt" if name == "gpt" else "mlp", seed=100 * step + rank, batch_size=3,
                        model=model, dtype=torch.float64)


def _trainable(model):
    return [p for p in dict.fromkeys(model.parameters()) if p.requires_grad]


def _names(model):
    return {id(p): k for k, p in model.named_parameters()}


def _numels(name):
    return {k: p.numel() for k, p in _model(name).named_parameters()}


def _trainable_names(name):
    return sorted(k for k, p in _model(name).named_parameters() if p.requires_grad)


def _calls(calls):
    return [{k: c[k] for k in ("op", "peer", "bytes", "group")} for c in calls]


# -- probes: run the submission on its ranks, observe, return plain data ------------------------------
def _probe_shares(cases):
    ex = exercise_module("ex03_zero1")
    return [float(ex.largest_share(list(numels), n)) for numels, n in cases]


def _probe_partition(name):
    import torch.distributed as dist
    ex = exercise_module("ex03_zero1")
    rank = dist.get_rank()
    model = _model(name)
    names = _names(model)
    x, y = _batch(name, model, 0, rank)
    hold = []                                  # keeps the census's storages alive: no address reuse
    before = live_storages(hold)               # the model and the batch
    opt = ex.ParamZero1(model.parameters(), torch.optim.AdamW, lr=LR)
    partition = [[names[id(p)] for p in ps] for ps in opt.partition]
    local = [names.get(id(p), "?") for g in opt.local.param_groups for p in g["params"]]
    model(x, y).backward()
    opt.step()
    opt.zero_grad()
    owned = sum(p.numel() for p in opt.partition[rank]) * 8
    kept = new_bytes(before, settle_to=2 * owned + 4096)
    moments = sum(t.numel() for s in opt.local.state.values() for t in s.values() if torch.is_tensor(t) and t.dim())
    return {"partition": partition, "local": local, "state": [names.get(id(p), "?") for p in opt.local.state],
            "moments": moments, "kept_bytes": kept}


def _probe_training(name, steps, group_ranks=None):
    """``steps`` steps of ParamZero1; with ``group_ranks`` (on 4 ranks): those ranks share one optimizer
    on a subgroup, every other rank trains alone on a group of its own. Returns the final parameters,
    the partition, and the collectives of the last step."""
    import torch.distributed as dist
    ex = exercise_module("ex03_zero1")
    rank = dist.get_rank()
    group = None
    if group_ranks is not None:
        groups = {tuple(group_ranks): dist.new_group(group_ranks)}    # every rank creates every group
        for r in range(dist.get_world_size()):
            if r not in group_ranks:
                groups[(r,)] = dist.new_group([r])
        group = next(g for ranks, g in groups.items() if rank in ranks)
    model = _model(name)
    names = _names(model)
    opt = ex.ParamZero1(model.parameters(), torch.optim.AdamW, lr=LR, group=group)
    for step in range(steps):
        model(*_batch(name, model, step, rank)).backward()
        with record_collectives() as calls:
            opt.step()
        opt.zero_grad()
    return {"params": {k: p.detach().clone() for k, p in model.named_parameters()},
            "partition": [[names[id(p)] for p in ps] for ps in opt.partition], "calls": _calls(calls)}


# -- trusted: torch's own ZeroRedundancyOptimizer, on ranks that never import the submission -----------
def torch_partition(name):
    """torch's ZeroRedundancyOptimizer's partition of ``name``'s trainable parameters (names per rank)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    model = _model(name)
    names = _names(model)
    theirs = ZeroRedundancyOptimizer(_trainable(model), torch.optim.AdamW, lr=LR)
    return [sorted(names[id(p)] for g in groups for p in g["params"]) for groups in theirs._partition_parameters()]


def torch_state_shares():
    """What torch's ZeroRedundancyOptimizer really holds on this rank (Adam state elements)."""
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer
    model = models.build("gpt", seed=0)
    opt = ZeroRedundancyOptimizer(list(dict.fromkeys(model.parameters())), torch.optim.AdamW, lr=1e-3)
    model(*models.batch("gpt", seed=dist.get_rank(), batch_size=2, model=model)).backward()
    opt.step()
    return sum(t.numel() for s in opt.optim.state.values() for t in s.values() if t.dim() > 0)


def _reference(name, ranks, steps):
    """One process, float64, plain AdamW, on the concatenated batches of ``ranks`` (global ranks)."""
    ref = _model(name)
    opt = torch.optim.AdamW(_trainable(ref), lr=LR)
    for step in range(steps):
        xs, ys = zip(*[_batch(name, ref, step, r) for r in ranks])
        ref(torch.cat(xs), torch.cat(ys)).backward()
        opt.step()
        opt.zero_grad()
    return {k: p.detach() for k, p in ref.named_parameters()}


def _check_params(got, want, what):
    for k, q in want.items():
        p = got[k]
        if not torch.allclose(p, q, rtol=1e-9, atol=1e-12):
            d = (p - q).abs().max().item()
            raise AssertionError(f"{what}: parameter {k} differs from one process on the concatenated batches "
                                 f"(float64) by up to {d:.3g}")


def _check_bytes(rank, calls, partition, numels, ranks_of):
    """Each owner's parameters reduced to it and broadcast from it, once; nothing else."""
    ops = sorted({c["op"] for c in calls})
    assert set(ops) <= {"reduce", "broadcast"}, (
        f"rank {rank}: step() called {ops}: each gradient goes to its owner only (reduce) and each "
        f"parameter comes back from it (broadcast); an all-reduce would send every gradient to everyone")
    want = {ranks_of[r]: 8 * sum(numels[k] for k in ps) for r, ps in enumerate(partition) if ps}
    for op in ("reduce", "broadcast"):
        per_peer = {}
        for c in calls:
            if c["op"] == op:
                per_peer[c["peer"]] = per_peer.get(c["peer"], 0) + c["bytes"]
        assert per_peer == want, (
            f"rank {rank}: bytes {'reduced to' if op == 'reduce' else 'broadcast from'} each rank (global "
            f"ranks): {per_peer}; expected the bytes of the parameters it owns, once: {want}")


@pytest.mark.points(3)
@pytest.mark.parametrize("name", ["gpt", "mlp"])
def test_partition_and_state_like_torch(student, clusters, name):
    """balance and memory: torch's greedy partition; optimizer state for owned parameters only, and
    nothing else left behind by a step"""
    theirs = clusters(N).run(torch_partition, name)[0]
    numels = _numels(name)
    for rank, got in enumerate(student.on_ranks(N, _probe_partition, name)):
        for r, ps in enumerate(got["partition"]):
            assert sorted(ps) == theirs[r], (
                f"{name}: rank {rank} says rank {r} owns {sorted(ps)}; torch's ZeroRedundancyOptimizer gives it "
                f"{theirs[r]} (largest first, each to the least-loaded rank; frozen parameters owned by nobody)")
        own = sorted(got["partition"][rank])
        assert sorted(got["local"]) == own, (
            f"{name}: rank {rank}: its local optimizer is over {sorted(got['local'])[:6]}...; it must be over "
            f"the parameters this rank owns only: {own}")
        extra = sorted(set(got["state"]) - set(own))
        assert not extra, (f"{name}: rank {rank}: the local optimizer holds state for parameters it does not "
                           f"own: {extra[:4]}")
        owned = sum(numels[k] for k in own)
        assert got["moments"] == 2 * owned, (
            f"{name}: rank {rank}: {got['moments']} elements of Adam state for the {owned} elements it owns: "
            f"expected two moments per owned element")
        bound = 2 * owned * 8 + 64 * len(own) + 4096     # Adam's two moments, a step counter each, slack
        assert got["kept_bytes"] <= bound, (
            f"{name}: rank {rank}: after step() and zero_grad(), {got['kept_bytes']} bytes of tensors are alive "
            f"that were not before the optimizer existed; its state for the {owned} elements it owns is "
            f"{2 * owned * 8} bytes (at most {bound} with counters): something of the size of the gradients "
            f"or of other ranks' parameters is kept (a buffer, the gradients themselves)")


@pytest.mark.points(3)
@pytest.mark.parametrize("name", ["gpt", "mlp", "spare"])
def test_training_equals_one_process(student, name):
    """values: 3 steps equal one process on the concatenated batches (a frozen layer, a module used
    twice, a layer no forward uses)"""
    got = student.on_ranks(N, _probe_training, name, 3)
    want = _reference(name, range(N), 3)
    for rank, g in enumerate(got):
        _check_params(g["params"], want, f"{name}: rank {rank} after 3 steps")


@pytest.mark.points(2)
def test_each_gradient_to_its_owner_each_parameter_from_it(student):
    """bytes: reduce to the owner, broadcast from it, every element once; no all-reduce"""
    numels = _numels("gpt")
    for rank, g in enumerate(student.on_ranks(N, _probe_training, "gpt", 1)):
        _check_bytes(rank, g["calls"], g["partition"], numels, list(range(N)))


@pytest.mark.points(3)
def test_on_a_subgroup(student, clusters):
    """group=: 3 of 4 ranks share the optimizer (global ranks 1-3) while rank 0 trains alone"""
    got = student.on_ranks(4, _probe_training, "gpt", 2, SUBGROUP)
    theirs = clusters(len(SUBGROUP)).run(torch_partition, "gpt")[0]
    numels = _numels("gpt")
    _check_params(got[0]["params"], _reference("gpt", [0], 2), "rank 0, alone in its own group")
    alone = got[0]["partition"]
    assert len(alone) == 1 and sorted(alone[0]) == _trainable_names("gpt"), (
        f"rank 0, alone in its group, has a partition over {len(alone)} ranks: its group has one rank, which "
        f"owns every trainable parameter")
    assert all(c["group"] == (0,) for c in got[0]["calls"]), (
        f"rank 0 (alone in its group) called {[(c['op'], c['group']) for c in got[0]['calls']][:4]}: every "
        f"collective goes to the group given")
    want = _reference("gpt", SUBGROUP, 2)
    for rank in SUBGROUP:
        g = got[rank]
        assert [sorted(ps) for ps in g["partition"]] == theirs, (
            f"rank {rank}: the partition over the group of {len(SUBGROUP)} ranks is "
            f"{[sorted(ps) for ps in g['partition']]}; torch's on {len(SUBGROUP)} ranks: {theirs}")
        wrong = [(c["op"], c["group"]) for c in g["calls"] if c["group"] != tuple(SUBGROUP)]
        assert not wrong, (f"rank {rank}: collectives outside the group {SUBGROUP}: {wrong[:4]} (a collective "
                           f"without group= runs on every rank, and rank 0 is busy with its own)")
        _check_params(g["params"], want, f"rank {rank} of the group {SUBGROUP}, after 2 steps")
        _check_bytes(rank, g["calls"], g["partition"], numels, SUBGROUP)


@pytest.mark.points(2)
def test_largest_share_derived(student, clusters):
    """derived: the most loaded rank's share, by hand and as torch's optimizer measures it"""
    cases = [([4, 4, 4, 4], 4, 0.25), ([10, 1, 1], 2, 10 / 12), ([3, 3, 2, 2, 2], 2, 7 / 12),
             ([5, 4, 3, 3, 3], 2, 10 / 18), ([7], 3, 1.0), ([2, 2, 2], 4, 2 / 6), ([6, 5, 4, 3], 2, 9 / 18)]
    gpt = [p.numel() for p in dict.fromkeys(models.build("gpt", seed=0).parameters())]
    got = student.on_ranks(N, _probe_shares, [(numels, n) for numels, n, _ in cases] + [(gpt, N)])[0]   # live ranks
    for (numels, n, want), g in zip(cases, got):
        assert g == pytest.approx(want, rel=1e-12), f"largest_share({numels}, {n}) = {g}; by hand {want}"
    shares = clusters(N).run(torch_state_shares)
    assert got[-1] == pytest.approx(max(shares) / sum(shares), rel=1e-12), (
        f"TinyGPT on {N} ranks: largest_share = {got[-1]:.4f}; torch's ZeroRedundancyOptimizer's most loaded "
        f"rank holds {max(shares) / sum(shares):.4f} of the Adam state (measured: {shares})")

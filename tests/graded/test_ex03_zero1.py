"""Graded: exercise 03, ZeRO-1 by whole parameters. The submission runs in probes (its own ranks)
that report plain data; every verdict is decided here, against references computed here: the
partition on its properties (every trainable parameter owned whole by exactly one rank, frozen ones
by none, a tied one counted once, the same on every rank, a rank allowed to own nothing) and its
balance against the best whole-parameter partition, found exactly by search here (at most 4/3 of it,
on models whose sizes and order make round-robin, in-order and fill-to-the-average rules fail);
training against one process on the concatenated batches (float64), with a frozen layer, a module
used twice and a layer no forward uses; the optimizer state against the owned elements and a census
of every live tensor after the step (memory); the step's collectives recorded call by call: each
gradient reduced to its owner and each parameter broadcast from it, Ψ elements each way, no
all-reduce (bytes); all of it on a subgroup of 3 of 4 ranks while the fourth trains alone
(``group=``); and 03.2's share against the share measured on the submission's own ranks."""
import pytest
import torch
import torch.nn as nn

from zerolab import models
from zerolab.grade.helpers import exercise_module, live_storages, new_bytes, record_collectives

# The reference implementation of this exercise: a submission that uses it scores 0
# (checked before and while the tests run, by zerolab.grade.references).
REFERENCE_MODULES = ["zerolab.zero1", "zerolab.shard_optim", "zerolab.Zero1Optimizer",
                     "torch.distributed.optim"]   # ZeroRedundancyOptimizer: whole-parameter ZeRO-1 itself

N = 3
LR = 1e-2
GPT = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=2, seq_len=16)
SUBGROUP = [1, 2, 3]       # on 4 ranks: these share one optimizer; rank 0 trains alone meanwhile
# The groups the partition probes use on 4 ranks (every rank creates every one): sizes 2, 3 and 4,
# two of them not starting at global rank 0.
GROUPS = {2: [2, 3], 3: [1, 2, 3], 4: [0, 1, 2, 3]}
# Sizes (elements per parameter, in the model's order) on which rules without a balance guarantee
# fail the 4/3 bound, each with the world size it is graded on: many small parameters before a large
# one (in-order greedy, round-robin, sorted round-robin); a case where no simple rule reaches OPT
# (a good one lands between OPT and 4/3 OPT); sizes that make "fill each rank up to Ψ/N, in order"
# overshoot either way.
AWKWARD = [([10] * 6 + [30], 3), ([10, 10, 20], 2), ([8] * 12 + [32], 4),
           ([20, 20, 16, 16, 12, 12, 12], 3), ([3] * 6 + [9, 1, 1, 1], 3)]
# 03.2 by hand-sized cases, measured on ranks: ties, one parameter outweighing the rest, a rank (or
# two) that owns nothing, sizes whose order matters.
SHARES = [([4, 4, 4, 4], 4), ([10, 1, 1], 2), ([3, 3, 2, 2, 2], 2), ([5, 4, 3, 3, 3], 2), ([7], 3),
          ([2, 2, 2], 4), ([6, 5, 4, 3], 2), ([1, 1, 2], 2)]
BIG_N = (1, 5, 8, 16)      # 03.2 on TinyGPT for world sizes no probe runs: the bound only


class Spare(nn.Module):
    """ToyMLP (a frozen layer, a module used twice, sizes no N divides) plus a layer that no forward
    uses: it never gets a gradient, so one process's AdamW never touches it."""

    def __init__(self):
        super().__init__()
        self.mlp = models.ToyMLP()
        self.spare = nn.Linear(7, 3)

    def forward(self, x, y):
        return self.mlp(x, y)


class Sizes(nn.Module):
    """Parameters of the given sizes, in that order (names '0', '1', ...), float64, seeded."""

    def __init__(self, numels):
        super().__init__()
        gen = torch.Generator().manual_seed(len(numels))
        self.p = nn.ParameterList([nn.Parameter(torch.randn(k, generator=gen, dtype=torch.float64))
                                   for k in numels])


def _model(name):
    if isinstance(name, (list, tuple)):
        return Sizes(name)
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


def _passed(model):
    """Every parameter as the model registers it: TinyGPT's tied weight comes twice (as ``embed`` and
    as ``head``), which the contract says counts once."""
    return [p for _, p in model.named_parameters(remove_duplicate=False)]


def _names(model):
    return {id(p): k for k, p in model.named_parameters()}


def _numels(name):
    return {k: p.numel() for k, p in _model(name).named_parameters()}


def _trainable_names(name):
    return sorted(k for k, p in _model(name).named_parameters() if p.requires_grad)


def _calls(calls):
    return [{k: c[k] for k in ("op", "peer", "bytes", "group")} for c in calls]


# -- trusted references: the best partition, by search ----------------------------------------------
def best_max_load(numels, n):
    """OPT: the smallest largest load over every assignment of whole items of ``numels`` elements to
    ``n`` ranks. Exact branch and bound: start from a greedy assignment's largest load and look for a
    strictly smaller one; items largest first, cut at the best found so far, each state (items placed,
    loads as a multiset) explored once; stop at the lower bound max(largest item, ceil(total / n))."""
    items = sorted(numels, reverse=True)
    lower = max(items[0], -(-sum(items) // n))
    greedy = [0] * n
    for k in items:
        greedy[greedy.index(min(greedy))] += k
    best = [max(greedy)]
    seen = set()

    def search(i, loads):
        if best[0] == lower or (i, loads) in seen:
            return
        seen.add((i, loads))
        if i == len(items):
            best[0] = max(loads)
            return
        for r in range(n):
            if (r == 0 or loads[r] != loads[r - 1]) and loads[r] + items[i] < best[0]:
                search(i + 1, tuple(sorted(loads[:r] + (loads[r] + items[i],) + loads[r + 1:])))

    search(0, (0,) * n)
    return best[0]


def _check_partition(what, partition, n, name):
    """Every trainable parameter owned by exactly one of the n ranks, once; frozen ones by none."""
    assert len(partition) == n, f"{what}: the partition has {len(partition)} ranks; the group has {n}"
    owned = [k for ps in partition for k in ps]
    twice = sorted({k for k in owned if owned.count(k) > 1})
    assert not twice, (f"{what}: {twice[:4]} owned more than once (by two ranks, or twice by one): each "
                       f"parameter, tied ones included, is owned whole by exactly one rank")
    trainable = _trainable_names(name)
    frozen = sorted(set(owned) - set(trainable))
    assert not frozen, (f"{what}: frozen (or unknown) parameters owned: {frozen[:4]}; a parameter that is "
                        f"not trained needs no optimizer state, so nobody owns it")
    missing = sorted(set(trainable) - set(owned))
    assert not missing, f"{what}: trainable parameters nobody owns: {missing[:4]}"


def _check_balance(what, partition, n, name):
    numels = _numels(name)
    loads = [sum(numels[k] for k in ps) for ps in partition]
    opt = best_max_load([numels[k] for k in _trainable_names(name)], n)
    assert 3 * max(loads) <= 4 * opt, (
        f"{what}: the ranks own {loads} elements; the most loaded, {max(loads)}, is more than 4/3 of "
        f"{opt}, the most loaded rank's elements under the best whole-parameter partition over {n} ranks "
        f"(found by search): this rule has no balance guarantee")


# -- probes: run the submission on its ranks, observe, return plain data ------------------------------
def _probe_state(name):
    import torch.distributed as dist
    ex = exercise_module("ex03_zero1")
    rank = dist.get_rank()
    model = _model(name)
    names = _names(model)
    x, y = _batch(name, model, 0, rank)
    hold = []                                  # keeps the census's storages alive: no address reuse
    before = live_storages(hold)               # the model and the batch
    opt = ex.ParamZero1(_passed(model), torch.optim.AdamW, lr=LR)
    partition = [[names[id(p)] for p in ps] for ps in opt.partition]
    local = [] if opt.local is None else [names.get(id(p), "?") for g in opt.local.param_groups for p in g["params"]]
    model(x, y).backward()
    opt.step()
    opt.zero_grad()
    owned = sum(p.numel() for p in opt.partition[rank]) * 8
    kept = new_bytes(before, settle_to=2 * owned + 4096)
    state = {} if opt.local is None else opt.local.state
    moments = sum(t.numel() for s in state.values() for t in s.values() if torch.is_tensor(t) and t.dim())
    return {"partition": partition, "local": local, "state": [names.get(id(p), "?") for p in state],
            "moments": moments, "kept_bytes": kept}


def _probe_partitions(cases, step):
    """On 4 ranks, for each (model name or sizes, n): ParamZero1 on the group GROUPS[n], on its ranks
    only; with ``step``, one step of a loss every parameter of the model has a gradient for. Returns,
    per case, None on ranks outside the group, else the partition (names), the optimizer state
    elements this rank holds, and largest_share of the sizes (sizes cases only)."""
    import torch.distributed as dist
    ex = exercise_module("ex03_zero1")
    rank = dist.get_rank()
    groups = {n: (dist.new_group(ranks) if n < dist.get_world_size() else None) for n, ranks in GROUPS.items()}
    out = []
    for name, n in cases:
        if rank not in GROUPS[n]:
            out.append(None)
            continue
        model = _model(name)
        names = _names(model)
        opt = ex.ParamZero1(_passed(model), torch.optim.AdamW, lr=LR, group=groups[n])
        got = {"partition": [[names[id(p)] for p in ps] for ps in opt.partition]}
        if step:
            sum((p * p).sum() for p in _trainable(model)).backward()
            opt.step()
            opt.zero_grad()
            state = {} if opt.local is None else opt.local.state
            got["moments"] = sum(t.numel() for s in state.values() for t in s.values()
                                 if torch.is_tensor(t) and t.dim())
            got["share"] = float(ex.largest_share(list(name), n))
        out.append(got)
    return out


def _probe_shares(cases):
    ex = exercise_module("ex03_zero1")
    return [float(ex.largest_share(list(numels), n)) for numels, n in cases]


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
def test_partition_and_state(student, name):
    """ownership and memory: every trainable parameter owned whole by one rank, the same on every rank;
    optimizer state for owned parameters only, and nothing else left behind by a step"""
    numels = _numels(name)
    got = student.on_ranks(N, _probe_state, name)
    for rank, g in enumerate(got):
        _check_partition(f"{name}: rank {rank}'s partition", g["partition"], N, name)
        assert [sorted(ps) for ps in g["partition"]] == [sorted(ps) for ps in got[0]["partition"]], (
            f"{name}: rank {rank}'s partition differs from rank 0's: every rank must agree on who owns "
            f"what, or the reduces and broadcasts do not match")
    for rank, g in enumerate(got):
        own = sorted(g["partition"][rank])
        assert sorted(g["local"]) == own, (
            f"{name}: rank {rank}: its local optimizer is over {sorted(g['local'])[:6]}...; it must be over "
            f"the parameters this rank owns only: {own}")
        extra = sorted(set(g["state"]) - set(own))
        assert not extra, (f"{name}: rank {rank}: the local optimizer holds state for parameters it does not "
                           f"own: {extra[:4]}")
        owned = sum(numels[k] for k in own)
        assert g["moments"] == 2 * owned, (
            f"{name}: rank {rank}: {g['moments']} elements of Adam state for the {owned} elements it owns: "
            f"expected two moments per owned element")
        bound = 2 * owned * 8 + 64 * len(own) + 4096     # Adam's two moments, a step counter each, slack
        assert g["kept_bytes"] <= bound, (
            f"{name}: rank {rank}: after step() and zero_grad(), {g['kept_bytes']} bytes of tensors are alive "
            f"that were not before the optimizer existed; its state for the {owned} elements it owns is "
            f"{2 * owned * 8} bytes (at most {bound} with counters): something of the size of the gradients "
            f"or of other ranks' parameters is kept (a buffer, the gradients themselves)")


@pytest.mark.points(3)
def test_balance_within_four_thirds_of_the_best(student):
    """balance: on 2, 3 and 4 ranks (subgroups), the most loaded rank owns at most 4/3 of what the best
    whole-parameter partition's does, on TinyGPT, ToyMLP and awkward sizes and orders (and a rank
    that owns nothing)"""
    cases = [("gpt", 2), ("gpt", 3), ("gpt", 4), ("mlp", 3), ("spare", 2), ([12, 40], 3)] + AWKWARD
    got = student.on_ranks(4, _probe_partitions, cases, False)
    for i, (name, n) in enumerate(cases):
        label = f"sizes {name}" if isinstance(name, list) else name
        ranks = GROUPS[n]
        first = got[ranks[0]][i]["partition"]
        for r in ranks:
            part = got[r][i]["partition"]
            what = f"{label} on {n} ranks (global ranks {ranks}), rank {r}'s partition"
            _check_partition(what, part, n, name)
            assert [sorted(ps) for ps in part] == [sorted(ps) for ps in first], (
                f"{label} on {n} ranks: rank {r}'s partition differs from rank {ranks[0]}'s: every rank "
                f"of the group must agree on who owns what")
        _check_balance(f"{label} on {n} ranks", first, n, name)


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
        _check_partition(f"rank {rank}'s partition", g["partition"], N, "gpt")
        _check_bytes(rank, g["calls"], g["partition"], numels, list(range(N)))


@pytest.mark.points(3)
def test_on_a_subgroup(student):
    """group=: 3 of 4 ranks share the optimizer (global ranks 1-3) while rank 0 trains alone"""
    got = student.on_ranks(4, _probe_training, "gpt", 2, SUBGROUP)
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
        what = f"rank {rank}: the partition over the group {SUBGROUP}"
        _check_partition(what, g["partition"], len(SUBGROUP), "gpt")
        _check_balance(what, g["partition"], len(SUBGROUP), "gpt")
        wrong = [(c["op"], c["group"]) for c in g["calls"] if c["group"] != tuple(SUBGROUP)]
        assert not wrong, (f"rank {rank}: collectives outside the group {SUBGROUP}: {wrong[:4]} (a collective "
                           f"without group= runs on every rank, and rank 0 is busy with its own)")
        _check_params(g["params"], want, f"rank {rank} of the group {SUBGROUP}, after 2 steps")
        _check_bytes(rank, g["calls"], g["partition"], numels, SUBGROUP)


@pytest.mark.points(2)
def test_largest_share_is_your_partitions(student):
    """03.2: the share largest_share gives equals the share measured on your ParamZero1's ranks (its
    optimizer state, counted), and stays within the balance guarantee where no probe can run it"""
    cases = [(numels, n) for numels, n in SHARES + AWKWARD]
    got = student.on_ranks(4, _probe_partitions, cases, True)
    for i, (numels, n) in enumerate(cases):
        rows = [got[r][i] for r in GROUPS[n]]
        moments = [row["moments"] for row in rows]
        assert sum(moments) == 2 * sum(numels), (
            f"sizes {numels} on {n} ranks: the ranks hold {moments} elements of Adam state, "
            f"{sum(moments)} in all; two moments per trained element make {2 * sum(numels)}")
        measured = max(moments) / sum(moments)
        for r, row in zip(GROUPS[n], rows):
            assert row["share"] == pytest.approx(measured, rel=1e-12, abs=1e-15), (
                f"largest_share({numels}, {n}) = {row['share']} (on global rank {r}); your ParamZero1 on "
                f"parameters of these sizes leaves the most loaded rank {max(moments)} of the {sum(moments)} "
                f"optimizer state elements (measured, per rank: {moments}): {measured}")
    gpt = [p.numel() for p in _trainable(_model("gpt"))]
    shares = student.on_ranks(N, _probe_shares, [(gpt, n) for n in BIG_N])[0]
    for n, share in zip(BIG_N, shares):
        opt = best_max_load(gpt, n)
        assert opt <= share * sum(gpt) * (1 + 1e-12) and 3 * share * sum(gpt) <= 4 * opt * (1 + 1e-12), (
            f"largest_share(TinyGPT, {n}) = {share}: the best whole-parameter partition over {n} ranks "
            f"leaves the most loaded rank {opt / sum(gpt):.4f} of the state, and 03.1's guarantee is at most "
            f"4/3 of that, {4 * opt / 3 / sum(gpt):.4f}")

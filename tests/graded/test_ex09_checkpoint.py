"""Graded: exercise 09, owned ranges and assembling parameters from pieces. Checked against a
brute-force element-by-element map of the padded flat layout (written here), against the shards
zerolab's real stage-2 engine holds on 3 ranks, and by resharding 4 ranks' pieces into 3 ranks'."""
import random

import pytest
import torch

from zerolab.grade.helpers import exercise_module

# The reference implementation of this exercise: a submission that uses it scores 0
# (checked before and while the tests run, by zerolab.grade.references).
REFERENCE_MODULES = ["zerolab.checkpoint"]

LAYOUTS = [[5], [3, 4], [7, 1, 9, 2], [1, 1, 1], [10, 10, 10, 10], [13, 37, 5, 1]]


def brute_force(numels, world_size, rank):
    """Every element's (parameter, element) position, run-length grouped: the ranges rank owns."""
    flat = [(i, e) for i, n in enumerate(numels) for e in range(n)]
    shard = -(-len(flat) // world_size)
    out = []
    for pos in range(rank * shard, (rank + 1) * shard):
        if pos >= len(flat):
            break                                               # padding
        i, e = flat[pos]
        if out and out[-1][0] == i and out[-1][2] == e:
            out[-1][2] += 1                                     # extends the current run
        else:
            out.append([i, e, e + 1, pos - rank * shard])
    return [tuple(r) for r in out]


@pytest.mark.points(3)
def test_owned_ranges_by_brute_force():
    ex = exercise_module("ex09_checkpoint")
    for numels in LAYOUTS:
        for n in range(1, 8):
            for r in range(n):
                got = [tuple(x) for x in ex.owned_ranges(numels, n, r)]
                want = brute_force(numels, n, r)
                assert got == want, f"owned_ranges({numels}, world_size={n}, rank={r}): got {got}, expected {want}"
    for bad in [(0, 0), (2, 2), (2, -1)]:
        with pytest.raises(ValueError):
            ex.owned_ranges([4], *bad)


def shards_match_engine():
    """On each rank: a real stage-2 engine (fp64, 3 ranks: the padding is real) after one step; every
    range the exercise says this rank owns must hold exactly those parameter values in its master
    shard, and the elements no range covers must be padding (zero)."""
    import torch.distributed as dist

    import zerolab
    from zerolab import models
    ex = exercise_module("ex09_checkpoint")
    rank, n = dist.get_rank(), dist.get_world_size()
    model = models.build("gpt", seed=0, dtype=torch.float64)
    engine = zerolab.initialize(model, stage=2, lr=1e-2, bucket_bytes=200_000)    # several buckets
    engine.backward(engine(*models.batch("gpt", seed=rank, batch_size=2, model=model)))
    engine.step()
    checked = 0
    for flat, shard_optim, i in engine.shards():
        master = shard_optim.master[i]
        ranges = ex.owned_ranges([p.numel() for p in flat.params], n, rank)
        covered = torch.zeros(master.numel(), dtype=torch.bool)
        for index, lo, hi, off in ranges:
            want = flat.params[index].detach().reshape(-1)[lo:hi]
            got = master[off:off + hi - lo]
            assert torch.equal(got, want), (f"rank {rank}: ranges {(index, lo, hi, off)} do not hold parameter "
                                            f"{index}'s elements [{lo}, {hi}) in the master shard")
            covered[off:off + hi - lo] = True
            checked += hi - lo
        assert not bool(master[~covered].any()), f"rank {rank}: shard elements outside every range are not padding"
    return checked


@pytest.mark.points(2)
def test_owned_ranges_match_a_real_engines_shards(on_ranks):
    counts = on_ranks(3, shards_match_engine)
    from zerolab import models
    psi = sum(p.numel() for p in dict.fromkeys(models.build("gpt", seed=0).parameters()))
    assert sum(counts) == psi, f"the ranks' ranges cover {sum(counts)} elements, the model has {psi}"


@pytest.mark.points(2)
def test_assemble_puts_pieces_together_and_refuses_gaps_and_overlaps():
    ex = exercise_module("ex09_checkpoint")
    rng = random.Random(0)
    full = torch.arange(50, dtype=torch.float64) * 0.5
    cuts = sorted(rng.sample(range(1, 50), 7))
    pieces = [(lo, hi, full[lo:hi].clone()) for lo, hi in zip([0] + cuts, cuts + [50])]
    rng.shuffle(pieces)
    got = ex.assemble(50, pieces)
    assert torch.equal(got, full), "assemble: the pieces, put back, do not give the parameter"
    with pytest.raises(ValueError):
        ex.assemble(50, pieces[1:])                             # a gap: a missing file's part
    with pytest.raises(ValueError):
        ex.assemble(50, pieces + [(3, 5, full[3:5].clone())])   # an overlap: two saves mixed
    with pytest.raises(ValueError):
        ex.assemble(50, [(0, 50, full[:49])])                   # a truncated piece
    with pytest.raises(ValueError):      # overlap [25, 30) and gap [40, 45): sizes still add up to 50
        ex.assemble(50, [(0, 30, full[:30]), (25, 40, full[25:40]), (45, 50, full[45:])])


@pytest.mark.points(2)
def test_pieces_of_4_ranks_reshard_into_3_ranks():
    ex = exercise_module("ex09_checkpoint")
    torch.manual_seed(0)
    params = [torch.randn(n, dtype=torch.float64) for n in (13, 37, 5, 1)]
    numels = [p.numel() for p in params]
    pieces = {i: [] for i in range(len(params))}
    for r in range(4):                                           # "save" on 4 ranks
        for i, lo, hi, _ in ex.owned_ranges(numels, 4, r):
            pieces[i].append((lo, hi, params[i][lo:hi].clone()))
    rebuilt = [ex.assemble(n, pieces[i]) for i, n in enumerate(numels)]
    flat = torch.cat(params)
    shard = -(-flat.numel() // 3)
    padded = torch.cat([flat, flat.new_zeros(3 * shard - flat.numel())])
    for r in range(3):                                           # "load" on 3 ranks
        mine = torch.zeros(shard, dtype=torch.float64)
        for i, lo, hi, off in ex.owned_ranges(numels, 3, r):
            mine[off:off + hi - lo] = rebuilt[i][lo:hi]
        assert torch.equal(mine, padded[r * shard:(r + 1) * shard]), f"rank {r} of 3: wrong shard after resharding"

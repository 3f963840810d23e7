"""Graded: exercise 05, ZeRO-3's schedule. Each all-gather is traced to the unit it fills; hooks the
grader registers after the exercise's observe, at every block's forward and backward and at every
gradient, which units are gathered. Checked: the gather order in forward and in backward, that the
next block's all-gather is started asynchronously before a block computes (prefetch), that a block
is freed right after its forward, that no more than two blocks are ever gathered, that every unit's
gradients are reduce-scattered from inside backward; and the values (gradient shards equal the mean
of every rank's gradients, recomputed in this process in float64), with gradient accumulation and
on a model whose blocks return a tuple and a dict."""
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils._pytree as pytree

from zerolab import comm, models
from zerolab.grade.helpers import assert_close, exercise_module, record_collectives

# The reference implementation of this exercise: a submission that uses it scores 0
# (checked before and while the tests run, by zerolab.grade.references).
REFERENCE_MODULES = ["zerolab.zero3", "zerolab.stages", "zerolab.initialize", "zerolab.offload"]
REFERENCE_ALLOWED = [  # the four primitives lesson 05 shows, offered by the exercise
    "zerolab.zero3.gather", "zerolab.zero3.free", "zerolab.zero3.reduce_scatter_grads",
    "zerolab.zero3.register_pre_backward",
]

N = 3                           # padding is real: no unit's size divides by 3
GPT = dict(vocab_size=64, d_model=32, n_layers=4, n_heads=2, seq_len=16)


class Gate(nn.Module):
    """A block returning a tuple (or a dict): what real models' layers do (hidden states and more)."""

    def __init__(self, d, as_dict):
        super().__init__()
        self.lin, self.gate, self.as_dict = nn.Linear(d, d), nn.Linear(d, d), as_dict

    def forward(self, x):
        h, g = torch.tanh(self.lin(x)), torch.sigmoid(self.gate(x))
        return {"hidden": h, "gate": g} if self.as_dict else (h, g)


class GatedNet(nn.Module):
    def __init__(self, d=10, n_blocks=3):
        super().__init__()
        self.inp, self.out = nn.Linear(5, d), nn.Linear(d, 1)
        self.blocks = nn.ModuleList(Gate(d, as_dict=i % 2 == 1) for i in range(n_blocks))

    def forward(self, x, y):
        h = self.inp(x)
        for block in self.blocks:
            out = block(h)
            hidden, gate = (out["hidden"], out["gate"]) if isinstance(out, dict) else out
            h = hidden * gate + h
        return ((self.out(h).squeeze(-1) - y) ** 2).mean()


def _model(name):
    if name == "gpt":
        return models.build("gpt", seed=0, dtype=torch.float64, **GPT)
    torch.manual_seed(0)
    return GatedNet().double()


def _batch(name, model, rank, micro=0):
    if name == "gpt":
        return models.batch("gpt", seed=100 * micro + rank, batch_size=3, model=model)
    g = torch.Generator().manual_seed(100 * micro + rank)
    return torch.randn(4, 5, generator=g, dtype=torch.float64), torch.randn(4, generator=g, dtype=torch.float64)


def check_values(name):
    ex = exercise_module("ex05_zero3")
    rank, n = dist.get_rank(), dist.get_world_size()
    model = _model(name)
    names = {id(p): k for k, p in model.named_parameters()}
    sched = ex.Zero3Schedule(model)
    ref = _model(name)
    for micro in range(2):                                # two backward passes before a step
        model(*_batch(name, model, rank, micro)).backward()
        sched.finish()
        for r in range(n):
            (ref(*_batch(name, ref, r, micro)) / n).backward()
    grads = {k: p.grad for k, p in ref.named_parameters()}
    for u, shard in zip(sched.units, sched.grad_shards):
        expected = u.flat.shard_from([grads[names[id(p)]] for p in u.flat.params])
        assert_close(shard, expected, f"{name}: gradient shard of unit {u.name} after two backward passes",
                     rtol=1e-10, atol=1e-13)
    live = [u.name for u in sched.units if u.full.untyped_storage().nbytes()]
    assert not live, f"rank {rank}: after finish() these units are still gathered: {live}"
    kept = [k for k, p in model.named_parameters() if p.grad is not None]
    assert not kept, f"rank {rank}: after finish() these parameters still hold a .grad: {kept[:4]}"


def _trace(name, prefetch=True):
    """One forward + backward + finish with every gather traced: the list of events."""
    ex = exercise_module("ex05_zero3")
    model = _model(name)
    sched = ex.Zero3Schedule(model, prefetch=prefetch)
    units = sched.units
    blocks = [u for u in units if u.module is not None]
    owner = {u.full.untyped_storage()._cdata: u.name for u in units}
    events, real = [], comm._all_gather_flat
    phase = ["forward"]

    def alive():
        return sorted(u.name for u in blocks if u.full.untyped_storage().nbytes())

    def spy(output, input, *args, async_op=False, **kwargs):
        events.append(("gather", owner.get(output.untyped_storage()._cdata, "?"), phase[0], async_op))
        return real(output, input, *args, async_op=async_op, **kwargs)

    def before(i):
        return lambda m, a: events.append(("start", blocks[i].name, "forward", alive()))

    def after(i):
        def hook(m, a, out):
            events.append(("end", blocks[i].name, "forward", alive()))
            leaf = next(t for t in pytree.tree_leaves(out) if torch.is_tensor(t) and t.requires_grad)
            leaf.register_hook(lambda g: events.append(("start", blocks[i].name, "backward", alive())))
        return hook

    for i, u in enumerate(blocks):                        # after the exercise's: they see its effect
        u.module.register_forward_pre_hook(before(i))
        u.module.register_forward_hook(after(i))
    for u in units:
        for p in u.flat.params:
            p.register_post_accumulate_grad_hook(lambda p, u=u: events.append(("grad", u.name, "backward", alive())))
    comm._all_gather_flat = spy
    try:
        with record_collectives() as calls:
            loss = model(*_batch(name, model, dist.get_rank()))
            phase[0] = "backward"
            loss.backward()
            phase[0] = "finish"
            sched.finish()
    finally:
        comm._all_gather_flat = real
    return events, calls, [u.name for u in units], [u.name for u in blocks]


def check_order_and_prefetch(name):
    rank = dist.get_rank()
    events, _, units, blocks = _trace(name)
    root = [u for u in units if u not in blocks]
    fwd = [e[1] for e in events if e[0] == "gather" and e[2] == "forward"]
    bwd = [e[1] for e in events if e[0] == "gather" and e[2] == "backward"]
    assert fwd == root + blocks, (f"rank {rank}: all-gathers in forward: {fwd}; expected the root, then each "
                                  f"block once, in forward order: {root + blocks}")
    assert bwd == blocks[::-1], (f"rank {rank}: all-gathers in backward: {bwd}; expected each block once more, "
                                 f"in reverse order (the root stays gathered): {blocks[::-1]}")
    for phase, order in (("forward", blocks), ("backward", blocks[::-1])):
        for i, b in enumerate(order[:-1]):
            nxt = order[i + 1]
            k = events.index(("start", b, phase, next(e[3] for e in events if e[:3] == ("start", b, phase))))
            started = [e for e in events[:k] if e[0] == "gather" and e[1] == nxt and e[2] == phase]
            assert started, (f"rank {rank}: when {b}'s {phase} started, the all-gather of {nxt} (next in "
                             f"{phase}) had not been started: prefetch it as {b} starts, so it runs while "
                             f"{b} computes")
            assert started[-1][3], (f"rank {rank}: {nxt}'s all-gather in {phase} was blocking: a prefetch must "
                                    f"be asynchronous (async_op=True), waited for when {nxt} starts")


def check_memory(name):
    rank = dist.get_rank()
    events, calls, units, blocks = _trace(name)
    for e in events:
        if e[0] in ("start", "end", "grad") and len(e[3]) > 2:
            raise AssertionError(f"rank {rank}: at the {e[0]} of {e[1]}'s {e[2]}, {len(e[3])} blocks were "
                                 f"gathered ({e[3]}); the schedule keeps at most two (the one computing and "
                                 f"the one prefetched)")
        if e[0] == "end" and e[1] in e[3]:
            raise AssertionError(f"rank {rank}: right after {e[1]}'s forward it is still gathered: free each "
                                 f"block as soon as its forward is done")
    rs = [c for c in calls if c["op"] == "reduce_scatter"]
    assert len(rs) == len(units) and all(c["in_backward"] for c in rs), (
        f"rank {rank}: {len(rs)} reduce-scatters, {sum(c['in_backward'] for c in rs)} of them from inside "
        f"backward; expected one per unit ({len(units)}), each started as soon as the unit's gradients "
        f"are complete")


def engine_bytes():
    """zerolab's own stage-3 and data-parallel engines, one step each: ring bytes per rank (comm log)."""
    import zerolab
    out = {}
    for stage in (0, 3):
        model = models.build("gpt", seed=0)
        engine = zerolab.initialize(model, stage=stage, lr=1e-3)
        for step in range(2):
            engine.backward(engine(*models.batch("gpt", seed=10 * step + dist.get_rank(), model=model)))
            engine.step()
        out[stage] = engine.last_step_comm.ideal_bytes
    return out[3] / out[0]


@pytest.mark.points(2)
def test_traffic_ratio_derived(on_ranks):
    """derived: stage 3's bytes per step over data parallelism's, by hand and measured"""
    ex = exercise_module("ex05_zero3")
    for blocks, root, want in [([10, 10], 0, 1.5), ([], 10, 1.0), ([30], 10, 110 / 80), ([4, 4, 4], 12, 60 / 48)]:
        got = ex.traffic_ratio(blocks, root)
        assert got == pytest.approx(want, rel=1e-12), f"traffic_ratio({blocks}, root={root}) = {got}; by hand {want}"
    model = models.build("gpt", seed=0)
    blocks = [sum(p.numel() for p in b.parameters()) for b in model.blocks]
    root = sum(p.numel() for p in dict.fromkeys(model.parameters())) - sum(blocks)
    got = ex.traffic_ratio(blocks, root)
    measured = on_ranks(N, engine_bytes)[0]
    assert got == pytest.approx(measured, rel=5e-3), (
        f"TinyGPT (root {root}, blocks {blocks}): traffic_ratio = {got:.4f}; zerolab's engines on {N} ranks "
        f"send {measured:.4f} times data parallelism's bytes (comm log, padding included)")


@pytest.mark.points(3)
@pytest.mark.parametrize("name", ["gpt", "gated"])
def test_gradient_shards_with_accumulation(on_ranks, name):
    """values: gradient shards over two backward passes; blocks returning a tuple or a dict"""
    on_ranks(N, check_values, name)


@pytest.mark.points(3)
def test_gather_order_and_prefetch(on_ranks):
    """schedule: gather order in forward and backward; the next block prefetched, asynchronously"""
    on_ranks(N, check_order_and_prefetch, "gpt")


@pytest.mark.points(3)
def test_at_most_two_blocks_gathered(on_ranks):
    """memory: blocks freed after forward, never more than two gathered; reduce-scatter in backward"""
    on_ranks(N, check_memory, "gpt")

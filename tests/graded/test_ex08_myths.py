"""Graded: exercise 08, the measurements that refute three myths. Each runs on real ranks against
zerolab's real engines or reference communication, and is checked against what must come out
(ZeRO, arXiv 1910.02054): N copies of every state under data parallelism and one under ZeRO-3; a
master rank sending N-1 times the others' bytes (counted send by send, and on the sockets); a
ring all_reduce sending 2(N-1)/N x S on every rank; under ZeRO-3, every rank doing the whole
model's forward FLOPs for its own rows (closed forms from the layer shapes)."""
import hashlib

import pytest
import torch
import torch.distributed as dist

from zerolab import comm
from zerolab.grade.helpers import assert_close, exercise_module, point_to_point_only

# The reference implementation of this exercise: none in zerolab (solutions/ is refused for
# every exercise, by zerolab.grade.references).
REFERENCE_MODULES = []


# -- 08.1: count_copies ----------------------------------------------------------------------
@pytest.mark.points(1)
def test_count_copies_by_hand():
    ex = exercise_module("ex08_myths")
    same = [(8, "a"), (4, "b")]
    cases = [
        ([same, same, same], 3.0, "3 ranks holding the same two tensors"),
        ([[(8, "a")], [(8, "b")], [(8, "c")], [(8, "d")]], 1.0, "4 ranks, 4 different shards"),
        ([[(8, "a"), (4, "p")], [(8, "a"), (4, "q")]], 24 / 16, "a shared 8-byte tensor + a 4-byte one "
         "of each rank's own: 24 bytes held, 16 distinct (by bytes, not by tensors: 4/3 would be wrong)"),
        ([[(8, "a")], []], 1.0, "one rank holds nothing"),
    ]
    for per_rank, want, what in cases:
        got = ex.count_copies(per_rank)
        assert got == pytest.approx(want, rel=1e-12), f"count_copies({per_rank}) = {got!r}, expected {want} ({what})"


def engine_fingerprints(stage):
    """On each rank, after one training step of zerolab's engine for ``stage``: {kind: [(nbytes,
    sha1 of the contents)]} of the state tensors this rank holds. The grader's own fingerprinting:
    freed (0-byte) buffers, Adam's 0-dim step counters and second views of a storage are skipped."""
    import zerolab
    from zerolab import models
    model = models.build("gpt", seed=0)                       # Ψ = 118,528 fp32: no padding at N = 2, 4
    engine = zerolab.initialize(model, stage=stage, lr=1e-3)
    x, y = models.batch("gpt", seed=dist.get_rank(), batch_size=2, model=model)
    engine.backward(engine(x, y))
    engine.step()                                             # params, grads, Adam state all exist
    out, seen = {}, set()
    for kind, tensors in engine.state_tensors().items():
        for t in tensors:
            if t is None or t.dim() == 0 or t.untyped_storage().nbytes() == 0:
                continue
            if t.untyped_storage().data_ptr() in seen:
                continue
            seen.add(t.untyped_storage().data_ptr())
            raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
            out.setdefault(kind, []).append((raw.numel(), hashlib.sha1(raw.numpy().tobytes()).hexdigest()))
    return out


@pytest.mark.points(1)
@pytest.mark.parametrize("world_size", [2, 4])
def test_count_copies_real_engines(on_ranks, world_size):
    ex = exercise_module("ex08_myths")
    ex.count_copies([[(4, "x")]])               # a stub fails here, before any rank starts
    n = world_size
    # ZeRO Sec. 5: data parallelism replicates every model state N times; stage 1 partitions the
    # optimizer states (parameters still replicated); stage 3 partitions everything.
    expected = {0: {"params": n, "grads": n, "optimizer": n},
                1: {"params": n, "optimizer": 1},
                3: {"params": 1, "grads": 1, "optimizer": 1}}
    for stage, kinds in expected.items():
        per_rank = on_ranks(n, engine_fingerprints, stage)
        for kind, want in kinds.items():
            prints = [r.get(kind, []) for r in per_rank]
            assert all(prints), f"grader: stage {stage} has no {kind} on some rank"
            got = ex.count_copies(prints)
            assert got == pytest.approx(want, rel=1e-12), (
                f"stage {stage}, N={n}, {kind}: count_copies = {got!r}; the ranks' real tensors hold "
                f"{want} cop{'y' if want == 1 else 'ies'} ({sum(b for p in prints for b, _ in p)} bytes held)")


# -- 08.2a: master_average -------------------------------------------------------------------
def _quarters(seed, numel):
    """Multiples of 1/4 in float64: their sums and their averages over 2 or 4 ranks are exact."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-1000, 1001, (numel,), generator=g).to(torch.float64) / 4


def check_master_average(numel):
    ex = exercise_module("ex08_myths")
    rank, n = dist.get_rank(), dist.get_world_size()
    x = _quarters(800 + rank, numel)
    expected = sum(_quarters(800 + r, numel) for r in range(n)) / n      # every rank's tensor, by hand
    with comm.log() as log, point_to_point_only("master_average") as counted:
        ex.master_average(x)
    assert_close(x, expected, "master_average: the average of the ranks' tensors", rtol=0, atol=0)
    digest = hashlib.sha1(x.numpy().tobytes()).hexdigest()
    return counted["sent"], log.measured_bytes, digest


@pytest.mark.points(1)
@pytest.mark.parametrize("world_size", [2, 4])
def test_master_average(on_ranks, world_size):
    n, numel = world_size, 65536
    s = numel * 8                                              # S: the full tensor, 512 KiB of fp64
    results = on_ranks(n, check_master_average, numel)
    assert len({digest for _, _, digest in results}) == 1, "after master_average the ranks' tensors differ"
    for rank, (sent, measured, _) in enumerate(results):
        # the master sends the average to each of the N-1 others; every other rank sends S once
        want = (n - 1) * s if rank == 0 else s
        assert sent == want, (
            f"rank {rank}: master_average sent {sent} bytes; the master scheme: rank 0 sends (N-1) x S "
            f"= {(n - 1) * s}, every other rank S = {s}")
        if measured is not None:                               # the kernel's count of socket bytes
            assert abs(measured - sent) <= 0.1 * sent, f"rank {rank}: sockets carried {measured} bytes, sends {sent}"


# -- 08.2b: bytes_per_rank -------------------------------------------------------------------
def ring_average(tensor, group=None):
    """The reference: data parallelism's all_reduce, then divide (ring: 2(N-1)/N x S per rank)."""
    comm.all_reduce(tensor, group=group)
    tensor /= dist.get_world_size(group)


def uneven_shift(tensor, group=None):
    """A deliberately asymmetric exchange: rank r sends its first (r+1)/N of ``tensor`` to rank r+1."""
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    k = tensor.numel() // n
    inbox = torch.empty(((rank - 1) % n + 1) * k, dtype=tensor.dtype)
    send = comm.isend(tensor[:(rank + 1) * k].clone(), (rank + 1) % n, group=group)
    comm.irecv(inbox, (rank - 1) % n, group=group).wait()
    send.wait()


def check_bytes_per_rank(numel):
    ex = exercise_module("ex08_myths")
    out = {}
    for name, fn in (("ring_average", ring_average), ("uneven_shift", uneven_shift)):
        x = _quarters(900 + dist.get_rank(), numel)
        out[name] = [float(b) for b in ex.bytes_per_rank(fn, x, None)]
    return out


@pytest.mark.points(2)
def test_bytes_per_rank(on_ranks):
    n, numel = 4, 4096
    s = numel * 8
    expected = {"ring_average": [2 * (n - 1) / n * s] * n,            # symmetric: 1.5 x S each
                "uneven_shift": [(r + 1) * s / n for r in range(n)]}  # S/4, S/2, 3S/4, S
    for rank, got in enumerate(on_ranks(n, check_bytes_per_rank, numel)):
        for name, want in expected.items():
            assert got[name] == pytest.approx(want, rel=1e-9), (
                f"rank {rank}: bytes_per_rank({name}) returned {got[name]}; the bytes each rank sent are "
                f"{want} (anything sent to collect the numbers must not be counted)")


# -- 08.3: forward_flops ---------------------------------------------------------------------
def gpt_flops_per_row(model):
    """TinyGPT's Linear FLOPs per token, from its shapes: per block qkv 3C², proj C², fc 4C², out 4C²;
    the head V·C (tied to the embedding, still a matmul); 2 FLOPs per weight element."""
    c, layers, vocab = model.tok.embedding_dim, len(model.blocks), model.head.out_features
    return 2 * (layers * 12 * c * c + vocab * c)


def mlp_flops_per_row(model):
    """ToyMLP: inp, frozen, mid TWICE (the same module called twice), out."""
    d_in, h, d_out = model.inp.in_features, model.mid.in_features, model.out.out_features
    return 2 * (d_in * h + h * h + 2 * h * h + h * d_out)


@pytest.mark.points(1)
def test_forward_flops_one_process():
    from zerolab import models
    ex = exercise_module("ex08_myths")
    mlp = models.build("mlp", seed=0)
    x, _ = models.batch("mlp", seed=1, batch_size=6)
    for attempt in (1, 2):                                     # twice: a second call must not see the first's hooks
        got = ex.forward_flops(mlp, lambda: mlp(x))
        want = 6 * mlp_flops_per_row(mlp)
        assert got == want, (f"forward_flops(ToyMLP, 6 rows), call {attempt}: {got}; expected {want} "
                             f"(mid is called twice and counts twice)")
        left = [n for n, m in mlp.named_modules() if m._forward_hooks]
        assert not left, f"forward_flops left forward hooks on {left}: remove them before returning"
    gpt = models.build("gpt", seed=0, d_model=32, n_layers=3)
    idx, y = models.batch("gpt", seed=1, batch_size=3, model=gpt)
    got, want = ex.forward_flops(gpt, lambda: gpt(idx, y)), 3 * gpt.seq_len * gpt_flops_per_row(gpt)
    assert got == want, f"forward_flops(TinyGPT, 3 x {gpt.seq_len} rows) = {got}; expected {want}"
    # A layer holding only part of its weight (as a tensor-parallel rank would) must count only that
    # part: the FLOPs come from the tensors at the call, not from the module's declared sizes.
    half = torch.nn.Linear(8, 6)
    half.weight = torch.nn.Parameter(torch.randn(3, 8))        # out_features still says 6
    half.bias = torch.nn.Parameter(torch.randn(3))
    got = ex.forward_flops(half, lambda: half(torch.randn(5, 8)))
    assert got == 2 * 5 * 8 * 3, (f"forward_flops on a Linear computing with a (3, 8) weight, 5 rows: {got}; "
                                  f"expected 2 x 5 x 8 x 3 = 240 (count the weight that is used, not out_features)")


def check_zero3_flops():
    """Stage 3 on each rank, each rank with a batch of its own size: the FLOPs the student counts,
    the whole model's closed form for this rank's rows, and how much of Ψ the rank stores."""
    import zerolab
    from zerolab import models
    ex = exercise_module("ex08_myths")
    rank, out = dist.get_rank(), {}
    for name, per_row in (("gpt", gpt_flops_per_row), ("mlp", mlp_flops_per_row)):
        model = models.build(name, seed=0)
        engine = zerolab.initialize(model, stage=3, lr=1e-3)
        x, y = models.batch(name, seed=rank, batch_size=2 + rank, model=model)
        rows = x.shape[0] * (x.shape[1] if name == "gpt" else 1)
        hooks = {n: len(m._forward_hooks) for n, m in model.named_modules()}
        got = ex.forward_flops(model, lambda: engine(x, y))
        left = [n for n, m in model.named_modules() if len(m._forward_hooks) != hooks[n]]
        stored = sum(u.shard.numel() for u in engine.units)
        psi = sum(p.numel() for p in dict.fromkeys(model.parameters()) if p.requires_grad)
        out[name] = (got, rows * per_row(model), rows, stored, psi, left)
    return out


@pytest.mark.points(2)
def test_forward_flops_zero3_is_data_parallel(on_ranks):
    ex = exercise_module("ex08_myths")
    ex.forward_flops(torch.nn.Linear(2, 2), lambda: None)      # a stub fails here, before any rank starts
    n = 2
    for rank, res in enumerate(on_ranks(n, check_zero3_flops)):
        for name, (got, want, rows, stored, psi, left) in res.items():
            assert not left, f"rank {rank}, {name}: forward_flops left hooks on {left}"
            assert got == want, (
                f"rank {rank}, {name} under ZeRO-3: forward_flops = {got}; the whole model on this rank's "
                f"{rows} rows is {want} (tensor parallelism would be {want // n}), while the rank stores "
                f"{stored} of {psi} parameters")

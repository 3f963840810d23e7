"""Graded: exercise 12, block quantization packed for the wire, and the gradient path of a mesh with
three kinds of links.

The submission runs only inside probes; every verdict is decided here, on the plain data they
return, against references computed here: the block quantizer in float32 (written out below from
lesson 12's definition), and the per-token mean of every rank's gradient in float64. A payload is
made in one process and decoded in others (the payload must carry everything). The mesh runs on 8
ranks in several shapes; the bytes each kind of link carries are counted from the collectives the
submission makes (op, group, bytes of its largest buffer, recorded through taps installed before it
is imported), with the ring algorithms' per-rank volumes, as lesson 12 counts them."""
import math

import pytest
import torch

from zerolab.grade.helpers import assert_close, exercise_module, record_collectives

# What this exercise must not use (checked before and while the tests run, zerolab.grade.references).
REFERENCE_MODULES = ["zerolab.quantize", "zerolab.hybrid", "zerolab.mesh"]


def _close(actual, expected, what, *, rtol, atol):
    """assert_close, decided here (its rank prefix would name this process, not the rank checked:
    ``what`` names the rank)."""
    try:
        assert_close(actual, expected, what, rtol=rtol, atol=atol)
    except AssertionError as exc:
        raise AssertionError(str(exc).removeprefix("rank 0: ")) from None


# -- 12.1 ----------------------------------------------------------------------------------------
def _tensor(numel, seed):
    """Magnitudes over four decades: one scale for everything would be visibly worse."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(numel, generator=g, dtype=torch.float64) * torch.logspace(-3, 1, numel, dtype=torch.float64)


def _zeros_then_a_value():
    x = torch.zeros(300)
    x[250] = 2.5
    return x


def _halves_int8():
    # block 0: max 127, scale 1: x / s is exactly k + 0.5; block 1: max 254, scale 2
    return torch.tensor([127.0, 0.5, 1.5, 2.5, -3.5, -0.5, 126.5, 64.5,
                         254.0, 1.0, 3.0, 5.0, -7.0, 9.0, -0.0, 11.0])


def _halves_int4():
    return torch.tensor([7.0, 0.5, 1.5, 2.5, -3.5, -6.5, 4.5, 5.5, -14.0, 1.0, -3.0, 5.0, 13.0])


GENERAL = [("decades, block 1", lambda: _tensor(1000, 0), 1, 8),
           ("decades, block 5", lambda: _tensor(1000, 0), 5, 8),
           ("decades, block 64", lambda: _tensor(1000, 0), 64, 8),
           ("decades, block 256", lambda: _tensor(1000, 0), 256, 8),
           ("decades, block 64, int4", lambda: _tensor(1000, 0), 64, 4),
           ("decades, block 5, int4", lambda: _tensor(1000, 0), 5, 4),
           ("27x37 float32, block 64", lambda: _tensor(999, 1).float().view(27, 37), 64, 8),
           ("27x37 float32, block 64, int4 (an odd count)", lambda: _tensor(999, 1).float().view(27, 37), 64, 4),
           ("513 bfloat16, block 64, int4", lambda: _tensor(513, 2).bfloat16(), 64, 4),
           ("one element, int4", lambda: torch.tensor([3.0]), 4, 4)]
EDGES = [("blocks of zeros, then a value", _zeros_then_a_value, 100, 8),
         ("blocks of zeros, then a value, int4", _zeros_then_a_value, 100, 4),
         ("exact halves, int8", _halves_int8, 8, 8),
         ("exact halves, int4 (a short last block)", _halves_int4, 8, 4),
         ("a block of zeros only", lambda: torch.zeros(7), 7, 4)]
CASES = {"general": GENERAL, "edges": EDGES}


def _reference(x, block, bits):
    """The quantizer's values, from lesson 12's definition, in float32."""
    top = 2 ** (bits - 1) - 1
    flat = x.reshape(-1).float()
    n, blocks = flat.numel(), math.ceil(flat.numel() / block)
    rows = torch.cat([flat, flat.new_zeros(blocks * block - n)]).view(blocks, block)
    scales = rows.abs().amax(dim=1) / top
    codes = torch.round(rows / torch.where(scales > 0, scales, torch.ones_like(scales))[:, None]).clamp(-top, top)
    codes = codes.to(torch.int8).float()                 # integers: a code 0 is +0, whatever the sign of x/s
    return (codes * scales[:, None]).reshape(-1)[:n]


def _bits(t):
    return t.contiguous().view(torch.int32)


def _probe_quantize(which):
    ex = exercise_module("ex12_hybrid")
    out = []
    for _, make, block, bits in CASES[which]:
        x = make()
        payload = ex.quantize_blocks(x, block, bits)
        out.append({"payload": payload, "x_after": x})
    return out


def _probe_dequantize(which, payloads):
    ex = exercise_module("ex12_hybrid")
    out = []
    for (_, make, block, bits), payload in zip(CASES[which], payloads):
        before = payload.clone()
        values = ex.dequantize_blocks(payload, make().numel(), block, bits)
        out.append({"values": values, "payload_changed": not torch.equal(payload, before)})
    return out


def _check_quantizer(student, which):
    made = student.run(_probe_quantize, which)              # one process makes the payloads ...
    payloads = [m["payload"] for m in made]
    decoded = student.on_ranks(2, _probe_dequantize, which, payloads)   # ... two others decode them
    for i, (name, make, block, bits) in enumerate(CASES[which]):
        x, payload = make(), made[i]["payload"]
        what = f"{name} ({tuple(x.shape)} {x.dtype}, block {block}, {bits} bits)"
        assert torch.equal(made[i]["x_after"], x), f"{what}: quantize_blocks changed the caller's x"
        assert torch.is_tensor(payload) and payload.dtype == torch.uint8, (
            f"{what}: the payload must be ONE uint8 tensor, got {type(payload).__name__} "
            f"{getattr(payload, 'dtype', '')}")
        least = math.ceil(x.numel() * bits / 8) + 4 * math.ceil(x.numel() / block)
        assert payload.numel() == least, (
            f"{what}: the payload has {payload.numel()} bytes; the codes at {bits} bits and one fp32 scale per "
            f"block need {least}, and nothing more is needed")
        want = _reference(x, block, bits)
        for rank, got in enumerate(decoded):
            values = got[i]["values"]
            assert not got[i]["payload_changed"], f"{what}: dequantize_blocks changed the payload (rank {rank})"
            assert torch.is_tensor(values) and values.dtype == torch.float32 and values.numel() == x.numel(), (
                f"{what}: dequantize_blocks must return {x.numel()} fp32 values, got "
                f"{getattr(values, 'dtype', type(values).__name__)} x {getattr(values, 'numel', lambda: '?')()}")
            values = values.reshape(-1)
            if not torch.equal(_bits(values), _bits(want)):
                bad = int((_bits(values) != _bits(want)).nonzero()[0])
                raise AssertionError(
                    f"{what}: decoded in another process, element {bad} is {values[bad].item()!r}, the quantizer "
                    f"gives {want[bad].item()!r} (x = {x.reshape(-1)[bad].item()!r}); "
                    f"{int((_bits(values) != _bits(want)).sum())} of {x.numel()} values differ")


@pytest.mark.points(3)
def test_payload_is_the_least_bytes_and_decodes_bit_for_bit(student):
    """12.1: the least payload, decoded in other processes to the quantizer's values bit for bit; x unchanged"""
    _check_quantizer(student, "general")


@pytest.mark.points(1)
def test_exact_halves_and_blocks_of_zeros(student):
    """12.1: halves round to even, blocks of zeros decode to +0.0, short last blocks"""
    _check_quantizer(student, "edges")


# -- 12.2 ----------------------------------------------------------------------------------------
WORLD = 8
MESHES = [(2, 2, 2), (1, 2, 4), (2, 4, 1), (4, 1, 2)]     # (pods m, nodes per pod n, devices per node p)
K = 150                                                   # elements per shard: S = n·p·K


def _tokens(mesh_index):
    counts = [5, 0, 12, 7, 3, 0, 9, 1]                     # some ranks hold none
    return [counts[(r + 3 * mesh_index) % WORLD] for r in range(WORLD)]


def _grad(mesh_index, rank, numel, tokens):
    g = torch.Generator().manual_seed(1000 * mesh_index + rank)
    return torch.randn(numel, generator=g, dtype=torch.float64) * tokens   # a sum over `tokens` tokens


def _coords(rank, n, p):
    return rank // (n * p), rank // p % n, rank % p


def _mesh_groups(m, n, p):
    """Every rank makes every group of the mesh, in the same order; this rank's three, and their ranks."""
    import torch.distributed as dist
    at = lambda a, b, c: (a * n + b) * p + c  # noqa: E731
    spec = {"node": {(a, b): [at(a, b, c) for c in range(p)] for a in range(m) for b in range(n)},
            "pod": {(a, c): [at(a, b, c) for b in range(n)] for a in range(m) for c in range(p)},
            "replicas": {(b, c): [at(a, b, c) for a in range(m)] for b in range(n) for c in range(p)}}
    made = {kind: {key: dist.new_group(ranks) for key, ranks in groups.items()} for kind, groups in spec.items()}
    a, b, c = _coords(dist.get_rank(), n, p)
    keys = {"node": (a, b), "pod": (a, c), "replicas": (b, c)}
    return ({kind: made[kind][keys[kind]] for kind in spec}, {kind: spec[kind][keys[kind]] for kind in spec})


def _destroy(groups):
    """Give a mesh's groups back (each holds threads and sockets; a sandboxed grader bounds both)."""
    import torch.distributed as dist
    dist.barrier()
    for group in groups.values():
        dist.destroy_process_group(group)


def _probe_mesh():
    import torch.distributed as dist
    ex = exercise_module("ex12_hybrid")
    rank, out = dist.get_rank(), []
    for i, (m, n, p) in enumerate(MESHES):
        groups, ranks = _mesh_groups(m, n, p)
        tokens = _tokens(i)[rank]
        grad = _grad(i, rank, n * p * K, tokens)
        before = grad.clone()
        with record_collectives() as rec:
            shard = ex.hsdp_reduce_gradients(grad, tokens, groups["node"], groups["pod"], groups["replicas"])
        calls = [[c["op"], list(c["group"]) if c["group"] is not None else None, c["bytes"], c["peer"]] for c in rec]
        _destroy(groups)
        out.append({"shard": shard, "grad_changed": not torch.equal(grad, before), "calls": calls, "groups": ranks})
    return out


def _want_shard(i, rank, m, n, p):
    S = n * p * K
    tokens = _tokens(i)
    mean = sum(_grad(i, r, S, tokens[r]) for r in range(WORLD)) / sum(tokens)
    _, b, c = _coords(rank, n, p)
    j = b * p + c
    return mean[j * K:(j + 1) * K]


@pytest.mark.points(2)
def test_mesh_reduction_values(student):
    """12.2: each rank's shard of the per-token mean over 8 ranks, for 4 mesh shapes; grad unchanged"""
    for rank, results in enumerate(student.on_ranks(WORLD, _probe_mesh)):
        for i, ((m, n, p), res) in enumerate(zip(MESHES, results)):
            what = f"mesh {m} pods x {n} nodes x {p} devices, rank {rank} (node {_coords(rank, n, p)[1]}, device " \
                   f"{_coords(rank, n, p)[2]}, tokens {_tokens(i)[rank]} of {sum(_tokens(i))})"
            assert not res["grad_changed"], f"{what}: hsdp_reduce_gradients changed the caller's grad"
            shard = res["shard"]
            assert torch.is_tensor(shard) and shard.dtype == torch.float64, (
                f"{what}: expected a float64 tensor (grad's dtype), got {getattr(shard, 'dtype', type(shard).__name__)}")
            want = _want_shard(i, rank, m, n, p)
            _close(shard.reshape(-1), want, f"{what}: shard b·p + c of Σ grad / Σ tokens", rtol=1e-12, atol=1e-14)


RING = {"all_reduce": lambda k: 2 * (k - 1) / k, "reduce_scatter": lambda k: (k - 1) / k,
        "all_gather": lambda k: (k - 1) / k, "all_to_all": lambda k: (k - 1) / k}
SLACK = 64                                               # bytes per kind of link: the divisor's few numbers


def _link(rank, peer, n, p):
    """The kind of link between two ranks."""
    (a, b, _), (a2, b2, _) = _coords(rank, n, p), _coords(peer, n, p)
    return "fast" if (a, b) == (a2, b2) else "medium" if a == a2 else "slow"


@pytest.mark.points(3)
def test_mesh_reduction_bytes_per_link(student):
    """12.2: the least bytes on the slow links, then the medium, then the fast; only the mesh's three groups"""
    for rank, results in enumerate(student.on_ranks(WORLD, _probe_mesh)):
        for (m, n, p), res in zip(MESHES, results):
            what = f"mesh {m} pods x {n} nodes x {p} devices, rank {rank}"
            kinds = {tuple(res["groups"]["node"]): "fast", tuple(res["groups"]["pod"]): "medium",
                     tuple(res["groups"]["replicas"]): "slow"}
            sent = {"fast": 0.0, "medium": 0.0, "slow": 0.0}
            for op, group, nbytes, peer in res["calls"]:
                if op in ("isend", "send"):
                    sent[_link(rank, peer, n, p)] += nbytes
                    continue
                if op in ("irecv", "recv"):
                    continue
                kind = kinds.get(tuple(group) if group is not None else None)
                assert kind is not None, (
                    f"{what}: {op} on the ranks {group}, which are not one of this rank's three groups (node "
                    f"{res['groups']['node']}, pod {res['groups']['pod']}, replicas {res['groups']['replicas']}): "
                    f"a group that spans kinds of links runs at the slowest one's speed")
                k = len(group)
                sent[kind] += RING.get(op, lambda k: 1.0 if k > 1 else 0.0)(k) * nbytes
            S = n * p * K * 8                                                  # float64 bytes of a gradient
            least = {"slow": 2 * (m - 1) / m * S / (n * p), "medium": (n - 1) / n * S / p, "fast": (p - 1) / p * S}
            for kind in ("slow", "medium", "fast"):
                assert sent[kind] <= least[kind] + SLACK, (
                    f"{what}: the {kind} links carry {sent[kind]:.0f} bytes per rank; {least[kind]:.0f} is enough "
                    f"(+ {SLACK} for the divisor) once the slower links carry their least. Per kind: "
                    f"{ {k: round(v) for k, v in sent.items()} }, collectives (op, group, bytes): "
                    f"{[c[:3] for c in res['calls']]}")

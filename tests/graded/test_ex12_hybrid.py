"""Graded: exercise 12, block quantization (against zerolab's quantizer: codes, scales, the error
bound) and HSDP's gradient path on 2 nodes x 2 devices (against the float64 mean over ranks, and
which group carried how many bytes: (p-1)/p of the gradient inside the node, 2(m-1)/m of a 1/p
shard across nodes, nothing over all ranks)."""
import math

import pytest
import torch
import torch.distributed as dist

from zerolab import quantize as Q
from zerolab.grade.helpers import assert_close, exercise_module, record_collectives

# What this exercise must not use (checked before and while the tests run, zerolab.grade.references).
REFERENCE_MODULES = ["zerolab.quantize", "zerolab.hybrid", "zerolab.mesh"]

BLOCKS = (1, 5, 64, 256)


def _tensor(numel, seed):
    """Magnitudes over four decades: one scale for everything would be visibly worse."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(numel, generator=g, dtype=torch.float64) * torch.logspace(-3, 1, numel, dtype=torch.float64)


@pytest.mark.points(3)
def test_quantize_blocks_equals_the_reference_quantizer():
    ex = exercise_module("ex12_hybrid")
    cases = [(_tensor(1000, 0), b) for b in BLOCKS] + [(_tensor(999, 1).float().view(27, 37), 64)]
    zeros = torch.zeros(300)
    zeros[250] = 2.5
    cases.append((zeros, 100))                            # two blocks of zeros, then one value
    for x, block in cases:
        codes, scales = ex.quantize_blocks(x, block)
        want = Q.quantize(x, bits=8, block=block)
        what = f"{tuple(x.shape)} {x.dtype}, block {block}"
        assert codes.dtype == torch.int8 and codes.numel() == x.numel(), f"{what}: codes must be int8, one per element"
        assert scales.dtype == torch.float32 and scales.numel() == math.ceil(x.numel() / block), \
            f"{what}: one fp32 scale per block: expected {math.ceil(x.numel() / block)}, got {scales.numel()}"
        assert torch.equal(scales, want.scales), f"{what}: scales differ from max|x| / 127 per block"
        assert torch.equal(codes.reshape(-1), want.q), f"{what}: codes differ from round(x / scale)"
        back = ex.dequantize_blocks(codes, scales, block)
        assert back.dtype == torch.float32 and torch.equal(back.reshape(-1), Q.dequantize(want, block=block)), \
            f"{what}: dequantize_blocks is not code x its block's scale"
        step = scales.double().repeat_interleave(block)[:x.numel()]
        err = (back.double() - x.reshape(-1).double()).abs()
        assert bool((err <= step / 2 * (1 + 1e-6) + 1e-12).all()), f"{what}: an element is off by more than half a step"


def check_hsdp(numel):
    ex = exercise_module("ex12_hybrid")
    rank, m, p = dist.get_rank(), 2, 2
    nodes = [dist.new_group([0, 1]), dist.new_group([2, 3])]     # every rank makes every group, in order
    devices = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    intra, inter = nodes[rank // p], devices[rank % p]
    grads = [torch.randn(numel, generator=torch.Generator().manual_seed(10 + r), dtype=torch.float64)
             for r in range(m * p)]                              # every rank's, to compute the mean here
    with record_collectives() as calls:       # (zerolab.comm's own cross-rank checks are not recorded)
        shard = ex.hsdp_reduce_gradients(grads[rank].clone(), intra, inter)
    mean = torch.stack(grads).mean(dim=0)
    return shard, mean.view(p, -1)[rank % p], [(c["op"], c["group"], c["bytes"]) for c in calls]


@pytest.mark.points(4)
def test_hsdp_reduce_gradients_values_and_bytes_per_group(on_ranks):
    m, p, numel = 2, 2, 4000
    S = numel * 8                                                # float64 bytes of a full gradient
    for rank, (shard, want, calls) in enumerate(on_ranks(4, check_hsdp, numel)):
        node = tuple(range(rank // p * p, rank // p * p + p))
        across = (rank % p, rank % p + p)
        assert_close(shard.reshape(-1), want, f"rank {rank}: its 1/p shard of the mean over all 4 ranks")
        ops = {(op, group) for op, group, _ in calls}
        assert not any(group == (0, 1, 2, 3) for _, group, _ in calls), \
            f"rank {rank}: a collective over all 4 ranks crosses the slow links with the whole gradient: {calls}"
        assert ops == {("reduce_scatter", node), ("all_reduce", across)}, \
            f"rank {rank}: expected one reduce-scatter in the node {node} and one all-reduce across nodes {across}, got {calls}"
        # bytes each link carries, ring algorithms: (p-1)/p of S in the node, 2(m-1)/m of S/p across
        sent = {"intra": 0.0, "inter": 0.0}
        for op, group, nbytes in calls:
            n = len(group)
            sent["intra" if group == node else "inter"] += (2 if op == "all_reduce" else 1) * (n - 1) / n * nbytes
        assert sent == {"intra": (p - 1) / p * S, "inter": 2 * (m - 1) / m * S / p}, \
            f"rank {rank}: bytes per link {sent}, expected intra {(p - 1) / p * S}, inter {2 * (m - 1) / m * S / p}"

"""Lesson 13's measuring and demonstration tools, each against an independent reference: the tier
measurements return what they claim (small sizes, no timing asserted), owner + broadcast and 1/N
reads + all-gather deliver the parameter written to disk byte for byte with the bytes each rank
read, an emulated link really holds a transfer to its rate, TiledLinear equals nn.Linear (values and
input gradients) while holding one tile, the traced prefetcher gives the model's own outputs, reads
ahead only once the order is traced, re-traces when it changes, and removes its files."""
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from zerolab import bandwidth_centric as bc
from zerolab import memory, tiers
from zerolab.prefetch import DiskWeights, TracedPrefetcher
from zerolab.tiling import TiledLinear


def test_tier_measurements(tmp_path):
    out = tiers.disk_tiers(tmp_path, nbytes=4 << 20, repeats=2, depths=(1, 2))
    names = ["write buffered", "read buffered, cold", "read buffered, right after a buffered write"]
    if out["direct_ok"]:
        names += ["write O_DIRECT", "read O_DIRECT", "read O_DIRECT, queue depth 1", "read O_DIRECT, queue depth 2"]
    else:
        assert out["why"]
    for name in names:
        assert len(out[name]) == 2 and all(v > 0 for v in out[name]), name
    assert list(tmp_path.iterdir()) == []
    assert len(tiers.memcpy_bandwidth(1 << 20, repeats=2)) == 2
    sweep = tiers.request_size_sweep(tmp_path, nbytes=1 << 20, sizes=(4096, 1 << 20), repeats=1)
    assert sorted(sweep) == [4096, 1 << 20] and list(tmp_path.iterdir()) == []
    assert tiers.summary([3.0, 1.0, 2.0]) == (2.0, 1.0, 3.0)
    fs = tiers.filesystem(tmp_path)
    assert fs["mount"] and str(tmp_path).startswith(fs["mount"])


def test_emulated_link_holds_its_rate():
    link = bc.EmulatedLink(50e6)
    t0 = time.perf_counter()
    for _ in range(10):
        link.transfer(1e6)                                  # 10 MB at 50 MB/s: >= 0.2 s minus the burst
    assert time.perf_counter() - t0 >= 0.19
    with pytest.raises(ValueError, match="rate=0 must be > 0"):
        bc.EmulatedLink(0)


def _both_ways(path, numel, rate):
    if dist.get_rank() == 0:
        bc.write_parameter(path, torch.arange(numel, dtype=torch.float32) / 7)
    dist.barrier()
    out = {}
    for name, fn in (("owner", bc.owner_broadcast), ("sharded", bc.sharded_allgather)):
        p, t_read, t_total, nbytes = fn(path, numel, torch.float32, link=bc.EmulatedLink(rate) if rate else None)
        out[name] = (p, t_read, nbytes)
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_owner_broadcast_and_sharded_allgather_deliver_the_parameter(clusters, tmp_path, world_size):
    numel = 300_001                                          # not a multiple of the ranks or of 4 KiB
    want = torch.arange(numel, dtype=torch.float32) / 7
    results = clusters(world_size).run(_both_ways, str(tmp_path / "p.bin"), numel, 20e6)
    per = -(-numel * 4 // world_size // 4096) * 4096
    for r, res in enumerate(results):
        for name, (p, t_read, nbytes) in res.items():
            assert torch.equal(p, want), (r, name)
        assert res["owner"][2] == (numel * 4 if r == 0 else 0)
        assert res["sharded"][2] == max(0, min(per, numel * 4 - r * per))
        assert res["owner"][1] >= (numel * 4 / 20e6 - 0.05 if r == 0 else 0)    # the emulated link's time
    assert sum(res["sharded"][2] for res in results) == numel * 4


def test_tiled_linear_equals_linear_and_holds_one_tile(tmp_path):
    torch.manual_seed(0)
    lin = nn.Linear(96, 200)
    x = torch.randn(5, 3, 96, requires_grad=True)
    y = lin(x)
    y.square().sum().backward()
    gx = x.grad.clone()
    for k in (1, 3, 8, 200):
        x.grad = None
        t = TiledLinear(lin, k, tmp_path)
        with memory.allocation_trace() as trace:
            out = t(x)
        torch.testing.assert_close(out, y, rtol=1e-6, atol=1e-6)
        out.square().sum().backward()
        torch.testing.assert_close(x.grad, gx, rtol=1e-5, atol=1e-5)
        tile = -(-max(t.tile_bytes) // 4096) * 4096
        assert t.stats["largest_tile"] == tile and t.stats["reads"] == 2 * k      # forward + backward
        assert trace["peak"] <= out.numel() * 4 + 2 * tile + 4096 * 2 + 65536, (k, trace["peak"])
        t.close()
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="tiles=0: use an int from 1 to out_features=200"):
        TiledLinear(lin, 0, tmp_path)


class _Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(64, 64) for _ in range(5))

    def forward(self, x, order=None):
        for i in order or range(5):
            x = torch.tanh(self.layers[i](x))
        return x


def test_traced_prefetcher(tmp_path):
    torch.manual_seed(0)
    m = _Stack()
    x = torch.randn(4, 64)
    with torch.no_grad():
        want, want_rev = m(x), m(x, order=[4, 3, 2, 1, 0])
    w = DiskWeights(m.layers, tmp_path)
    assert all(p.numel() == 0 for p in m.parameters())       # no memory until loaded
    p = TracedPrefetcher(w, depth=2)
    with torch.no_grad():
        for step in range(3):
            reads_before = len(p.io.spans)
            with p.step():
                got = m(x)
            assert torch.equal(got, want)
            assert p.last["order"] == [0, 1, 2, 3, 4] and len(p.io.spans) - reads_before == 5
        assert p.trace == [0, 1, 2, 3, 4] and p.pool.high_water <= 3
        with p.step():
            got = m(x, order=[4, 3, 2, 1, 0])                 # another order: re-traced
        assert torch.equal(got, want_rev) and p.trace == [4, 3, 2, 1, 0]
    assert p.pool.in_use() == 0 and all(q.numel() == 0 for q in m.parameters())
    p.close()
    w.close()
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="depth=-1"):
        TracedPrefetcher(w, depth=-1)

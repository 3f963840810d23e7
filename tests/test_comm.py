"""zerolab.comm and zerolab.ring on real ranks: values against torch's collectives, bytes against
the closed-form ring formulas, and the kernel's own count of bytes written to the sockets."""
import pytest
import torch
import torch.distributed as dist

from zerolab import comm, ring

SIZES = [1, 5, 17, 1000, 4099]  # smaller than N, and not divisible by 2, 3 or 4
PIECES = [ring.PIECE_BYTES // 8 * 2 + 3]   # float64 chunks of several pieces (a reduce-scatter step's unit)


def rings_match_torch(sizes):
    n, rank = dist.get_world_size(), dist.get_rank()
    for numel in sizes:
        g = torch.Generator().manual_seed(numel * 31 + rank)
        x = torch.randn(numel, generator=g, dtype=torch.float64)
        expected = x.clone()
        dist.all_reduce(expected)
        got = ring.ring_all_reduce(x.clone())
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)

        big = torch.randn(numel * n, generator=g, dtype=torch.float64)
        rs_ref, rs = torch.empty(numel, dtype=torch.float64), torch.empty(numel, dtype=torch.float64)
        comm.reduce_scatter(rs_ref, big.clone())
        before = big.clone()
        ring.ring_reduce_scatter(rs, big)
        torch.testing.assert_close(rs, rs_ref, rtol=1e-12, atol=1e-12)
        assert torch.equal(big, before), "ring_reduce_scatter wrote into its input"

        ag_ref, ag = torch.empty(numel * n, dtype=torch.float64), torch.empty(numel * n, dtype=torch.float64)
        comm.all_gather(ag_ref, x)
        ring.ring_all_gather(ag, x)
        assert torch.equal(ag, ag_ref)
    return True


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_ring_collectives_equal_torch(clusters, world_size):
    """Uneven chunks (sizes no world size divides), chunks that arrive in several pieces, and a
    reduce-scatter that leaves its input as it was."""
    assert all(clusters(world_size).run(rings_match_torch, SIZES + PIECES))


def logged_bytes(numel):
    n = dist.get_world_size()
    x = torch.ones(numel)  # float32
    out = {}
    ops = {"all_reduce": lambda: comm.all_reduce(x),
           "all_gather": lambda: comm.all_gather(torch.empty(numel * n), x),
           "reduce_scatter": lambda: comm.reduce_scatter(torch.empty(numel // n), x),
           "broadcast": lambda: comm.broadcast(x, 0),
           "ring_all_reduce": lambda: ring.ring_all_reduce(x),
           "ring_reduce_scatter": lambda: ring.ring_reduce_scatter(torch.empty(numel // n), x)}
    for name, op in ops.items():
        dist.barrier()
        with comm.log() as log:
            op()
        out[name] = (log.sent_bytes, log.ideal_bytes, log.measured_bytes)
    return out


@pytest.mark.parametrize("world_size", [2, 4])
def test_bytes_on_the_wire_match_ring_formulas_and_the_kernel_count(clusters, world_size):
    n, numel = world_size, 1 << 18  # 1 MiB of float32
    S = 4 * numel
    per_rank = clusters(world_size).run(logged_bytes, numel)
    ring_ = (n - 1) / n
    for rank, got in enumerate(per_rank):
        # theory: closed forms written out here, independently of zerolab.comm.ring_bytes
        assert got["all_reduce"][:2] == (2 * ring_ * S, 2 * ring_ * S)
        assert got["all_gather"][:2] == (ring_ * n * S, ring_ * n * S)
        # gloo emulates reduce_scatter with an all_reduce: twice the ideal ring's bytes
        assert got["reduce_scatter"][:2] == (2 * ring_ * S, ring_ * S)
        assert got["ring_all_reduce"][:2] == (2 * ring_ * S, 2 * ring_ * S)
        assert got["ring_reduce_scatter"][:2] == (ring_ * S, ring_ * S)      # half gloo's
        children = {2: [1, 0], 4: [2, 1, 0, 0]}[n][rank]  # binomial tree rooted at rank 0
        assert got["broadcast"][0] == children * S
        # measurement: bytes this process wrote to its sockets, within 1% (+ a few headers)
        for op, (sent, _, measured) in got.items():
            assert measured is not None, "expected /proc/self/io on Linux"
            assert abs(measured - sent) <= 0.01 * sent + 8192, (rank, op, sent, measured)


def mismatched_sizes():
    with pytest.raises(ValueError, match="expected world_size"):
        comm.reduce_scatter(torch.empty(3), torch.empty(10))
    with pytest.raises(ValueError, match="expected world_size"):
        ring.ring_all_gather(torch.empty(10), torch.empty(3))
    with pytest.raises(ValueError, match="contiguous"):
        ring.ring_all_reduce(torch.ones(4, 4).t())
    return True


def test_size_mismatch_is_a_clear_error_before_any_communication(clusters):
    assert all(clusters(2).run(mismatched_sizes))

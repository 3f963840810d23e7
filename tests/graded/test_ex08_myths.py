"""Graded: exercise 08, a sharded parameter server and ZeRO's bytes per element. The server average
is checked exactly (multiples of 1/4 in float64: every sum and average is exact) on 4 ranks with
K = 1, 2 and 4 servers, with every collective forbidden and every message recorded: a rank that is
not a server talks to servers only, and each rank sends exactly the bytes the scheme implies (the
closed form, per rank). The bytes per element are compared with the grader's own measurement of the
same step on the sockets, in float32 and bfloat16."""
import pytest
import torch
import torch.distributed as dist

from zerolab import comm, models
from zerolab.grade.helpers import assert_close, exercise_module, point_to_point_only

# The reference implementation of this exercise: none in zerolab (solutions/ is refused for
# every exercise, by zerolab.grade.references).
REFERENCE_MODULES = []

N = 4


def _quarters(seed, numel):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-1000, 1001, (numel,), generator=g).to(torch.float64) / 4


def expected_sent(rank, n, k, numel, element=8):
    """Bytes rank sends: its slices for the other servers, and, as a server, its averaged slice to
    every other rank (slices as tensor_split cuts them)."""
    sizes = [t.numel() for t in torch.empty(numel).tensor_split(k)]
    sent = sum(sizes[j] for j in range(k) if j != rank)
    if rank < k:
        sent += (n - 1) * sizes[rank]
    return sent * element


def check_server(numel, k):
    ex = exercise_module("ex08_myths")
    rank, n = dist.get_rank(), dist.get_world_size()
    x = _quarters(800 + rank, numel)
    expected = sum(_quarters(800 + r, numel) for r in range(n)) / n      # every rank's tensor, by hand
    with point_to_point_only("sharded_server_average") as sent:
        ex.sharded_server_average(x, k)
    assert_close(x, expected, f"sharded_server_average with {k} server(s): the average", rtol=0, atol=0)
    if rank >= k:
        strangers = sorted({d for d, _ in sent["to"] if d >= k})
        assert not strangers, (f"rank {rank} (not a server, K={k}) sent to ranks {strangers}: a rank talks to "
                               f"the servers only")
    want = expected_sent(rank, n, k, numel)
    assert sent["sent"] == want, (
        f"rank {rank}, K={k}: sent {sent['sent']} bytes; the sharded server sends each slice once to its server "
        f"and, from a server, its averaged slice once to each other rank: {want} bytes")
    return sent["sent"]


def measure_step(param_dtype):
    """The grader's own measurement of a warm stage-2 step, and the student's."""
    import zerolab
    ex = exercise_module("ex08_myths")
    theirs = ex.bytes_per_element(param_dtype)
    n, rank = dist.get_world_size(), dist.get_rank()
    model = models.build("gpt")
    engine = zerolab.initialize(model, stage=2, lr=1e-3, param_dtype=param_dtype)
    x, y = models.batch("gpt", seed=rank, model=model)
    for _ in range(2):
        dist.barrier()
        with comm.log() as log:
            engine.backward(engine(x, y))
            engine.step()
        engine.zero_grad()
    psi = sum(p.numel() for p in dict.fromkeys(model.parameters()))
    ours = None if log.measured_bytes is None else log.measured_bytes / (2 * (n - 1) / n * psi)
    return theirs, ours


@pytest.mark.points(4)
def test_sharded_server_average(on_ranks):
    """values, topology and bytes: K servers of one slice each, K = 1, 2, N"""
    for k in (1, 2, N):
        for numel in (4096, 7):                          # 7: slices of unequal sizes
            sent = on_ranks(N, check_server, numel, k)
            if numel == 4096 and k == 1:
                assert sent[0] == (N - 1) * sent[1], f"K=1: the master sends {sent[0]}, the others {sent[1]}"


@pytest.mark.points(3)
def test_bytes_per_element_measured(on_ranks):
    """measured: socket bytes per communicated element, float32 and bfloat16"""
    for dtype in (torch.float32, torch.bfloat16):
        for rank, (theirs, ours) in enumerate(on_ranks(N, measure_step, dtype)):
            if ours is None:
                pytest.skip("no per-process write counter here (/proc/self/io)")
            assert theirs == pytest.approx(ours, rel=0.03), (
                f"rank {rank}, {dtype}: bytes_per_element = {theirs!r}; the grader measured {ours:.3f} bytes on "
                f"the sockets per element the ring carries in the same step")

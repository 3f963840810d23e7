"""Graded: exercise 08, a sharded parameter server and ZeRO's bytes per element. The submission runs
only inside probes (its own processes), which return what it did: the averaged tensors and every
message each rank sent and received (recorded by the grader's taps, with every collective made to
raise). Every verdict is decided here. The server average is checked exactly (multiples of 1/4 in
float64: every sum and average is exact) on 4 ranks with K = 1 to 4 servers and tensors whose
sizes K does not divide (where tensor.chunk and an even split differ, and a tensor smaller than K);
the traffic is checked message by message against what the scheme implies for the part sizes the
messages show (each part once to its server, once back to every other rank, the parts as even as
they can be, non-servers talking to servers only); ``group=`` on a subgroup of 3 of the 4 ranks
(its ranks are not the global ones) while the fourth does something else. The bytes per element are
compared with the grader's own measurement of the same step on ranks that never import the
submission, to within a few hundred bytes: no formula comes that close."""
import pytest
import torch

from zerolab.grade.helpers import exercise_module

# The reference implementation of this exercise: none in zerolab (solutions/ is refused for
# every exercise, by zerolab.grade.references).
REFERENCE_MODULES = []

N = 4
SIZES = (4096, 10, 6, 3)          # 10 and 6: chunk's parts differ from an even split; 3: fewer than K
SLACK_BYTES = 640                 # 08.2: two barriers' worth of socket bytes (288 each on 4 ranks)


def _quarters(seed, numel):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-1000, 1001, (numel,), generator=g).to(torch.float64) / 4


# -- probes: run the submission, return what it did (never a verdict) ------------------------------
def _messages(calls):
    return {"sends": [[c["peer"], c["bytes"]] for c in calls if c["op"] in ("isend", "send")],
            "recvs": [[c["peer"], c["bytes"]] for c in calls if c["op"] in ("irecv", "recv")]}


def _serve(cases, members=None):
    """Each (numel, K) case on this rank: the tensor after the call and the messages it sent and
    received. ``members``: run on the subgroup of these global ranks; the other ranks do something
    else (a computation of their own) and return None."""
    import torch.distributed as dist

    from zerolab.grade.helpers import point_to_point_only
    rank = dist.get_rank()
    group = dist.new_group(members) if members is not None else None   # every rank makes every group
    if members is not None and rank not in members:
        torch.manual_seed(rank)
        torch.linalg.qr(torch.randn(300, 300))                          # something else entirely
        return None
    ex = exercise_module("ex08_myths")
    out = []
    for numel, k in cases:
        x = _quarters(800 + rank, numel)
        with point_to_point_only("sharded_server_average") as rec:
            returned = ex.sharded_server_average(x, k, group) if group is not None else \
                ex.sharded_server_average(x, k)
        out.append({"tensor": x, "returned_same": returned is x, **_messages(rec["calls"])})
    return out


def _bad_servers(values):
    """sharded_server_average with each number of servers in ``values``: what it raised (or None)."""
    ex = exercise_module("ex08_myths")
    out = []
    for k in values:
        try:
            ex.sharded_server_average(torch.zeros(8, dtype=torch.float64), k)
            out.append(None)
        except NotImplementedError:
            raise
        except Exception as exc:
            out.append({"raised": [c.__name__ for c in type(exc).__mro__], "message": str(exc)})
    return out


def _student_bytes(param_dtype):
    return exercise_module("ex08_myths").bytes_per_element(param_dtype)


def _grader_bytes(param_dtype):
    """The grader's measurement (trusted ranks): socket bytes of a warm stage-2 step per element the
    ring carries."""
    import torch.distributed as dist

    import zerolab
    from zerolab import comm, models
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
    elements = 2 * (n - 1) / n * psi
    return None if log.measured_bytes is None else {"bytes": log.measured_bytes, "elements": elements}


# -- checks, here ------------------------------------------------------------------------------------
def _check_values(results, ranks, numel, k, seed_of):
    expected = sum(_quarters(800 + seed_of(r), numel) for r in ranks) / len(ranks)
    for r, got in zip(ranks, results):
        assert got["returned_same"], f"rank {r}: sharded_server_average must return the tensor it averaged in place"
        assert torch.equal(got["tensor"], expected), (
            f"rank {r}, K={k}, {numel} elements: the tensor after sharded_server_average is not the average over "
            f"the {len(ranks)} ranks (largest difference "
            f"{float((got['tensor'] - expected).abs().max()) if got['tensor'].shape == expected.shape else 'shape'})")


def _check_traffic(results, ranks, numel, k, element=8):
    """Every message, against the scheme: the part each server serves, read off its messages; every
    part once to its server and once from it to every other rank; non-servers talk to servers only."""
    n, servers = len(ranks), ranks[:k]
    what = f"K={k}, {numel} elements on ranks {ranks}"
    sent = {r: {} for r in ranks}                 # sender -> {receiver: bytes}
    for r, got in zip(ranks, results):
        for peer, nbytes in got["sends"]:
            assert peer in ranks, f"{what}: rank {r} sent {nbytes} bytes to rank {peer}, outside the group"
            sent[r][peer] = sent[r].get(peer, 0) + nbytes
        received = {}
        for peer, nbytes in got["recvs"]:
            received[peer] = received.get(peer, 0) + nbytes
        if r not in servers:
            strangers = sorted(p for p in set(sent[r]) | {p for p, b in received.items() if b} if p not in servers)
            assert not strangers, (f"{what}: rank {r} is not a server, yet it exchanged messages with ranks "
                                   f"{strangers}: a rank that is not a server talks to the servers only")
    # The part server s serves, read off its traffic (n > 2): it sends every part but its own once,
    # to their servers, and its own averaged part to the n-1 others: numel + (n-2) p_s elements.
    total = {r: sum(sent[r].values()) for r in ranks}
    part = {s: (total[s] / element - numel) / (n - 2) for s in servers}
    assert all(float(p).is_integer() and p >= 0 for p in part.values()) and sum(part.values()) == numel, (
        f"{what}: the servers sent {[total[s] for s in servers]} bytes: that is not one part of an exact split "
        f"of the {numel} elements once to its server and, averaged, once to each other rank (per rank: "
        f"numel + (N-2) x its part, in elements of {element} bytes)")
    part = {s: int(p) for s, p in part.items()}
    sizes = sorted(part.values())
    assert sizes[-1] - sizes[0] <= 1, (
        f"{what}: the servers serve parts of {[part[s] for s in servers]} elements; the K parts must be as even "
        f"as they can be (sizes differing by at most one)")
    for r in ranks:
        for q in ranks:
            if q == r:
                continue
            want = (part[q] if q in part else 0) + (part[r] if r in part else 0)   # in to q, out from r
            got = sent[r].get(q, 0) // element
            assert got == want, (
                f"{what}: rank {r} sent {got} elements to rank {q}; the scheme sends "
                f"{part.get(q, 0)} (rank {q}'s part, to its server) + {part.get(r, 0)} (rank {r}'s averaged "
                f"part, back) = {want}")


@pytest.mark.points(2)
def test_sharded_server_average_values(student):
    """values: the exact average on every rank, K = 1 to 4, sizes K does not divide; a bad K is refused"""
    cases = [(numel, k) for k in (1, 2, 3, N) for numel in SIZES]
    results = student.on_ranks(N, _serve, cases)
    for i, (numel, k) in enumerate(cases):
        _check_values([results[r][i] for r in range(N)], list(range(N)), numel, k, lambda r: r)
    bad = [0, N + 1, True, 2.0]           # True is an int to Python, 2.0 compares like one: neither is a K
    refused = student.on_ranks(N, _bad_servers, bad)[0]
    for k, got in zip(bad, refused):
        assert got is not None and "ValueError" in got["raised"] and "servers" in got["message"], (
            f"sharded_server_average(tensor, servers={k!r}) on {N} ranks: "
            f"{'accepted' if got is None else 'raised ' + got['raised'][0] + ': ' + got['message'][:200]}; "
            f"expected a ValueError naming servers and the values it may take (an int from 1 to {N})")


@pytest.mark.points(3)
def test_sharded_server_traffic(student):
    """traffic: each part once to its server and once back to every other rank, even parts, servers only"""
    cases = [(numel, k) for k in (1, 2, 3, N) for numel in SIZES]
    results = student.on_ranks(N, _serve, cases)
    for i, (numel, k) in enumerate(cases):
        per_rank = [results[r][i] for r in range(N)]
        _check_traffic(per_rank, list(range(N)), numel, k)
        if numel == 4096 and k == 1:
            sent = [sum(b for _, b in got["sends"]) for got in per_rank]
            assert sent[0] == (N - 1) * sent[1], f"K=1: the master sends {sent[0]}, the others {sent[1]}"


@pytest.mark.points(2)
def test_sharded_server_on_a_subgroup(student):
    """group=: 3 of the 4 ranks (group ranks are not global ranks) while the fourth does something else"""
    members = [1, 2, 3]
    cases = [(10, 2), (4096, 3)]
    results = student.on_ranks(N, _serve, cases, members)
    assert results[0] is None
    for i, (numel, k) in enumerate(cases):
        per_rank = [results[r][i] for r in members]
        _check_values(per_rank, members, numel, k, lambda r: r)
        _check_traffic(per_rank, members, numel, k)


@pytest.mark.points(3)
def test_bytes_per_element_measured(student, clusters):
    """measured: socket bytes per communicated element, float32 and bfloat16, as the grader measures them"""
    for dtype in (torch.float32, torch.bfloat16):
        ours = clusters(N).run(_grader_bytes, dtype)
        if ours[0] is None:
            pytest.skip("no per-process write counter here (/proc/self/io)")
        theirs = student.on_ranks(N, _student_bytes, dtype)
        for rank, (t, o) in enumerate(zip(theirs, ours)):
            assert isinstance(t, (int, float)) and not isinstance(t, bool), f"rank {rank}: returned {t!r}"
            measured = o["bytes"] / o["elements"]
            assert abs(t - measured) * o["elements"] <= SLACK_BYTES, (
                f"rank {rank}, {dtype}: bytes_per_element = {t!r}; the grader measured {measured:.5f} bytes on the "
                f"sockets per element the ring carries in the same step ({o['bytes']} bytes): yours is "
                f"{abs(t - measured) * o['elements']:.0f} bytes away (at most {SLACK_BYTES}): measure, don't compute")

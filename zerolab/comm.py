"""Collectives that count their bytes.

Thin wrappers over ``torch.distributed`` that record, for every call, the op, the tensor's bytes,
and the bytes THIS rank sends on the wire under the algorithm the backend really runs. Wrap a
region in :func:`log` to collect the records::

    with comm.log() as step_log:
        comm.all_reduce(grad)
    step_log.sent_bytes        # what the algorithm sends, per rank (the theory)
    step_log.measured_bytes    # what this process really wrote to its sockets (Linux, gloo)

Per rank and per call, with S the bytes of the full buffer and N the world size:

=========================  =====================  ===========================================
op                         ring (bandwidth-opt.)  what gloo on torch 2.13 really sends
=========================  =====================  ===========================================
all_reduce                 2(N-1)/N * S           same (ring: reduce-scatter then all-gather)
reduce_scatter (S = input) (N-1)/N * S            2(N-1)/N * S: emulated with an all_reduce
all_gather (S = output)    (N-1)/N * S            same
broadcast                  (N-1)/N * S, pipelined binomial tree: S per child (root: log2 N * S)
send / recv                S / 0                  same
=========================  =====================  ===========================================

``ideal_bytes`` is the left column, ``sent_bytes`` the right. ``measured_bytes`` comes from the
kernel's per-process write counter (``/proc/self/io``, wchar): every byte gloo hands to a TCP
socket is counted there, so it is a measurement, not the formula again. It also counts anything
else the process writes in the region (printing, files): keep logged regions free of I/O.
"""
import contextlib
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

# torch 2.13 renamed the flat-tensor collectives; older releases only have the old names.
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass
class CommRecord:
    op: str
    tensor_bytes: int     # S: the full buffer the op is defined on (see the table above)
    sent_bytes: float     # bytes this rank sends under the backend's real algorithm
    ideal_bytes: float    # bytes this rank sends under the bandwidth-optimal ring
    world_size: int
    seconds: float = None  # wall time of a blocking call; None for async_op=True


@dataclass
class CommLog:
    """Records of every zerolab.comm call made inside ``with log():`` on this rank."""
    records: list = field(default_factory=list)
    measured_bytes: int = None
    seconds: float = None
    _io_start: int = None
    _t0: float = None

    @property
    def sent_bytes(self):
        return sum(r.sent_bytes for r in self.records)

    @property
    def ideal_bytes(self):
        return sum(r.ideal_bytes for r in self.records)

    def by_op(self):
        """{op: (calls, tensor_bytes, sent_bytes)} summed over the records."""
        out = {}
        for r in self.records:
            calls, tb, sb = out.get(r.op, (0, 0, 0.0))
            out[r.op] = (calls + 1, tb + r.tensor_bytes, sb + r.sent_bytes)
        return out

    def table(self):
        rows = [f"{'op':<16}{'calls':>6}{'tensor MB':>11}{'sent MB':>10}"]
        for op, (calls, tb, sb) in self.by_op().items():
            rows.append(f"{op:<16}{calls:>6}{tb / 1e6:>11.3f}{sb / 1e6:>10.3f}")
        rows.append(f"{'total':<16}{len(self.records):>6}{'':>11}{self.sent_bytes / 1e6:>10.3f}")
        if self.measured_bytes is not None:
            rows.append(f"{'measured':<16}{'':>6}{'':>11}{self.measured_bytes / 1e6:>10.3f}")
        return "\n".join(rows)


_ACTIVE = []  # logs currently collecting on this process (nested regions all see each call)


def _written_bytes():
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("wchar:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


@contextlib.contextmanager
def log(group=None):
    """Collect a :class:`CommLog` of every zerolab.comm call in the region, plus the bytes this
    process really wrote (gloo on Linux; ``measured_bytes`` stays None elsewhere)."""
    entry = CommLog()
    measurable = dist.is_initialized() and dist.get_backend(group) == "gloo"
    entry._io_start = _written_bytes() if measurable else None
    entry._t0 = time.perf_counter()
    _ACTIVE.append(entry)
    try:
        yield entry
    finally:
        _ACTIVE.remove(entry)
        entry.seconds = time.perf_counter() - entry._t0
        end = _written_bytes() if entry._io_start is not None else None
        entry.measured_bytes = None if end is None else end - entry._io_start


def ring_bytes(op, nbytes, world_size):
    """Bytes one rank sends in a bandwidth-optimal ring (Patarasuk & Yuan 2009; the ZeRO paper's
    accounting): all_reduce 2(N-1)/N*S, reduce_scatter and all_gather (N-1)/N*S, S the full buffer."""
    n = world_size
    factor = {"all_reduce": 2 * (n - 1) / n, "reduce_scatter": (n - 1) / n,
              "all_gather": (n - 1) / n, "broadcast": (n - 1) / n}[op]
    return factor * nbytes


def _binomial_children(rank, src, n):
    v, children, step = (rank - src) % n, 0, 1
    while step < n:
        if step > v and v + step < n:
            children += 1
        step *= 2
    return children


def _record(op, tensor, group, sent, ideal, seconds=None):
    if _ACTIVE:
        n = dist.get_world_size(group)
        rec = CommRecord(op, tensor.numel() * tensor.element_size(), sent, ideal, n, seconds)
        for entry in _ACTIVE:
            entry.records.append(rec)


def _timed(call, async_op):
    if async_op:
        return call(), None
    t0 = time.perf_counter()
    work = call()
    return work, time.perf_counter() - t0


def _backend(group):
    return dist.get_backend(group)


def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
    """In-place all-reduce (sum by default) of ``tensor`` across the group."""
    n = dist.get_world_size(group)
    work, secs = _timed(lambda: dist.all_reduce(tensor, op=op, group=group, async_op=async_op), async_op)
    s = tensor.numel() * tensor.element_size()
    _record("all_reduce", tensor, group, ring_bytes("all_reduce", s, n), ring_bytes("all_reduce", s, n), secs)
    return work


def reduce_scatter(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False, impl="torch"):
    """``output`` (1/N of ``input``) receives the sum over ranks of this rank's slice of ``input``.
    On gloo torch emulates this with an all_reduce of the whole input: twice the ring's bytes.

    ``impl="ring"`` runs :func:`zerolab.ring.ring_reduce_scatter` instead (send/recv only, sum only,
    blocking): the ring's (N-1)/N bytes, recorded as one reduce_scatter record (its inner sends are
    not recorded separately). On gloo it is the faster of the two for large buffers (benchmarks)."""
    n = dist.get_world_size(group)
    if impl not in ("torch", "ring"):
        raise ValueError(f"reduce_scatter: impl={impl!r} is not supported: use 'torch' or 'ring'")
    if input.numel() != n * output.numel():
        raise ValueError(f"reduce_scatter: input has {input.numel()} elements, expected world_size "
                         f"({n}) x output ({output.numel()}) = {n * output.numel()}")
    s = input.numel() * input.element_size()
    if impl == "ring":
        if async_op or op != dist.ReduceOp.SUM:
            raise ValueError("reduce_scatter: impl='ring' is blocking and sums only "
                             f"(got async_op={async_op!r}, op={op!r})")
        from zerolab.ring import ring_reduce_scatter
        t0, saved = time.perf_counter(), list(_ACTIVE)
        _ACTIVE.clear()  # the ring's own sends are this one record, not separate ones
        try:
            ring_reduce_scatter(output, input, group)
        finally:
            _ACTIVE[:] = saved
        ring = ring_bytes("reduce_scatter", s, n)
        _record("reduce_scatter", input, group, ring, ring, time.perf_counter() - t0)
        return None
    work, secs = _timed(lambda: _reduce_scatter_flat(output, input, op=op, group=group,
                                                     async_op=async_op), async_op)
    real_op = "all_reduce" if _backend(group) == "gloo" else "reduce_scatter"
    _record("reduce_scatter", input, group, ring_bytes(real_op, s, n), ring_bytes("reduce_scatter", s, n), secs)
    return work


def all_gather(output, input, group=None, async_op=False):
    """``output`` (N x ``input``) receives every rank's ``input``, in rank order."""
    n = dist.get_world_size(group)
    if output.numel() != n * input.numel():
        raise ValueError(f"all_gather: output has {output.numel()} elements, expected world_size "
                         f"({n}) x input ({input.numel()}) = {n * input.numel()}")
    work, secs = _timed(lambda: _all_gather_flat(output, input, group=group, async_op=async_op), async_op)
    s = output.numel() * output.element_size()
    _record("all_gather", output, group, ring_bytes("all_gather", s, n), ring_bytes("all_gather", s, n), secs)
    return work


def broadcast(tensor, src, group=None, async_op=False):
    """Copy ``tensor`` from rank ``src`` to every rank."""
    n = dist.get_world_size(group)
    work, secs = _timed(lambda: dist.broadcast(tensor, src=src, group=group, async_op=async_op), async_op)
    s = tensor.numel() * tensor.element_size()
    rank = dist.get_rank(group)
    group_src = src if group is None else dist.get_group_rank(group, src)  # src is a global rank
    sent = _binomial_children(rank, group_src, n) * s if _backend(group) == "gloo" else ring_bytes("broadcast", s, n)
    _record("broadcast", tensor, group, sent, ring_bytes("broadcast", s, n), secs)
    return work


def isend(tensor, dst, group=None):
    """Start sending ``tensor`` to rank ``dst`` (group rank); returns a handle to ``wait()`` on."""
    s = tensor.numel() * tensor.element_size()
    work = dist.isend(tensor, _global(dst, group), group=group)
    _record("send", tensor, group, s, s)
    return work


def irecv(tensor, src, group=None):
    """Start receiving into ``tensor`` from rank ``src`` (group rank)."""
    work = dist.irecv(tensor, _global(src, group), group=group)
    _record("recv", tensor, group, 0, 0)
    return work


def send(tensor, dst, group=None):
    isend(tensor, dst, group).wait()


def recv(tensor, src, group=None):
    irecv(tensor, src, group).wait()


def _global(rank, group):
    return rank if group is None else dist.get_global_rank(group, rank)


def measured_bandwidth(op, nbytes, *, repeats=5, group=None, dtype=torch.float32):
    """Median seconds of ``op`` ('all_reduce', 'reduce_scatter', 'all_gather', 'broadcast') on a
    buffer of ``nbytes``, and the resulting bus bandwidth (ideal ring bytes per rank / time)."""
    n = dist.get_world_size(group)
    numel = max(n, nbytes // torch.tensor([], dtype=dtype).element_size() // n * n)
    big = torch.ones(numel, dtype=dtype)
    small = torch.ones(numel // n, dtype=dtype)
    calls = {"all_reduce": lambda: all_reduce(big, group=group),
             "reduce_scatter": lambda: reduce_scatter(small, big, group=group),
             "all_gather": lambda: all_gather(big, small, group=group),
             "broadcast": lambda: broadcast(big, 0, group=group)}
    times = []
    for _ in range(repeats + 1):  # the first call warms up connections and allocations
        dist.barrier(group=group)
        t0 = time.perf_counter()
        calls[op]()
        times.append(time.perf_counter() - t0)
    t = sorted(times[1:])[len(times[1:]) // 2]
    return t, ring_bytes(op, big.numel() * big.element_size(), n) / t

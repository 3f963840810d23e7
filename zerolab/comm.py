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
all_to_all (S = input)     (N-1)/N * S            same (pairwise: S/N to every other rank)
send / recv                S / 0                  same
=========================  =====================  ===========================================

``ideal_bytes`` is the left column, ``sent_bytes`` the right. An algorithm built from several calls
(lesson 00's ring, :mod:`zerolab.ring`) records itself as ONE collective (:func:`composite`). ``measured_bytes`` comes from the
kernel's per-process write counter (``/proc/self/io``, wchar): every byte gloo hands to a TCP
socket is counted there, so it is a measurement, not the formula again. It also counts anything
else the process writes in the region (printing, files): keep logged regions free of I/O.

Links: every record also names the group it ran on (``group``, its global ranks) and, under the
algorithm, how many bytes went to each peer (``peers``, {global rank: bytes}: a ring sends
everything to one neighbour, a binomial broadcast S to each child, an all-to-all S/N to
every other rank; on NCCL the ring collectives' peers are unknown: {}). :meth:`CommLog.by_group` and :meth:`CommLog.by_peer` sum them; a
:class:`zerolab.mesh.Mesh` turns peers into links (intra-node, inter-node). The measurement per
peer: ``log(sockets=True)`` also reads the kernel's count of bytes sent on each of this process's
TCP sockets (``tcp_info``: :func:`socket_bytes`) at both ends of the region; :func:`peer_map` (a
collective) says which rank is at the other end of each socket.

Timelines: ``log(timeline=tl)`` also records a span on ``tl`` (a :class:`zerolab.timeline.Timeline`)
for every collective in the region: blocking calls from start to return, asynchronous ones from
launch to completion, plus a "wait" span for every ``wait()`` on their handle. Compute code marks its
own spans with :func:`span` (a no-op when no timeline is active). So the algorithms carry no
instrumentation beyond naming their compute; the engines pass their timeline here.

Checked collectives: with the environment variable ``ZEROLAB_CHECK_COLLECTIVES=1`` (the tests set
it), every collective here first compares what each rank is about to do (op, dtype, shape, reduce
op, source rank) with one small all-reduce, and raises :class:`CollectiveMismatch` on EVERY rank,
naming the ranks and what each called, instead of running it. Gloo does not check: an all_reduce
of a (2, 3) tensor against a (3, 2) one, or a broadcast of 3 elements into 4, "works" and leaves
wrong numbers. Like torch's ``TORCH_DISTRIBUTED_DEBUG=DETAIL``, it costs one extra collective per
call: off by default. The check's own bytes are not in ``sent_bytes`` nor in ``measured_bytes``.
"""
import contextlib
import os
import socket
import struct
import threading
import time
import zlib
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
    impl: str = "torch"   # "torch" (the backend's collective) or "ring" (zerolab.ring, send/recv)
    tag: str = None       # what the buffer is ("bucket 3", "blocks.0"): names the timeline span
    group: tuple = None   # global ranks of the group it ran on, in group order
    peers: dict = None    # {global rank: bytes this rank sent it} under the algorithm (sent_bytes in all)


@dataclass
class CommLog:
    """Records of every zerolab.comm call made inside ``with log():`` on this rank."""
    records: list = field(default_factory=list)
    measured_bytes: int = None
    seconds: float = None
    timeline: object = None   # a zerolab.timeline.Timeline that also gets a span per call, or None
    socket_sent: dict = None  # log(sockets=True): {(local port, peer port): bytes the kernel sent}
    _io_start: int = None
    _sockets_start: dict = None
    _t0: float = None
    _excluded: int = 0    # bytes the collective checks wrote (not part of the algorithm's traffic)

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

    def by_group(self):
        """{group (its global ranks): sent_bytes} summed over the records."""
        out = {}
        for r in self.records:
            out[r.group] = out.get(r.group, 0.0) + r.sent_bytes
        return out

    def by_peer(self):
        """{global rank: bytes this rank sent it} under the algorithms, summed over the records."""
        out = {}
        for r in self.records:
            for peer, b in (r.peers or {}).items():
                out[peer] = out.get(peer, 0.0) + b
        return out

    def measured_by_peer(self, ports):
        """{global rank: bytes} the kernel sent on this process's sockets to each peer during the
        region (``log(sockets=True)``), ``ports`` from :func:`peer_map`; sockets it does not know
        (opened after it was made, or not the group's) are summed under None."""
        if self.socket_sent is None:
            return None
        out = {}
        for key, b in self.socket_sent.items():
            peer = ports.get(key)
            out[peer] = out.get(peer, 0) + b
        return out

    def table(self):
        rows = [f"{'op':<16}{'calls':>6}{'tensor MB':>11}{'sent MB':>10}"]
        for op, (calls, tb, sb) in self.by_op().items():
            rows.append(f"{op:<16}{calls:>6}{tb / 1e6:>11.3f}{sb / 1e6:>10.3f}")
        rows.append(f"{'total':<16}{len(self.records):>6}{'':>11}{self.sent_bytes / 1e6:>10.3f}")
        if self.measured_bytes is not None:
            rows.append(f"{'measured':<16}{'':>6}{'':>11}{self.measured_bytes / 1e6:>10.3f}")
        return "\n".join(rows)


class _Active:
    """The logs collecting right now in this process. Process-wide, not per thread, on purpose:
    gradient hooks may run on autograd's device threads (CUDA), and their collectives belong to the
    region the training loop opened. The one piece of shared state in comm; changed only by
    :func:`log`, under a lock."""

    def __init__(self):
        self._lock = threading.Lock()
        self._logs = ()
        self._composite = threading.local()   # inside a composite collective on this thread

    def add(self, entry):
        with self._lock:
            self._logs = self._logs + (entry,)

    def remove(self, entry):
        with self._lock:
            self._logs = tuple(e for e in self._logs if e is not entry)

    def logs(self):
        return () if getattr(self._composite, "depth", 0) else self._logs

    def timeline(self):
        """The timeline of the innermost active log that has one, or None."""
        return next((e.timeline for e in reversed(self._logs) if e.timeline is not None), None)


_ACTIVE = _Active()


# struct tcp_info (linux/tcp.h): tcpi_bytes_sent (Linux >= 4.19) and tcpi_bytes_retrans, both u64
_TCPI_BYTES_SENT, _TCPI_BYTES_RETRANS, _TCPI_SIZE = 200, 208, 232


def socket_bytes():
    """{(local port, peer port): payload bytes sent} of every TCP socket this process holds, from
    the kernel's own per-socket counter (``getsockopt(TCP_INFO)``: bytes sent minus retransmitted),
    or None where that is not available. gloo opens one socket per pair of ranks and per group, so
    this counts what went to each peer on each group's connections. Reads a duplicate of each file
    descriptor; gloo's sockets are never touched."""
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return None
    out = {}
    for fd in fds:
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            s = socket.fromfd(int(fd), socket.AF_INET, socket.SOCK_STREAM)   # a dup, closed below
        except (OSError, ValueError):
            continue
        try:
            if s.type != socket.SOCK_STREAM or s.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            info = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCPI_SIZE)
            if len(info) < _TCPI_BYTES_RETRANS + 8:
                return None                                  # a kernel without tcpi_bytes_sent
            sent, retrans = struct.unpack_from("<QQ", info, _TCPI_BYTES_SENT)
            out[(s.getsockname()[1], s.getpeername()[1])] = sent - retrans
        except OSError:
            continue                                         # a listening or unconnected socket
        finally:
            s.close()
    return out


def peer_map(group=None):
    """{(local port, peer port): global rank at the other end} for this process's TCP sockets whose
    other end is a rank of ``group``: every rank lists its sockets and one all_gather_object
    exchanges the lists (a collective; call it after the groups you measure exist: gloo connects
    each group's ranks when the group is made)."""
    mine = sorted(socket_bytes() or {})
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, (dist.get_rank(), mine), group=group)
    owner = {key: rank for rank, keys in everyone for key in keys}
    return {(local, peer): owner[(peer, local)] for local, peer in mine if (peer, local) in owner}


def _written_bytes():
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("wchar:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


class _LogRegion:
    """What :func:`log` returns: a context manager, also usable as open()/close() across calls (the
    engine opens its step log at the first forward and closes it in step())."""

    def __init__(self, group, timeline, sockets=False):
        self.entry = CommLog(timeline=timeline)
        self._measurable = dist.is_initialized() and dist.get_backend(group) == "gloo"
        self._sockets = sockets and self._measurable

    def open(self):
        e = self.entry
        e._io_start = _written_bytes() if self._measurable else None
        e._sockets_start = socket_bytes() if self._sockets else None
        e._t0 = time.perf_counter()
        _ACTIVE.add(e)
        return e

    def close(self):
        e = self.entry
        _ACTIVE.remove(e)
        e.seconds = time.perf_counter() - e._t0
        end = _written_bytes() if e._io_start is not None else None
        e.measured_bytes = None if end is None else end - e._io_start - e._excluded
        if e._sockets_start is not None:
            now = socket_bytes() or {}
            e.socket_sent = {k: b - e._sockets_start.get(k, 0) for k, b in now.items()
                             if b != e._sockets_start.get(k, 0)}
        return e

    def __enter__(self):
        return self.open()

    def __exit__(self, *exc):
        self.close()


def log(group=None, *, timeline=None, sockets=False):
    """Collect a :class:`CommLog` of every zerolab.comm call in the region, plus the bytes this
    process really wrote (gloo on Linux; ``measured_bytes`` stays None elsewhere). With
    ``timeline``, every call also becomes a span on it. With ``sockets``, ``socket_sent`` gets the
    bytes the kernel sent on each TCP socket during the region (:func:`socket_bytes`; see
    :meth:`CommLog.measured_by_peer`)."""
    return _LogRegion(group, timeline, sockets)


@contextlib.contextmanager
def composite(op, tensor, group=None, *, impl, tag=None):
    """Record the calls inside as ONE collective ``op`` on ``tensor`` (the full buffer S), with the
    ring's bytes, e.g. lesson 00's ring all-reduce built from 2(N-1) sends. Blocking only."""
    _check(op, tensor, group)
    depth = getattr(_ACTIVE._composite, "depth", 0)
    _ACTIVE._composite.depth = depth + 1
    t0 = time.perf_counter()
    try:
        yield
    finally:
        _ACTIVE._composite.depth = depth
    n, s = dist.get_world_size(group), tensor.numel() * tensor.element_size()
    ring = ring_bytes(op, s, n)
    _record(op, tensor, group, ring, ring, None, t0=t0, impl=impl, tag=tag)


# -- compute spans: the algorithms name their compute, comm knows whether anyone listens ----------
def span(name, category="compute"):
    """A span on the active log's timeline around the ``with`` block; a no-op without one."""
    tl = _ACTIVE.timeline()
    return tl.span(name, category) if tl is not None else contextlib.nullcontext()


def clock():
    """Now on the active timeline (seconds since its origin), or None when none is active: for
    spans whose start and end happen in different hooks (see :func:`end_span`)."""
    tl = _ACTIVE.timeline()
    return None if tl is None else tl.now()


def end_span(name, category, start):
    """Record [``start``, now] on the active timeline (``start`` from :func:`clock`)."""
    tl = _ACTIVE.timeline()
    if tl is not None and start is not None:
        tl.record(name, category, start, tl.now())


def ring_bytes(op, nbytes, world_size):
    """Bytes one rank sends in a bandwidth-optimal ring (Patarasuk & Yuan 2009; the ZeRO paper's
    accounting): all_reduce 2(N-1)/N*S, reduce_scatter and all_gather (N-1)/N*S, S the full buffer.
    (all_to_all is no ring: each rank keeps 1/N of its input and sends S/N to every other rank.)"""
    n = world_size
    factor = {"all_reduce": 2 * (n - 1) / n, "reduce_scatter": (n - 1) / n,
              "all_gather": (n - 1) / n, "broadcast": (n - 1) / n, "all_to_all": (n - 1) / n}[op]
    return factor * nbytes


def _binomial_children(rank, src, n):
    """Group ranks of ``rank``'s children in a binomial broadcast tree rooted at ``src``."""
    v, children, step = (rank - src) % n, [], 1
    while step < n:
        if step > v and v + step < n:
            children.append((v + step + src) % n)
        step *= 2
    return children


class Then:
    """The handle of an asynchronous collective with a follow-up: ``wait()`` waits for the
    collective, then runs ``then()`` once (a dequantization, keeping a slice of what was gathered).
    What a composite collective returns when ``async_op=True``."""

    def __init__(self, work, then):
        self._work, self._then = work, then

    def wait(self):
        if self._work is not None:
            self._work.wait()
            self._work = None
            self._then()
        return True


class _Traced:
    """An async handle whose ``wait()`` is recorded as a "wait" span (only made while a timeline is
    active); everything else is the handle's own."""

    def __init__(self, work, timeline, name):
        self._work, self._timeline, self._name = work, timeline, name

    def wait(self, *args, **kwargs):
        with self._timeline.span(f"wait {self._name}", "wait"):
            return self._work.wait(*args, **kwargs)

    def __getattr__(self, attr):
        return getattr(self._work, attr)


def _group_ranks(group):
    return tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))


def _peers(op, ranks, sent, peers, impl, group):
    """{global rank: bytes} this rank sent under the algorithm: given (``peers``: group ranks), or for
    the ring collectives all of it to one neighbour: zerolab.ring sends to the next rank in group order
    (r -> r+1); gloo's own rings: all_reduce (and reduce_scatter, which gloo runs as one) send to the
    previous rank (r -> r-1), all_gather to the next (r -> r+1), as measured per socket
    (tests/test_hybrid.py). Unknown ({}) on NCCL, which picks its rings and trees from the topology."""
    if peers is not None:
        return {ranks[i]: b for i, b in peers.items() if b}
    if op in ("all_reduce", "reduce_scatter", "all_gather") and len(ranks) > 1 and sent:
        gloo = _backend(group) == "gloo"
        step = 1 if impl == "ring" or (gloo and op == "all_gather") else -1 if gloo else None
        if step is not None:
            me = ranks.index(dist.get_rank())
            return {ranks[(me + step) % len(ranks)]: sent}
    return {}


def _record(op, tensor, group, sent, ideal, work=None, *, t0=None, impl="torch", tag=None, peers=None):
    """Log one call on every active log; give it a span on the active timeline. Returns ``work``
    (wrapped so that its wait is a span too, when a timeline is active). ``peers``: {group rank:
    bytes sent to it}, where the algorithm is not a ring."""
    logs = _ACTIVE.logs()
    if not logs:
        return work
    seconds = None if t0 is None else time.perf_counter() - t0
    ranks = _group_ranks(group)
    rec = CommRecord(op, tensor.numel() * tensor.element_size(), sent, ideal, len(ranks),
                     seconds, impl, tag, ranks, _peers(op, ranks, sent, peers, impl, group))
    for entry in logs:
        entry.records.append(rec)
    tl = _ACTIVE.timeline()
    if tl is None or op in ("send", "recv"):
        return work
    name = f"{op} {tag}" if tag else op
    if work is not None:
        tl.mark_async(name, "comm", work)
        return _Traced(work, tl, tag or op)
    tl.record(name, "comm", t0 - tl.t0, t0 - tl.t0 + seconds)
    return work


def _call(call, async_op):
    """Run a torch collective; (handle or None, start time of a blocking call or None)."""
    if async_op:
        return call(), None
    t0 = time.perf_counter()
    return call(), t0


def _backend(group):
    return dist.get_backend(group)


# -- checked collectives (ZEROLAB_CHECK_COLLECTIVES=1) -----------------------------------------------
CHECK_ENV = "ZEROLAB_CHECK_COLLECTIVES"
_OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")
_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool)
_MAX_DIMS = 6
_CHECK_COST = {}            # (group, world size) -> socket bytes of one check (its smallest delta)


class CollectiveMismatch(RuntimeError):
    """Ranks called a collective with different ops, dtypes, shapes, reduce ops or source ranks
    (found by the check that ``ZEROLAB_CHECK_COLLECTIVES=1`` turns on)."""


def checking():
    """True when every collective is checked across ranks first (``ZEROLAB_CHECK_COLLECTIVES=1``)."""
    return os.environ.get(CHECK_ENV, "") not in ("", "0")


def _describe(op, tensor, other=None, reduce_op=None, src=None):
    """(a fixed-length int vector, the same in words) of what this rank is about to run."""
    shape = tuple(tensor.shape)
    code = [_OPS.index(op), _DTYPES.index(tensor.dtype) if tensor.dtype in _DTYPES else 99, len(shape)]
    code += list(shape[:_MAX_DIMS]) + [-1] * (_MAX_DIMS - min(len(shape), _MAX_DIMS))
    code += [tensor.numel(), -1 if other is None else other.numel(),
             -1 if reduce_op is None else zlib.crc32(str(reduce_op).encode()), -1 if src is None else src]
    words = f"{op} of {tensor.dtype} {shape}"
    if other is not None:
        words += f" into/from {other.numel()} elements"
    if reduce_op is not None:
        words += f", op {reduce_op}"
    if src is not None:
        words += f", src {src}"
    return code, words


def _check(op, tensor, group, other=None, reduce_op=None, src=None):
    """With checks on: one all-reduce (MAX of the description and of its negation) says whether
    every rank is about to run the same collective; if not, every rank gathers the descriptions
    and raises the same CollectiveMismatch. Not logged; its socket writes are excluded from
    ``measured_bytes``."""
    if not checking() or getattr(_ACTIVE._composite, "depth", 0):
        return
    logs = _ACTIVE.logs()
    w0 = _written_bytes() if logs else None
    code, words = _describe(op, tensor, other, reduce_op, src)
    both = torch.tensor(code + [-c for c in code], dtype=torch.int64, device=tensor.device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    n = len(code)
    same = both[:n].tolist() == code and [-c for c in both[n:].tolist()] == code
    if not same:
        everyone = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, words, group=group)
    if w0 is not None:
        # The check's own socket bytes are the same every time (a fixed-size all-reduce), but the
        # delta also holds the bytes of any asynchronous collective running meanwhile (a prefetch, a
        # bucket's reduce-scatter): exclude the smallest delta seen for this group, not this one.
        key = (id(group), dist.get_world_size(group))
        cost = _CHECK_COST[key] = min(_written_bytes() - w0, _CHECK_COST.get(key, float("inf")))
        for entry in logs:
            entry._excluded += cost
    if not same:
        ranks = {}
        for r, w in enumerate(everyone):
            ranks.setdefault(w, []).append(r)
        held = "; ".join(f"{w} on rank{'s' if len(rs) > 1 else ''} {rs if len(rs) > 1 else rs[0]}"
                         for w, rs in ranks.items())
        raise CollectiveMismatch(f"the ranks called different collectives: {held}. Every rank must call "
                                 f"the same collectives in the same order, with the same shapes and dtypes")


def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False, *, tag=None):
    """In-place all-reduce (sum by default) of ``tensor`` across the group."""
    n = dist.get_world_size(group)
    _check("all_reduce", tensor, group, reduce_op=op)
    work, t0 = _call(lambda: dist.all_reduce(tensor, op=op, group=group, async_op=async_op), async_op)
    s = ring_bytes("all_reduce", tensor.numel() * tensor.element_size(), n)
    return _record("all_reduce", tensor, group, s, s, work, t0=t0, tag=tag)


def reduce_scatter(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False, *, tag=None):
    """``output`` (1/N of ``input``) receives the sum over ranks of this rank's slice of ``input``.
    On gloo torch emulates this with an all_reduce of the whole input: twice the ring's bytes
    (:func:`zerolab.ring.ring_reduce_scatter` sends the ring's (N-1)/N, from send/recv)."""
    n = dist.get_world_size(group)
    if input.numel() != n * output.numel():
        raise ValueError(f"reduce_scatter: input has {input.numel()} elements, expected world_size "
                         f"({n}) x output ({output.numel()}) = {n * output.numel()}")
    s = input.numel() * input.element_size()
    _check("reduce_scatter", input, group, other=output, reduce_op=op)
    work, t0 = _call(lambda: _reduce_scatter_flat(output, input, op=op, group=group, async_op=async_op),
                     async_op)
    real_op = "all_reduce" if _backend(group) == "gloo" else "reduce_scatter"
    return _record("reduce_scatter", input, group, ring_bytes(real_op, s, n), ring_bytes("reduce_scatter", s, n),
                   work, t0=t0, tag=tag)


def all_gather(output, input, group=None, async_op=False, *, tag=None):
    """``output`` (N x ``input``) receives every rank's ``input``, in rank order."""
    n = dist.get_world_size(group)
    if output.numel() != n * input.numel():
        raise ValueError(f"all_gather: output has {output.numel()} elements, expected world_size "
                         f"({n}) x input ({input.numel()}) = {n * input.numel()}")
    _check("all_gather", input, group, other=output)
    work, t0 = _call(lambda: _all_gather_flat(output, input, group=group, async_op=async_op), async_op)
    s = ring_bytes("all_gather", output.numel() * output.element_size(), n)
    return _record("all_gather", output, group, s, s, work, t0=t0, tag=tag)


def broadcast(tensor, src, group=None, async_op=False, *, tag=None):
    """Copy ``tensor`` from rank ``src`` to every rank."""
    n = dist.get_world_size(group)
    _check("broadcast", tensor, group, src=src)
    work, t0 = _call(lambda: dist.broadcast(tensor, src=src, group=group, async_op=async_op), async_op)
    s = tensor.numel() * tensor.element_size()
    rank = dist.get_rank(group)
    group_src = src if group is None else dist.get_group_rank(group, src)  # src is a global rank
    if _backend(group) == "gloo":
        children = _binomial_children(rank, group_src, n)
        sent, peers = len(children) * s, {c: s for c in children}
    else:
        sent, peers = ring_bytes("broadcast", s, n), None
    return _record("broadcast", tensor, group, sent, ring_bytes("broadcast", s, n), work, t0=t0, tag=tag,
                   peers=peers)


def all_to_all(output, input, group=None, async_op=False, *, tag=None):
    """Rank r's chunk j of ``input`` (N equal chunks) lands as chunk r of rank j's ``output``: each
    rank sends S/N bytes to every other rank, (N-1)/N * S in all (S = ``input``'s bytes)."""
    n = dist.get_world_size(group)
    if input.numel() != output.numel() or input.numel() % n:
        raise ValueError(f"all_to_all: input ({input.numel()} elements) and output ({output.numel()}) must "
                         f"have the same size, a multiple of world_size ({n})")
    work, t0 = _call(lambda: dist.all_to_all_single(output, input, group=group, async_op=async_op), async_op)
    s = input.numel() * input.element_size()
    me = dist.get_rank(group)
    return _record("all_to_all", input, group, ring_bytes("all_to_all", s, n), ring_bytes("all_to_all", s, n),
                   work, t0=t0, tag=tag, peers={j: s // n for j in range(n) if j != me})


def isend(tensor, dst, group=None):
    """Start sending ``tensor`` to rank ``dst`` (group rank); returns a handle to ``wait()`` on."""
    s = tensor.numel() * tensor.element_size()
    work = dist.isend(tensor, _global(dst, group), group=group)
    _record("send", tensor, group, s, s, peers={dst: s})
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

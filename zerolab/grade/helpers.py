"""Helpers for graded exercise tests: which implementation to grade, and checks that name names.

The implementation under test is chosen by one switch, the environment variable ``ZEROLAB_IMPL``
(or pytest's ``--impl``, which sets it): ``exercises`` (default: your work), ``solutions``, or a
path to a folder holding ``exNN_*.py`` files (a student's submission). The chosen folder is
importable as the package ``zerolab_impl`` in the test process and in every rank alike.

Under the grader (``zerolab grade``), two more environment variables, set by its child pytest
process and inherited by the ranks, make :func:`exercise_module` stricter:
``ZEROLAB_REFERENCES`` (each exercise's REFERENCE_MODULES / REFERENCE_ALLOWED, JSON): refuse a
submission that uses the reference implementation (:mod:`zerolab.grade.references`);
``ZEROLAB_IMPORT_MARKS`` (a folder): a file per import in progress, left behind when the import
hangs or ends its process, so that the grader stops running that exercise's tests.
"""
import contextlib
import importlib
import json
import os
import pathlib
import sys
import types

from zerolab.grade.checkout import REPO
from zerolab.grade.references import guard, runtime_check

__all__ = ["REPO", "impl_dir", "use_impl", "exercise_module", "Student", "isolation", "assert_close",
           "point_to_point_only", "record_collectives", "live_storages", "new_bytes"]

TRUSTED_PID = "ZEROLAB_TRUSTED_PID"  # the process that decides verdicts: it never imports a submission
SANDBOX = "ZEROLAB_SANDBOX"          # set by the grader: the sandbox spec submissions run in


def impl_dir():
    """The folder of exercise modules being graded (see module docstring)."""
    choice = os.environ.get("ZEROLAB_IMPL", "exercises")
    path = REPO / choice if choice in ("exercises", "solutions") else pathlib.Path(choice)
    if not path.is_dir():
        raise FileNotFoundError(f"ZEROLAB_IMPL={choice!r}: no such folder {path}")
    return path.resolve()


def use_impl(path):
    """From now on, in this process, grade the folder ``path`` (sets ``ZEROLAB_IMPL``; the next
    :func:`exercise_module` imports from it). Run on live ranks too when switching a test session
    from one implementation to the next (``pytest --impl-each``)."""
    os.environ["ZEROLAB_IMPL"] = str(path)


def exercise_module(name):
    """Import exercise module ``name`` (e.g. 'ex00_collectives') from :func:`impl_dir`.

    Only in a process that runs the submission (a probe, through :class:`Student`): in the process
    that decides the verdicts (``ZEROLAB_TRUSTED_PID``) it raises, because the submission's code
    could then change the verdicts (patch pytest, the checks, the references)."""
    if os.environ.get(TRUSTED_PID) == str(os.getpid()):
        raise RuntimeError(f"exercise_module({name!r}) called in the process that decides the "
                           f"verdicts: a graded test runs the submission only through a probe "
                           f"(student.run(probe, ...) or student.on_ranks(n, probe, ...)) and checks "
                           f"the plain data the probe returns")
    path = str(impl_dir())
    pkg = sys.modules.get("zerolab_impl")
    if pkg is None or list(pkg.__path__) != [path]:
        for key in [k for k in sys.modules if k == "zerolab_impl" or k.startswith("zerolab_impl.")]:
            del sys.modules[key]
        pkg = types.ModuleType("zerolab_impl")
        pkg.__path__ = [path]
        sys.modules["zerolab_impl"] = pkg
    refused, allowed = json.loads(os.environ.get("ZEROLAB_REFERENCES", "{}")).get(name, ([], []))
    if refused:
        guard(os.path.join(path, f"{name}.py"), refused, allowed)  # before the submission runs
    marks = os.environ.get("ZEROLAB_IMPORT_MARKS")
    # Unique per import: inside the sandbox every rank sits in a PID namespace of its own, where it
    # may well be process 2 like its neighbours.
    mark = pathlib.Path(marks, f"{name}.{os.getpid()}-{os.urandom(6).hex()}") if marks and \
        f"zerolab_impl.{name}" not in sys.modules else None
    if mark:
        mark.touch()
    _taps()  # before the submission runs: names it imports from torch.distributed are the taps
    try:
        module = importlib.import_module(f"zerolab_impl.{name}")
    except Exception:
        if mark:
            mark.unlink()  # an ordinary error: the test reports it; a hang or an exit keeps the mark
        raise
    if mark:
        mark.unlink()
    if refused:
        runtime_check(module, refused, allowed)
    return module


def isolation():
    """The :class:`zerolab.launch.Isolation` a submission's ranks run under: the grader's sandbox
    when ``ZEROLAB_SANDBOX`` names its spec (set by ``zerolab grade``), else plain replies only
    (pytest run by hand: ordinary processes, the same plain-data channel)."""
    import sys

    from zerolab.launch import Isolation
    spec = os.environ.get(SANDBOX)
    if not spec:
        return Isolation()
    scratch = json.loads(pathlib.Path(spec).read_text())["scratch"]
    return Isolation(prefix=(sys.executable, "-m", "zerolab.grade.sandbox", spec), scratch=scratch)


class Student:
    """What a graded test uses to run the submission: ``run(probe, *args)`` in one process,
    ``on_ranks(n, probe, *args)`` on n ranks (a list, rank order). The probe is a module-level
    function of the test file; it imports the exercise (:func:`exercise_module`), runs it, and
    returns plain data (tensors, numbers, str, bool, None, lists, tuples, dicts), which comes back
    here without unpickling. The test then decides, here, from that data and from references it
    computes itself. A failure on a rank fails the test with the rank's error. ``clusters``: a
    callable world_size -> :class:`zerolab.Cluster` (isolated; see :func:`isolation`)."""

    def __init__(self, clusters):
        self._clusters = clusters

    def run(self, probe, *args, **kwargs):
        return self.on_ranks(1, probe, *args, **kwargs)[0]

    def call(self, module, function, *args, **kwargs):
        """``module.function(*args, **kwargs)`` of the submission, in one process; its return value
        (plain data) comes back."""
        return self.run(_call, module, function, args, kwargs)

    def module(self, name):
        """The exercise module ``name`` seen from here: ``student.module("ex07_cost_model").f(x)``
        is ``student.call("ex07_cost_model", "f", x)`` (for exercises that are plain functions)."""
        return _Remote(self, name)

    def on_ranks(self, world_size, probe, *args, **kwargs):
        import pytest

        from zerolab.launch import RankError
        _by_value(probe)
        try:
            return self._clusters(world_size).run(probe, *args, **kwargs)
        except RankError as exc:
            pytest.fail(str(exc), pytrace=False)


def _by_value(probe):
    """Send the probe's module by value: the ranks get the probe's code and the globals it uses,
    never the test file itself (its references and expected values stay in this process, and the
    sandbox does not show the tests)."""
    import cloudpickle
    module = sys.modules.get(getattr(probe, "__module__", None) or "")
    if module is not None and not module.__name__.split(".")[0] == "zerolab":
        cloudpickle.register_pickle_by_value(module)


class _Remote:
    def __init__(self, student, name):
        self._student, self._name = student, name

    def __getattr__(self, function):
        if function.startswith("_"):
            raise AttributeError(function)
        return lambda *args, **kwargs: self._student.call(self._name, function, *args, **kwargs)


def _call(module, function, args, kwargs):
    return getattr(exercise_module(module), function)(*args, **kwargs)


def assert_close(actual, expected, what, *, rtol=None, atol=None):
    """torch.testing.assert_close with a message naming the rank, the tensor and the worst element."""
    import torch
    import torch.distributed as dist
    rank = dist.get_rank() if dist.is_initialized() else 0
    if tuple(actual.shape) != tuple(expected.shape):
        raise AssertionError(f"rank {rank}: {what}: shape {tuple(actual.shape)}, expected "
                             f"{tuple(expected.shape)}")
    if actual.dtype != expected.dtype:
        raise AssertionError(f"rank {rank}: {what}: dtype {actual.dtype}, expected {expected.dtype}")
    try:
        torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)
    except AssertionError:
        diff = (actual.double() - expected.double()).abs().reshape(-1)
        diff = torch.where(diff.isnan(), torch.full_like(diff, float("inf")), diff)  # NaN: worst
        i = int(diff.argmax())
        raise AssertionError(
            f"rank {rank}: {what}: largest difference {float(diff[i]):.3g} at flat index {i} "
            f"(got {float(actual.reshape(-1)[i]):.6g}, expected {float(expected.reshape(-1)[i]):.6g}); "
            f"{int((diff > 0).sum())} of {diff.numel()} elements differ") from None


_COLLECTIVES = ("all_reduce", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single",
                "all_gather", "all_gather_into_tensor", "all_gather_single", "broadcast",
                "all_to_all", "all_to_all_single", "reduce", "scatter", "gather")
_P2P = ("isend", "send", "irecv", "recv")


class _Recording(list):
    """What :func:`record_collectives` yields: the calls (dicts, see there) and ``marks``."""

    def __init__(self, forbid=None):
        super().__init__()
        self.forbid = forbid      # record_collectives(forbid=what): collectives raise (p2p only)
        self.marks = []
        self.pending = {}         # id(work) -> (work, call): started asynchronously, not yet waited

    def outstanding(self):
        return len(self.pending)

    def mark(self, label):
        """Record a moment of the test's own (e.g. from a gradient hook of the test): its time,
        whether autograd's backward runs, and how many recorded asynchronous calls were started
        and not yet waited for then (communication in flight while compute goes on)."""
        import time

        import torch
        self.marks.append({"label": label, "t": time.perf_counter(), "outstanding": len(self.pending),
                           "in_backward": torch._C._current_graph_task_id() != -1})


class _Taps:
    """The recording taps of one process, installed once, BEFORE the submission is imported (by
    :func:`exercise_module`): a submission that wrote ``from torch.distributed import all_reduce``
    holds the tap, not torch's function, so its calls are seen too. A tap passes calls straight
    through while nothing records."""

    def __init__(self):
        import threading

        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d
        from torch._C._distributed_c10d import Work

        from zerolab import comm
        self.active, self.state = [], threading.local()
        self.check_code = comm._check.__code__
        targets = {n: getattr(dist, n) for n in _COLLECTIVES + _P2P if hasattr(dist, n)}
        for name, real in targets.items():
            tap = self._tap(name, real)
            setattr(dist, name, tap)
            if getattr(c10d, name, None) is real:
                setattr(c10d, name, tap)
        for name in ("_reduce_scatter_flat", "_all_gather_flat"):
            setattr(comm, name, self._tap(name, getattr(comm, name)))
        real_wait = Work.wait
        taps = self

        def wait(work, *args, **kwargs):
            out = real_wait(work, *args, **kwargs)
            for rec in taps.active:
                done = rec.pending.pop(id(work), None)
                if done is not None and done[0] is work:
                    done[1]["t_waited"] = _now()
            return out
        Work.wait = wait

    def _tap(self, name, real):
        taps = self

        def call(*args, **kwargs):
            if not taps.active or getattr(taps.state, "inside", False) or \
                    sys._getframe(1).f_code is taps.check_code:   # zerolab.comm's own cross-rank check
                return real(*args, **kwargs)                      # (ZEROLAB_CHECK_COLLECTIVES=1)
            import torch
            rec = taps.active[-1]
            op = _OP_NAMES.get(name, name)
            if rec.forbid and name in _COLLECTIVES + ("_reduce_scatter_flat", "_all_gather_flat"):
                raise AssertionError(f"{rec.forbid} must use only point-to-point send/recv, but it called "
                                     f"torch.distributed.{op}")
            tensors = [a for a in list(args) + list(kwargs.values()) if torch.is_tensor(a)]
            bound = _bound(real, args, kwargs)
            asynchronous = bool(bound.get("async_op", False)) or name in ("isend", "irecv")
            entry = {"op": op, "bytes": max((t.numel() * t.element_size() for t in tensors), default=0),
                     "in_backward": torch._C._current_graph_task_id() != -1, "async": asynchronous,
                     "peer": _peer(real, args, kwargs, "dst", "src"), "group": _group(bound.get("group")),
                     "seq": len(rec), "outstanding": len(rec.pending), "t_start": _now(),
                     "t_end": None, "t_waited": None}
            rec.append(entry)
            taps.state.inside = True
            try:
                result = real(*args, **kwargs)
            finally:
                taps.state.inside = False
                entry["t_end"] = _now()
            if asynchronous and result is not None:
                rec.pending[id(result)] = (result, entry)
            else:
                entry["t_waited"] = entry["t_end"]
            return result
        return call


_TAPS = []  # this process's _Taps, once installed (instrumentation: one per process, never replaced)


def _taps():
    if not _TAPS:
        _TAPS.append(_Taps())
    return _TAPS[0]


def _now():
    import time
    return time.perf_counter()


@contextlib.contextmanager
def point_to_point_only(what):
    """Inside the region torch's collectives raise, and p2p sends are counted.

    Yields a dict: 'sent' (bytes this rank passed to send/isend), 'sends' (how many), and 'to' (each
    send's (destination global rank, bytes), in call order), filled when the region ends; and
    'calls', the region's recording (:func:`record_collectives`). Recorded through the taps, so
    calls through ``dist.isend``, names imported from torch.distributed, and ``zerolab.comm`` alike.
    """
    counter = {"sent": 0, "sends": 0, "to": [], "calls": None}
    with record_collectives(forbid=what) as calls:
        counter["calls"] = calls
        try:
            yield counter
        finally:
            sends = [c for c in calls if c["op"] in ("isend", "send")]
            counter.update(sent=sum(c["bytes"] for c in sends), sends=len(sends),
                           to=[(c["peer"], c["bytes"]) for c in sends])


def _bound(real, args, kwargs):
    import inspect
    try:
        return inspect.signature(real).bind(*args, **kwargs).arguments
    except (TypeError, ValueError):
        return dict(kwargs)


def _peer(real, args, kwargs, *names):
    """The global rank a send / reduce / broadcast goes to or comes from (None if not given)."""
    import torch.distributed as dist
    bound = _bound(real, args, kwargs)
    for name in names:
        if bound.get(name) is not None:
            return bound[name]
        group_name = "group_" + name        # torch's group-relative spelling (group_dst, group_src)
        if bound.get(group_name) is not None:
            return dist.get_global_rank(bound["group"], bound[group_name]) if bound.get("group") else bound[group_name]
    return None


def _group(group):
    """The global ranks of ``group`` (None: the default group), as a tuple; None if unknown."""
    import torch.distributed as dist
    try:
        return tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
    except (RuntimeError, ValueError, AttributeError, TypeError):
        return None


_OP_NAMES = {"reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_single": "reduce_scatter",
             "_reduce_scatter_flat": "reduce_scatter", "all_gather_into_tensor": "all_gather",
             "all_gather_single": "all_gather", "_all_gather_flat": "all_gather"}


@contextlib.contextmanager
def record_collectives(*, forbid=None):
    """Inside the region, every collective or send/recv started through torch.distributed (directly,
    through a name imported from it, or via zerolab.comm) is recorded as a dict: 'op' normalised
    ('reduce_scatter', 'all_gather', 'all_reduce', 'broadcast', 'reduce', 'isend', 'irecv', ...),
    'bytes' of its largest tensor, 'in_backward' True when launched while autograd's backward was
    running (from a gradient hook), 'async' (started with ``async_op=True``, or isend/irecv), 'peer'
    (the global rank of ``dst`` / ``src``; else None), 'group' (the global ranks of its group, a
    tuple), 'seq' (its position among the calls recorded, from 0), 'outstanding' (how many recorded
    asynchronous calls were started and not yet waited for when it started), and times from
    ``time.perf_counter``: 't_start', 't_end' (the call returned) and 't_waited' (its work's
    ``wait()`` returned; a blocking call: 't_end'; never waited: None). Only the outermost call is
    recorded (torch's deprecated names call the new ones). Yields the list; its ``mark(label)``
    records the test's own moments in ``.marks`` (see :class:`_Recording`). ``forbid``: a name;
    collectives then raise (what :func:`point_to_point_only` uses)."""
    taps = _taps()
    rec = _Recording(forbid)
    taps.active.append(rec)
    try:
        yield rec
    finally:
        taps.active.remove(rec)


def live_storages(hold=None):
    """{storage key: bytes} of every tensor the garbage collector can see now, each storage once
    (views share one). A census independent of any engine's own accounting: take one before, one
    at the moment that matters, and compare (:func:`new_bytes`). Tensors held only inside autograd's
    graph (saved activations) have no Python object and are not seen. ``hold``: a list that gets
    every tensor seen, to keep their storages alive, so that a later allocation cannot reuse an
    address of the census (a key is the storage's address)."""
    import gc

    import torch
    out = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and not obj.is_meta:
            try:
                st = obj.untyped_storage()
            except RuntimeError:   # tensors without storage (sparse, nested, functorch wrappers)
                continue
            if st.nbytes():
                out[(st.device.type, st.device.index, st.data_ptr())] = st.nbytes()
                if hold is not None:
                    hold.append(obj)
    return out


def new_bytes(before, extra=(), *, settle_to=None, settle_s=1.0):
    """Bytes of the storages alive now (the census, plus the tensors in ``extra``) that were not in
    the census ``before``. ``settle_to``: while the count is above it, count again (for up to
    ``settle_s`` seconds): gloo's worker thread drops its reference to a completed collective's
    tensors a moment AFTER ``wait()`` returns, so a buffer the code under test already released can
    still be alive for an instant. A buffer the code really keeps stays counted."""
    import gc
    import time

    def count():
        now = live_storages()
        for t in extra:
            if t is not None and t.untyped_storage().nbytes():
                st = t.untyped_storage()
                now[(st.device.type, st.device.index, st.data_ptr())] = st.nbytes()
        return sum(b for key, b in now.items() if key not in before)

    extra = list(extra)
    got, deadline = count(), time.monotonic() + settle_s
    while settle_to is not None and got > settle_to and time.monotonic() < deadline:
        time.sleep(0.005)
        gc.collect()
        got = count()
    return got

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
    mark = pathlib.Path(marks, f"{name}.{os.getpid()}") if marks and \
        f"zerolab_impl.{name}" not in sys.modules else None
    if mark:
        mark.touch()
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
        try:
            return self._clusters(world_size).run(probe, *args, **kwargs)
        except RankError as exc:
            pytest.fail(str(exc), pytrace=False)


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


@contextlib.contextmanager
def point_to_point_only(what):
    """Inside the region torch's collectives raise, and p2p sends are counted.

    Yields a dict: 'sent' (bytes this rank passed to send/isend), 'sends' (how many), and 'to' (each
    send's (destination global rank, bytes), in call order). Patching the torch.distributed module
    attributes catches calls made through ``dist.isend`` and through ``zerolab.comm`` alike.
    """
    import torch.distributed as dist
    counter = {"sent": 0, "sends": 0, "to": []}
    saved = {name: getattr(dist, name) for name in _COLLECTIVES + ("isend", "send") if hasattr(dist, name)}

    def forbidden(name):
        def call(*args, **kwargs):
            raise AssertionError(f"{what} must use only point-to-point send/recv, but it called "
                                 f"torch.distributed.{name}")
        return call

    def counting(real):
        def call(tensor, *args, **kwargs):
            counter["sent"] += tensor.numel() * tensor.element_size()
            counter["sends"] += 1
            counter["to"].append((_peer(real, (tensor,) + args, kwargs, "dst"), tensor.numel() * tensor.element_size()))
            return real(tensor, *args, **kwargs)
        return call

    for name in saved:
        setattr(dist, name, counting(saved[name]) if name in ("isend", "send") else forbidden(name))
    try:
        yield counter
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


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
def record_collectives():
    """Inside the region, every collective or send started through torch.distributed (directly or
    via zerolab.comm) is recorded as a dict: 'op' normalised ('reduce_scatter', 'all_gather',
    'all_reduce', 'broadcast', 'reduce', 'isend', ...), 'bytes' of its largest tensor, 'in_backward'
    True when launched while autograd's backward was running (from a gradient hook), 'async' (it was
    started with ``async_op=True``), 'peer' (the global rank of ``dst`` / ``src`` for reduce,
    broadcast and sends; else None), 'group' (the global ranks of the group it ran on, a tuple) and
    'seq' (its position among every call recorded, from 0).
    Only the outermost call is recorded (torch's deprecated names call the new ones). Yields the list."""
    import threading

    import torch
    import torch.distributed as dist
    from zerolab import comm
    calls, state = [], threading.local()
    check_code = comm._check.__code__

    def wrap(name, real):
        def call(*args, **kwargs):
            if sys._getframe(1).f_code is check_code:   # zerolab.comm's own cross-rank check
                return real(*args, **kwargs)            # (ZEROLAB_CHECK_COLLECTIVES=1): not the code's
            outer = not getattr(state, "inside", False)
            if outer:
                tensors = [a for a in list(args) + list(kwargs.values()) if torch.is_tensor(a)]
                bound = _bound(real, args, kwargs)
                calls.append({"op": _OP_NAMES.get(name, name),
                              "bytes": max((t.numel() * t.element_size() for t in tensors), default=0),
                              "in_backward": torch._C._current_graph_task_id() != -1,
                              "async": bool(bound.get("async_op", False)) or name in ("isend", "irecv"),
                              "peer": _peer(real, args, kwargs, "dst", "src"),
                              "group": _group(bound.get("group")),
                              "seq": len(calls)})
                state.inside = True
            try:
                return real(*args, **kwargs)
            finally:
                if outer:
                    state.inside = False
        return call

    targets = [(dist, n) for n in _COLLECTIVES + ("isend", "send") if hasattr(dist, n)]
    targets += [(comm, "_reduce_scatter_flat"), (comm, "_all_gather_flat")]
    saved = [(mod, n, getattr(mod, n)) for mod, n in targets]
    for mod, n, real in saved:
        setattr(mod, n, wrap(n, real))
    try:
        yield calls
    finally:
        for mod, n, real in saved:
            setattr(mod, n, real)


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

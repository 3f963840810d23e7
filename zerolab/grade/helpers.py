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

__all__ = ["REPO", "impl_dir", "exercise_module", "assert_close", "point_to_point_only",
           "record_collectives"]


def impl_dir():
    """The folder of exercise modules being graded (see module docstring)."""
    choice = os.environ.get("ZEROLAB_IMPL", "exercises")
    path = REPO / choice if choice in ("exercises", "solutions") else pathlib.Path(choice)
    if not path.is_dir():
        raise FileNotFoundError(f"ZEROLAB_IMPL={choice!r}: no such folder {path}")
    return path.resolve()


def exercise_module(name):
    """Import exercise module ``name`` (e.g. 'ex00_collectives') from :func:`impl_dir`."""
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

    Yields a dict whose 'sent' entry is the bytes this rank passed to send/isend. Patching the
    torch.distributed module attributes catches calls made through ``dist.isend`` and through
    ``zerolab.comm`` alike.
    """
    import torch.distributed as dist
    counter = {"sent": 0, "sends": 0}
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
            return real(tensor, *args, **kwargs)
        return call

    for name in saved:
        setattr(dist, name, counting(saved[name]) if name in ("isend", "send") else forbidden(name))
    try:
        yield counter
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


_OP_NAMES = {"reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_single": "reduce_scatter",
             "_reduce_scatter_flat": "reduce_scatter", "all_gather_into_tensor": "all_gather",
             "all_gather_single": "all_gather", "_all_gather_flat": "all_gather"}


@contextlib.contextmanager
def record_collectives():
    """Inside the region, every collective or send started through torch.distributed (directly or
    via zerolab.comm) is recorded as {'op', 'bytes', 'in_backward'}: 'op' normalised
    ('reduce_scatter', 'all_gather', 'all_reduce', 'broadcast', 'isend', ...), 'bytes' of its
    largest tensor, 'in_backward' True when launched while autograd's backward was running (from a
    gradient hook). Only the outermost call is recorded (torch's deprecated names call the new
    ones). Yields the list."""
    import threading

    import torch
    import torch.distributed as dist
    from zerolab import comm
    calls, state = [], threading.local()

    def wrap(name, real):
        def call(*args, **kwargs):
            outer = not getattr(state, "inside", False)
            if outer:
                tensors = [a for a in list(args) + list(kwargs.values()) if torch.is_tensor(a)]
                calls.append({"op": _OP_NAMES.get(name, name),
                              "bytes": max((t.numel() * t.element_size() for t in tensors), default=0),
                              "in_backward": torch._C._current_graph_task_id() != -1})
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

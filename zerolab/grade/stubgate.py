"""The stub gate: ``pytest tests/graded --impl exercises --stubs-must-fail``.

A graded test that cannot fail grades nothing, so every graded test must fail on the untouched
stubs, and fail BECAUSE of the stub: the NotImplementedError that the exercise file under test
raises, in the test process or on ranks (a RankError whose failed ranks all raised it there; the
others may have been stopped while waiting for them). Anything else is a broken test, and the gate
fails it, saying why: an import error, a fixture error, a timeout, a dead rank, an AssertionError
of the test itself, a NotImplementedError from some other file.
"""
import os
import re

from zerolab.grade.checkout import exercise_name
from zerolab.grade.helpers import impl_dir
from zerolab.launch import RankError, RankTimeout

NOT_THE_STUB = "failed, but not because of the stub: "


def _chain(exc):
    """``exc`` and the exceptions it was raised from or while handling (pytest.fail inside an
    ``except RankError`` keeps the RankError as its context)."""
    seen = []
    while exc is not None and exc not in seen:
        seen.append(exc)
        exc = exc.__cause__ or exc.__context__
    return seen


def _same(a, b):
    return os.path.realpath(a) == os.path.realpath(b)


def _innermost_file(traceback_text):
    files = re.findall(r'File "([^"]+)", line \d+', traceback_text)
    return files[-1] if files else None


def why_not_the_stub(exc, stub_file):
    """None when ``exc`` (a test's failure) is the stub's NotImplementedError raised from
    ``stub_file``; else a sentence saying what it is instead."""
    shown = os.path.basename(stub_file)
    if isinstance(exc, NotImplementedError):
        tb = exc.__traceback__
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        where = tb.tb_frame.f_code.co_filename if tb is not None else None
        if where and _same(where, stub_file):
            return None
        return f"NotImplementedError raised from {where}, not from the stub {shown}"
    rank_error = next((e for e in _chain(exc) if isinstance(e, RankError)), None)
    if rank_error is None:
        return f"{type(exc).__name__}: {str(exc).strip()[:500]}"
    first_line = str(rank_error).splitlines()[0] if str(rank_error) else type(rank_error).__name__
    if isinstance(rank_error, RankTimeout):
        return f"RankTimeout: {first_line}"
    died = [r for r in rank_error.ranks if r not in rank_error.exc_types]
    if died or not rank_error.exc_types:
        return f"RankError: {first_line}"
    for rank, etype in sorted(rank_error.exc_types.items()):
        where = _innermost_file(rank_error.remote_tracebacks.get(rank, ""))
        if etype != "NotImplementedError":
            return f"rank {rank} raised {etype}: {first_line}"
        if not (where and _same(where, stub_file)):
            return f"rank {rank} raised NotImplementedError from {where}, not from the stub {shown}"
    return None


def judge(item, call, report):
    """Invert one graded test's report in place: a failure caused by the stub passes; a pass, or a
    failure with another cause, fails with the reason."""
    if report.when == "setup" and report.failed:
        report.longrepr = f"{NOT_THE_STUB}its setup failed:\n{report.longreprtext}"
        return
    if report.when != "call":
        return
    if report.passed:
        report.outcome = "failed"
        report.longrepr = (f"{item.nodeid} PASSED on the untouched stubs: a graded test that cannot "
                           f"fail grades nothing")
    elif report.failed:
        stub_file = os.path.join(impl_dir(), exercise_name(item.path) + ".py")
        why = why_not_the_stub(call.excinfo.value, stub_file)
        if why is None:
            report.outcome, report.longrepr = "passed", None
        else:
            report.longrepr = f"{NOT_THE_STUB}{why}\n\n{report.longreprtext}"

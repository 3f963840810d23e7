"""Fixtures of the graded tests. ``student``: runs the submission (zerolab.grade.helpers.Student);
the test process itself never imports it (ZEROLAB_TRUSTED_PID), so that what decides the verdicts
cannot be changed by the code being graded."""
import os

import pytest

from zerolab import RankError
from zerolab.grade.helpers import TRUSTED_PID, Student


@pytest.fixture(autouse=True)
def _trusted_process(monkeypatch):
    """Every graded test: this process refuses to import the submission (exercise_module raises),
    so a test that would run the student's code where the verdict is decided fails loudly."""
    monkeypatch.setenv(TRUSTED_PID, str(os.getpid()))


@pytest.fixture
def student(student_clusters):
    """``student.run(probe, *args)`` / ``student.on_ranks(n, probe, *args)``: the submission's code,
    in its own processes; plain data back."""
    return Student(student_clusters)


@pytest.fixture
def on_ranks(student_clusters):
    """``on_ranks(n, fn, *args)``: run a check on n ranks; a rank's failure becomes a plain test
    failure whose message names the rank (no noise from the launcher's own frames)."""
    def run(n, fn, *args, **kwargs):
        try:
            return student_clusters(n).run(fn, *args, **kwargs)
        except RankError as exc:
            pytest.fail(str(exc), pytrace=False)
    return run


@pytest.fixture(scope="session", autouse=True)
def _impl_each(request, student_clusters):
    """With ``--impl-each DIRS`` every graded test runs once per folder (pytest groups the tests by
    folder): the folder is switched here, in this process and on the ranks already running (ranks
    started later inherit it). Without the option: nothing to do."""
    path = getattr(request, "param", None)
    if path is None:
        yield
        return
    from zerolab.grade.helpers import use_impl
    use_impl(path)
    for cluster in student_clusters.live():
        cluster.run(use_impl, path)
    yield

"""The grader, the top layer of zerolab: it may import anything in zerolab; nothing imports it.

    zerolab grade [PATH] [--gradescope results.json] [--csv grades.csv] ...   (see cli)
    zerolab.grade.check("03")                                               (a lesson's last cell)

Modules: :mod:`~zerolab.grade.cli` (the command line, ``check``, Gradescope's JSON, the CSV of a class),
:mod:`~zerolab.grade.runner` (run the graded tests on one submission and score them),
:mod:`~zerolab.grade.child` (the child pytest process that runs them),
:mod:`~zerolab.grade.references` (refusing a submission that uses the reference implementation),
:mod:`~zerolab.grade.stubgate` (``--stubs-must-fail``: a graded test must fail because of the stub),
:mod:`~zerolab.grade.helpers` (what graded tests import: exercise_module, assert_close, ...),
:mod:`~zerolab.grade.checkout` (where the graded tests live).
"""
from zerolab.grade.cli import check, gradescope_results, main
from zerolab.grade.runner import run_graded

__all__ = ["check", "gradescope_results", "main", "run_graded"]

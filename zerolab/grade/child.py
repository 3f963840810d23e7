"""The grader's child process: pytest on the graded tests, with a plugin that reports to the parent.

    python -m zerolab.grade.child CONFIG_JSON [pytest arguments ...]

Started by :func:`zerolab.grade.runner.run_graded`, never by hand. CONFIG_JSON names:
``events`` (a file this process appends one JSON line to per event, flushed at once, so that the
parent knows what finished and what was running if this process dies), ``verdicts`` (exercise ->
reason, decided by the parent before any test runs: a missing file, a syntax error, a refused
import) and ``marks`` (the folder of import marks, see :func:`zerolab.grade.helpers.exercise_module`).
"""
import json
import os
import pathlib
import re
import sys

import pytest

from zerolab.grade.checkout import exercise_name


class GradePlugin:
    """Records collection, start and result of every graded test; fails at once, without running
    them, the tests of an exercise the parent refused or whose import hung or ended its process."""

    def __init__(self, config):
        self.events = config["events"]
        self.verdicts = dict(config["verdicts"])
        self.marks = pathlib.Path(config["marks"])
        self.broken = {}    # exercise -> why its remaining tests are not run
        self.points = {}
        self._scan_marks("an earlier test")

    def _write(self, row):
        with open(self.events, "a") as f:
            f.write(json.dumps(row) + "\n")

    def _scan_marks(self, where):
        for mark in sorted(self.marks.iterdir()):
            name = mark.name.rpartition(".")[0]
            self.broken.setdefault(name, f"importing {name}.py did not complete in {where}: it hung, "
                                         f"or ended its process; the remaining tests of this exercise "
                                         f"are not run")

    def pytest_collection_modifyitems(self, items):
        declared = {}
        for item in items:
            marker = item.get_closest_marker("points")
            self.points[item.nodeid] = marker.args[0] if marker else 0
            _, sep, rest = item.nodeid.partition("::")
            self._write({"event": "collected", "nodeid": item.nodeid, "arg": f"{item.path}{sep}{rest}",
                         "points": self.points[item.nodeid]})
            module = getattr(item, "module", None)
            declared[exercise_name(item.path)] = (list(getattr(module, "REFERENCE_MODULES", [])),
                                                  list(getattr(module, "REFERENCE_ALLOWED", [])))
        # Read by exercise_module here and on every rank: the ranks start later and inherit it.
        os.environ["ZEROLAB_REFERENCES"] = json.dumps(declared)

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item):
        name = exercise_name(item.path)
        reason = self.verdicts.get(name) or self.broken.get(name)
        if reason:
            pytest.fail(f"not run: {reason}", pytrace=False)

    def pytest_runtest_logstart(self, nodeid, location):
        self._write({"event": "start", "nodeid": nodeid})

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or (report.when == "setup" and not report.passed):
            text = report.longreprtext if report.failed else ""
            self._write({"event": "result", "nodeid": report.nodeid, "outcome": report.outcome,
                         "points": self.points.get(report.nodeid, 0), "message": reason(text),
                         "output": text[-4000:]})

    def pytest_runtest_logfinish(self, nodeid, location):
        self._scan_marks(nodeid.partition("::")[2] or nodeid)


def reason(text):
    """The most useful line of a failure: the remote exception, else the assertion, else the last."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for pattern in (r"^(not run|refused): ", r"raised \w+(Error|Exception)", r"did not finish within",
                    r"died \(", r"^E\s+\w*(Error|Exception)", r"Error:", r"^E\s", r"Timeout"):
        for line in lines:
            if re.search(pattern, line):
                return re.sub(r"^E\s+", "", line)[:400]
    return lines[-1][:400] if lines else ""


def main(argv):
    config = json.loads(pathlib.Path(argv[0]).read_text())
    # No folder that holds a solutions/ (a checkout) stays on the path: a submission must not import
    # the worked answers. The ranks start with this sys.path, so they cannot either.
    sys.path[:] = [p for p in sys.path if not os.path.isdir(os.path.join(p or os.getcwd(), "solutions"))]
    return pytest.main(argv[1:], plugins=[GradePlugin(config)])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

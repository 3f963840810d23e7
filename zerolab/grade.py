"""Grading a student's exercises: the graded tests under tests/graded, scored by their points.

``check("03")`` (in a notebook) runs lesson 03's graded tests on your ``exercises/`` and prints
one line per test with its points and, on failure, the first line of the reason.
"""
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile

from zerolab.grading import REPO

GRADED = REPO / "tests" / "graded"


class _Recorder:
    """pytest plugin: writes {nodeid, points, outcome, message} per graded test to a JSON file."""

    def __init__(self, path):
        self.path, self.rows, self.points = path, [], {}

    def pytest_collection_modifyitems(self, items):
        for item in items:
            marker = item.get_closest_marker("points")
            self.points[item.nodeid] = marker.args[0] if marker else 0

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or (report.when == "setup" and not report.passed):
            message = ""
            if report.failed:
                message = _reason(report.longreprtext)
            self.rows.append({"nodeid": report.nodeid, "points": self.points.get(report.nodeid, 0),
                              "outcome": report.outcome, "message": message})

    def pytest_sessionfinish(self):
        pathlib.Path(self.path).write_text(json.dumps(self.rows))


def _reason(text):
    """The most useful line of a failure: the remote exception, else the assertion, else the last."""
    lines = [l.strip() for l in text.splitlines() if l.strip()]
    for pattern in (r"raised \w+(Error|Exception)", r"^E\s+\w*(Error|Exception)", r"Error:", r"^E\s"):
        for line in lines:
            if re.search(pattern, line):
                return re.sub(r"^E\s+", "", line)[:300]
    return lines[-1][:300] if lines else ""


def run_graded(pattern, impl, timeout=900):
    """Run graded tests whose files match ``pattern`` against ``impl``; returns the result rows."""
    files = sorted(GRADED.glob(pattern))
    if not files:
        raise ValueError(f"no graded tests match {pattern!r} in {GRADED}")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "results.json")
        code = ("import sys, pytest; from zerolab.grade import _Recorder; "
                f"sys.exit(pytest.main(sys.argv[1:], plugins=[_Recorder({out!r})]))")
        env = dict(os.environ, ZEROLAB_IMPL=str(impl))
        env.pop("PYTEST_CURRENT_TEST", None)
        subprocess.run([sys.executable, "-c", code, "-q", "-p", "no:cacheprovider", "--no-header",
                        "-o", "addopts=", *map(str, files)], cwd=REPO, env=env, timeout=timeout,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if not os.path.exists(out):
            raise RuntimeError(f"the graded tests for {pattern!r} did not run (pytest crashed)")
        return json.loads(pathlib.Path(out).read_text())


def check(lesson, path=None):
    """Run lesson ``lesson``'s graded tests on your exercises (or ``path``) and print the score."""
    lesson = f"{int(lesson):02d}"
    rows = run_graded(f"test_ex{lesson}_*.py", path or (REPO / "exercises"))
    got = sum(r["points"] for r in rows if r["outcome"] == "passed")
    total = sum(r["points"] for r in rows)
    print(f"Exercise {lesson}: {got} / {total} points")
    previous = None
    for r in rows:
        name = r["nodeid"].split("::", 1)[-1]
        mark = "PASS" if r["outcome"] == "passed" else "FAIL"
        print(f"  {mark} {name:<48} {r['points'] if mark == 'PASS' else 0}/{r['points']}")
        # A stub fails the same way on every world size: say why once.
        reason = re.sub(r"^ranks? [\d, ]+ raised ", "", r["message"])
        if reason and reason != previous:
            print(f"       {reason}")
        previous = reason
    return got, total

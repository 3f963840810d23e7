"""The grader: score a student's exercises with the graded tests under tests/graded.

    zerolab grade [PATH]                       # PATH: a folder of exNN_*.py (default: exercises/)
    zerolab grade PATH --gradescope results.json
    zerolab grade SUBMISSIONS --csv grades.csv # a folder of students' folders or .zip files

In a notebook, ``zerolab.grade.check("03")`` grades one lesson and prints the result inline.

Isolation: the graded tests run in a child pytest process, each under its own time limit
(pytest-timeout). A hang inside a collective ends as a RankTimeout, a killed rank as a RankError:
that test scores 0 and the next one runs on fresh ranks. If student code takes down the whole
child process, the grader scores the test that was running 0 with the reason and starts a new
child for the tests that remain.
"""
import argparse
import csv
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import zipfile

from zerolab.grading import REPO

GRADED = REPO / "tests" / "graded"
TEST_TIMEOUT = 240  # seconds per graded test, ranks' start-up included


class _Recorder:
    """pytest plugin: appends one JSON line per event to a file, flushed at once, so that the
    parent knows what finished and what was running if this process dies."""

    def __init__(self, path):
        self.path, self.points = path, {}

    def _write(self, row):
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")

    def pytest_collection_modifyitems(self, items):
        for item in items:
            marker = item.get_closest_marker("points")
            self.points[item.nodeid] = marker.args[0] if marker else 0
            self._write({"event": "collected", "nodeid": item.nodeid, "points": self.points[item.nodeid]})

    def pytest_runtest_logstart(self, nodeid):
        self._write({"event": "start", "nodeid": nodeid})

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or (report.when == "setup" and not report.passed):
            self._write({"event": "result", "nodeid": report.nodeid, "outcome": report.outcome,
                         "points": self.points.get(report.nodeid, 0),
                         "message": _reason(report.longreprtext) if report.failed else "",
                         "output": report.longreprtext[-4000:] if report.failed else ""})


def _reason(text):
    """The most useful line of a failure: the remote exception, else the assertion, else the last."""
    lines = [l.strip() for l in text.splitlines() if l.strip()]
    for pattern in (r"raised \w+(Error|Exception)", r"did not finish within", r"died \(",
                    r"^E\s+\w*(Error|Exception)", r"Error:", r"^E\s", r"Timeout"):
        for line in lines:
            if re.search(pattern, line):
                return re.sub(r"^E\s+", "", line)[:300]
    return lines[-1][:300] if lines else ""


def _files(lessons):
    files = sorted(GRADED.glob("test_ex*.py"))
    if lessons:
        wanted = {f"{int(l):02d}" for l in lessons}
        files = [f for f in files if f.name[7:9] in wanted]
    if not files:
        raise ValueError(f"no graded tests for lessons {lessons} in {GRADED}")
    return files


def run_graded(impl, lessons=None, test_timeout=TEST_TIMEOUT):
    """Grade the exercise folder ``impl``; returns one row per graded test (in collection order):
    {nodeid, lesson, points, score, outcome, message, output}."""
    impl = pathlib.Path(impl).resolve()
    if not impl.is_dir():
        raise FileNotFoundError(f"no such exercises folder: {impl}")
    targets = [str(f) for f in _files(lessons)]
    collected, results = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for attempt in range(50):  # each pass resumes after a crash of the child process
            log = os.path.join(tmp, f"events{attempt}.jsonl")
            code = ("import sys, pytest; from zerolab.grade import _Recorder; "
                    f"sys.exit(pytest.main(sys.argv[1:], plugins=[_Recorder({log!r})]))")
            env = dict(os.environ, ZEROLAB_IMPL=str(impl))
            env.pop("PYTEST_CURRENT_TEST", None)
            remaining = [n for n in collected if n not in results] if collected else targets
            proc = subprocess.run(
                [sys.executable, "-c", code, "-q", "-p", "no:cacheprovider", "--no-header", "-o", "addopts=",
                 f"--timeout={test_timeout}", *[str(REPO / n) if "::" in n else n for n in remaining]],
                cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            running = None
            if os.path.exists(log):
                for line in pathlib.Path(log).read_text().splitlines():
                    ev = json.loads(line)
                    if ev["event"] == "collected":
                        collected.setdefault(_rel(ev["nodeid"]), ev["points"])
                    elif ev["event"] == "start":
                        running = _rel(ev["nodeid"])
                    else:
                        results[_rel(ev["nodeid"])] = ev
                        running = None
            if not collected:  # the test files themselves could not be collected
                raise RuntimeError("the graded tests could not be collected:\n" + proc.stdout[-3000:])
            if running is not None and running not in results:
                # the child died inside this test: it scores 0 and the rest run in a new child
                results[running] = {"outcome": "failed", "message":
                                    f"this test crashed the grading process (exit code {proc.returncode})",
                                    "output": proc.stdout[-4000:]}
            if all(n in results for n in collected):
                break
    rows = []
    for nodeid, points in collected.items():
        r = results.get(nodeid, {"outcome": "failed", "message": "not run", "output": ""})
        passed = r["outcome"] == "passed"
        rows.append({"nodeid": nodeid, "lesson": re.search(r"test_ex(\d\d)", nodeid).group(1),
                     "points": points, "score": points if passed else 0, "outcome": r["outcome"],
                     "message": r.get("message", ""), "output": r.get("output", "")})
    return rows


def _rel(nodeid):
    """Node ids relative to the repo, whatever path pytest was given."""
    path, _, rest = nodeid.partition("::")
    p = pathlib.Path(path)
    if p.is_absolute():
        p = p.relative_to(REPO)
    return f"{p.as_posix()}::{rest}" if rest else p.as_posix()


def _table(rows):
    lines, previous = [], None
    for lesson in sorted({r["lesson"] for r in rows}):
        mine = [r for r in rows if r["lesson"] == lesson]
        lines.append(f"Exercise {lesson}: {sum(r['score'] for r in mine)} / {sum(r['points'] for r in mine)} points")
        for r in mine:
            mark = "PASS" if r["outcome"] == "passed" else "FAIL"
            lines.append(f"  {mark} {r['nodeid'].split('::', 1)[-1]:<48} {r['score']}/{r['points']}")
            # A stub fails the same way on every world size: say why once.
            reason = re.sub(r"^ranks? [\d, ]+ raised ", "", r["message"])
            if reason and reason != previous:
                lines.append(f"       {reason}")
            previous = reason
    return "\n".join(lines)


def check(lesson, path=None):
    """Grade one lesson's exercises (default: the repo's exercises/) and print the result."""
    rows = run_graded(path or (REPO / "exercises"), lessons=[lesson])
    print(_table(rows))
    return sum(r["score"] for r in rows), sum(r["points"] for r in rows)


def gradescope_results(rows, error=None):
    """Gradescope's autograder results.json format."""
    tests = [{"name": r["nodeid"].split("::", 1)[-1], "number": f"{r['lesson']}.{i + 1}",
              "score": r["score"], "max_score": r["points"],
              "status": "passed" if r["outcome"] == "passed" else "failed",
              "output": r["message"] + ("\n\n" + r["output"] if r["output"] else ""),
              "visibility": "visible"} for i, r in enumerate(rows)]
    out = {"score": sum(r["score"] for r in rows), "tests": tests,
           "output": error or f"{len(rows)} graded tests run"}
    if rows:
        out["max_score"] = sum(r["points"] for r in rows)
    return out


def _submissions(folder, workdir):
    """(student name, exercises folder) for each subfolder or .zip in ``folder``."""
    for entry in sorted(pathlib.Path(folder).iterdir()):
        if entry.is_dir():
            yield entry.name, entry
        elif entry.suffix == ".zip":
            target = pathlib.Path(workdir) / entry.stem
            with zipfile.ZipFile(entry) as z:
                z.extractall(target)
            found = sorted({p.parent for p in target.rglob("ex[0-9][0-9]_*.py")})
            yield entry.stem, found[0] if found else target


def main(argv=None):
    ap = argparse.ArgumentParser(prog="zerolab grade", description="Grade exercises with the graded tests.")
    ap.add_argument("path", nargs="?", default=str(REPO / "exercises"),
                    help="folder of exNN_*.py files (default: exercises/); with --csv, a folder of submissions")
    ap.add_argument("--lessons", nargs="*", help="only these lessons, e.g. 00 03")
    ap.add_argument("--gradescope", nargs="?", const="results.json", metavar="RESULTS_JSON",
                    help="write Gradescope's results.json (default name results.json)")
    ap.add_argument("--csv", metavar="GRADES_CSV", help="grade every submission in PATH; one row per student")
    ap.add_argument("--test-timeout", type=float, default=TEST_TIMEOUT, help="seconds per graded test")
    args = ap.parse_args(argv)

    if args.csv:
        with tempfile.TemporaryDirectory() as work, open(args.csv, "w", newline="") as f:
            writer = None
            for student, folder in _submissions(args.path, work):
                rows = run_graded(folder, args.lessons, args.test_timeout)
                lessons = sorted({r["lesson"] for r in rows})
                if writer is None:
                    writer = csv.writer(f)
                    writer.writerow(["student"] + [f"ex{l}" for l in lessons] + ["total"])
                scores = [sum(r["score"] for r in rows if r["lesson"] == l) for l in lessons]
                writer.writerow([student] + scores + [sum(scores)])
                print(f"{student}: {sum(scores)} / {sum(r['points'] for r in rows)}")
        return 0

    rows, error = [], None
    try:
        rows = run_graded(args.path, args.lessons, args.test_timeout)
        print(_table(rows))
    except Exception as exc:  # the grader itself must always produce a result file
        error = f"grading failed: {type(exc).__name__}: {exc}"
        print(error, file=sys.stderr)
    finally:
        if args.gradescope:
            pathlib.Path(args.gradescope).write_text(json.dumps(gradescope_results(rows, error), indent=2))
    if rows:
        print(f"\nTotal: {sum(r['score'] for r in rows)} / {sum(r['points'] for r in rows)} points")
    return 0 if error is None else 1

"""The grader: score a student's exercises with the graded tests of a zerolab checkout.

    zerolab grade [PATH]                       # PATH: a folder of exNN_*.py (default: exercises/)
    zerolab grade PATH --gradescope results.json
    zerolab grade SUBMISSIONS --csv grades.csv # a folder of students' folders or .zip files
    options: --lessons 00 03  --tests PATH  --budget S  --test-timeout S  --rank-timeout S

In a notebook, ``zerolab.grade.check("03")`` grades one lesson and prints the result inline.

Before any test runs, each submitted ``exNN_*.py`` is read, never executed: a missing file, a
syntax error, or a use of the exercise's reference implementation (the test file's
REFERENCE_MODULES, see :mod:`zerolab.grade.references`) scores that exercise 0 with the reason.

Isolation: the graded tests run in a child pytest process (:mod:`zerolab.grade.child`) whose
``sys.path`` holds the zerolab package but not the checkout, so a submission cannot import
``solutions/``. Each test has its own time limit (``--test-timeout``, pytest-timeout); the ranks'
limit per run (``--rank-timeout``, ZEROLAB_TEST_TIMEOUT) is below it, so that a hang inside a
collective ends as a RankTimeout, which stops the ranks: the next test starts on fresh ones. A
killed rank is a RankError. If student code takes down the child process, the test that was
running scores 0 with the reason and a new child runs the tests that remain. An import that hangs
or ends its process is not retried: that exercise's remaining tests score 0 with the reason.

Time: a submission has a budget (``--budget``, all its tests together). When it runs out, the
child and every process it started are killed; the test running and those not run score 0.
"""
import csv
import json
import os
import pathlib
import re
import secrets
import subprocess
import sys
import tempfile
import threading
import time
import zipfile

from zerolab.grade.checkout import checkout_root, exercise_name, graded_dir
from zerolab.grade.references import REFUSED, declaration, static_check

TEST_TIMEOUT = 240.0  # seconds per graded test, the ranks' start-up included
RANK_TIMEOUT = 60.0   # seconds per run on the ranks (at most half the test's limit)
BUDGET = 900.0        # seconds per submission; the solutions take under a minute on 2 cores
OUTPUT_TAIL = 20_000  # characters of the child's output kept: a submission may print megabytes
ZIP_LIMIT = 50 << 20  # bytes a submitted .zip may expand to
PACKAGE = pathlib.Path(__file__).resolve().parents[1]  # the zerolab package the child imports


def _options(test_timeout, rank_timeout, budget):
    """(test_timeout, rank_timeout, budget) validated; ValueError naming the bad value."""
    def seconds(name, value):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
            raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        return float(value)
    test_timeout = seconds("test_timeout", test_timeout)
    rank_timeout = seconds("rank_timeout", min(RANK_TIMEOUT, test_timeout / 2) if rank_timeout is None
                           else rank_timeout)
    if rank_timeout >= test_timeout:
        raise ValueError(f"rank_timeout ({rank_timeout:g} s) must be below test_timeout "
                         f"({test_timeout:g} s): a stuck test must end as a RankTimeout, which restarts "
                         f"the ranks, not as a pytest-timeout kill that leaves them stuck")
    return test_timeout, rank_timeout, seconds("budget", budget)


def _files(graded, lessons):
    files = sorted(graded.glob("test_ex[0-9][0-9]_*.py"))
    if lessons:
        wanted = set()
        for lesson in lessons:
            if not re.fullmatch(r"\d{1,2}", str(lesson)):
                raise ValueError(f"lessons: {lesson!r} is not a lesson number (00-99)")
            wanted.add(f"{int(lesson):02d}")
        files = [f for f in files if f.name[7:9] in wanted]
    if not files:
        raise ValueError(f"no graded tests for lessons {lessons} in {graded}")
    return files


def _static_verdicts(impl, files):
    """exercise -> why its tests need not run, decided from the submitted files alone."""
    verdicts = {}
    for test_file in files:
        name = exercise_name(test_file)
        path = impl / f"{name}.py"
        refused, allowed = declaration(test_file)
        if not path.is_file():
            verdicts[name] = f"{path.name} is missing from the submission"
            continue
        try:
            reason = static_check(path.read_bytes(), path.name, refused, allowed)
        except SyntaxError as exc:
            reason = f"{path.name} does not compile: SyntaxError: {exc.msg} (line {exc.lineno})"
        except ValueError as exc:  # e.g. null bytes
            reason = f"{path.name} does not compile: {exc}"
        if reason:
            verdicts[name] = reason
    return verdicts


class _Tail(threading.Thread):
    """Drains a stream, keeping only its last OUTPUT_TAIL characters."""

    def __init__(self, stream):
        super().__init__(daemon=True)
        self.stream, self.data = stream, b""
        self.start()

    def run(self):
        for chunk in iter(lambda: self.stream.read1(1 << 16), b""):
            self.data = (self.data + chunk)[-OUTPUT_TAIL:]

    def text(self):
        return self.data.decode(errors="replace")


def _kill_all(proc, tag):
    """Kill the child and every process it started: its descendants, and any process whose
    environment carries this grading's tag (the ranks run in sessions of their own, and a child
    that died has left them orphaned)."""
    import psutil
    try:
        family = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        family = []
    proc.kill()
    proc.wait()
    for p in psutil.process_iter():
        try:
            if p not in family and p.environ().get("ZEROLAB_GRADE_TAG") == tag:
                family.append(p)
        except psutil.Error:
            pass
    for p in family:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(family, timeout=10)


def _child_env(impl, rank_timeout, tmp, tag):
    env = dict(os.environ, ZEROLAB_IMPL=str(impl), ZEROLAB_TEST_TIMEOUT=f"{rank_timeout:g}",
               ZEROLAB_IMPORT_MARKS=str(tmp / "marks"), ZEROLAB_GRADE_TAG=tag)
    for key in ("PYTEST_CURRENT_TEST", "ZEROLAB_REFERENCES", "PYTEST_ADDOPTS"):
        env.pop(key, None)
    # The zerolab package through a folder that holds only it: the child drops from sys.path every
    # folder that holds a solutions/ (the checkout), and still imports zerolab.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(tmp / "sys_path"), env.get("PYTHONPATH")) if p)
    return env


def _read_events(path, collected, results):
    """Fold one child's events into ``collected`` and ``results``; return the test it was running
    when it ended (None if it was between tests)."""
    running = None
    if path.exists():
        for line in path.read_text().splitlines():
            ev = json.loads(line)
            if ev["event"] == "collected":
                collected.setdefault(ev["nodeid"], ev)
            elif ev["event"] == "start":
                running = ev["nodeid"]
            else:
                results[ev["nodeid"]] = ev
                running = None
    return running


def run_graded(impl, lessons=None, test_timeout=TEST_TIMEOUT, *, rank_timeout=None, budget=BUDGET,
               tests=None):
    """Grade the exercise folder ``impl``; returns one row per graded test (in collection order):
    {nodeid, lesson, points, score, outcome, message, output}. ``tests``: the folder of graded
    test files (default: the checkout's tests/graded); other options: see the module docstring."""
    test_timeout, rank_timeout, budget = _options(test_timeout, rank_timeout, budget)
    graded = graded_dir(tests)
    impl = pathlib.Path(impl).resolve()
    if not impl.is_dir():
        raise FileNotFoundError(f"no such exercises folder: {impl}")
    files = _files(graded, lessons)
    verdicts = _static_verdicts(impl, files)
    deadline = time.monotonic() + budget
    collected, results, out_of_time = {}, {}, False
    with tempfile.TemporaryDirectory(prefix="zerolab-grade-") as tmp:
        tmp = pathlib.Path(tmp)
        (tmp / "marks").mkdir()
        (tmp / "sys_path").mkdir()
        (tmp / "sys_path" / "zerolab").symlink_to(PACKAGE, target_is_directory=True)
        tag = secrets.token_hex(8)
        env = _child_env(impl, rank_timeout, tmp, tag)
        for attempt in range(1_000_000):  # each pass resumes after a crash of the child; ends below
            remaining = ([ev["arg"] for n, ev in collected.items() if n not in results] if collected
                         else [str(f) for f in files])
            config = tmp / f"child{attempt}.json"
            events = tmp / f"events{attempt}.jsonl"
            config.write_text(json.dumps({"events": str(events), "verdicts": verdicts,
                                          "marks": str(tmp / "marks")}))
            proc = subprocess.Popen(
                [sys.executable, "-m", "zerolab.grade.child", str(config), "-q", "--no-header",
                 "-p", "no:cacheprovider", "-o", "addopts=", "-o", "pythonpath=",
                 "--continue-on-collection-errors", f"--timeout={test_timeout:g}", *remaining],
                cwd=tmp, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, start_new_session=True)
            tail = _Tail(proc.stdout)
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                out_of_time = True
            finally:
                _kill_all(proc, tag)
                tail.join(5)
            output = tail.text()
            done_before = len(results)
            running = _read_events(events, collected, results)
            if not collected:  # the test files themselves could not be collected
                raise RuntimeError("the graded tests could not be collected:\n" + output[-3000:])
            if running is not None and running not in results:
                why = (f"the submission's time budget ({budget:g} s, --budget) ran out while this test ran"
                       if out_of_time else
                       f"this test crashed the grading process (exit code {proc.returncode})")
                results[running] = {"outcome": "failed", "message": why, "output": output[-4000:]}
            if out_of_time or len(results) == done_before or all(n in results for n in collected):
                break
    not_run = (f"not run: the submission's time budget ({budget:g} s, --budget) ran out" if out_of_time
               else "not run: the grading process ended before this test")
    rows = []
    for nodeid, ev in collected.items():
        r = results.get(nodeid, {"outcome": "failed", "message": not_run, "output": ""})
        passed = r["outcome"] == "passed"
        rows.append({"nodeid": nodeid, "lesson": re.search(r"test_ex(\d\d)", nodeid).group(1),
                     "points": ev["points"], "score": ev["points"] if passed else 0,
                     "outcome": r["outcome"], "message": r.get("message", ""), "output": r.get("output", "")})
    return _refuse_whole_exercises(rows)


def _refuse_whole_exercises(rows):
    """A use of the reference implementation found at run time by one test scores the whole
    exercise 0, as the static check does."""
    for lesson in {r["lesson"] for r in rows}:
        refusal = next((r["message"] for r in rows if r["lesson"] == lesson and REFUSED in r["message"]), None)
        if refusal:
            for r in rows:
                if r["lesson"] == lesson:
                    r.update(score=0, outcome="failed" if r["outcome"] == "passed" else r["outcome"],
                             message=refusal[refusal.index(REFUSED):])
    return rows


def notes(rows):
    """One line per exercise scored 0 without (fully) running: refused, missing, not compiling,
    import hung, time budget."""
    seen = {}
    for r in rows:
        m = r["message"]
        if m.startswith("not run: ") or m.startswith(REFUSED) or "time budget" in m:
            seen.setdefault(r["lesson"], re.sub(r"^not run: ", "", m))
    return [f"ex{lesson}: {m}" for lesson, m in sorted(seen.items())]


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


def check(lesson, path=None, **options):
    """Grade one lesson's exercises (default: the checkout's exercises/) and print the result.
    Returns (points scored, points possible). ``options``: as :func:`run_graded`'s."""
    rows = run_graded(path or checkout_root() / "exercises", lessons=[lesson], **options)
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
           "output": error or "\n".join([f"{len(rows)} graded tests run", *notes(rows)])}
    if rows:
        out["max_score"] = sum(r["points"] for r in rows)
    return out


def _exercise_folder(root):
    """The folder of a submission that holds its exNN_*.py files (they may sit one level down)."""
    if any(root.glob("ex[0-9][0-9]_*.py")):
        return root
    found = sorted({p.parent for p in root.rglob("ex[0-9][0-9]_*.py")})
    return found[0] if found else root


def _unpack(entry, workdir):
    """The exercises folder of one submission: a folder, or a .zip extracted under ``workdir``."""
    if entry.is_dir():
        return _exercise_folder(entry)
    target = pathlib.Path(workdir) / entry.stem
    try:
        with zipfile.ZipFile(entry) as z:
            size = sum(i.file_size for i in z.infolist())
            if size > ZIP_LIMIT:
                raise ValueError(f"{entry.name} expands to {size} bytes, more than the {ZIP_LIMIT} allowed")
            z.extractall(target)  # member names with '..' or absolute paths stay inside target
    except (zipfile.BadZipFile, EOFError, OSError) as exc:
        raise ValueError(f"{entry.name} is not a readable .zip file ({exc})") from None
    return _exercise_folder(target)


def grade_submissions(folder, csv_path, lessons=None, **options):
    """Grade every subfolder or .zip of ``folder``; one row per student in ``csv_path``, written
    as each finishes: a score per exercise, the total, and notes (why an exercise scored 0 without
    running, or why a submission could not be graded: it scores 0, the others are unaffected)."""
    folder = pathlib.Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"no such submissions folder: {folder}")
    lessons_all = sorted({f.name[7:9] for f in _files(graded_dir(options.get("tests")), lessons)})
    entries = [e for e in sorted(folder.iterdir()) if e.is_dir() or e.suffix == ".zip"]
    with tempfile.TemporaryDirectory(prefix="zerolab-submissions-") as work, \
            open(csv_path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["student", *[f"ex{lesson}" for lesson in lessons_all], "total", "notes"])
        for entry in entries:
            student = entry.stem if entry.suffix == ".zip" else entry.name
            scores, remarks = [0] * len(lessons_all), []
            try:
                rows = run_graded(_unpack(entry, work), lessons, **options)
                scores = [sum(r["score"] for r in rows if r["lesson"] == lesson) for lesson in lessons_all]
                remarks = notes(rows)
            except Exception as exc:  # this submission scores 0; the batch goes on
                remarks = [f"not graded: {exc}".splitlines()[0]]
            writer.writerow([student, *scores, sum(scores), "; ".join(remarks)])
            f.flush()
            print(f"{student}: {sum(scores)}" + (f"  ({'; '.join(remarks)})" if remarks else ""))
    return 0


def main(argv=None):
    import argparse
    ap = argparse.ArgumentParser(prog="zerolab grade", description="Grade exercises with the graded tests.")
    ap.add_argument("path", nargs="?", help="folder of exNN_*.py files (default: the checkout's "
                                            "exercises/); with --csv, a folder of submissions")
    ap.add_argument("--lessons", nargs="*", help="only these lessons, e.g. 00 03")
    ap.add_argument("--gradescope", nargs="?", const="results.json", metavar="RESULTS_JSON",
                    help="write Gradescope's results.json (default name results.json)")
    ap.add_argument("--csv", metavar="GRADES_CSV", help="grade every submission in PATH; one row per student")
    ap.add_argument("--tests", metavar="PATH", help="folder of graded test files (default: tests/graded "
                                                    "of the zerolab checkout)")
    ap.add_argument("--budget", type=float, default=BUDGET,
                    help=f"seconds for one submission's tests together (default {BUDGET:g}); when they "
                         f"run out, the test running and those not run score 0")
    ap.add_argument("--test-timeout", type=float, default=TEST_TIMEOUT,
                    help=f"seconds per graded test, ranks' start-up included (default {TEST_TIMEOUT:g})")
    ap.add_argument("--rank-timeout", type=float, default=None,
                    help=f"seconds per run on the ranks (sets ZEROLAB_TEST_TIMEOUT; default "
                         f"{RANK_TIMEOUT:g} or half the test timeout if less); must be below --test-timeout")
    args = ap.parse_args(argv)
    options = dict(test_timeout=args.test_timeout, rank_timeout=args.rank_timeout,
                   budget=args.budget, tests=args.tests)

    if args.csv:
        try:
            return grade_submissions(args.path or ".", args.csv, args.lessons, **options)
        except Exception as exc:
            print(f"grading failed: {exc}", file=sys.stderr)
            return 1

    rows, error = [], None
    try:
        rows = run_graded(args.path or checkout_root() / "exercises", args.lessons, **options)
        print(_table(rows))
    except Exception as exc:  # the grader itself must always produce a result file
        error = f"grading failed: {exc}"
        print(error, file=sys.stderr)
    finally:
        if args.gradescope:
            pathlib.Path(args.gradescope).write_text(json.dumps(gradescope_results(rows, error), indent=2))
    if rows:
        print(f"\nTotal: {sum(r['score'] for r in rows)} / {sum(r['points'] for r in rows)} points")
        for line in notes(rows):
            print(line)
    return 0 if error is None else 1

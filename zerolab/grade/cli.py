"""The grader's command line, the notebook's ``check``, and what they write.

    zerolab grade [PATH]                       # PATH: a folder of exNN_*.py (default: exercises/)
    zerolab grade PATH --gradescope results.json
    zerolab grade SUBMISSIONS --csv grades.csv # a folder of students' folders or .zip files
    options: --lessons 00 03  --tests PATH  --budget S  --test-timeout S  --rank-timeout S

In a notebook, ``zerolab.grade.check("03")`` grades one lesson and prints the result inline.
How a submission is run and scored: :mod:`zerolab.grade.runner`.
"""
import csv
import json
import pathlib
import re
import sys
import tempfile
import zipfile

from zerolab.grade.checkout import checkout_root, graded_dir
from zerolab.grade.references import REFUSED
from zerolab.grade.runner import (BUDGET_PER_EXERCISE, RANK_TIMEOUT, TEST_TIMEOUT, graded_files,
                                  run_graded)

ZIP_LIMIT = 50 << 20  # bytes a submitted .zip may expand to


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


def lesson_exercises():
    """The folder a lesson's grade cell grades by default: the ``exercises/`` beside the lesson's own
    folder (the kernel's working directory is the lesson's folder). From ``make lab`` that is the
    student's copy, mywork/exercises beside mywork/notebooks (tools/jupyter/mywork.py); for the
    committed lessons (nbval, ``make notebooks``) it is the checkout's exercises/, the stubs. Without
    one there, the checkout's exercises/."""
    beside = pathlib.Path.cwd().resolve().parent / "exercises"
    if any(beside.glob("ex[0-9][0-9]_*.py")):
        return beside
    return checkout_root() / "exercises"


def check(lesson, path=None, **options):
    """Grade one lesson's exercises (default: :func:`lesson_exercises`) and print the result.
    Returns (points scored, points possible). ``options``: as :func:`run_graded`'s."""
    rows = run_graded(path or lesson_exercises(), lessons=[lesson], **options)
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
    lessons_all = sorted({f.name[7:9] for f in graded_files(graded_dir(options.get("tests")), lessons)})
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
            writer.writerow([_cell(student), *scores, sum(scores), _cell("; ".join(remarks))])
            f.flush()
            print(f"{student}: {sum(scores)}" + (f"  ({'; '.join(remarks)})" if remarks else ""))
    return 0


def _cell(text):
    """A CSV cell a spreadsheet shows as text: a name or note that starts like a formula (a file
    name or an error message is the student's to choose) gets a leading apostrophe."""
    return "'" + text if text[:1] in ("=", "+", "-", "@", "\t", "\r") else text


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
    ap.add_argument("--budget", type=float, default=None,
                    help=f"seconds for one submission's tests together, shared fairly by its exercises "
                         f"(default {BUDGET_PER_EXERCISE:g} per exercise graded); when an exercise's share "
                         f"runs out, its test running and those not run score 0")
    ap.add_argument("--test-timeout", type=float, default=TEST_TIMEOUT,
                    help=f"seconds per graded test, ranks' start-up included (default {TEST_TIMEOUT:g})")
    ap.add_argument("--rank-timeout", type=float, default=None,
                    help=f"seconds per run on the ranks (sets ZEROLAB_TEST_TIMEOUT; default "
                         f"{RANK_TIMEOUT:g} or half the test timeout if less); must be below --test-timeout")
    ap.add_argument("--no-sandbox", action="store_true",
                    help="grade without the sandbox (zerolab.grade.sandbox), trusting the submissions; "
                         "--csv and --gradescope otherwise refuse to grade on a machine without it")
    args = ap.parse_args(argv)
    instructor = bool(args.csv or args.gradescope)
    options = dict(test_timeout=args.test_timeout, rank_timeout=args.rank_timeout,
                   budget=args.budget, tests=args.tests,
                   sandbox="off" if args.no_sandbox else "required" if instructor else "auto")

    if args.csv:
        if args.path is None:
            ap.error("--csv needs PATH, the folder of submissions (students' folders or .zip files)")
        try:
            return grade_submissions(args.path, args.csv, args.lessons, **options)
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

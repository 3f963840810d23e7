"""The graded tests reject plausible wrong answers.

Every file ``tests/graded/wrong/exNN_<what>.py`` is a complete exercise module, written as a student
might write it: right final numbers, one property of the lesson broken. Its name says which exercise
it answers (``exNN``) and what is wrong (``<what>``). For each exercise, one pytest session runs the
exercise's graded tests once per wrong answer (``--impl-each``: each answer in a folder of its own,
under the exercise's file name; the ranks are started once and switched from one answer to the
next), and every wrong answer must fail at least one graded test, with a failure of the test itself
(an assertion or a rank's error), not an import error or a stub's NotImplementedError. The kill rate
is printed at the end of the session, exercise by exercise.

A wrong answer may also name, in its docstring, the graded test aimed at its mistake (a line
``Caught by: test_name.``; several names separated by commas): that test must then be among the
ones that fail, so that a wrong answer rejected only by accident (a test aimed elsewhere) is seen. Such an answer is
then run against the tests it names only, which is enough for the verdict and a fraction of the
cost; ``ZEROLAB_WRONG_ANSWERS=all`` runs every graded test on every answer (before a release).

To add a wrong answer, drop a file in tests/graded/wrong/ named after its exercise (and, if you
like, naming the test that must catch it); nothing else.
"""
import ast
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

from zerolab.grade.checkout import exercise_name
from zerolab.grade.references import declaration, static_check

REPO = pathlib.Path(__file__).resolve().parent.parent
GRADED = REPO / "tests" / "graded"
WRONG = GRADED / "wrong"
CAUGHT_BY = re.compile(r"^Caught by:\s*(.+?)\.?\s*$", re.MULTILINE)
# A failure that says the wrong answer itself is broken, not that the tests caught its mistake.
# A TypeError about the call itself (a keyword or an argument the function does not take) says the
# wrong answer was written against another signature than the stub's.
BROKEN = re.compile(r"\b(ImportError|ModuleNotFoundError|SyntaxError|NameError|NotImplementedError|"
                    r"AttributeError: module|TypeError: \S+\(\) (got an unexpected keyword argument|"
                    r"missing \d+ required|takes \d+ positional))")


def caught_by(path):
    """The graded tests a wrong answer's docstring says must catch it (``Caught by: ...``), or []."""
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    return [name.strip() for match in CAUGHT_BY.findall(doc) for name in match.split(",") if name.strip()]


def wrong_answers():
    """{lesson: (graded test file, [wrong answer files])}."""
    found = {}
    for path in sorted(WRONG.glob("ex[0-9][0-9]_*.py")):
        lesson = path.name[2:4]
        tests = sorted(GRADED.glob(f"test_ex{lesson}_*.py"))
        found.setdefault(lesson, (tests[0] if tests else None, []))[1].append(path)
    return found


WRONG_ANSWERS = wrong_answers()


def test_every_wrong_answer_has_an_exercise_and_every_exercise_has_eight():
    orphans = [p.name for lesson, (tests, paths) in WRONG_ANSWERS.items() if tests is None for p in paths]
    assert not orphans, f"wrong answers for exercises that have no graded tests: {orphans}"
    lessons = sorted(p.name[7:9] for p in GRADED.glob("test_ex[0-9][0-9]_*.py"))
    few = {lesson: len(WRONG_ANSWERS.get(lesson, (None, []))[1]) for lesson in lessons}
    few = {lesson: k for lesson, k in few.items() if k < 8}
    assert not few, f"exercises with fewer than eight wrong answers in tests/graded/wrong/: {few}"
    unknown = [f"{p.name}: {name}" for lesson, (tests, paths) in WRONG_ANSWERS.items() if tests is not None
               for p in paths for name in caught_by(p) if not re.search(rf"^def {name}\(", tests.read_text(), re.M)]
    assert not unknown, f"'Caught by:' names a test its exercise's graded file does not define: {unknown}"


def _grade_each(test_file, wrong, tmp_path, *, every_test):
    """Run ``test_file`` once per wrong answer in one pytest session; {answer: [result rows]}.

    Unless ``every_test``, an answer whose docstring names the tests that catch it runs only those
    (a verdict needs one failing test, and the named one must be among the failures anyway): the
    same verdict at a fraction of the cost, since a wrong answer passes every test before the one
    aimed at its mistake. ``ZEROLAB_WRONG_ANSWERS=all`` runs every graded test on every answer."""
    name = exercise_name(test_file)
    folders, only = [], {}
    for path in wrong:
        folder = tmp_path / path.stem
        folder.mkdir()
        shutil.copy(path, folder / f"{name}.py")
        folders.append(str(folder))
        if caught_by(path) and not every_test:
            only[str(folder)] = caught_by(path)
    tests_file = tmp_path / "only.json"
    tests_file.write_text(json.dumps(only))
    report = tmp_path / "report.jsonl"
    env = dict(os.environ, ZEROLAB_TEST_TIMEOUT="90")
    for key in ("PYTEST_CURRENT_TEST", "PYTEST_ADDOPTS", "ZEROLAB_IMPL"):
        env.pop(key, None)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", str(test_file), "-q", "-p", "no:cacheprovider", "-o", "addopts=",
         "--impl-each", os.pathsep.join(folders), "--impl-report", str(report),
         "--impl-tests", str(tests_file)],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=1500)
    rows = [json.loads(line) for line in report.read_text().splitlines()] if report.exists() else []
    by_answer = {p.stem: [r for r in rows if pathlib.Path(r["impl"]).name == p.stem] for p in wrong}
    return by_answer, proc.stdout


@pytest.mark.parametrize("lesson", sorted(WRONG_ANSWERS))
def test_graded_tests_reject_every_wrong_answer(lesson, tmp_path, kill_rates):
    test_file, wrong = WRONG_ANSWERS[lesson]
    refused, allowed = declaration(test_file)
    for path in wrong:                   # rejected for its mistake, not for using the reference
        reason = static_check(path.read_bytes(), f"{exercise_name(test_file)}.py", refused, allowed)
        assert reason is None, f"{path.name} would be refused before any test runs: {reason}"
    every_test = os.environ.get("ZEROLAB_WRONG_ANSWERS") == "all"
    by_answer, output = _grade_each(test_file, wrong, tmp_path, every_test=every_test)
    lines, problems = [], []
    for path in wrong:
        rows = by_answer[path.stem]
        failed = [r for r in rows if r["outcome"] == "failed"]
        passed = sum(1 for r in rows if r["outcome"] == "passed")
        if not rows:
            problems.append(f"{path.name}: no graded test ran")
        elif not failed:
            problems.append(f"{path.name}: passed all {len(rows)} graded tests it ran"
                            + ("" if every_test or not caught_by(path) else
                               f" (those its 'Caught by:' line names; ZEROLAB_WRONG_ANSWERS=all runs all)"))
        else:
            broken = [r["test"] for r in failed if BROKEN.search(r["message"])]
            if broken:
                problems.append(f"{path.name}: the wrong answer itself is broken ({broken[0]}: "
                                f"{BROKEN.search(next(r['message'] for r in failed if r['test'] == broken[0])).group(0)})")
        tests = sorted({r["test"] for r in failed})
        missed = [t for t in caught_by(path) if t not in tests]
        if failed and missed:
            problems.append(f"{path.name}: {', '.join(missed)} should catch it, but the tests that failed "
                            f"were {', '.join(tests)}")
        lines.append(f"  {path.stem}: {'rejected by ' + ', '.join(tests) if failed else 'NOT REJECTED'}"
                     f" ({passed} graded test{'s' if passed != 1 else ''} passed before)")
    killed = sum(1 for path in wrong if any(r["outcome"] == "failed" for r in by_answer[path.stem]))
    kill_rates.append(f"ex{lesson}: {killed} of {len(wrong)} wrong answers rejected "
                      f"(kill rate {killed / len(wrong):.0%})\n" + "\n".join(lines))
    assert not problems, "\n".join(problems) + "\n\n" + output[-4000:]

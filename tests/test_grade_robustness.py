"""The grader against hostile or broken submissions: each ends with a clear per-test failure and a
valid Gradescope results.json with a score, in bounded time, with no process left behind.

Most cases grade a tiny fake exercise (one in-process test, two on 2 ranks) with a fake graded
folder (``--tests``) that uses the repository's real conftest files, so each run stays short; the
reference-import cases also run against the real lesson 00 tests."""
import csv
import json
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap
import time
import zipfile

import jsonschema
import psutil
import pytest

from test_grader import SCHEMA

REPO = pathlib.Path(__file__).resolve().parent.parent
RANK_TIMEOUT = 3    # seconds per run on the ranks, for hangs to end fast
TEST_TIMEOUT = 40   # seconds per test: above the ranks' limit and a 2-rank start on a busy machine
BOUND = 200         # seconds any one grading below may take (2 busy cores)

FAKE_TEST = '''
import pytest
import torch
import torch.distributed as dist

from zerolab.grade.helpers import exercise_module

REFERENCE_MODULES = ["zerolab.ring"]
REFERENCE_ALLOWED = ["zerolab.ring.exchange"]


def total_on_rank():                       # the probe: runs the submission on each rank
    t = torch.ones(3) * (dist.get_rank() + 1)
    exercise_module("ex00_tiny").total(t)
    return t


def check_total(student):                  # the verdict: here, never in the submission's process
    for rank, t in enumerate(student.on_ranks(2, total_on_rank)):
        assert t.tolist() == [3.0] * 3, f"rank {rank}: total gave {t.tolist()}"


@pytest.mark.points(1)
def test_double(student):
    assert student.module("ex00_tiny").double(2) == 4


@pytest.mark.points(2)
def test_total(student):
    check_total(student)


@pytest.mark.points(1)
def test_total_again(student):
    check_total(student)
'''

GOOD = '''
import torch.distributed as dist

def double(x):
    return 2 * x

def total(t):
    dist.all_reduce(t)
    return t
'''


@pytest.fixture
def graded(tmp_path):
    """A graded folder with one exercise, ex00_tiny (4 points), and the repo's conftest files."""
    root = tmp_path / "course"
    (root / "tests" / "graded").mkdir(parents=True)
    shutil.copy(REPO / "tests" / "conftest.py", root / "tests" / "conftest.py")
    shutil.copy(REPO / "tests" / "graded" / "conftest.py", root / "tests" / "graded" / "conftest.py")
    (root / "tests" / "graded" / "test_ex00_tiny.py").write_text(FAKE_TEST)
    (root / "pytest.ini").write_text("[pytest]\nmarkers =\n    points(n): points\n")
    return root / "tests" / "graded"


def submission(tmp_path, source, name="ex00_tiny.py", folder="student"):
    path = tmp_path / folder
    path.mkdir()
    if source is not None:
        (path / name).write_text(textwrap.dedent(source))
    return path


def leftovers(key="ZEROLAB_GRADE_TAG", value=None):
    """Processes still running that a grading started: its child, its ranks and what they started
    carry the grading's tag in their environment (``key``; with ``value``, that value). A process
    that cleared its environment ends with its sandbox's PID namespace. Call once the grader ended."""
    found = []
    for p in psutil.process_iter():
        try:
            env = p.environ()
            if p.pid != os.getpid() and key in env and (value is None or env[key] == value):
                found.append(p.cmdline())
        except psutil.Error:
            pass
    return found


def grade(sub, *args, tests=None, lessons=("00",), env=None):
    """Run the grader CLI on ``sub``; returns (completed process, results.json data, seconds)."""
    results = sub.parent / f"{sub.name}-results.json"
    cmd = [sys.executable, "-m", "zerolab", "grade", str(sub), "--gradescope", str(results),
           "--rank-timeout", str(RANK_TIMEOUT), "--test-timeout", str(TEST_TIMEOUT), *map(str, args)]
    if tests is not None:
        cmd += ["--tests", str(tests)]
    if lessons:
        cmd += ["--lessons", *lessons]
    t0 = time.monotonic()
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=BOUND + 120,
                       env=dict(os.environ, ZEROLAB_TEST_GRADING=str(sub), **(env or {})))
    seconds = time.monotonic() - t0
    data = json.loads(results.read_text())
    jsonschema.validate(data, SCHEMA)
    assert not leftovers("ZEROLAB_TEST_GRADING", str(sub)), f"processes left behind: {leftovers()}"
    assert seconds < BOUND, f"grading took {seconds:.0f} s"
    return r, data, seconds


def by_name(data):
    return {t["name"]: t for t in data["tests"]}


def test_syntax_error_scores_zero_without_running(tmp_path, graded):
    r, data, _ = grade(submission(tmp_path, "def double(x):\n    return 2 *\n"), tests=graded)
    assert data["score"] == 0 and data["max_score"] == 4
    for t in data["tests"]:
        assert "ex00_tiny.py does not compile: SyntaxError" in t["output"] and "(line 2)" in t["output"]


def test_missing_file_scores_zero_with_the_reason(tmp_path, graded):
    r, data, _ = grade(submission(tmp_path, GOOD, name="ex00_other.py"), tests=graded)
    assert data["score"] == 0 and data["max_score"] == 4
    assert all("ex00_tiny.py is missing from the submission" in t["output"] for t in data["tests"])
    assert "ex00: ex00_tiny.py is missing" in data["output"]


def test_hang_in_a_collective_ends_as_rank_timeouts(tmp_path, graded):
    # Each rank waits for a message nobody sends: a deadlocked ring.
    hang = GOOD.replace("    dist.all_reduce(t)", "    dist.recv(t, src=1 - dist.get_rank())")
    r, data, _ = grade(submission(tmp_path, hang), tests=graded)
    tests = by_name(data)
    assert data["score"] == 1 and tests["test_double"]["status"] == "passed"
    for name in ("test_total", "test_total_again"):  # each on fresh ranks, each a RankTimeout
        assert f"did not finish within {RANK_TIMEOUT} s" in tests[name]["output"], tests[name]["output"]


def test_megabytes_of_output_stay_out_of_the_results(tmp_path, graded):
    noisy = GOOD.replace("def double(x):\n    return 2 * x",
                         "print('x' * 3_000_000)\n\ndef double(x):\n    print('y' * 3_000_000)\n    return 2 * x + 1")
    noisy = noisy.replace("    dist.all_reduce(t)", "    print('z' * 2_000_000)\n    dist.all_reduce(t)")
    r, data, _ = grade(submission(tmp_path, noisy), tests=graded)
    assert data["score"] == 3, data  # the ranks' sums are right; double is wrong
    assert len(json.dumps(data)) < 50_000
    assert "assert 5 == 4" in by_name(data)["test_double"]["output"]


@pytest.mark.parametrize("how, first", [
    ("sys.exit(3)", "SystemExit"),
    ("os._exit(3)", "rank 0 died (exit code 3)"),   # in its sandboxed rank, not in the grader
])
def test_exit_at_import_is_not_retried(tmp_path, graded, how, first):
    r, data, _ = grade(submission(tmp_path, f"import os, sys\n{how}\n" + GOOD), tests=graded)
    tests = by_name(data)
    assert data["score"] == 0
    assert first in tests["test_double"]["output"], tests["test_double"]["output"]
    for name in ("test_total", "test_total_again"):  # no ranks started for an import that ends its process
        assert "not run: importing ex00_tiny.py did not complete" in tests[name]["output"]


def test_hanging_import_is_not_retried(tmp_path, graded):
    # The test's limit leaves room for a rank to start on a busy machine; the ranks' own limit
    # (RANK_TIMEOUT, the import included) ends the hang.
    r, data, seconds = grade(submission(tmp_path, "import time\ntime.sleep(600)\n" + GOOD), "--test-timeout", 40,
                             tests=graded)
    tests = by_name(data)
    assert data["score"] == 0
    assert f"did not finish within {RANK_TIMEOUT} s" in tests["test_double"]["output"], tests["test_double"]["output"]
    for name in ("test_total", "test_total_again"):
        assert "not run: importing ex00_tiny.py did not complete" in tests[name]["output"]


def test_budget_stops_the_submission_and_kills_its_ranks(tmp_path, graded):
    hang = GOOD.replace("    dist.all_reduce(t)", "    import time\n    time.sleep(600)")
    t0 = time.monotonic()
    # The ranks' own limit (35 s) is beyond the budget, so the budget ends the hang wherever it began
    # (with a 20 s limit, a hang that started within 5 s ended as a rank timeout on a fast machine).
    r, data, seconds = grade(submission(tmp_path, hang), "--budget", 25, "--rank-timeout", 35,
                             "--test-timeout", 60, tests=graded)
    assert r.returncode == 0 and data["score"] == 1, data
    tests = by_name(data)
    assert "time budget (25 s, --budget) ran out while this test ran" in tests["test_total"]["output"]
    assert "not run: the submission's time budget (25 s, --budget) ran out" in tests["test_total_again"]["output"]
    assert seconds < 25 + 30


def test_a_deadlock_in_one_exercise_leaves_the_next_its_share(tmp_path, graded):
    # Two exercises share a 150 s budget: ex00 hangs (its rank limit, 120 s, is beyond its share, about
    # half); ex01 then gets the time left, enough for a new child process and a rank on a busy machine.
    (graded / "test_ex01_more.py").write_text(
        "import pytest\n\n\n@pytest.mark.points(5)\n"
        "def test_triple(student):\n    assert student.module('ex01_more').triple(2) == 6\n")
    hang = GOOD.replace("    dist.all_reduce(t)", "    import time\n    time.sleep(600)")
    sub = submission(tmp_path, hang)
    (sub / "ex01_more.py").write_text("def triple(x):\n    return 3 * x\n")
    r, data, seconds = grade(sub, "--budget", 150, "--rank-timeout", 120, "--test-timeout", 180,
                             lessons=None, tests=graded)
    tests = by_name(data)
    assert data["score"] == 1 + 5, data
    assert "exercise 00's share of the time budget (--budget 150 s, shared by the exercises left) ran out " \
           "while this test ran" in tests["test_total"]["output"]
    assert tests["test_total_again"]["output"].startswith("not run: exercise 00's share")
    assert tests["test_triple"]["status"] == "passed"


def test_reference_implementation_found_at_run_time_scores_the_exercise_zero(tmp_path, graded):
    # Reached through an alias the static check does not follow (zerolab.quantize loads zerolab.ring);
    # double() is honest, but the exercise scores 0.
    cheat = GOOD.replace("    dist.all_reduce(t)",
                         "    import zerolab.quantize\n    z = zerolab\n    z.ring.ring_all_reduce(t)")
    r, data, _ = grade(submission(tmp_path, cheat), tests=graded)
    assert data["score"] == 0
    for t in data["tests"]:
        assert t["output"].startswith("refused: ex00_tiny.py (at run time) uses zerolab.ring.ring_all_reduce")


def test_solutions_are_not_importable_by_a_submission(tmp_path, graded):
    # Even with the checkout on PYTHONPATH, and an import the static check cannot see (a module the
    # submission writes and imports).
    peek = GOOD.replace("    return 2 * x", "    import os, sys, tempfile\n    d = tempfile.mkdtemp()\n"
                                           "    open(os.path.join(d, 'peek.py'), 'w').write('import solutions')\n"
                                           "    sys.path.insert(0, d)\n    import peek\n"
                                           "    return 2 * x")
    r, data, _ = grade(submission(tmp_path, peek), tests=graded, env={"PYTHONPATH": str(REPO)})
    assert "No module named 'solutions'" in by_name(data)["test_double"]["output"]
    assert data["score"] == 3


@pytest.mark.parametrize("source, used", [
    ("from solutions.ex00_collectives import *\n",
     "solutions.ex00_collectives.*, from solutions: the course's worked answers"),
    ("from zerolab.ring import ring_reduce_scatter, ring_all_gather, ring_all_reduce\n",
     "zerolab.ring.ring_reduce_scatter, from zerolab.ring: the reference implementation of this exercise"),
])
def test_reference_imports_score_zero_on_the_real_lesson(tmp_path, source, used):
    r, data, seconds = grade(submission(tmp_path, source, name="ex00_collectives.py"))
    graded_file = (REPO / "tests" / "graded" / "test_ex00_collectives.py").read_text()
    tests = graded_file.count("\ndef test_")          # every graded test of lesson 00, each scored 0
    assert r.returncode == 0 and data["score"] == 0 and data["max_score"] > 0 and len(data["tests"]) >= tests
    for t in data["tests"]:  # refused before any test runs: no rank started
        assert t["output"].startswith(f"refused: ex00_collectives.py line 1 uses {used}"), t["output"]
    assert "ex00: refused: " in data["output"]


def test_csv_batch_survives_a_corrupt_zip(tmp_path, graded):
    subs = tmp_path / "submissions"
    subs.mkdir()
    (subs / "alice").mkdir()
    (subs / "alice" / "ex00_tiny.py").write_text(GOOD)
    (subs / "bob.zip").write_bytes(b"PK\x03\x04 this is not a zip file")
    with zipfile.ZipFile(subs / "carol.zip", "w") as z:
        z.writestr("work/ex00_tiny.py", GOOD)
    (subs / "dave").mkdir()                       # nothing submitted
    out = tmp_path / "grades.csv"
    r = subprocess.run([sys.executable, "-m", "zerolab", "grade", str(subs), "--csv", str(out),
                        "--tests", str(graded), "--rank-timeout", str(RANK_TIMEOUT)],
                       cwd=REPO, capture_output=True, text=True, timeout=BOUND * 3,
                       env=dict(os.environ, ZEROLAB_TEST_GRADING=str(subs)))
    assert r.returncode == 0, r.stdout + r.stderr
    assert not leftovers("ZEROLAB_TEST_GRADING", str(subs)), f"processes left behind: {leftovers()}"
    rows = list(csv.reader(out.open()))
    assert rows[0] == ["student", "ex00", "total", "notes"]
    assert rows[1] == ["alice", "4", "4", ""]
    assert rows[2][:3] == ["bob", "0", "0"] and "bob.zip is not a readable .zip file" in rows[2][3]
    assert rows[3] == ["carol", "4", "4", ""]
    assert rows[4] == ["dave", "0", "0", "ex00: ex00_tiny.py is missing from the submission"]

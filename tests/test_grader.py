"""The grader, as instructors and Gradescope use it (lesson 00's graded tests keep it quick)."""
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

REPO = pathlib.Path(__file__).resolve().parent.parent

# Gradescope's autograder results format (the fields zerolab writes, with their types).
SCHEMA = {
    "type": "object", "required": ["score", "tests"],
    "properties": {
        "score": {"type": "number"}, "max_score": {"type": "number"}, "output": {"type": "string"},
        "tests": {"type": "array", "items": {
            "type": "object", "required": ["name", "score", "max_score", "status", "output", "visibility"],
            "properties": {"name": {"type": "string"}, "number": {"type": "string"},
                           "score": {"type": "number"}, "max_score": {"type": "number"},
                           "status": {"enum": ["passed", "failed"]}, "output": {"type": "string"},
                           "visibility": {"enum": ["visible", "hidden", "after_due_date", "after_published"]}}}},
    },
}

WRONG = REPO / "tests" / "graded" / "wrong"
GRADED_00 = REPO / "tests" / "graded" / "test_ex00_collectives.py"


def _points(name):
    """Points of one graded test of lesson 00 times its parametrizations, read from the test file."""
    src = GRADED_00.read_text()
    head = src[:src.index(f"def {name}(")].rsplit("\n\n\n", 1)[-1]
    points = int(head.split("@pytest.mark.points(")[1].split(")")[0])
    params = head.split("@pytest.mark.parametrize(")[1].count(",") if "parametrize(" in head else 1
    return points * params


MAX_00 = sum(_points(n) for n in ("test_bidirectional_all_reduce_values", "test_both_directions_neighbours_only",
                                  "test_reduce_bytes_measured"))
# A student whose all-reduce is right and who took gloo's reduce bytes from the ring formula instead
# of measuring them (one of lesson 00's wrong answers): every test but the measured one.
HALF = (WRONG / "ex00_ring_reduce_formula.py").read_text()
HALF_CORRECT = MAX_00 - _points("test_reduce_bytes_measured")

HOSTILE = '''
import os, signal, time
import torch, torch.distributed as dist

def bidirectional_all_reduce(tensor, group=None):
    n = dist.get_world_size()
    if n == 2:                                   # nobody sends: both ranks hang
        dist.recv(torch.empty(1), src=(dist.get_rank() - 1) % n)
    elif dist.get_rank() == 1:
        os._exit(1)                              # kills its rank
    return tensor

def reduce_bytes(numel, dst, group=None):
    if dist.get_rank() == 0:
        os.kill(os.getppid(), signal.SIGKILL)    # tries to kill the grading process itself
    time.sleep(30)
'''


def _grade(*args, env=None, timeout=600):
    return subprocess.run([sys.executable, "-m", "zerolab", "grade", *map(str, args), "--lessons", "00"],
                          cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, **(env or {})))


def _write(folder, source):
    folder.mkdir(parents=True)
    (folder / "ex00_collectives.py").write_text(textwrap.dedent(source))
    return folder


def test_csv_over_folders_and_zips_scores_each_student(tmp_path):
    subs = tmp_path / "submissions"
    subs.mkdir()
    shutil.copytree(REPO / "solutions", subs / "alice")
    half = _write(tmp_path / "bob_src" / "exercises", HALF)
    with zipfile.ZipFile(subs / "bob.zip", "w") as z:
        z.write(half / "ex00_collectives.py", "exercises/ex00_collectives.py")
    out = tmp_path / "grades.csv"
    r = _grade(subs, "--csv", out)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = list(csv.reader(out.open()))
    assert rows == [["student", "ex00", "total", "notes"], ["alice", str(MAX_00), str(MAX_00), ""],
                    ["bob", str(HALF_CORRECT), str(HALF_CORRECT), ""]], r.stdout + r.stderr


def test_hostile_submission_scores_zero_in_bounded_time_and_results_json_is_valid(tmp_path):
    hostile = _write(tmp_path / "hostile", HOSTILE)
    results = tmp_path / "results.json"
    t0 = time.monotonic()
    r = _grade(hostile, "--gradescope", results, "--rank-timeout", 5)
    assert time.monotonic() - t0 < 300, "grading hanging code must end in bounded time"
    data = json.loads(results.read_text())
    jsonschema.validate(data, SCHEMA)
    assert data["score"] == 0 and data["max_score"] == MAX_00 and len(data["tests"]) == 4
    by_name = {t["name"]: t["output"] for t in data["tests"]}
    assert "did not finish within 5 s" in by_name["test_bidirectional_all_reduce_values[2]"]
    assert "rank 1 died (exit code 1)" in by_name["test_bidirectional_all_reduce_values[4]"]
    assert "rank 1 died (exit code 1)" in by_name["test_both_directions_neighbours_only"]
    # The sandbox's ranks run as a user of their own in their own PID namespace: their parent is the
    # submission's own keeper process, the grader is out of reach (it graded on, and wrote the file).
    out = by_name["test_reduce_bytes_measured"]
    assert ("PermissionError" in out or "rank 0 died" in out) and "crashed the grading process" not in out, out


def test_results_json_is_written_even_when_grading_cannot_start(tmp_path):
    results = tmp_path / "results.json"
    r = _grade(tmp_path / "does-not-exist", "--gradescope", results)
    assert r.returncode == 1
    data = json.loads(results.read_text())
    jsonschema.validate(data, SCHEMA)
    assert data["score"] == 0 and "no such exercises folder" in data["output"]


def test_outside_a_checkout_the_grader_says_what_it_needs(tmp_path):
    # An installed zerolab (a copy of the package, no tests/graded next to it), run from elsewhere.
    shutil.copytree(REPO / "zerolab", tmp_path / "site" / "zerolab",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "elsewhere").mkdir()
    results = tmp_path / "results.json"
    r = subprocess.run([sys.executable, "-m", "zerolab", "grade", "--gradescope", str(results)],
                       cwd=tmp_path / "elsewhere", capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=str(tmp_path / "site")))
    assert r.returncode == 1
    needs = "the graded tests live in a zerolab checkout (tests/graded): run from one, or pass --tests PATH"
    assert needs in r.stderr
    data = json.loads(results.read_text())
    jsonschema.validate(data, SCHEMA)
    assert data["score"] == 0 and needs in data["output"]


def test_rank_timeout_must_be_below_the_test_timeout(tmp_path):
    results = tmp_path / "results.json"
    r = _grade(REPO / "exercises", "--rank-timeout", 300, "--gradescope", results, timeout=120)
    assert r.returncode == 1
    assert "rank_timeout (300 s) must be below test_timeout (240 s)" in json.loads(results.read_text())["output"]


def test_zerolab_stays_light_and_never_imports_the_grader():
    import ast
    for path in (REPO / "zerolab").glob("*.py"):
        if path.name == "__main__.py":
            continue  # the command line: the layer above the grader
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n == "zerolab.grade" or n.startswith("zerolab.grade.") for n in names), path
    code = "import sys, zerolab, zerolab.grade; print(sorted(m for m in ('torch', 'pytest') if m in sys.modules))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.stdout.strip() == "[]", r.stdout + r.stderr   # the grader's parent process needs neither
    r = subprocess.run([sys.executable, "-m", "zerolab"], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 2 and "zerolab grade" in r.stderr

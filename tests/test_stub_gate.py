"""The stub gate itself (`pytest tests/graded --impl exercises --stubs-must-fail`): a graded test
passes it only when it fails BECAUSE of the stub (the NotImplementedError raised by the exercise
file under test, here or on ranks); every other failure, and a pass, fails it with the reason.

A fake graded test file and a fake exercise folder run in a child pytest with the repository's
real conftest files."""
import os
import pathlib
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET

REPO = pathlib.Path(__file__).resolve().parent.parent

STUBS = '''
def stub():
    raise NotImplementedError("Exercise 00.1: write me")

def wrong():
    return 41

def slow():
    import time
    time.sleep(60)

def right():
    return 42
'''

TESTS = '''
import os

import pytest
import torch
import torch.distributed as dist

from zerolab.grade.helpers import exercise_module


def ex():
    return exercise_module("ex00_gate")


@pytest.fixture
def broken():
    raise RuntimeError("the fixture broke")


def stub_on_ranks():
    ex().stub()


def hang():
    dist.recv(torch.empty(1), src=1 - dist.get_rank())  # nobody sends


def stub_and_a_dead_rank():
    if dist.get_rank() == 1:
        os._exit(1)
    ex().stub()


def stub_and_another_error():
    if dist.get_rank() == 0:
        ex().stub()
    raise ValueError("rank 1 broke on its own")


def assertion_on_ranks():
    assert ex().wrong() == 42, "wrong on a rank"


def call(name):
    return getattr(ex(), name)()


def import_missing():
    exercise_module("ex00_gate_missing")


@pytest.mark.points(1)
def test_stub_in_one_process(student):
    student.run(call, "stub")


@pytest.mark.points(1)
def test_stub_on_ranks(on_ranks):
    on_ranks(2, stub_on_ranks)


@pytest.mark.points(1)
def test_assertion_of_the_test(student):
    assert student.run(call, "wrong") == 42


@pytest.mark.points(1)
def test_not_implemented_by_the_test(student):
    student.run(call, "right")
    raise NotImplementedError("raised by the test, not the stub")


@pytest.mark.points(1)
def test_import_error(student):
    student.run(import_missing)


@pytest.mark.points(1)
def test_fixture_error(broken, student):
    student.run(call, "stub")


@pytest.mark.points(1)
@pytest.mark.timeout(3)
def test_timeout():
    import time
    time.sleep(60)       # the test itself runs out of time: not the stub


@pytest.mark.points(1)
def test_the_submission_imported_where_the_verdict_is_decided():
    ex().stub()          # refused in the trusted process, whatever the stub would have raised


@pytest.mark.points(1)
def test_rank_timeout(on_ranks):
    on_ranks(2, hang)


@pytest.mark.points(1)
def test_rank_died(on_ranks):
    on_ranks(2, stub_and_a_dead_rank)


@pytest.mark.points(1)
def test_another_error_on_a_rank(on_ranks):
    on_ranks(2, stub_and_another_error)


@pytest.mark.points(1)
def test_assertion_on_ranks(on_ranks):
    on_ranks(2, assertion_on_ranks)


@pytest.mark.points(1)
def test_passes(student):
    assert student.run(call, "right") == 42
'''

# test -> what the gate must say (None: the gate passes it).
EXPECTED = {
    "test_stub_in_one_process": None,
    "test_stub_on_ranks": None,
    "test_assertion_of_the_test": "not because of the stub: AssertionError: assert 41 == 42",
    "test_not_implemented_by_the_test": "not because of the stub: NotImplementedError raised from",
    "test_import_error": "not because of the stub: rank 0 raised ModuleNotFoundError",
    "test_fixture_error": "not because of the stub: its setup failed",
    "test_timeout": "not because of the stub: Failed: Timeout",
    "test_rank_timeout": "not because of the stub: RankTimeout: ranks 0, 1 did not finish within 3 s",
    "test_rank_died": "not because of the stub: RankError: rank 1 died (exit code 1)",
    "test_another_error_on_a_rank": "not because of the stub: rank 1 raised ValueError",
    "test_assertion_on_ranks": "not because of the stub: rank 0 raised AssertionError",
    "test_passes": "PASSED on the untouched stubs",
    "test_the_submission_imported_where_the_verdict_is_decided":
        "not because of the stub: RuntimeError: exercise_module('ex00_gate') called in the process that "
        "decides the verdicts",
}


def test_gate_accepts_only_failures_caused_by_the_stub(tmp_path):
    (tmp_path / "tests" / "graded").mkdir(parents=True)
    shutil.copy(REPO / "tests" / "conftest.py", tmp_path / "tests" / "conftest.py")
    shutil.copy(REPO / "tests" / "graded" / "conftest.py", tmp_path / "tests" / "graded" / "conftest.py")
    (tmp_path / "tests" / "graded" / "test_ex00_gate.py").write_text(TESTS)
    (tmp_path / "impl").mkdir()
    (tmp_path / "impl" / "ex00_gate.py").write_text(STUBS)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    points(n): points\n")
    report = tmp_path / "report.xml"
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "tests/graded", "-q", "-p", "no:cacheprovider",
         "--impl", str(tmp_path / "impl"), "--stubs-must-fail", f"--junitxml={report}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
        env=dict(os.environ, ZEROLAB_TEST_TIMEOUT="3"))
    assert r.returncode == 1, r.stdout + r.stderr  # some graded tests fail the gate
    outcomes = {}
    for case in ET.parse(report).iter("testcase"):
        bad = [e for e in case if e.tag in ("failure", "error")]
        outcomes[case.get("name")] = "\n".join((e.get("message") or "") + "\n" + (e.text or "") for e in bad) or None
    assert set(outcomes) == set(EXPECTED), r.stdout
    for name, expected in EXPECTED.items():
        if expected is None:
            assert outcomes[name] is None, f"{name} should pass the gate:\n{outcomes[name]}"
        else:
            assert outcomes[name] and expected in outcomes[name], f"{name}: expected {expected!r} in\n{outcomes[name]}"

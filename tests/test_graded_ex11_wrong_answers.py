"""Exercise 11's graded tests reject plausible wrong answers. Each file in tests/graded/wrong/ex11_*.py
is what a student might write; it is put in a fresh folder as ``ex11_fully_shard.py`` and the graded
tests run on it (ZEROLAB_IMPL pointing there, in a child pytest, stopping at the first failure): the
run must fail, in the test aimed at that mistake."""
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
GRADED = REPO / "tests" / "graded" / "test_ex11_fully_shard.py"
WRONG = REPO / "tests" / "graded" / "wrong"
CAUGHT_BY = {   # wrong answer -> the graded test that must reject it
    "ex11_local_norm.py": "test_clip_grad_norm_equals_torch",
    "ex11_replicated_counted_n_times.py": "test_clip_grad_norm_equals_torch",
    "ex11_no_skip_elsewhere.py": "test_found_inf_same_decision_on_every_rank",
    "ex11_wrong_rank_shard.py": "test_shard_dim0_pads_and_gives_each_rank_its_rows",
    "ex11_no_padding.py": "test_shard_dim0_pads_and_gives_each_rank_its_rows",
}


def test_every_wrong_answer_is_listed():
    assert sorted(p.name for p in WRONG.glob("ex11_*.py")) == sorted(CAUGHT_BY)


@pytest.mark.parametrize("wrong", sorted(CAUGHT_BY))
def test_graded_tests_reject(tmp_path, wrong):
    shutil.copy(WRONG / wrong, tmp_path / "ex11_fully_shard.py")
    env = dict(os.environ, ZEROLAB_IMPL=str(tmp_path), ZEROLAB_TEST_TIMEOUT="120")
    env.pop("PYTEST_CURRENT_TEST", None)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
                           "--impl", str(tmp_path), str(GRADED)],
                          cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900)
    assert proc.returncode != 0, f"{wrong} passed every graded test:\n{proc.stdout[-3000:]}"
    failed = [line for line in proc.stdout.splitlines() if line.startswith("FAILED")]
    assert failed and CAUGHT_BY[wrong] in failed[0], (
        f"{wrong} should fail {CAUGHT_BY[wrong]}; the run ended with {failed or proc.stdout[-3000:]}")

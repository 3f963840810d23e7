"""Exercise 10's graded tests reject plausible wrong answers: each file in tests/graded/wrong/ex10_*.py
(a complete module with the exercise's names) is graded by the real grader, as a student's folder
holding it under the exercise's file name; it must lose points, on the test that targets its mistake."""
import pathlib
import shutil

import pytest

from zerolab.grade import run_graded

WRONG = pathlib.Path(__file__).parent / "graded" / "wrong"
# the mistake -> the graded test that must fail because of it
TARGET = {"ex10_saves_everything": "test_keeps_only_the_input",
          "ex10_recomputes_twice": "test_recomputes_once",
          "ex10_detached_input": "test_gradients_equal_the_plain_block",
          "ex10_paper_crossover": "test_crossover_seq_len"}


def test_every_wrong_answer_has_a_target():
    assert sorted(p.stem for p in WRONG.glob("ex10_*.py")) == sorted(TARGET)


@pytest.mark.parametrize("wrong", sorted(TARGET))
def test_wrong_answer_is_rejected(tmp_path, wrong):
    shutil.copy(WRONG / f"{wrong}.py", tmp_path / "ex10_activations.py")
    rows = run_graded(tmp_path, lessons=["10"])
    failed = {r["nodeid"].split("::")[-1] for r in rows if r["outcome"] != "passed"}
    assert TARGET[wrong] in failed, f"{wrong}: the graded tests that failed: {sorted(failed) or 'none'}"
    assert sum(r["score"] for r in rows) < sum(r["points"] for r in rows)

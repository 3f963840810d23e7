"""No lesson shows an exercise's answer: no code cell of lesson NN defines, or prints the source of,
a function or class named as one that exercises/exNN_*.py asks the student to write. Lessons teach
with zerolab's code; where zerolab has the exercise's very function, the lesson describes it instead
of printing it (README, "Exercises and grading"). Fast: the committed notebooks, no kernel."""
import ast
import json
import pathlib
import re

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
EXERCISES = sorted((REPO / "exercises").glob("ex[0-9][0-9]_*.py"))


def asked_for(exercise):
    """The public functions and classes an exercise file asks for."""
    return sorted(n.name for n in ast.parse(exercise.read_text()).body
                  if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and not n.name.startswith("_"))


def shown(cell):
    """A code cell's source and its outputs' text, as the student sees them."""
    text = [cell["source"] if isinstance(cell["source"], str) else "".join(cell["source"])]
    for out in cell.get("outputs", []):
        text.append("".join(out.get("text", "")))
        text.append("".join(out.get("data", {}).get("text/plain", "")))
    return "\n".join(text)


def definitions(text, names):
    return [n for n in names if re.search(rf"^\s*(?:async\s+)?(?:def|class)\s+{re.escape(n)}\b", text, re.M)]


@pytest.mark.parametrize("exercise", EXERCISES, ids=lambda p: p.name)
def test_no_lesson_shows_the_answer_of_its_exercise(exercise):
    lessons = sorted((REPO / "notebooks").glob(f"{exercise.name[2:4]}_*.ipynb"))
    assert lessons, f"{exercise.name} has no lesson"
    names = asked_for(exercise)
    assert names, f"{exercise.name} asks for nothing"
    found = [f"{nb.name} code cell {i}: {', '.join(hits)}"
             for nb in lessons
             for i, cell in enumerate(json.loads(nb.read_text(encoding="utf-8"))["cells"])
             if cell["cell_type"] == "code" and (hits := definitions(shown(cell), names))]
    assert found == [], f"lessons define or print what {exercise.name} asks for"


def test_the_check_sees_a_printed_definition():
    cell = {"source": "print(inspect.getsource(m.found_inf))",
            "outputs": [{"output_type": "stream", "text": ["def found_inf(grads, group=None):\n", "    ...\n"]}]}
    assert definitions(shown(cell), ["found_inf", "clip_grad_norm_"]) == ["found_inf"]
    assert definitions("x = found_inf(g)\n", ["found_inf"]) == []

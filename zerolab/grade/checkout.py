"""Where the graded tests and the course's folders are: a zerolab checkout.

The graded tests (``tests/graded``), the stubs (``exercises/``) and the worked answers
(``solutions/``) ship with the course's repository, not with the ``zerolab`` package. The grader
finds them next to the package (an editable install or a run from the checkout), else in the
current directory, else it needs ``--tests PATH``.
"""
import pathlib

# The checkout this package lives in, when it lives in one (zerolab/grade/checkout.py -> root).
REPO = pathlib.Path(__file__).resolve().parents[2]

NEEDS_CHECKOUT = ("the graded tests live in a zerolab checkout (tests/graded): run from one, or pass "
                  "--tests PATH (a folder of test_exNN_*.py files)")


def checkout_root():
    """The zerolab checkout to grade with: the package's own, else the current directory's.
    Raises FileNotFoundError saying what is needed when neither holds ``tests/graded``."""
    for root in (REPO, pathlib.Path.cwd().resolve()):
        if (root / "tests" / "graded").is_dir():
            return root
    raise FileNotFoundError(NEEDS_CHECKOUT)


def graded_dir(tests=None):
    """The folder of graded test files: ``tests`` when given, else the checkout's tests/graded."""
    if tests is None:
        return checkout_root() / "tests" / "graded"
    path = pathlib.Path(tests).resolve()
    if not path.is_dir() or not list(path.glob("test_ex[0-9][0-9]_*.py")):
        raise FileNotFoundError(f"--tests {tests}: no test_exNN_*.py files in {path}")
    return path


def exercise_name(test_file):
    """The exercise module a graded test file grades: tests/graded/test_ex03_zero1.py -> 'ex03_zero1'."""
    return pathlib.Path(test_file).stem[len("test_"):]

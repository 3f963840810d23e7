"""Refusing the reference implementation (zerolab.grade.references): the declarations in the graded
test files name real things, the course's own stubs and solutions pass, and plausible shortcuts are
refused, statically and at run time."""
import importlib
import json
import pathlib
import subprocess
import sys
import textwrap

import pytest

from zerolab.grade.checkout import exercise_name
from zerolab.grade.references import declaration, refused_entry, static_check

REPO = pathlib.Path(__file__).resolve().parent.parent
GRADED = sorted((REPO / "tests" / "graded").glob("test_ex[0-9][0-9]_*.py"))
RING = declaration(REPO / "tests" / "graded" / "test_ex00_collectives.py")  # lesson 00's


def _resolves(name):
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return True
    return False


@pytest.mark.parametrize("test_file", GRADED, ids=lambda p: p.stem)
def test_declarations_name_real_modules_and_allow_only_parts_of_them(test_file):
    refused, allowed = declaration(test_file)
    for name in refused + allowed:
        assert _resolves(name), f"{test_file.name}: {name} does not exist"
    for name in allowed:
        assert any(name.startswith(r + ".") for r in refused), f"{test_file.name}: {name} is allowed but not refused"


@pytest.mark.parametrize("folder", ["exercises", "solutions"])
def test_the_course_stubs_and_solutions_pass_the_static_check(folder):
    for test_file in GRADED:
        name = exercise_name(test_file)
        source = (REPO / folder / f"{name}.py").read_bytes()
        assert static_check(source, f"{name}.py", *declaration(test_file)) is None


@pytest.mark.parametrize("source, used", [
    ("from solutions.ex00_collectives import *", "solutions.ex00_collectives.*"),
    ("import solutions.ex00_collectives as s", "solutions.ex00_collectives"),
    ("from zerolab.ring import ring_all_reduce, exchange", "zerolab.ring.ring_all_reduce"),
    ("from zerolab.ring import *", "zerolab.ring.*"),
    ("from zerolab import ring\ndef f(t):\n    return ring.ring_all_reduce(t)", "zerolab.ring.ring_all_reduce"),
    ("import zerolab.ring\nf = zerolab.ring.reduce_scatter_chunks", "zerolab.ring.reduce_scatter_chunks"),
    ("import zerolab.ring as r\nr.all_gather_chunks", "zerolab.ring.all_gather_chunks"),
    ("from zerolab import ring\nhelper(ring)", "zerolab.ring"),
    ("import importlib\nimportlib.import_module('solutions')", "solutions"),
    ("def f():\n    from zerolab.ring import ring_all_gather", "zerolab.ring.ring_all_gather"),
    ("from zerolab import engine\ndef f(o, i):\n    engine.reduce_scatter(o, i, impl='ring')", "zerolab.engine.reduce_scatter"),
])
def test_static_check_refuses_the_reference(source, used):
    reason = static_check(source, "ex00_collectives.py", *RING)
    assert reason and reason.startswith("refused: ex00_collectives.py line ") and f" uses {used}," in reason


@pytest.mark.parametrize("source", [
    "from zerolab.ring import exchange",
    "from zerolab import ring\nx = ring.exchange",
    "import zerolab.ring\nzerolab.ring.exchange",
    "from zerolab import comm\nimport torch.distributed as dist\ncomm.isend\ncomm.recv",
    '"""Use zerolab.ring.exchange, not zerolab.ring.ring_all_reduce."""',  # text is not code
])
def test_static_check_allows_what_the_exercise_offers(source):
    assert static_check(source, "ex00_collectives.py", *RING) is None


def test_refused_entry_matches_whole_dotted_components():
    assert refused_entry("zerolab.ringbuffer.x", *RING) is None
    assert refused_entry("zerolab.ring.exchange.__doc__", *RING) is None
    assert refused_entry("zerolab.ring.ring_all_reduce", *RING) == "zerolab.ring"


RUNTIME = '''
import json, os, pathlib, sys
os.environ["ZEROLAB_REFERENCES"] = json.dumps(DECLARED)
from zerolab.grade.helpers import exercise_module
import zerolab.ring
out = {}
for case in CASES:
    os.environ["ZEROLAB_IMPL"] = str(pathlib.Path(sys.argv[1]) / case)
    name = "ex03_zero1" if case.startswith("zero1") else "ex00_collectives"
    try:
        m = exercise_module(name)
        m.run() if hasattr(m, "run") else None
        out[case] = "ok"
    except Exception as exc:
        out[case] = f"{type(exc).__name__}: {exc}"
# the reference still works for everyone else, and the solutions pass
out["reference"] = zerolab.ring.ring_all_reduce.__name__
for test_file in sorted(pathlib.Path(sys.argv[2]).glob("test_ex*.py")):
    os.environ["ZEROLAB_IMPL"] = sys.argv[3]
    name = test_file.stem[5:]
    try:
        exercise_module(name)
    except Exception as exc:
        out[name] = f"{type(exc).__name__}: {exc}"
print(json.dumps(out))
'''

CHEATS = {   # each past the static rules: zerolab.quantize (allowed) loads zerolab.ring, reached
             # through a name the static check does not follow
    # bound at import: the namespace check
    "bound": "import zerolab.quantize\nz = zerolab\nring_all_reduce = z.ring.ring_all_reduce",
    # reached at call time: the guarded function refuses a call from the submitted file
    "call": "import zerolab.quantize\ndef run():\n    z = zerolab\n    z.ring.ring_all_reduce(None)",
    # the allowed step, at call time: fine
    "allowed": "import zerolab.quantize\ndef run():\n    z = zerolab\n    return z.ring.exchange",
    # a subclass of the reference optimizer (zerolab.stages loads zerolab.zero1)
    "zero1_subclass": "import zerolab.stages\nz = zerolab\nclass Zero1Optimizer(z.zero1.Zero1Optimizer):\n    pass",
}


def test_run_time_check_refuses_what_the_static_check_cannot_see(tmp_path):
    for case, source in CHEATS.items():
        (tmp_path / case).mkdir()
        name = "ex03_zero1" if case.startswith("zero1") else "ex00_collectives"
        (tmp_path / case / f"{name}.py").write_text(textwrap.dedent(source))
        assert static_check(source, f"{name}.py", *declaration(next(p for p in GRADED if name in p.name))) is None
    declared = {exercise_name(p): declaration(p) for p in GRADED}
    script = f"DECLARED = {declared!r}\nCASES = {list(CHEATS)!r}\n" + RUNTIME
    r = subprocess.run([sys.executable, "-c", script, str(tmp_path), str(REPO / "tests" / "graded"),
                        str(REPO / "solutions")], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.splitlines()[-1])
    refusal = "ReferenceImplementationError: refused: "
    assert out["bound"].startswith(refusal + "ex00_collectives.py (its ring_all_reduce) uses zerolab.ring.ring_all_reduce")
    assert out["call"].startswith(refusal + "ex00_collectives.py (at run time) uses zerolab.ring.ring_all_reduce")
    assert out["allowed"] == "ok"
    assert out["zero1_subclass"].startswith(refusal + "ex03_zero1.py (its Zero1Optimizer) uses "
                                            "zerolab.zero1.Zero1Optimizer")
    assert out["reference"] == "ring_all_reduce"
    assert not [k for k in out if k.startswith("ex")], {k: v for k, v in out.items() if k.startswith("ex")}

"""The grader's defences that need no ranks (fast): what an isolated rank's reply may hold, how much
of a rank's output the parent keeps, what the sandbox shows of the grading tree, which constructs
a submission may not use, and the instructor's CSV. The end-to-end attacks are in
tests/test_grade_adversarial.py."""
import io
import os
import pathlib
import stat
import subprocess
import sys
import types

import pytest
import torch

from zerolab import _protocol
from zerolab.grade import cli, runner, sandbox, tree
from zerolab.grade.references import REFUSED, declaration, static_check

REPO = pathlib.Path(__file__).resolve().parent.parent


class _Conn:
    def __init__(self, message):
        buf = io.BytesIO()
        torch.save(message, buf)
        self.data = buf.getvalue()

    def recv_bytes(self, limit):
        return self.data


def _plain_ranks():
    ranks = _protocol.Ranks.__new__(_protocol.Ranks)   # only _recv is exercised: nothing started
    ranks.plain = True
    return ranks


@pytest.mark.parametrize("body", [
    {"type": "E", "message": "m", "traceback": "t", "exception": b"\x80\x04K\x01."},  # a pickle
    {"type": "E", "message": "m", "traceback": "t", "extra": "x"},
    {"type": "E", "message": 3, "traceback": "t"},
])
def test_an_isolated_rank_error_is_text_only(body):
    """An error reply carrying anything but its three texts (a pickled exception above all, which
    unpickled in the parent would run the submission's code where the verdict is decided) ends the
    conversation as a dead rank would."""
    with pytest.raises(_protocol._Garbled):
        _plain_ranks()._recv(_Conn(("err", 1, body)))


def test_an_isolated_rank_error_is_bounded():
    got = _plain_ranks()._recv(_Conn(("err", 1, {"type": "E", "message": "m" * (1 << 20),
                                                 "traceback": "t", "exception": None})))
    assert got[0] == "err" and got[2]["exception"] is None
    assert len(got[2]["message"]) == _protocol._ERR_CHARS


def test_a_flood_of_output_costs_the_parent_a_bounded_amount():
    """40 MB on one line, then lines: the parent keeps pieces of at most _LINE_BYTES and, per
    stream, about _KEEP_CHARS characters, saying what it dropped."""
    code = ("import sys\nsys.stdout.write('x' * (40 << 20))\nsys.stdout.write('\\nlast line\\n')\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    rank = _protocol._Rank(0, proc, None)
    proc.wait(timeout=60)
    out = rank.take_output(1, 30)["stdout"]
    assert max(map(len, out)) <= _protocol._LINE_BYTES
    assert sum(map(len, out)) <= _protocol._KEEP_CHARS + _protocol._LINE_BYTES
    assert out[0].startswith("[earlier output of stdout dropped") and out[-1] == "last line"


SNIPPETS = {
    "exec('x = 1')": "exec",
    "f = eval": "eval",
    "compile('1', '<elsewhere>', 'eval')": "compile",
    "__import__('zerolab.' + 'cost')": "__import__",
    "import importlib": "import importlib",
    "from importlib import import_module": "from importlib import",
    "import gc": "import gc",
    "import inspect": "import inspect",
    "import ctypes": "import ctypes",
    "import sys\nsys.modules['zerolab.cost']": "sys.modules",
    "import sys\nf = sys._getframe()": "._getframe",
    "from sys import modules": "from sys import modules",
    "def f(): pass\ng = f.__globals__": ".__globals__",
    "def f(): pass\nc = f.__code__": ".__code__",
    "import zerolab\nzerolab.__dict__": ".__dict__",
    "import zerolab\ngetattr(zerolab, 'co' + 'st')": "getattr with a name that is not a public literal",
    "import zerolab\ngetattr(zerolab, '_private')": "getattr with a name",
    "import torch.distributed as dist\ndist.group.WORLD.allreduce([1])": ".allreduce",
    "import torch.distributed as dist\ndist.distributed_c10d._get_default_group()": "._get_default_group",
    "import os\nos.fdopen(13)": ".fdopen",
    "import zerolab.grade.helpers": "zerolab.grade",
}


@pytest.mark.parametrize("source", SNIPPETS)
def test_dynamic_constructs_are_refused(source):
    reason = static_check(source.encode(), "ex00_collectives.py", [], [])
    assert reason is not None and reason.startswith(REFUSED) and SNIPPETS[source] in reason, reason


@pytest.mark.parametrize("source", [
    "leaf = getattr(node, 'variable', None)",
    "import torch\nm = torch.nn.Linear(2, 2)\nn = len(list(m.modules()))",
    "class S:\n    def __init__(self):\n        self.meta_path = 'x'",
    "import os, sys\nsys.path.insert(0, os.getcwd())",
    "import torch.distributed as dist\ndef f(t, group=None):\n    dist.all_reduce(t, group=group)",
])
def test_ordinary_code_is_not_refused(source):
    assert static_check(source.encode(), "ex00_collectives.py", [], []) is None


def test_no_solution_or_wrong_answer_trips_the_rules():
    for path in [*REPO.glob("solutions/ex*.py"), *REPO.glob("tests/graded/wrong/ex*.py")]:
        tests = sorted(REPO.glob(f"tests/graded/test_{path.name[:4]}_*.py"))
        refused, allowed = declaration(tests[0])
        name = next(REPO.glob(f"exercises/{path.name[:4]}_*.py")).name
        assert static_check(path.read_bytes(), name, refused, allowed) is None, path


def test_a_submitted_file_is_read_as_itself_and_bounded(tmp_path):
    (tmp_path / "ex07_cost_model.py").symlink_to(REPO / "solutions" / "ex07_cost_model.py")
    with pytest.raises(ValueError, match="not a regular file"):
        runner._read_submitted(tmp_path / "ex07_cost_model.py")
    big = tmp_path / "ex00_collectives.py"
    with open(big, "wb") as f:
        f.truncate(runner.FILE_LIMIT + 1)
    with pytest.raises(ValueError, match="larger than"):
        runner._read_submitted(big)
    with pytest.raises(FileNotFoundError):
        runner._read_submitted(tmp_path / "ex03_zero1.py")


def test_the_sandbox_shows_the_submission_not_the_tests(tmp_path):
    impl = tmp_path / "impl"
    impl.mkdir()
    (impl / "ex07_cost_model.py").write_text("x = 1\n")
    work = tmp_path / "work"
    work.mkdir()
    files = sorted((REPO / "tests" / "graded").glob("test_ex07_*.py"))
    submission, tests, *_ , spec, uid = tree.make_tree(work, impl, REPO / "tests" / "graded", files,
                                                      sandboxed="namespaces")
    import json
    shown = json.loads(spec.read_text())["read_only"]
    assert str(submission) in shown
    assert not any(str(tests[0]).startswith(p.rstrip("/") + "/") for p in shown), shown


@pytest.mark.parametrize("text, cell", [
    ('=HYPERLINK("http://x","10")', '\'=HYPERLINK("http://x","10")'),
    ("+1", "'+1"), ("-1", "'-1"), ("@SUM(A1)", "'@SUM(A1)"), ("alice", "alice"), ("", ""),
])
def test_csv_cells_never_start_a_formula(text, cell):
    assert cli._cell(text) == cell


def test_probes_travel_by_value(tmp_path):
    """A probe's module is sent by value: the ranks never import the test file (nor see it)."""
    import cloudpickle
    from zerolab.grade import helpers
    module = types.ModuleType("test_exZZ_probe_by_value")
    module.EXPECTED = {"answer": 42}
    exec("def probe():\n    return 1\n", module.__dict__)
    sys.modules[module.__name__] = module
    try:
        helpers._by_value(module.probe)
        data = cloudpickle.dumps(module.probe)
    finally:
        cloudpickle.unregister_pickle_by_value(module)
        del sys.modules[module.__name__]
    assert b"answer" not in data   # the module's expected values stay here
    assert cloudpickle.loads(data)() == 1


def test_user_mode_refuses_a_checkout_others_may_read(tmp_path):
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    assert not sandbox.others_may(private, stat.S_IROTH)
    public = tmp_path / "public"
    public.mkdir(mode=0o755)
    os.chmod(public, 0o755)
    assert sandbox.others_may(public, stat.S_IROTH) == all(
        os.stat(p).st_mode & 0o001 for p in [*public.parents][:-1])

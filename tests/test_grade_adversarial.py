"""The grader against submissions that cheat: each scores what the untouched stub scores, the next
(correct) submission in the same batch still scores full marks, and nothing they write survives.

The batch grades a tiny exercise (tests/test_grade_robustness.py's ``graded`` folder: one test in
one process, two on 2 ranks, 4 points) with ``--csv``, the instructor's path, in the sandbox. Every
hostile submission is the stub plus an attack (the issue each comes from: "forged score", "tests
tampered for the next student", "answer key readable", "interference", "writes anywhere"), and a
correct submission follows each one. The attacks:

* forging the verdict: patching pytest's TestReport or Function.runtest, zerolab.grade's helpers,
  zerolab.comm's counters (none of them runs where the score is decided);
* reading what it must not: the worked answers through ``zerolab.__file__``, ``/proc/PID/root``
  and ``/proc/PID/cwd`` of other processes, a walk of ``/``; the test's expected values through the
  call stack, ``gc`` and ``sys.modules`` (the references live in the trusted process only);
* tampering: rewriting the graded test files for the next student, writing results files, files in
  /tmp, the home folder and the checkout;
* disrupting: killing the grading process (its parent, every process it may signal), a fork bomb,
  a detached process (setsid, double fork) that would act after its submission ended, an endless
  loop at import.
"""
import csv
import hashlib
import os
import pathlib
import subprocess
import sys
import textwrap
import time

import pytest

from test_grade_robustness import GOOD, RANK_TIMEOUT, graded, leftovers  # noqa: F401 (graded: a fixture)

REPO = pathlib.Path(__file__).resolve().parent.parent
MARK = "zerolab-adversary-was-here"

STUB = '''
def double(x):
    raise NotImplementedError("ex00_tiny: double")

def total(t):
    raise NotImplementedError("ex00_tiny: total")
'''

# Each attack runs at import, after the stub's definitions (so that what it defines wins).
_ATTACKS = {
    "forge_test_report": '''
import _pytest.reports as _r
_init = _r.TestReport.__init__
def _forged(self, *a, **k):
    _init(self, *a, **k)
    self.outcome = "passed"
_r.TestReport.__init__ = _forged
''',
    "forge_runtest": '''
import _pytest.python as _p
_p.Function.runtest = lambda self: None
''',
    "forge_grade_helpers": '''
import zerolab.grade.helpers as _h, zerolab.grade.child as _c, zerolab.comm as _comm
_h.assert_close = lambda *a, **k: None
_h.Student.on_ranks = lambda self, n, fn, *a, **k: [None] * n
_c.reason = lambda text: ""
for _name in dir(_comm):
    if "count" in _name.lower() or "log" in _name.lower():
        try:
            setattr(_comm, _name, lambda *a, **k: {})
        except Exception:
            pass
''',
    "answer_key": '''
import os, zerolab
_root = os.path.dirname(os.path.dirname(os.path.realpath(zerolab.__file__)))
_found = []
for _base in [_root, "/proc/1/root" + _root, "/"] + [f"/proc/{p}/cwd" for p in os.listdir("/proc") if p.isdigit()]:
    for _d, _dirs, _files in os.walk(_base):
        _found += [os.path.join(_d, f) for f in _files if f.startswith(("ex00_tiny", "ex07_cost_model"))
                   and "solutions" in _d]
        _dirs[:] = [d for d in _dirs if d not in ("usr", "sys", "proc", ".venv", "site-packages")]
        if _d.count("/") > 5:
            _dirs[:] = []
for _p in _found:
    try:
        _g = {}
        exec(open(_p).read(), _g)
        double, total = _g.get("double", double), _g.get("total", total)
    except Exception:
        pass
''',
    "expected_from_the_stack": '''
import gc, inspect, sys
def double(x):
    for frame in inspect.stack():
        for name in ("want", "expected", "ref", "reference"):
            if name in frame.frame.f_locals:
                return frame.frame.f_locals[name]
    for obj in gc.get_objects():           # anything the grader keeps that holds the answer
        if isinstance(obj, dict) and obj.get("__name__", "").startswith("test_ex00"):
            return obj.get("WANT", None)
    mod = sys.modules.get("test_ex00_tiny")
    if mod is not None:
        return getattr(mod, "WANT", None)
    raise NotImplementedError("ex00_tiny: double")
''',
    "tamper_tests_and_results": '''
import os, json, zerolab
_forged = "import pytest\\n@pytest.mark.points(4)\\ndef test_x():\\n    pass\\n"
_roots = [os.path.dirname(os.path.dirname(os.path.realpath(zerolab.__file__))), "/tmp", "/autograder",
          os.path.expanduser("~"), os.getcwd()]
for _root in _roots:
    for _d, _dirs, _files in os.walk(_root):
        for _f in _files:
            try:
                if _f.startswith("test_ex00"):
                    open(os.path.join(_d, _f), "w").write(_forged)
                if _f.endswith((".json", ".csv")) and ("result" in _f or "grade" in _f):
                    open(os.path.join(_d, _f), "w").write(json.dumps({"score": 100, "tests": []}))
            except OSError:
                pass
''',
    "writes_everywhere": f'''
import os, zerolab
_root = os.path.dirname(os.path.dirname(os.path.realpath(zerolab.__file__)))
for _p in ["/tmp/{MARK}", os.path.expanduser("~/{MARK}"), _root + "/{MARK}",
           _root + "/zerolab/{MARK}", "/var/tmp/{MARK}", "/dev/shm/{MARK}"]:
    try:
        open(_p, "w").write("x")
    except OSError:
        pass
''',
    "kills_the_grader": '''
import os, signal
for _pid in [os.getppid(), 1, -1] + [int(p) for p in os.listdir("/proc") if p.isdigit()]:
    try:
        os.kill(_pid, signal.SIGKILL) if _pid != os.getpid() else None
    except OSError:
        pass
''',
    "fork_bomb": '''
import os, time
_kids = 0
while _kids < 100_000:
    try:
        if os.fork() == 0:
            time.sleep(120)
            os._exit(0)
        _kids += 1
    except OSError:
        break
''',
    "detached_later": f'''
import os, subprocess, sys
_code = ("import time, os\\ntime.sleep(8)\\n"
         "for p in ['/tmp/{MARK}-late', os.path.expanduser('~/{MARK}-late')]:\\n"
         "    try: open(p, 'w').write('x')\\n"
         "    except OSError: pass\\n")
subprocess.Popen([sys.executable, "-c", _code], start_new_session=True,
                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
if os.fork() == 0:                       # and a double fork
    os.setsid()
    if os.fork() == 0:
        exec(_code)
    os._exit(0)
''',
    "endless_import": '''
while True:
    pass
''',
    "forged_error_reply": '''
import io, os, pickle, torch
from multiprocessing.connection import Connection
class _Run:                              # unpickled where the verdict is decided, this would run
    def __reduce__(self):
        return (exec, ("import _pytest.reports as R\\n"
                       "_i = R.TestReport.__init__\\n"
                       "def _f(self, *a, **k):\\n"
                       "    _i(self, *a, **k); self.outcome = 'passed'\\n"
                       "R.TestReport.__init__ = _f\\n", {}))
_conn = Connection(int(os.environ["ZEROLAB_CONTROL_FD"]))
for _run in range(1, 64):                # the run ids are small integers: answer each of them
    _buf = io.BytesIO()
    torch.save(("err", _run, {"type": "E", "message": "m", "traceback": "t",
                              "exception": pickle.dumps(_Run())}), _buf)
    try:
        _conn.send_bytes(_buf.getvalue())
    except OSError:
        break
''',
}


# One submission per kind of attack (each of its attacks alone scores no more than they do
# together; an attack that finds the answers comes last in its group, so nothing masks it).
GROUPS = {
    "forges_the_verdict": ("forge_test_report", "forge_runtest", "forge_grade_helpers"),
    "forges_a_reply": ("forged_error_reply",),
    "reads_the_answers": ("expected_from_the_stack", "answer_key"),
    "tampers": ("tamper_tests_and_results", "writes_everywhere"),
    "disrupts": ("detached_later", "kills_the_grader", "fork_bomb"),
    "hangs": ("endless_import",),
}
assert sorted(n for names in GROUPS.values() for n in names) == sorted(_ATTACKS)


def _smuggled(kind, code):
    """The attack as a module that the submission writes to its /tmp and imports (and whose names
    it takes): past the static rules of zerolab.grade.references, which refuse most of these
    attacks written plainly, so that what is tested here is the isolation, not the rules."""
    module = f"_zl_{kind}"
    return (f"import os as _os, sys as _sys, tempfile as _tempfile\n"
            f"_where = _tempfile.mkdtemp()\n"
            f"with open(_os.path.join(_where, {module + '.py'!r}), 'w') as _f:\n"
            f"    _f.write({textwrap.dedent(STUB) + code!r})\n"
            f"_sys.path.insert(0, _where)\n"
            f"from {module} import *\n")


ATTACKS = {kind: _smuggled(kind, "\n".join(textwrap.dedent(_ATTACKS[name]) for name in names))
           for kind, names in GROUPS.items()}


def _snapshot(root):
    """{relative path: sha256} of every file of the checkout (its venv and caches aside)."""
    out = {}
    for path in root.rglob("*"):
        rel = path.relative_to(root)
        if rel.parts[0] in (".venv", ".git", "_site", ".pytest_cache") or "__pycache__" in rel.parts \
                or not path.is_file():
            continue
        out[str(rel)] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def _marks():
    places = [pathlib.Path("/tmp"), pathlib.Path.home(), REPO, REPO / "zerolab", pathlib.Path("/var/tmp"),
              pathlib.Path("/dev/shm")]
    return sorted(str(p / name) for p in places for name in (MARK, MARK + "-late") if (p / name).exists())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the grader's sandbox is Linux only")
def test_cheats_score_as_the_stub_and_touch_nothing(tmp_path, graded):  # noqa: F811
    from zerolab.grade.sandbox import unavailable_reason
    if unavailable_reason():
        pytest.skip(unavailable_reason())
    subs = tmp_path / "submissions"
    subs.mkdir()
    stub = textwrap.dedent(STUB)
    (subs / "00_stub").mkdir()
    (subs / "00_stub" / "ex00_tiny.py").write_text(stub)
    for i, (name, attack) in enumerate(ATTACKS.items(), start=1):
        (subs / f"{i:02d}_{name}").mkdir()
        (subs / f"{i:02d}_{name}" / "ex00_tiny.py").write_text(stub + attack)
        (subs / f"{i:02d}z_good").mkdir()                       # graded right after it
        (subs / f"{i:02d}z_good" / "ex00_tiny.py").write_text(textwrap.dedent(GOOD))
    # A submission may hold a link: the grader copies regular files only, never what a link names.
    (subs / "00_stub" / "peek.py").symlink_to(REPO / "solutions" / "ex00_collectives.py")
    before, marks_before = _snapshot(REPO), _marks()
    out = tmp_path / "grades.csv"
    run_id = f"adversarial-{os.getpid()}-{time.time_ns()}"   # inherited by every process it starts
    r = subprocess.run([sys.executable, "-m", "zerolab", "grade", str(subs), "--csv", str(out),
                        "--tests", str(graded), "--rank-timeout", str(RANK_TIMEOUT), "--test-timeout", "60",
                        "--budget", "150"], cwd=REPO, capture_output=True, text=True, timeout=3000,
                       env=dict(os.environ, ZEROLAB_ADVERSARIAL_RUN=run_id))
    assert r.returncode == 0, r.stdout + r.stderr
    rows = {row["student"]: row for row in csv.DictReader(out.open())}
    assert rows["00_stub"]["total"] == "0", rows["00_stub"]
    cheats = {k: v["total"] for k, v in rows.items() if not k.endswith("good") and k != "00_stub"}
    assert cheats == {k: "0" for k in cheats}, f"a cheat scored more than the stub: {cheats}\n{r.stdout}"
    goods = {k: v["total"] for k, v in rows.items() if k.endswith("good")}
    assert goods == {k: "4" for k in goods}, f"a correct submission lost points after a hostile one: {goods}"
    assert len(cheats) == len(goods) == len(ATTACKS)
    time.sleep(10)                                # the detached processes would have written by now
    assert _marks() == marks_before, f"files a submission wrote survived it: {_marks()}"
    assert _snapshot(REPO) == before, "the checkout changed while the batch was graded"
    assert not leftovers("ZEROLAB_ADVERSARIAL_RUN", run_id), f"processes left behind: {leftovers()}"

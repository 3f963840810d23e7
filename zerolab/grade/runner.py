"""Run the graded tests of a zerolab checkout on one submission and score them: :func:`run_graded`.
(The command line, the notebook's ``check`` and the result formats: :mod:`zerolab.grade.cli`.)

Before any test runs, each submitted ``exNN_*.py`` is read, never executed: a missing file, a
syntax error, or a use of the exercise's reference implementation (the test file's
REFERENCE_MODULES, see :mod:`zerolab.grade.references`) scores that exercise 0 with the reason.

Isolation: the graded tests run in a child pytest process (:mod:`zerolab.grade.child`) whose
``sys.path`` holds the zerolab package but not the checkout, so a submission cannot import
``solutions/``. Each test has its own time limit (``--test-timeout``, pytest-timeout); the ranks'
limit per run (``--rank-timeout``, ZEROLAB_TEST_TIMEOUT) is below it, so that a hang inside a
collective ends as a RankTimeout, which stops the ranks: the next test starts on fresh ones. A
killed rank is a RankError. If student code takes down the child process, the test that was
running scores 0 with the reason and a new child runs the tests that remain. An import that hangs
or ends its process is not retried: that exercise's remaining tests score 0 with the reason.

Time: a submission has a budget (``--budget``, default 240 s per exercise graded), shared by its
exercises: each, when it starts, gets the time left divided by the exercises left. When a share
runs out, the child and every process it started are killed, that exercise's test running and
those not run score 0, and a new child grades the next exercises.
"""
import errno
import json
import os
import pathlib
import re
import secrets
import stat
import subprocess
import sys
import tempfile
import threading
import time

from zerolab.grade.checkout import REPO, exercise_name, graded_dir
from zerolab.grade.helpers import SANDBOX, TRUSTED_PID
from zerolab.grade.references import REFUSED, declaration, static_check
from zerolab.grade.sandbox import SandboxUnavailable, mode, others_may, unavailable_reason
from zerolab.grade.tree import PACKAGE, make_tree

TEST_TIMEOUT = 240.0  # seconds per graded test, the ranks' start-up included
RANK_TIMEOUT = 30.0   # default seconds per run on the ranks (at most half the test's limit): the
                      # graded runs take under 5 s on 2 cores at load 7; a hang costs this + a restart
BUDGET_PER_EXERCISE = 240.0  # default budget, per exercise graded: room for one function that deadlocks
                             # at every world size (3 hangs) and the rest; the ten solutions take 36-80 s
OUTPUT_TAIL = 20_000  # characters of the child's output kept: a submission may print megabytes
SANDBOX_MODES = ("auto", "required", "off")


def _options(test_timeout, rank_timeout, budget, exercises):
    """(test_timeout, rank_timeout, budget) validated, defaults filled in; ValueError naming the
    bad value."""
    def seconds(name, value):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
            raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        return float(value)
    test_timeout = seconds("test_timeout", test_timeout)
    rank_timeout = seconds("rank_timeout", min(RANK_TIMEOUT, test_timeout / 2) if rank_timeout is None
                           else rank_timeout)
    if rank_timeout >= test_timeout:
        raise ValueError(f"rank_timeout ({rank_timeout:g} s) must be below test_timeout "
                         f"({test_timeout:g} s): a stuck test must end as a RankTimeout, which restarts "
                         f"the ranks, not as a pytest-timeout kill that leaves them stuck")
    budget = BUDGET_PER_EXERCISE * exercises if budget is None else budget
    return test_timeout, rank_timeout, seconds("budget", budget)


def graded_files(graded, lessons):
    """The graded test files of ``lessons`` (all when None) in the folder ``graded``."""
    files = sorted(graded.glob("test_ex[0-9][0-9]_*.py"))
    if lessons:
        wanted = set()
        for lesson in lessons:
            if not re.fullmatch(r"\d{1,2}", str(lesson)):
                raise ValueError(f"lessons: {lesson!r} is not a lesson number (00-99)")
            wanted.add(f"{int(lesson):02d}")
        files = [f for f in files if f.name[7:9] in wanted]
    if not files:
        raise ValueError(f"no graded tests for lessons {lessons} in {graded}")
    return files


FILE_LIMIT = 5 << 20  # bytes of one submitted exercise file


def _read_submitted(path):
    """The bytes of a submitted file: a regular file (a link is not followed: it could point at a
    file only the grader may read, or at one that never ends), at most FILE_LIMIT bytes."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        if exc.errno == errno.ENOENT:
            raise FileNotFoundError(path) from None
        raise ValueError(f"{path.name} is not a regular file (a link or something else); submit the "
                         f"file itself") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise ValueError(f"{path.name} is not a regular file; submit the file itself")
        data = f.read(FILE_LIMIT + 1)
    if len(data) > FILE_LIMIT:
        raise ValueError(f"{path.name} is larger than {FILE_LIMIT >> 20} MB; submit the exercise's source")
    return data


def _static_verdicts(impl, files):
    """exercise -> why its tests need not run, decided from the submitted files alone."""
    verdicts = {}
    for test_file in files:
        name = exercise_name(test_file)
        path = impl / f"{name}.py"
        refused, allowed = declaration(test_file)
        try:
            source = _read_submitted(path)
        except FileNotFoundError:
            verdicts[name] = f"{path.name} is missing from the submission"
            continue
        except ValueError as exc:
            verdicts[name] = str(exc)
            continue
        try:
            reason = static_check(source, path.name, refused, allowed)
        except SyntaxError as exc:
            reason = f"{path.name} does not compile: SyntaxError: {exc.msg} (line {exc.lineno})"
        except ValueError as exc:  # e.g. null bytes
            reason = f"{path.name} does not compile: {exc}"
        if reason:
            verdicts[name] = reason
    return verdicts


class _Tail(threading.Thread):
    """Drains a stream, keeping only its last OUTPUT_TAIL characters."""

    def __init__(self, stream):
        super().__init__(daemon=True)
        self.stream, self.data = stream, b""
        self.start()

    def run(self):
        for chunk in iter(lambda: self.stream.read1(1 << 16), b""):
            self.data = (self.data + chunk)[-OUTPUT_TAIL:]

    def text(self):
        return self.data.decode(errors="replace")


def _kill_all(proc, tag, uid=None):
    """Kill the child and every process it started: its descendants, any process whose environment
    carries this grading's tag (the ranks run in sessions of their own, and a child that died has
    left them orphaned), and any process of the submission's own user id (``uid``, as root)."""
    import psutil
    try:
        family = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        family = []
    proc.kill()
    proc.wait()
    for p in psutil.process_iter():
        try:
            if p not in family and (p.environ().get("ZEROLAB_GRADE_TAG") == tag or
                                    (uid is not None and p.uids().real == uid)):
                family.append(p)
        except psutil.Error:
            pass
    for p in family:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(family, timeout=10)


def _child_env(impl, rank_timeout, tmp, tag, marks, spec):
    env = dict(os.environ, ZEROLAB_IMPL=str(impl), ZEROLAB_TEST_TIMEOUT=f"{rank_timeout:g}",
               ZEROLAB_IMPORT_MARKS=str(marks), ZEROLAB_GRADE_TAG=tag)
    for key in ("PYTEST_CURRENT_TEST", "ZEROLAB_REFERENCES", "PYTEST_ADDOPTS", SANDBOX, TRUSTED_PID):
        env.pop(key, None)
    if spec is not None:
        env[SANDBOX] = str(spec)  # the submission's ranks run in the sandbox (helpers.isolation)
    # The zerolab package through a folder that holds only it: the child drops from sys.path every
    # folder that holds a solutions/ (the checkout), and still imports zerolab.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(tmp / "sys_path"), env.get("PYTHONPATH")) if p)
    return env


class _Events:
    """What the child processes reported: the tests collected (nodeid -> event, in order), their
    results, and the test running now. Read as the child writes, one complete line at a time."""

    def __init__(self):
        self.collected, self.results, self.running = {}, {}, None
        self.path, self._offset = None, 0

    def follow(self, path):
        """From now on, read the events of a new child, written to ``path``."""
        self.path, self._offset, self.running = path, 0, None

    def read(self):
        if not self.path.exists():
            return
        with open(self.path, "rb") as f:
            f.seek(self._offset)
            data = f.read()
        complete = data[:data.rfind(b"\n") + 1]
        self._offset += len(complete)
        for line in complete.decode().splitlines():
            ev = json.loads(line)
            if ev["event"] == "collected":
                self.collected.setdefault(ev["nodeid"], ev)
            elif ev["event"] == "start":
                self.running = ev["nodeid"]
            else:
                self.results[ev["nodeid"]] = ev
                self.running = None

    def lessons_left(self):
        return sorted({_lesson(n) for n in self.collected if n not in self.results})


def _lesson(nodeid):
    return re.search(r"test_ex(\d\d)", nodeid).group(1)


def _failed(message, output=""):
    return {"outcome": "failed", "message": message, "output": output}


def sandbox_mode(sandbox):
    """(the sandbox's mode or None, why it is not the full sandbox or None) for ``sandbox`` in
    'auto', 'required', 'off'. Modes: "namespaces" (zerolab.grade.sandbox), "user" (root without
    namespaces: the submission's own user id only). ValueError for another value;
    :class:`SandboxUnavailable` when required and impossible."""
    if sandbox not in SANDBOX_MODES:
        raise ValueError(f"sandbox={sandbox!r} is not valid: use one of {', '.join(SANDBOX_MODES)}")
    if sandbox == "off":
        return None, "the sandbox was turned off (--no-sandbox)"
    reason, how = unavailable_reason(), mode()
    exposed = [p for p in (REPO / "solutions", REPO / "tests") if how == "user" and others_may(p, stat.S_IROTH)]
    if exposed:  # the lesser sandbox hides no file: the answers must be closed to other users
        how, reason = None, (f"{reason}; the lesser sandbox (the submission's own user id) would let a "
                             f"submission read {exposed[0]}: make the checkout private first "
                             f"(chmod -R o-rwx {REPO})")
    if how is None and sandbox == "required":
        if os.geteuid() == 0:
            reason += (f"; as root, the lesser sandbox (the submission's own user id, no namespaces) "
                       f"needs a Python installation other users may run, and {sys.executable} is not")
        raise SandboxUnavailable(f"{reason}. Instructor mode (--csv, --gradescope) grades only in the "
                                 f"sandbox; --no-sandbox grades without it, trusting the submissions")
    return how, reason


def _remove_files_of(uid):
    """Without namespaces, what a submission's user left in the shared temporary folders."""
    import shutil
    for folder in ("/tmp", "/var/tmp", "/dev/shm"):
        try:
            entries = list(os.scandir(folder))
        except OSError:
            continue
        for e in entries:
            try:
                if e.stat(follow_symlinks=False).st_uid == uid:
                    if e.is_dir(follow_symlinks=False):
                        shutil.rmtree(e.path, ignore_errors=True)
                    else:
                        os.unlink(e.path)
            except OSError:
                pass


def run_graded(impl, lessons=None, test_timeout=TEST_TIMEOUT, *, rank_timeout=None, budget=None,
               tests=None, sandbox="auto"):
    """Grade the exercise folder ``impl``; returns one row per graded test (in collection order):
    {nodeid, lesson, points, score, outcome, message, output}. ``tests``: the folder of graded
    test files (default: the checkout's tests/graded); ``sandbox``: 'required' (instructor mode:
    refuse to grade without it), 'auto' (use it where the machine has it) or 'off'; other options:
    see the module docstring.

    The budget is shared fairly: when an exercise's first test starts, it gets the time left
    divided by the number of exercises left (time it does not use goes to the next ones), so
    that a deadlock in one exercise cannot cost the others their points."""
    graded = graded_dir(tests)
    files = graded_files(graded, lessons)
    test_timeout, rank_timeout, budget = _options(test_timeout, rank_timeout, budget, len(files))
    impl = pathlib.Path(impl).resolve()
    if not impl.is_dir():
        raise FileNotFoundError(f"no such exercises folder: {impl}")
    sandboxed, _ = sandbox_mode(sandbox)  # "namespaces", "user" or None
    verdicts = _static_verdicts(impl, files)
    deadline = time.monotonic() + budget
    ev = _Events()
    lesson, lesson_deadline = None, deadline  # the exercise running, and the end of its share
    with tempfile.TemporaryDirectory(prefix="zerolab-grade-") as tmp:
        tmp = pathlib.Path(tmp)
        (tmp / "sys_path").mkdir()
        (tmp / "sys_path" / "zerolab").symlink_to(PACKAGE, target_is_directory=True)
        # A fresh copy of the tests and of the submission for this submission alone; its ranks see
        # only that, the Python installation and zerolab (tree.py, sandbox.py).
        submission, copies, _, marks, spec, uid = make_tree(tmp, impl, graded, files, sandboxed=sandboxed,
                                                            shown=[tmp / "sys_path"])
        tag = secrets.token_hex(8)
        env = _child_env(submission, rank_timeout, tmp, tag, marks, spec)
        for attempt in range(1_000_000):  # each pass resumes after a crash or a stop; ends below
            remaining = ([e["arg"] for n, e in ev.collected.items() if n not in ev.results]
                         if ev.collected else [str(f) for f in copies])
            config = tmp / f"child{attempt}.json"
            ev.follow(tmp / f"events{attempt}.jsonl")
            config.write_text(json.dumps({"events": str(ev.path), "verdicts": verdicts,
                                          "marks": str(marks)}))
            proc = subprocess.Popen(
                [sys.executable, "-m", "zerolab.grade.child", str(config), "-q", "--no-header",
                 "-p", "no:cacheprovider", "-o", "addopts=", "-o", "pythonpath=",
                 "--continue-on-collection-errors", "--show-capture=no", f"--timeout={test_timeout:g}",
                 *remaining],
                cwd=tmp, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, start_new_session=True)
            # over: (why the child was stopped, the exercise whose tests it stopped; None: all)
            tail, done_before, over = _Tail(proc.stdout), len(ev.results), None
            try:
                while proc.poll() is None and over is None:
                    time.sleep(0.2)
                    ev.read()
                    now = time.monotonic()
                    if ev.running and _lesson(ev.running) != lesson:  # an exercise starts: its share
                        lesson = _lesson(ev.running)
                        lesson_deadline = now + (deadline - now) / max(1, len(ev.lessons_left()))
                    if now >= deadline:
                        over = (f"the submission's time budget ({budget:g} s, --budget) ran out", None)
                    elif now >= lesson_deadline:
                        over = (f"exercise {lesson}'s share of the time budget (--budget {budget:g} s, "
                                f"shared by the exercises left) ran out", lesson)
            finally:
                _kill_all(proc, tag, uid)
                if sandboxed == "user":
                    _remove_files_of(uid)
                tail.join(5)
            ev.read()
            output = tail.text()
            if not ev.collected:  # the test files themselves could not be collected
                raise RuntimeError((over[0] + " before the graded tests were collected") if over else
                                   "the graded tests could not be collected:\n" + output[-3000:])
            if ev.running is not None and ev.running not in ev.results:
                ev.results[ev.running] = _failed(
                    f"{over[0]} while this test ran" if over else
                    f"this test crashed the grading process (exit code {proc.returncode})", output[-4000:])
            if over:  # the tests it stopped short of: the exercise's, or all when the budget is spent
                for n in ev.collected:
                    if n not in ev.results and over[1] in (None, _lesson(n)):
                        ev.results[n] = _failed(f"not run: {over[0]}")
                lesson, lesson_deadline = None, deadline  # the next exercise gets its own share
            if len(ev.results) == done_before or all(n in ev.results for n in ev.collected):
                break
    rows = []
    for nodeid, e in ev.collected.items():
        r = ev.results.get(nodeid, _failed("not run: the grading process ended before this test"))
        passed = r["outcome"] == "passed"
        rows.append({"nodeid": nodeid, "lesson": _lesson(nodeid), "points": e["points"],
                     "score": e["points"] if passed else 0, "outcome": r["outcome"],
                     "message": r.get("message", ""), "output": r.get("output", "")})
    return _refuse_whole_exercises(rows)


def _refuse_whole_exercises(rows):
    """A use of the reference implementation found at run time by one test scores the whole
    exercise 0, as the static check does."""
    for lesson in {r["lesson"] for r in rows}:
        refusal = next((r["message"] for r in rows if r["lesson"] == lesson and REFUSED in r["message"]), None)
        if refusal:
            for r in rows:
                if r["lesson"] == lesson:
                    r.update(score=0, outcome="failed" if r["outcome"] == "passed" else r["outcome"],
                             message=refusal[refusal.index(REFUSED):])
    return rows

"""Shared fixtures: one set of live ranks per world size for the whole session (spawning is the
expensive part: ~2.5 s of `import torch` per process), and the graded-test switches."""
import os
import sys

import pytest


def pytest_addoption(parser):
    group = parser.getgroup("zerolab")
    group.addoption("--impl", default=None,
                    help="what graded tests grade: 'exercises' (default), 'solutions', or a folder "
                         "of exNN_*.py files. Same as the environment variable ZEROLAB_IMPL.")
    group.addoption("--stubs-must-fail", action="store_true",
                    help="invert graded outcomes: each graded test passes only if it FAILS because of "
                         "the stub, a NotImplementedError raised by the exercise file under test (run "
                         "on the untouched exercises/ to prove every graded test can fail).")
    group.addoption("--impl-each", default=None, metavar="DIRS",
                    help="run every graded test once per folder of DIRS (separated by os.pathsep), one "
                         "folder after the other on the same ranks, skipping a folder's remaining tests "
                         "once one failed (tests/test_wrong_answers.py)")
    group.addoption("--impl-report", default=None, metavar="PATH",
                    help="append one JSON line per graded test result to PATH: the folder graded "
                         "(--impl-each), the test, its outcome and its failure's last lines")
    group.addoption("--impl-tests", default=None, metavar="PATH",
                    help="with --impl-each: a JSON file {folder: [graded test names]}; a folder it "
                         "names runs only those tests (tests/test_wrong_answers.py: a wrong answer "
                         "against the tests its docstring says catch it)")


def pytest_configure(config):
    impl = config.getoption("--impl")
    if impl:
        os.environ["ZEROLAB_IMPL"] = impl  # set before any rank starts, so ranks inherit it
    os.environ.setdefault("ZEROLAB_IMPL", "exercises")
    # Every zerolab.comm collective is first checked across ranks (op, dtype, shape): a mismatch is
    # a CollectiveMismatch naming the ranks, not silently wrong numbers (zerolab.comm's docstring).
    # Set before any rank starts, so that ranks inherit it.
    os.environ.setdefault("ZEROLAB_CHECK_COLLECTIVES", "1")


def pytest_generate_tests(metafunc):
    dirs = metafunc.config.getoption("--impl-each")
    if dirs and "_impl_each" in metafunc.fixturenames:   # graded tests (tests/graded/conftest.py)
        dirs = [d for d in dirs.split(os.pathsep) if d]
        metafunc.parametrize("_impl_each", dirs, indirect=True, scope="session",
                             ids=[os.path.basename(os.path.normpath(d)) for d in dirs])


_REJECTED = set()  # --impl-each: folders a graded test already failed; their other tests are skipped


def _impl_of(item):
    return getattr(getattr(item, "callspec", None), "params", {}).get("_impl_each")


def pytest_runtest_setup(item):
    if _impl_of(item) in _REJECTED:
        pytest.skip("an earlier graded test already rejected this implementation")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"rep_{report.when}", report)  # lets fixtures see the outcome (screenshots)
    path = item.config.getoption("--impl-report")
    if path and item.get_closest_marker("points") is not None and (
            report.when == "call" or (report.when == "setup" and not report.passed)):
        import json
        params = getattr(getattr(item, "callspec", None), "params", {})
        text = report.longreprtext if report.failed else ""
        if report.failed and params.get("_impl_each"):
            _REJECTED.add(params["_impl_each"])
        with open(path, "a") as f:
            f.write(json.dumps({"impl": params.get("_impl_each", os.environ.get("ZEROLAB_IMPL")),
                                "test": item.originalname or item.name, "nodeid": item.nodeid,
                                "outcome": report.outcome, "message": text[-1500:]}) + "\n")
    if not item.config.getoption("--stubs-must-fail") or item.get_closest_marker("points") is None:
        return
    # A graded test passes the gate only if it fails BECAUSE of the stub (its NotImplementedError).
    from zerolab.grade.stubgate import judge
    judge(item, call, report)


def pytest_collection_modifyitems(config, items):
    if config.getoption("--stubs-must-fail"):
        items[:] = [i for i in items if i.get_closest_marker("points") is not None]
    path = config.getoption("--impl-tests")
    if path:
        import json
        with open(path) as f:
            only = json.load(f)
        keep, drop = [], []
        for item in items:
            names = only.get(_impl_of(item))
            (keep if names is None or (item.originalname or item.name) in names else drop).append(item)
        if drop:
            config.hook.pytest_deselected(items=drop)
            items[:] = keep


class _Clusters:
    def __init__(self, isolation=None):
        self._live, self._isolation = {}, isolation

    def __call__(self, world_size):
        from zerolab import Cluster
        if world_size not in self._live:
            # ZEROLAB_TEST_TIMEOUT: per-run timeout of the shared ranks; `zerolab grade --rank-timeout`
            # sets it below the per-test limit, so a stuck test ends as a RankTimeout, not a kill
            timeout = float(os.environ.get("ZEROLAB_TEST_TIMEOUT", 60))
            self._live[world_size] = Cluster(world_size, timeout=timeout, isolation=self._isolation)
        return self._live[world_size]

    def live(self):
        return list(self._live.values())

    def close(self):
        for c in self._live.values():
            c.close()


@pytest.fixture(scope="session")
def clusters():
    """``clusters(n)`` -> a live zerolab.Cluster of n ranks, shared by every test in the session.
    Trusted code only: a graded test runs the submission through ``student`` instead."""
    pool = _Clusters()
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def student_clusters():
    """Like ``clusters``, for the submission's code: isolated ranks (plain-data replies; under
    ``zerolab grade``, the sandbox: zerolab.grade.helpers.isolation)."""
    from zerolab.grade.helpers import isolation
    pool = _Clusters(isolation())
    yield pool
    pool.close()


# -- no process left behind ------------------------------------------------------------------------
# Orphans (say, a process a rank started, whose rank was killed) are re-parented to this pytest
# process instead of init (Linux: PR_SET_CHILD_SUBREAPER), so the check below sees them too.
try:
    import ctypes
    ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # 36 = PR_SET_CHILD_SUBREAPER
except (OSError, AttributeError):
    pass


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session):
    """After every fixture (the session's clusters included) is torn down, no process this session
    started may still run: name each one, kill it, and fail the session."""
    import time
    import psutil

    def left():
        alive = []
        for p in psutil.Process().children(recursive=True):
            try:
                if p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p)
            except psutil.NoSuchProcess:
                pass
        return alive

    deadline = time.monotonic() + 10  # processes on their way out get a moment
    while left() and time.monotonic() < deadline:
        time.sleep(0.2)
    procs = left()
    if not procs:
        return
    lines = []
    for p in procs:
        try:
            lines.append(f"pid {p.pid}: {' '.join(p.cmdline())[:200]}")
            p.kill()
        except psutil.NoSuchProcess:
            pass
    report = session.config.pluginmanager.get_plugin("terminalreporter")
    write = report.write_line if report else lambda line: sys.stderr.write(line + "\n")
    write("ERROR: processes left behind by this test session (now killed):")
    for line in lines:
        write("  " + line)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


# -- the wrong answers' kill rates (tests/test_wrong_answers.py), printed at the end ------------------
_KILL_RATES = []


@pytest.fixture
def kill_rates():
    """A list a test appends one summary per exercise to; printed in the session's summary."""
    return _KILL_RATES


def pytest_terminal_summary(terminalreporter):
    if _KILL_RATES:
        terminalreporter.section("wrong answers rejected by the graded tests")
        for block in _KILL_RATES:
            for line in block.splitlines():
                terminalreporter.write_line(line)

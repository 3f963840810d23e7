"""zerolab.Cluster after things go wrong on the caller's side: it must always recover, refuse bad
options before any rank starts, and leave no process behind (issue #25, the launcher's bullets).

One 2-rank cluster serves the module (spawning ranks costs seconds); the tests that must stop it
(an interrupted run) come last, and each later run replaces the ranks by itself."""
import math
import operator
import os
import re
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest
import torch
import torch.distributed as dist

from zerolab import Cluster, RankError, launch

# The cluster's own timeout: short, so that its process group's start-up timeout (this + 10 s)
# is short too, which the long-run test below outlives.
CLUSTER_TIMEOUT = 2


@pytest.fixture(scope="module")
def cluster():
    with Cluster(2, timeout=CLUSTER_TIMEOUT) as c:
        yield c


def getpid():
    return os.getpid()


def _alive(pid):
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _wait_dead(pids, seconds=10):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


BAD_TIMEOUTS = ["5", math.nan, math.inf, -math.inf, 1e12, -1, 0, True, False, None, [5]]


def test_bad_options_are_refused_before_any_rank_starts():
    children = {p.pid for p in psutil.Process().children()}
    cases = [(dict(timeout=t), "timeout", r"\(0, 604800\]") for t in BAD_TIMEOUTS]
    cases += [(dict(threads=t), "threads", r"\[1, 1024\]") for t in (0, -2, True, 2.0, "2", 10**6)]
    cases += [(dict(world_size=n), "world_size", "positive int") for n in (0, -1, True, 2.0, "2", None)]
    cases += [(dict(backend=b), "backend", "use 'auto', 'gloo' or 'nccl'") for b in (None, "mpi", 3, "")]
    for options, name, accepted in cases:
        world_size = options.pop("world_size", 2)
        for make in (lambda: launch(getpid, world_size, **options),
                     lambda: Cluster(world_size, **options)):
            with pytest.raises(ValueError, match=rf"{name}.*{accepted}") as info:
                make()
            assert repr(options.get(name, world_size)) in str(info.value)
    assert {p.pid for p in psutil.Process().children()} == children  # no rank was ever started


def test_bad_or_overlong_run_timeout_is_refused_and_the_ranks_go_on(cluster):
    pids = cluster.run(getpid)
    for bad in [t for t in BAD_TIMEOUTS if t is not None]:
        with pytest.raises(ValueError, match=r"timeout=.* a number in \(0, 604800\]"):
            cluster.run(getpid, timeout=bad)
    assert cluster.run(getpid) == pids  # the same ranks, in step: nothing was sent
    assert "running" in repr(cluster)


def run_longer_than_the_groups_start_up_timeout():
    if dist.get_rank() == 1:
        time.sleep(CLUSTER_TIMEOUT + 10.5)  # rank 0 waits in the all_reduce meanwhile
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def test_a_run_timeout_longer_than_the_clusters_raises_the_groups_own(cluster):
    # The process group started with timeout CLUSTER_TIMEOUT + 10 s; a run given 30 s must get
    # them (before: gloo cut it at 12 s with "Timed out waiting 12000ms").
    assert cluster.run(run_longer_than_the_groups_start_up_timeout, timeout=30) == [2.0, 2.0]
    assert cluster.run(lambda: dist.get_world_size()) == [2, 2]  # default timeout again


class UnpicklableHere:
    """Pickles fine on the rank; unpickling it calls 1 / 0 in the parent."""

    def __reduce__(self):
        return operator.truediv, (1, 0)


def returns_unpicklable():
    print(f"rank {dist.get_rank()} got this far")
    return UnpicklableHere() if dist.get_rank() == 1 else "fine"


def test_a_result_that_cannot_be_unpickled_names_the_rank_and_keeps_the_ranks(cluster, capfd):
    pids = cluster.run(getpid)
    with pytest.raises(RankError) as info:
        cluster.run(returns_unpicklable)
    assert info.value.ranks == [1] and info.value.exc_types == {1: "ZeroDivisionError"}
    assert "rank 1 returned a value that cannot be unpickled in this process" in str(info.value)
    assert isinstance(info.value.exceptions[1], ZeroDivisionError)
    assert capfd.readouterr().out.splitlines() == ["[rank 0] rank 0 got this far",
                                                   "[rank 1] rank 1 got this far"]
    assert cluster.run(getpid) == pids  # every rank replied: they stay, in step


def whoami(tag):
    time.sleep(0.002)
    return tag, dist.get_rank()


def test_runs_from_several_threads_are_serialized(cluster):
    pids = cluster.run(getpid)
    wrong = []

    def client(name):
        try:
            for k in range(15):
                got = cluster.run(whoami, (name, k))
                if got != [((name, k), 0), ((name, k), 1)]:
                    wrong.append(got)
        except BaseException as exc:  # noqa: BLE001 - reported below
            wrong.append(repr(exc))

    threads = [threading.Thread(target=client, args=(n,)) for n in "abc"]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert wrong == []
    assert cluster.run(getpid) == pids


def starts_a_child_then_sleeps(seconds):
    # rank code that starts a process of its own, which inherits the rank's output pipes
    print("starting a child", flush=True)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    time.sleep(seconds)
    return child.pid


class SimulatedTestTimeout(BaseException):
    """What pytest-timeout's signal method does: raise from SIGALRM into the waiting thread."""


def _raise_timeout(signum, frame):
    raise SimulatedTestTimeout("Timeout from pytest-timeout")


def test_an_exception_raised_into_the_waiting_caller_stops_and_replaces_the_ranks(cluster, capfd):
    # A grader's per-test limit below the cluster's timeout, or Ctrl-C in a notebook: the run is
    # abandoned mid-flight. The ranks (and what they started) must stop, and the next run -- the
    # next graded test -- must get fresh ranks that answer it, not the old run's replies.
    pids = cluster.run(getpid)
    capfd.readouterr()
    children = []

    def interrupt_once_both_ranks_started_their_child():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(children) < 2:
            children[:] = [c.pid for p in pids for c in psutil.Process(p).children()]
            time.sleep(0.05)
        signal.pthread_kill(threading.main_thread().ident, signal.SIGALRM)

    old = signal.signal(signal.SIGALRM, _raise_timeout)
    try:
        threading.Thread(target=interrupt_once_both_ranks_started_their_child).start()
        with pytest.raises(SimulatedTestTimeout):
            cluster.run(starts_a_child_then_sleeps, 60, timeout=120)
    finally:
        signal.signal(signal.SIGALRM, old)
    out, err = capfd.readouterr()
    assert out.splitlines() == ["[rank 0] starting a child", "[rank 1] starting a child"]
    assert "SimulatedTestTimeout while the ranks were running: stopped all 2 ranks" in err
    assert "restarts on the next run" in repr(cluster)
    assert len(children) == 2 and _wait_dead(pids + children, 5) == []
    new_pids = cluster.run(getpid)
    assert "restarting the cluster (2 ranks)" in capfd.readouterr().err
    assert set(new_pids).isdisjoint(pids)
    assert cluster.run(lambda: dist.get_world_size()) == [2, 2]


def test_processes_started_by_rank_code_end_with_a_clean_close():
    threads = set(threading.enumerate())
    c = Cluster(1, timeout=10)
    pid = c.run(getpid)[0]
    child = c.run(starts_a_child_then_sleeps, 0)[0]
    c.close()
    # The child held the rank's stdout/stderr: before, it lived on (re-parented to init) and the
    # two threads reading those pipes stayed blocked.
    assert _wait_dead([pid, child], 3) == []
    assert set(threading.enumerate()) <= threads


# -- issue 33: only the rank answers, unsendable values, closed output, detached descendants ----------
def forks_then_returns(child_raises):
    # The forked child shares the rank's control socket: its reply would be read as the rank's.
    pid = os.fork()
    if pid == 0 and child_raises:
        raise ValueError("raised by the forked child")
    return ("child" if pid == 0 else "rank"), os.getpid()


def test_a_forked_child_returning_into_the_worker_never_answers(cluster):
    pids = cluster.run(getpid)
    for k in range(6):
        got = cluster.run(forks_then_returns, k % 2 == 1)
        assert got == [("rank", p) for p in pids], f"run {k}: {got} (the ranks are {pids})"
    assert cluster.run(getpid) == pids  # still the ranks themselves, in step


def returns_a_lock():
    return threading.Lock()


def returns_a_generator_inside_a_dict():
    return {"loss": 1.0, "batches": (i for i in range(3))}


def test_a_return_value_that_cannot_be_sent_names_it_and_what_to_return(cluster):
    pids = cluster.run(getpid)
    for fn, where, kind in ((returns_a_lock, "the return value is", "_thread.lock"),
                            (returns_a_generator_inside_a_dict, "the return value['batches'] is", "generator")):
        with pytest.raises(RankError) as info:
            cluster.run(fn)
        message = str(info.value).split("\n")[0]
        assert f"could not send the return value back: {where} a {kind}" in message, message
        assert "Return plain data" in message and "zerolab.rank_state()" in message, message
        assert info.value.ranks == [0, 1]
    assert cluster.run(getpid) == pids  # every rank replied: the ranks stay


def closes_fd(fd):
    os.close(fd)
    return "done"


def closes_sys_stdout():
    sys.stdout.close()  # fd 1 stays open: the launcher needs only the file descriptor
    return "done"


def test_a_rank_that_closes_its_stdout_or_stderr_is_reported_as_stopped_and_why():
    with Cluster(2, timeout=20) as c:
        for fd in (1, 2):
            t0 = time.monotonic()
            with pytest.raises(RankError) as info:
                c.run(closes_fd, fd)
            message = str(info.value)
            assert "rank 0 stopped: its code closed the rank's stdout or stderr" in message, message
            assert "exit code None" not in message and "did not finish" not in message, message
            assert time.monotonic() - t0 < 10  # not a timeout
            assert c.run(lambda: dist.get_world_size()) == [2, 2]  # fresh ranks on the next run
        assert c.run(closes_sys_stdout) == ["done", "done"]  # sys.stdout.close() alone: the right result
        assert c.run(lambda: dist.get_world_size()) == [2, 2]


def starts_detached_processes():
    """A child in a new session (Popen(start_new_session=True)) and a grandchild detached by a
    double fork + setsid, whose parent exits at once. Returns their pids and session ids."""
    sleeper = [sys.executable, "-c", "import time; time.sleep(120)"]
    popen = subprocess.Popen(sleeper, start_new_session=True)
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # only os calls and exec after a fork in a threaded process
        os.setsid()
        if os.fork() == 0:
            os.write(write_end, str(os.getpid()).encode())
            os.execv(sys.executable, sleeper)
        os._exit(0)
    os.close(write_end)
    os.waitpid(pid, 0)
    grandchild = int(os.read(read_end, 32))
    os.close(read_end)
    return [popen.pid, grandchild], [os.getsid(popen.pid), os.getsid(grandchild)], os.getsid(0)


def test_detached_descendants_end_with_a_clean_close():
    c = Cluster(2, timeout=20)
    try:
        results = c.run(starts_detached_processes)
        detached = [p for pids, _, _ in results for p in pids]
        for _, sessions, own in results:
            assert own not in sessions  # really left the rank's session (and process group)
        assert all(_alive(p) for p in detached)
    finally:
        c.close()
    assert _wait_dead(detached, 5) == [], "detached processes survived Cluster.close()"


def starts_detached_processes_then_dies(how, folder):
    pids, _, _ = starts_detached_processes()
    with open(os.path.join(folder, f"rank{dist.get_rank()}"), "w") as f:
        f.write(" ".join(map(str, pids)))
    if how == "exit":
        os._exit(7)
    os.kill(os.getpid(), signal.SIGKILL)


def test_detached_descendants_end_with_a_failed_run(tmp_path):
    with Cluster(2, timeout=3) as c:
        detached = [p for pids, _, _ in c.run(starts_detached_processes) for p in pids]
        with pytest.raises(RankError):  # a timeout: the ranks are stopped
            c.run(time.sleep, 60)
        assert _wait_dead(detached, 5) == [], "detached processes survived a failed run"
        for how, said in (("exit", "died (exit code 7)"), ("kill", "died (SIGKILL)")):
            # the rank itself dies at once: nothing of it is left to stop what it detached
            with pytest.raises(RankError, match=re.escape(f"rank 0 {said}")):
                c.run(starts_detached_processes_then_dies, how, str(tmp_path))
            detached = [int(p) for r in range(2) for p in (tmp_path / f"rank{r}").read_text().split()]
            assert len(detached) == 4 and _wait_dead(detached, 5) == [], f"detached processes outlived a rank ({how})"
        assert c.run(lambda: dist.get_world_size()) == [2, 2]

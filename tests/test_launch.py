"""zerolab.launch / zerolab.Cluster: what a notebook, a test and a terminal rely on."""
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest
import torch
import torch.distributed as dist

import zerolab
from zerolab import Cluster, RankError, RankTimeout, launch


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


def _run_script(code, timeout=120, **kwargs):
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=timeout, **kwargs)


def rank_and_sum():
    t = torch.ones(4) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), t.tolist()


def test_launch_runs_real_process_group_and_returns_in_rank_order():
    out = launch(rank_and_sum, 3)
    assert [o[0] for o in out] == [0, 1, 2]
    assert all(o[1] == 3 and o[2] == [6.0] * 4 for o in out)


def test_function_defined_in_main_is_sent_by_value():
    # A notebook cell's function lives in __main__, which the ranks cannot import: it must travel
    # by value, with the globals it uses.
    r = _run_script("""
        import torch, torch.distributed as dist, zerolab
        SCALE = 10
        def cell_fn(x):
            t = torch.tensor([float(dist.get_rank())])
            dist.all_reduce(t)
            return x * SCALE + t.item()
        print(zerolab.launch(cell_fn, 2, 1))
        print(zerolab.launch(lambda: dist.get_world_size(), 2))
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[-2:] == ["[11.0, 11.0]", "[2, 2]"]


def noisy(delays):
    time.sleep(delays[dist.get_rank()])  # later ranks finish first
    print(f"first line from {dist.get_rank()}")
    print(f"warning from {dist.get_rank()}", file=sys.stderr)
    print(f"second line from {dist.get_rank()}")


def test_output_relayed_by_parent_prefixed_and_in_rank_order(capfd):
    launch(noisy, 3, [0.6, 0.3, 0.0])
    out, err = capfd.readouterr()
    assert out.splitlines() == [f"[rank {r}] {w} line from {r}" for r in range(3) for w in ("first", "second")]
    assert err.splitlines() == [f"[rank {r}] warning from {r}" for r in range(3)]


def fails_on(rank):
    if dist.get_rank() == rank:
        raise ValueError(f"bad value on purpose")
    return "ok"


def test_rank_error_names_rank_with_remote_traceback():
    with pytest.raises(RankError) as info:
        launch(fails_on, 2, 1)
    err = info.value
    assert err.ranks == [1] and err.exc_types == {1: "ValueError"}
    assert "rank 1 raised ValueError: bad value on purpose" in str(err)
    assert "in fails_on" in err.remote_tracebacks[1] and "in fails_on" in str(err)
    assert isinstance(err.exceptions[1], ValueError)


def skips_collective():
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(3))  # rank 1 never joins
    return dist.get_rank()


def test_skipped_collective_times_out_naming_the_stuck_rank():
    t0 = time.monotonic()
    with pytest.raises(RankTimeout) as info:
        launch(skips_collective, 2, timeout=3)
    assert time.monotonic() - t0 < 30  # 3 s + start-up, never gloo's 30-minute default
    assert info.value.ranks == [0]
    assert "rank 0 did not finish within 3 s (rank 1 finished)" in str(info.value)


def getpid():
    return os.getpid()


def test_cluster_keeps_state_restarts_after_failure_and_leaves_no_orphans(capfd):
    with Cluster(2, timeout=3) as cluster:
        pids = cluster.run(getpid)
        cluster.run(lambda: zerolab.rank_state().update(x=dist.get_rank() * 7))
        assert cluster.run(lambda: zerolab.rank_state()["x"]) == [0, 7]
        assert cluster.run(getpid) == pids  # same processes between runs

        # Every rank raised and returned: the ranks and their state survive.
        with pytest.raises(RankError):
            cluster.run(lambda: 1 / 0)
        assert cluster.run(getpid) == pids

        # A stuck rank: all ranks are stopped, then replaced on the next run, which says so.
        with pytest.raises(RankTimeout):
            cluster.run(skips_collective)
        assert _wait_dead(pids) == []
        capfd.readouterr()
        new_pids = cluster.run(getpid)
        assert "restarting the cluster (2 ranks)" in capfd.readouterr().err
        assert set(new_pids).isdisjoint(pids)
        assert cluster.run(rank_and_sum)[0][2] == [3.0] * 4  # the new process group works
    assert _wait_dead(new_pids) == []


def dies():
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


def test_killed_rank_is_reported_quickly_and_others_are_stopped():
    with Cluster(3, timeout=60) as cluster:
        pids = cluster.run(getpid)
        t0 = time.monotonic()
        with pytest.raises(RankError) as info:
            cluster.run(dies)
        assert time.monotonic() - t0 < 15  # not the 60 s timeout
        assert info.value.ranks[0] == 1 and "rank 1 died (SIGKILL)" in str(info.value)
        assert _wait_dead(pids) == []


def test_ranks_and_what_they_started_exit_when_the_parent_dies(tmp_path):
    # A killed kernel must not leave ranks behind, nor the processes their code started, nor the
    # rendezvous folder; not even when a rank is wedged (here: stopped) and cannot notice by itself.
    r = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import os, signal, subprocess, sys, psutil, zerolab
        def start_child():
            return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"]).pid
        c = zerolab.Cluster(2)
        ranks = c.run(os.getpid)
        c.run(start_child)
        os.kill(ranks[1], signal.SIGSTOP)
        print(*[p.pid for p in psutil.Process().children(recursive=True)], flush=True)
        os.kill(os.getpid(), 9)
    """)], stdout=subprocess.PIPE, text=True, env=dict(os.environ, TMPDIR=str(tmp_path)))
    out, _ = r.communicate(timeout=120)
    pids = [int(p) for p in out.split()]
    assert len(pids) >= 4  # 2 ranks and their 2 children (and the launcher's watchdog)
    assert _wait_dead(pids, 10) == []
    assert list(tmp_path.glob("zerolab-*")) == []


def test_keyboard_interrupt_stops_all_ranks():
    p = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import os, signal, time, zerolab
        signal.signal(signal.SIGINT, signal.default_int_handler)   # even if started with SIGINT ignored
        c = zerolab.Cluster(2)
        print(*c.run(os.getpid), flush=True)
        try:
            c.run(time.sleep, 60)
        except KeyboardInterrupt:
            print("interrupted", flush=True)
    """)], stdout=subprocess.PIPE, text=True)
    pids = [int(x) for x in p.stdout.readline().split()]
    time.sleep(1.0)
    p.send_signal(signal.SIGINT)
    out, _ = p.communicate(timeout=60)
    assert "interrupted" in out
    assert _wait_dead(pids) == []


def test_concurrent_launches_do_not_collide():
    # Two notebooks (or pytest-xdist workers) launching at once: separate rendezvous, no fixed port.
    script = """
        import torch, torch.distributed as dist, zerolab
        def f():
            t = torch.ones(1000); dist.all_reduce(t); return t[0].item()
        print(zerolab.launch(f, 2))
    """
    procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(script)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=180) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
        assert out.strip().splitlines()[-1] == "[2.0, 2.0]"


def test_threads_shared_fairly_and_overridable():
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert launch(torch.get_num_threads, 2) == [max(1, cores // 2)] * 2
    assert launch(torch.get_num_threads, 2, threads=3) == [3, 3]


def test_bad_input_is_refused_before_any_rank_starts():
    with pytest.raises(ValueError, match="world_size must be a positive int"):
        launch(getpid, 0)
    with pytest.raises(ValueError, match="backend='nccl' needs one CUDA GPU per rank"):
        if torch.cuda.device_count() >= 64:
            pytest.skip("this machine has 64 GPUs")
        launch(getpid, 64, backend="nccl")
    lock = threading.Lock()
    with pytest.raises(TypeError, match="must be picklable"):
        launch(lambda l: None, 1, lock)
    with pytest.raises(TypeError, match="needs a callable"):
        launch(42, 1)


def test_rank_device_is_cpu_under_gloo():
    assert launch(lambda: str(zerolab.rank_device()), 2) == ["cpu", "cpu"]

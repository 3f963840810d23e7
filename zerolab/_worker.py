"""The processes the launcher starts: ``python -m zerolab._worker`` (one per rank) and
``python -m zerolab._worker --watchdog`` (one per set of ranks), both started by :class:`zerolab.Cluster`.

A worker joins the default process group once, then loops: receive a pickled function, run it,
send back its return value or its traceback. Between runs the process (and its process group,
and :func:`zerolab.rank_state`) stays alive, which is what makes a notebook ``Cluster`` cheap.

Control messages travel over a socket the parent hands over by file descriptor; printed output
travels over this process's own stdout/stderr pipes. After each run the worker writes an end
marker to both pipes so the parent knows it holds all of that run's output. Every reply carries
the id of the run it answers (see zerolab/_protocol.py).

Each worker leads its own session and process group, so "stop rank r" is one ``killpg`` that
also ends whatever the rank's code started (a ``subprocess.Popen``, a DataLoader's workers).
What left the group (``Popen(..., start_new_session=True)``, a double fork with ``setsid``) is
still a descendant: the worker is a child subreaper (Linux ``PR_SET_CHILD_SUBREAPER``), so a
detached grandchild whose parent exits is re-parented to the worker instead of init, and
:func:`zerolab._protocol.kill_descendants` ends the worker's whole tree before the worker itself
(the parent's ``Ranks.stop``, the worker leaving, the watchdog). So that this holds even when the
rank dies at once (SIGKILL, a crash, ``os._exit``), the process the parent starts is a *keeper*:
it forks at start-up, the child runs the rank, and the keeper, which runs nothing else, ends what
is left of the rank's tree when the rank ends, then exits as the rank did (:func:`_keep`). The
watchdog does that for every rank, and removes the rendezvous folder, if the parent dies.

Only the rank's own process answers: a process forked by the rank's code that returns into the
loop exits there (:func:`_call`). A rank whose code closes its stdout or stderr can no longer
mark the end of its output: it exits with :data:`OUTPUT_CLOSED`, which the caller reports.
"""
import datetime
import os
import select
import shutil
import signal
import stat
import sys
import threading
import time
import traceback

from zerolab._protocol import OUTPUT_CLOSED, kill_descendants

PR_SET_CHILD_SUBREAPER = 36       # linux/prctl.h


def _marker(run_id):
    return f"\x1ezerolab-end:{run_id}\x1e"


def _end_of_output(run_id):
    # Everything the run printed through Python is flushed first; output written straight to the
    # file descriptors by C++ code (gloo warnings) is already in the pipe, so it precedes the marker.
    for stream in (sys.stdout, sys.stderr):
        if stream is not None and not stream.closed:   # sys.stdout.close() leaves fd 1 open: fine
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
    line = (_marker(run_id) + "\n").encode()
    for fd in (1, 2):
        try:
            if not stat.S_ISFIFO(os.fstat(fd).st_mode):   # closed, then reused by a file or socket
                _output_closed(fd)
            os.write(fd, line)
        except OSError:
            _output_closed(fd)


def _output_closed(fd):
    """The rank's code closed fd 1 or 2 (``os.close(1)``): the parent can no longer read where a
    run's output ends, so this rank cannot go on. Exit with OUTPUT_CLOSED (the caller names it),
    ending what the rank started first; no reply (the caller reports the rank as stopped)."""
    try:
        os.write(2, f"[zerolab] the rank's code closed its {('stdout', 'stderr')[fd - 1]} (fd {fd}): "
                    f"stopping this rank\n".encode())
    except OSError:
        pass
    kill_descendants(os.getpid())
    os._exit(OUTPUT_CLOSED)


def _become_subreaper():
    """Linux: orphaned descendants (a detached grandchild whose parent exited) are re-parented to
    this process instead of init, so :func:`kill_descendants` still finds them. Elsewhere a no-op."""
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _call(fn, args, kwargs, rank_pid):
    """``fn(*args, **kwargs)`` on the rank. A process forked inside ``fn`` (``os.fork()``) that
    returns or raises into here is NOT the rank: it shares the rank's control socket, and its
    reply would be read as the rank's answer (the rank's own would then be dropped as stale). It
    exits on the spot, without answering; only the rank's own process replies."""
    try:
        return fn(*args, **kwargs)
    finally:
        if os.getpid() != rank_pid:
            _leave_forked_child()


def _leave_forked_child():
    try:
        sys.stdout.flush()
        sys.stderr.flush()
        os.write(2, f"[zerolab] process {os.getpid()}, forked by rank {os.environ.get('RANK')}'s code, returned "
                    f"from the run's function: it exits without answering (only the rank answers). End a "
                    f"forked child with os._exit(status)\n".encode())
    except (OSError, ValueError):
        pass
    os._exit(0)


def _dump_result(result):
    """The return value, pickled for the caller; or a TypeError that names the part that cannot
    travel (its place in the value and its type) and what to return instead."""
    import cloudpickle
    try:
        return cloudpickle.dumps(result)
    except Exception as exc:  # noqa: BLE001 - pickling raises TypeError, PicklingError, AttributeError...
        where, part = _unpicklable_part(result, "the return value")
        kind = type(part).__qualname__ if type(part).__module__ == "builtins" else \
            f"{type(part).__module__}.{type(part).__qualname__}"
        raise TypeError(
            f"could not send the return value back: {where} is a {kind}, which cannot be pickled ({exc}). "
            f"Return plain data: numbers, strings, tensors, and lists, tuples and dicts of them (e.g. "
            f"list(generator), tensor.tolist()); keep live objects (locks, generators, open files, "
            f"modules, optimizers) on the rank in zerolab.rank_state()") from None


def _unpicklable_part(value, where, depth=4):
    """(where, part): the innermost element of ``value`` that cannot be pickled, found through
    lists, tuples, sets and dicts (``where`` names it, e.g. "the return value['lock']")."""
    import cloudpickle
    if depth and isinstance(value, (list, tuple, set, frozenset, dict)):
        items = (value.items() if isinstance(value, dict) else enumerate(value))
        for key, item in items:
            label = f"{where}[{key!r}]" if not isinstance(value, (set, frozenset)) else f"an element of {where}"
            for part, name in ((item, label),) + (((key, f"a key of {where}"),) if isinstance(value, dict) else ()):
                try:
                    cloudpickle.dumps(part)
                except Exception:  # noqa: BLE001
                    return _unpicklable_part(part, name, depth - 1)
    return where, value


def _end_everything(store_dir):
    """The parent is gone: remove the rendezvous folder, then SIGKILL this worker's whole process
    group (the worker and everything its rank code started)."""
    shutil.rmtree(store_dir, ignore_errors=True)
    kill_descendants(os.getpid())     # those that left our group too (we are their subreaper)
    if os.getpgid(0) == os.getpid():  # we lead our group (start_new_session): end all of it
        os.killpg(0, signal.SIGKILL)
    os._exit(3)


def _exit_when_orphaned(parent_pid, store_dir):
    # Second line of defence behind the watchdog process (which also works when this interpreter
    # is wedged, e.g. stopped or inside C code holding the GIL): if the parent dies (kernel restart,
    # SIGKILL), we are re-parented, and we end our group at once.
    while os.getppid() == parent_pid:
        time.sleep(0.5)
    _end_everything(store_dir)


def _keep(rank_pid):
    """The process the parent started (the one it waits for and stops) keeps the rank, which runs
    in its forked child, and outlives it by a moment: when the rank ends in any way (an exit, a
    crash, SIGKILL, os._exit), whatever the rank's code started and detached (re-parented here:
    this process is a child subreaper) is killed, then this process exits as the rank did (same
    exit code, same signal), so the parent sees the rank's own end. It holds no control socket
    (the parent sees EOF when the rank dies) and runs nothing else; it reaps every orphan."""
    os.close(int(os.environ["ZEROLAB_CONTROL_FD"]))
    threading.Thread(target=_exit_when_orphaned, daemon=True,
                     args=(int(os.environ["ZEROLAB_PARENT_PID"]), os.environ["ZEROLAB_STORE_DIR"])).start()
    status = None
    while status is None:
        try:
            pid, st = os.waitpid(-1, 0)               # the rank, or an orphan re-parented here
        except ChildProcessError:
            break
        if pid == rank_pid:
            status = st
    kill_descendants(os.getpid())
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:            # reap them (they are zombies here now)
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                time.sleep(0.01)
        except ChildProcessError:
            break
    if status is not None and os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig not in (signal.SIGKILL, signal.SIGSTOP):   # those two cannot be caught anyway
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)                  # end as the rank ended (SIGKILL, SIGSEGV...)
        os._exit(128 + sig)
    os._exit(os.waitstatus_to_exitcode(status) if status is not None else 1)


def watchdog(parent_pid, store_dir):
    """``python -m zerolab._worker --watchdog PARENT_PID STORE_DIR``, commands on stdin, one a line:
    ``watch PGID`` (a rank's process group), ``exit`` (the parent stopped the ranks itself).

    If stdin reaches end-of-file without ``exit`` (the parent died: the kernel closed its end of
    the pipe) or this process is re-parented, every watched group gets SIGKILL and the rendezvous
    folder is removed. This process runs no torch and no user code, so it cannot be wedged.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    pgids, pending = [], b""
    while os.getppid() == parent_pid:
        if not select.select([0], [], [], 0.5)[0]:
            continue
        data = os.read(0, 4096)
        if not data:
            break
        *lines, pending = (pending + data).split(b"\n")
        for line in lines:
            word, _, arg = line.decode().partition(" ")
            if word == "watch":
                pgids.append(int(arg))
            elif word == "exit":
                return
    for pgid in pgids:
        kill_descendants(pgid)        # pgid == the worker's pid: its whole tree, detached parts too
        try:
            os.killpg(pgid, signal.SIGKILL)
        except OSError:
            pass
    shutil.rmtree(store_dir, ignore_errors=True)


def main():
    from multiprocessing.connection import Connection

    _become_subreaper()               # first: before the rank's code can start anything
    keeper, child = os.getpid(), os.fork()
    if child:                         # this process keeps; the child runs the rank (see _keep)
        _keep(child)
    _become_subreaper()               # not inherited across fork
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    conn = Connection(int(os.environ["ZEROLAB_CONTROL_FD"]))
    worker_pid = os.getpid()
    threading.Thread(target=_exit_when_orphaned, daemon=True,
                     args=(keeper, os.environ["ZEROLAB_STORE_DIR"])).start()

    import cloudpickle
    setup = conn.recv()
    # Plain mode (a Cluster with isolation, e.g. the grader's): every message back is plain data,
    # read by the parent without unpickling (zerolab/_plain.py).
    reply_to_parent = _plain_sender(conn) if setup.get("plain") else conn.send
    # Same import path as the parent, so functions defined in test modules, exercises/ or
    # solutions/ unpickle here by reference exactly as they resolve there.
    sys.path[:] = setup["sys_path"]

    import torch
    import torch.distributed as dist
    try:  # private: torch.distributed has no public way to change a live group's timeout
        from torch.distributed.distributed_c10d import _set_pg_timeout
    except ImportError:
        _set_pg_timeout = None

    torch.set_num_threads(setup["threads"])
    if setup["backend"] == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    store = dist.FileStore(setup["store_path"], world_size)
    pg_timeout = setup["pg_timeout"]
    dist.init_process_group(setup["backend"], store=store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=pg_timeout))
    _end_of_output(0)
    reply_to_parent(("ready", rank))

    while True:
        try:
            msg = conn.recv()
        except EOFError:
            break
        if msg[0] == "exit":
            break
        _, run_id, run_pg_timeout, payload = msg
        try:
            if run_pg_timeout != pg_timeout and dist.is_initialized():
                # The process group's own per-collective timeout backs up the caller's deadline:
                # it follows each run's timeout, so a long run is never cut short by it.
                if _set_pg_timeout is None:
                    raise RuntimeError(f"torch {torch.__version__} cannot change the process group's "
                                       f"timeout: create the Cluster with the timeout this run needs")
                _set_pg_timeout(datetime.timedelta(seconds=run_pg_timeout))
                pg_timeout = run_pg_timeout
            fn, args, kwargs = cloudpickle.loads(payload)
            result = _call(fn, args, kwargs, worker_pid)
            # plain mode: the result itself, checked and encoded by reply_to_parent
            reply = ("ok", run_id, result if setup.get("plain") else _dump_result(result))
        except BaseException as exc:  # noqa: BLE001 - every failure goes back to the caller
            reply = ("err", run_id, {
                "type": type(exc).__name__,
                "message": str(exc),
                "traceback": traceback.format_exc(),
                "exception": None if setup.get("plain") else _picklable(exc),
            })
        _end_of_output(run_id)
        try:
            reply_to_parent(reply)
        except Exception as exc:  # the result itself could not be pickled
            reply_to_parent(("err", run_id, {"type": type(exc).__name__,
                                              "message": f"could not send the return value back: {exc}",
                                              "traceback": traceback.format_exc(), "exception": None}))
    kill_descendants(os.getpid())     # leaving: what the rank started goes too (see the docstring)
    try:
        dist.destroy_process_group()
    except Exception:
        pass


def _plain_sender(conn):
    from zerolab import _plain

    def send(message):
        if message[0] == "ok":  # checked on its own, so that an error names the path inside it
            message = (*message[:2], _plain.plain(message[2], "the function's return value"))
        conn.send_bytes(_plain.dumps(message))
    return send


def _picklable(exc):
    import cloudpickle
    try:
        blob = cloudpickle.dumps(exc)
        cloudpickle.loads(blob)
        return blob
    except Exception:
        return None


if __name__ == "__main__":
    if sys.argv[1:2] == ["--watchdog"]:
        watchdog(int(sys.argv[2]), sys.argv[3])
    else:
        main()

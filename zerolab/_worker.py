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
The watchdog does that for every rank, and removes the rendezvous folder, if the parent dies.
"""
import datetime
import os
import select
import shutil
import signal
import sys
import threading
import time
import traceback


def _marker(run_id):
    return f"\x1ezerolab-end:{run_id}\x1e"


def _end_of_output(run_id):
    # Everything the run printed through Python is flushed first; output written straight to the
    # file descriptors by C++ code (gloo warnings) is already in the pipe, so it precedes the marker.
    sys.stdout.flush()
    sys.stderr.flush()
    line = (_marker(run_id) + "\n").encode()
    os.write(1, line)
    os.write(2, line)


def _end_everything(store_dir):
    """The parent is gone: remove the rendezvous folder, then SIGKILL this worker's whole process
    group (the worker and everything its rank code started)."""
    shutil.rmtree(store_dir, ignore_errors=True)
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
        try:
            os.killpg(pgid, signal.SIGKILL)
        except OSError:
            pass
    shutil.rmtree(store_dir, ignore_errors=True)


def main():
    from multiprocessing.connection import Connection

    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    conn = Connection(int(os.environ["ZEROLAB_CONTROL_FD"]))
    threading.Thread(target=_exit_when_orphaned, daemon=True,
                     args=(int(os.environ["ZEROLAB_PARENT_PID"]), os.environ["ZEROLAB_STORE_DIR"])).start()

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
            result = fn(*args, **kwargs)
            reply = ("ok", run_id, result if setup.get("plain") else cloudpickle.dumps(result))
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

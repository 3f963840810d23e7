"""The program each rank runs: ``python -m zerolab._worker`` (started by :class:`zerolab.Cluster`).

A worker joins the default process group once, then loops: receive a pickled function, run it,
send back its return value or its traceback. Between runs the process (and its process group,
and :func:`zerolab.rank_state`) stays alive, which is what makes a notebook ``Cluster`` cheap.

Control messages travel over a socket the parent hands over by file descriptor; printed output
travels over this process's own stdout/stderr pipes. After each run the worker writes an end
marker to both pipes so the parent knows it holds all of that run's output.
"""
import datetime
import os
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


def _exit_when_orphaned(parent_pid):
    # A worker must never outlive the notebook or test that started it: if the parent dies
    # (kernel restart, SIGKILL), we are re-parented, and we leave at once.
    while True:
        if os.getppid() != parent_pid:
            os._exit(3)
        time.sleep(0.5)


def main():
    from multiprocessing.connection import Connection

    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    conn = Connection(int(os.environ["ZEROLAB_CONTROL_FD"]))
    threading.Thread(target=_exit_when_orphaned, args=(int(os.environ["ZEROLAB_PARENT_PID"]),),
                     daemon=True).start()

    import cloudpickle
    setup = conn.recv()
    # Same import path as the parent, so functions defined in test modules, exercises/ or
    # solutions/ unpickle here by reference exactly as they resolve there.
    sys.path[:] = setup["sys_path"]

    import torch
    import torch.distributed as dist

    torch.set_num_threads(setup["threads"])
    if setup["backend"] == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    store = dist.FileStore(setup["store_path"], world_size)
    dist.init_process_group(setup["backend"], store=store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=setup["pg_timeout"]))
    _end_of_output(0)
    conn.send(("ready", rank))

    while True:
        try:
            msg = conn.recv()
        except EOFError:
            break
        if msg[0] == "exit":
            break
        _, run_id, payload = msg
        try:
            fn, args, kwargs = cloudpickle.loads(payload)
            result = fn(*args, **kwargs)
            reply = ("ok", run_id, cloudpickle.dumps(result))
        except BaseException as exc:  # noqa: BLE001 - every failure goes back to the caller
            reply = ("err", run_id, {
                "type": type(exc).__name__,
                "message": str(exc),
                "traceback": traceback.format_exc(),
                "exception": _picklable(exc),
            })
        _end_of_output(run_id)
        try:
            conn.send(reply)
        except Exception as exc:  # the result itself could not be pickled
            conn.send(("err", run_id, {"type": type(exc).__name__,
                                        "message": f"could not send the return value back: {exc}",
                                        "traceback": traceback.format_exc(), "exception": None}))
    try:
        dist.destroy_process_group()
    except Exception:
        pass


def _picklable(exc):
    import cloudpickle
    try:
        blob = cloudpickle.dumps(exc)
        cloudpickle.loads(blob)
        return blob
    except Exception:
        return None


if __name__ == "__main__":
    main()

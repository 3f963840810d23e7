"""Run a function on N real ranks: :func:`launch` (one shot) and :class:`Cluster` (persistent).

Every rank is a separate Python process (started fresh, never forked) that joins a real
``torch.distributed`` default process group: gloo on CPU, nccl when there is one GPU per rank.
Inside the function, plain ``torch.distributed`` calls work; :func:`rank_device` gives the
rank's device and :func:`rank_state` a dict that survives between runs of a ``Cluster``.

What the caller sees, in a terminal, a notebook, nbclient or nbval alike:

* output: each rank's stdout/stderr comes back through pipes and is printed by the *caller*,
  prefixed ``[rank r]``, grouped in rank order once the run ends (deterministic);
* failure: an exception on any rank becomes a :class:`RankError` naming the rank(s), with the
  remote traceback; ranks still running are stopped;
* hangs: a collective that never completes (a rank skipped it, shapes differ, a peer died)
  ends in a :class:`RankTimeout` after ``timeout`` seconds naming the ranks that did not finish;
* no fixed ports: the ranks meet through a fresh file store, so parallel launches never collide.
"""
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from multiprocessing.connection import Connection, wait

import cloudpickle

DEFAULT_TIMEOUT = 30.0
_STARTUP_TIMEOUT = 180.0  # importing torch in 4 processes on 2 busy cores can take a while
_GRACE = 2.0  # after one rank fails, how long the others get to finish on their own


class RankError(RuntimeError):
    """One or more ranks failed. ``ranks`` lists them; ``remote_tracebacks`` maps rank -> text;
    ``exc_types`` maps rank -> exception class name; ``exceptions`` maps rank -> the exception
    itself where it could be sent back."""

    def __init__(self, message, ranks=(), remote_tracebacks=None, exc_types=None, exceptions=None):
        super().__init__(message)
        self.ranks = list(ranks)
        self.rank = self.ranks[0] if self.ranks else None
        self.remote_tracebacks = dict(remote_tracebacks or {})
        self.exc_types = dict(exc_types or {})
        self.exceptions = dict(exceptions or {})


class RankTimeout(RankError):
    """Some ranks did not finish within the timeout (``ranks`` lists them)."""


def rank_device():
    """The device this rank computes on: ``cuda:<local rank>`` under nccl, else ``cpu``."""
    import torch
    import torch.distributed as dist
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


_RANK_STATE = {}


def rank_state():
    """A dict private to this rank that persists across ``Cluster.run`` calls (models, engines...)."""
    return _RANK_STATE


def resolve_backend(backend, world_size):
    """'auto' -> 'nccl' when CUDA has a GPU per rank, else 'gloo'. Raises ValueError for nccl
    without enough GPUs, or for an unknown name."""
    import torch
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend == "auto":
        return "nccl" if gpus >= world_size else "gloo"
    if backend == "nccl" and gpus < world_size:
        raise ValueError(f"backend='nccl' needs one CUDA GPU per rank: world_size={world_size} but "
                         f"{gpus} GPU(s) are visible. Use backend='gloo' (CPU) or backend='auto'.")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend={backend!r} is not supported: use 'auto', 'gloo' or 'nccl'.")
    return backend


def _default_threads(world_size):
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        cores = os.cpu_count() or 1
    return max(1, cores // world_size)


class _Rank:
    """Parent-side handle of one worker: its process, control connection and output buffers."""

    def __init__(self, rank, proc, conn):
        self.rank, self.proc, self.conn = rank, proc, conn
        self.lines = {"stdout": [], "stderr": []}
        self.ended = {"stdout": -1, "stderr": -1}  # last run id whose end marker was read
        self.cond = threading.Condition()
        self.readers = [threading.Thread(target=self._read, args=(name, stream), daemon=True)
                        for name, stream in (("stdout", proc.stdout), ("stderr", proc.stderr))]
        for t in self.readers:
            t.start()

    def _read(self, name, stream):
        for raw in iter(stream.readline, b""):
            line = raw.decode("utf-8", "replace").rstrip("\n")
            with self.cond:
                if "\x1ezerolab-end:" in line:
                    head, _, tail = line.partition("\x1ezerolab-end:")
                    if head:
                        self.lines[name].append(head)
                    self.ended[name] = int(tail.strip("\x1e"))
                else:
                    self.lines[name].append(line)
                self.cond.notify_all()
        with self.cond:
            self.ended[name] = float("inf")  # EOF: the process is gone
            self.cond.notify_all()

    def take_output(self, run_id, wait_s):
        """Wait (bounded) until both streams reached run_id's end marker, then hand over the lines."""
        deadline = time.monotonic() + wait_s
        with self.cond:
            while min(self.ended.values()) < run_id and time.monotonic() < deadline:
                self.cond.wait(max(0.0, deadline - time.monotonic()))
            out = self.lines
            self.lines = {"stdout": [], "stderr": []}
        return out


def _kill(ranks):
    for r in ranks:
        if r.proc.poll() is None:
            try:
                os.killpg(r.proc.pid, signal.SIGKILL)  # the worker and anything it started
            except (ProcessLookupError, PermissionError):
                r.proc.kill()
    for r in ranks:
        try:
            r.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        r.conn.close()
        for t in r.readers:
            t.join(timeout=2)


def _shutdown(ranks, store_dir):
    """Ask workers to exit, then kill what is left; remove the rendezvous directory."""
    for r in ranks:
        try:
            r.conn.send(("exit",))
        except (OSError, ValueError):
            pass
    deadline = time.monotonic() + 5
    for r in ranks:
        try:
            r.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    _kill(ranks)
    shutil.rmtree(store_dir, ignore_errors=True)


def _signal_name(code):
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


class Cluster:
    """N persistent ranks with a live process group, for a notebook session or a test session.

    >>> with Cluster(world_size=2) as cluster:          # doctest: +SKIP
    ...     cluster.run(lambda: torch.distributed.get_rank())
    [0, 1]

    ``run`` has the semantics of :func:`launch`. A failure that leaves some rank stuck (a timeout,
    a dead rank, a rank still waiting in a collective) stops all ranks; the next ``run`` starts
    fresh ones and says so. A failure every rank returned from keeps the ranks (and their state).
    """

    def __init__(self, world_size, *, backend="auto", timeout=DEFAULT_TIMEOUT, threads=None):
        if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        if not timeout or timeout <= 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        if threads is not None and (not isinstance(threads, int) or threads < 1):
            raise ValueError(f"threads must be a positive int or None, got {threads!r}")
        self.world_size = world_size
        self.backend = resolve_backend(backend, world_size)
        self.timeout = float(timeout)
        self.threads = threads or _default_threads(world_size)
        self._ranks = []
        self._store_dir = None
        self._run_id = 0
        self._needs_restart = False
        self._finalizer = None
        self.start()

    # -- lifecycle -------------------------------------------------------------------------
    def start(self):
        if self._ranks:
            return
        self._store_dir = tempfile.mkdtemp(prefix="zerolab-")
        setup = {"sys_path": list(sys.path), "threads": self.threads, "backend": self.backend,
                 "store_path": os.path.join(self._store_dir, "store"),
                 # The process group's own per-collective timeout backs up the caller's deadline.
                 "pg_timeout": self.timeout + 10}
        env = dict(os.environ, WORLD_SIZE=str(self.world_size), PYTHONUNBUFFERED="1",
                   OMP_NUM_THREADS=str(self.threads), ZEROLAB_PARENT_PID=str(os.getpid()))
        env.pop("PYTEST_CURRENT_TEST", None)
        ranks = []
        try:
            for rank in range(self.world_size):
                parent_end, child_end = socket.socketpair()
                env.update(RANK=str(rank), LOCAL_RANK=str(rank),
                           ZEROLAB_CONTROL_FD=str(child_end.fileno()))
                proc = subprocess.Popen([sys.executable, "-m", "zerolab._worker"], env=env,
                                        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, pass_fds=[child_end.fileno()],
                                        start_new_session=True)
                child_end.close()
                ranks.append(_Rank(rank, proc, Connection(parent_end.detach())))
            for r in ranks:
                r.conn.send(setup)
            self._wait_ready(ranks)
        except BaseException:
            _shutdown(ranks, self._store_dir)
            raise
        self._ranks = ranks
        self._needs_restart = False
        self._run_id = 0
        self._finalizer = weakref.finalize(self, _shutdown, ranks, self._store_dir)
        self._print_output({r.rank: r.take_output(0, 5) for r in ranks})

    def _wait_ready(self, ranks):
        pending = {r.conn: r for r in ranks}
        deadline = time.monotonic() + _STARTUP_TIMEOUT
        while pending:
            ready = wait(list(pending), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                raise RankTimeout(f"{_who(sorted(r.rank for r in pending.values()))} did not start "
                                  f"within {_STARTUP_TIMEOUT:.0f} s", ranks=[r.rank for r in pending.values()])
            for conn in ready:
                r = pending.pop(conn)
                try:
                    conn.recv()
                except EOFError:
                    r.proc.wait()
                    out = r.take_output(0, 2)
                    raise RankError(f"rank {r.rank} failed to start (exit code {r.proc.returncode}):\n"
                                    + "\n".join(out["stderr"][-30:]), ranks=[r.rank]) from None

    def close(self):
        """Stop all ranks (idempotent)."""
        if self._finalizer is not None:
            self._finalizer()
            self._finalizer = None
        self._ranks = []

    def restart(self):
        self.close()
        self.start()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        state = "running" if self._ranks and not self._needs_restart else "stopped"
        return f"Cluster(world_size={self.world_size}, backend={self.backend!r}, {state})"

    # -- running ---------------------------------------------------------------------------
    def run(self, fn, *args, timeout=None, **kwargs):
        """Run ``fn(*args, **kwargs)`` on every rank; return the per-rank results in rank order."""
        if not callable(fn):
            raise TypeError(f"run() needs a callable, got {type(fn).__name__}")
        try:
            payload = cloudpickle.dumps((fn, args, kwargs))
        except Exception as exc:
            raise TypeError(f"cannot send {getattr(fn, '__name__', fn)!r} and its arguments to the "
                            f"ranks: they must be picklable (by cloudpickle): {exc}") from exc
        if self._needs_restart:
            self.close()
            print(f"[zerolab] restarting the cluster ({self.world_size} ranks) after the last "
                  f"failure", file=sys.stderr)
        if not self._ranks:
            self.start()
        timeout = self.timeout if timeout is None else float(timeout)
        self._run_id += 1
        run_id = self._run_id
        for r in self._ranks:
            r.conn.send(("run", run_id, payload))
        try:
            results, errors, died, stuck = self._collect(run_id, timeout)
        except KeyboardInterrupt:
            self._needs_restart = True
            _kill(self._ranks)
            raise
        if died or stuck:
            self._needs_restart = True
            _kill(self._ranks)
        self._print_output({r.rank: r.take_output(run_id, 2.0) for r in self._ranks})
        if errors or died or stuck:
            raise self._error(errors, died, stuck, timeout)
        return [results[i] for i in range(self.world_size)]

    def _collect(self, run_id, timeout):
        """Wait for every rank's reply. Returns (results, errors, died, stuck)."""
        pending = {r.conn: r for r in self._ranks}
        results, errors, died = {}, {}, {}
        deadline = time.monotonic() + timeout
        while pending:
            ready = wait(list(pending), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            for conn in ready:
                r = pending.pop(conn)
                try:
                    kind, rid, body = conn.recv()
                except (EOFError, OSError):
                    try:
                        r.proc.wait(timeout=2)
                    except subprocess.TimeoutExpired:
                        pass
                    died[r.rank] = r.proc.returncode
                    continue
                assert rid == run_id, (rid, run_id)
                if kind == "ok":
                    results[r.rank] = cloudpickle.loads(body)
                else:
                    errors[r.rank] = body
            if (errors or died) and pending:
                # One rank failed: the others may be blocked in a collective waiting for it.
                deadline = min(deadline, time.monotonic() + _GRACE)
        stuck = sorted(r.rank for r in pending.values())
        return results, errors, died, stuck

    def _error(self, errors, died, stuck, timeout):
        parts = []
        # A dead rank is the cause; errors on the others (connection reset) are its consequence.
        for rank, code in sorted(died.items()):
            how = _signal_name(code) if code is not None and code < 0 else f"exit code {code}"
            parts.append(f"rank {rank} died ({how})")
        by_cause = {}
        for rank, e in sorted(errors.items()):
            by_cause.setdefault((e["type"], e["message"]), []).append(rank)
        for (etype, msg), ranks in by_cause.items():
            parts.append(f"{_who(ranks)} raised {etype}: {msg}")
        if stuck:
            done = sorted(set(range(self.world_size)) - set(stuck))
            if errors or died:
                parts.append(f"{_who(stuck)} still running (most likely waiting for the failed "
                             f"rank in a collective) and stopped")
            else:
                parts.append(f"{_who(stuck)} did not finish within {timeout:g} s"
                             + (f" ({_who(done)} finished)" if done else "")
                             + ". A collective that some rank skipped, different shapes on different "
                               "ranks, or a dead peer make a collective wait forever; all ranks were "
                               "stopped")
        if self._needs_restart:
            parts.append("the cluster restarts on its next run")
        message = "; ".join(parts)
        if errors:
            first = min(errors)
            message += (f"\n\n--- remote traceback (rank {first}) ---\n"
                        + errors[first]["traceback"].rstrip())
        ranks = sorted(died) + sorted(errors) + (stuck if not (errors or died) else [])
        exceptions = {}
        for rank, e in errors.items():
            try:
                exceptions[rank] = cloudpickle.loads(e["exception"]) if e.get("exception") else None
            except Exception:
                pass
        cls = RankTimeout if stuck and not (errors or died) else RankError
        return cls(message, ranks=ranks,
                   remote_tracebacks={k: e["traceback"] for k, e in errors.items()},
                   exc_types={k: e["type"] for k, e in errors.items()}, exceptions=exceptions)

    @staticmethod
    def _print_output(outputs):
        # Grouped by rank, in rank order: the same text every time, whatever the scheduling.
        for stream_name, stream in (("stdout", sys.stdout), ("stderr", sys.stderr)):
            text = "".join(f"[rank {rank}] {line}\n"
                           for rank in sorted(outputs) for line in outputs[rank][stream_name])
            if text:
                stream.write(text)
                stream.flush()


def _who(ranks):
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(str(r) for r in ranks)


def launch(fn, world_size, *args, backend="auto", timeout=DEFAULT_TIMEOUT, threads=None, **kwargs):
    """Run ``fn(*args, **kwargs)`` on ``world_size`` fresh ranks and return their results.

    Each rank is a new process with the default process group initialised (gloo on CPU; nccl
    when CUDA has a GPU per rank and ``backend`` is 'auto' or 'nccl'). ``fn`` may come from a
    notebook cell, a test or a module: it is sent by value with cloudpickle. Rank output is
    printed here, prefixed ``[rank r]``, in rank order. Raises :class:`RankError` (with the
    remote traceback) if any rank raises or dies, :class:`RankTimeout` if ranks are still
    running after ``timeout`` seconds. ``threads`` sets each rank's intra-op threads (default:
    the machine's cores shared fairly among the ranks).
    """
    with Cluster(world_size, backend=backend, timeout=timeout, threads=threads) as cluster:
        return cluster.run(fn, *args, **kwargs)



def init_from_env(backend="auto", timeout=DEFAULT_TIMEOUT):
    """Join the default process group from torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT): the multi-machine path. Returns the backend used. A no-op if already joined."""
    import datetime
    import torch
    import torch.distributed as dist
    if dist.is_initialized():
        return dist.get_backend()
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise ValueError(f"init_from_env needs torchrun's environment; missing {missing}. Start the "
                         f"script with `torchrun --nproc-per-node N ...`, or use zerolab.launch.")
    world_size = int(os.environ["WORLD_SIZE"])
    backend = resolve_backend(backend, int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend, init_method="env://",
                            timeout=datetime.timedelta(seconds=timeout + 10))
    return backend

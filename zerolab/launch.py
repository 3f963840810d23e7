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
* interrupts: Ctrl-C (or a test's time limit) while ranks run stops them all; a ``Cluster``
  says so and starts fresh ranks on its next run;
* no fixed ports: the ranks meet through a fresh file store, so parallel launches never collide;
* nothing left behind: every exit path, clean or not, ends each rank with everything its code
  started, and a watchdog does it if the caller itself is killed (zerolab/_protocol.py).
"""
import contextlib
import math
import numbers
import os
import signal
import sys
import tempfile
import threading
import traceback
import weakref

import cloudpickle

from zerolab._protocol import OUTPUT_CLOSED, Ranks, StartupFailure, who as _who

DEFAULT_TIMEOUT = 30.0
MAX_TIMEOUT = 7 * 24 * 3600.0  # a week; far beyond it the OS's timers overflow (poll: ~24.8 days)
MAX_THREADS = 1024
_BACKENDS = ("auto", "gloo", "nccl")
# The process group's own per-collective timeout, a backstop behind the caller's deadline: it is
# this much longer than each run's timeout, so the caller's clear RankTimeout always comes first.
_PG_MARGIN = 10.0


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
    """'auto' -> 'nccl' when CUDA has a GPU per rank, else 'gloo'. Raises ValueError for an
    unknown name, or for nccl without enough GPUs."""
    if not isinstance(backend, str) or backend not in _BACKENDS:
        raise ValueError(f"backend={backend!r} is not supported: use 'auto', 'gloo' or 'nccl'.")
    import torch
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend == "auto":
        return "nccl" if gpus >= world_size else "gloo"
    if backend == "nccl" and gpus < world_size:
        raise ValueError(f"backend='nccl' needs one CUDA GPU per rank: world_size={world_size} but "
                         f"{gpus} GPU(s) are visible. Use backend='gloo' (CPU) or backend='auto'.")
    return backend


def _check_timeout(timeout):
    """Seconds as a float, or ValueError: bool, str, nan, inf, <= 0 and > MAX_TIMEOUT are refused."""
    if (isinstance(timeout, numbers.Real) and not isinstance(timeout, bool)
            and math.isfinite(timeout) and 0 < timeout <= MAX_TIMEOUT):
        return float(timeout)
    raise ValueError(f"timeout={timeout!r} is not valid: give the seconds to wait for the ranks, "
                     f"a number in (0, {MAX_TIMEOUT:.0f}] (up to a week)")


def _check_options(world_size, timeout, threads):
    """The one place the launcher's options are validated, before any rank starts."""
    if not isinstance(world_size, numbers.Integral) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be a positive int (the number of ranks), got {world_size!r}")
    if threads is not None and (not isinstance(threads, numbers.Integral) or isinstance(threads, bool)
                                or not 1 <= threads <= MAX_THREADS):
        raise ValueError(f"threads must be None (share the cores fairly) or an int in [1, {MAX_THREADS}], "
                         f"got {threads!r}")
    return int(world_size), _check_timeout(timeout), None if threads is None else int(threads)


def _encode(fn, args, kwargs):
    """The request's payload: fn and its arguments, pickled by value where needed (cloudpickle)."""
    if not callable(fn):
        raise TypeError(f"run() needs a callable, got {type(fn).__name__}")
    try:
        return cloudpickle.dumps((fn, args, kwargs))
    except Exception as exc:
        raise TypeError(f"cannot send {getattr(fn, '__name__', fn)!r} and its arguments to the "
                        f"ranks: they must be picklable (by cloudpickle): {exc}") from exc


def _default_threads(world_size):
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        cores = os.cpu_count() or 1
    return max(1, cores // world_size)


def _signal_name(code):
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


class Isolation:
    """How a :class:`Cluster` runs code it must not trust (the grader's submissions).

    With any ``Isolation``, ranks reply in plain data only (tensors, numbers, strings and
    containers of them, zerolab/_plain.py), which this process reads without unpickling: a
    result or an error can never run code here. ``prefix``: an argv each rank's worker command is
    run under (e.g. a sandbox's entry point); ``scratch``: the folder the rendezvous is made in
    (one the ranks can see and write inside their sandbox). ``Isolation()`` alone: plain replies,
    ordinary processes (the graded tests outside the grader)."""

    def __init__(self, *, prefix=(), scratch=None):
        if isinstance(prefix, str) or not all(isinstance(a, str) for a in prefix):
            raise ValueError(f"Isolation(prefix=...) must be a sequence of str (an argv), got {prefix!r}")
        if scratch is not None and not os.path.isdir(scratch):
            raise ValueError(f"Isolation(scratch=...) must be an existing folder, got {scratch!r}")
        self.prefix, self.scratch = tuple(prefix), scratch

    def __repr__(self):
        return f"Isolation(prefix={self.prefix!r}, scratch={self.scratch!r})"


def _how_it_ended(code):
    """Why a rank stopped answering, from its exit status (None: it still ran), for RankError."""
    if code == OUTPUT_CLOSED:
        return ("stopped: its code closed the rank's stdout or stderr (os.close(1) or 2), the pipes the "
                "launcher reads its output and the end of each run through. Leave file descriptors 1 and 2 "
                "open; to silence printing, use contextlib.redirect_stdout(io.StringIO())")
    if code is None:
        return ("stopped answering: its control connection closed while its process still ran (did its "
                "code close file descriptors it had not opened, e.g. os.closerange?); stopped")
    return f"died ({_signal_name(code) if code < 0 else f'exit code {code}'})"


class Cluster:
    """N persistent ranks with a live process group, for a notebook session or a test session.

    >>> with Cluster(world_size=2) as cluster:          # doctest: +SKIP
    ...     cluster.run(lambda: torch.distributed.get_rank())
    [0, 1]

    ``run`` has the semantics of :func:`launch`. A failure that leaves some rank stuck (a timeout,
    a dead rank, a rank still waiting in a collective) stops all ranks, and so does anything that
    interrupts the caller while it waits (Ctrl-C, a test's time limit); the next ``run`` starts
    fresh ones and says so. A failure every rank returned from keeps the ranks (and their state).
    Runs from several threads are serialized: one waits for the other. ``isolation``: see
    :class:`Isolation` (the grader's; results are then plain data).
    """

    def __init__(self, world_size, *, backend="auto", timeout=DEFAULT_TIMEOUT, threads=None,
                 isolation=None):
        self.world_size, self.timeout, threads = _check_options(world_size, timeout, threads)
        if isolation is not None and not isinstance(isolation, Isolation):
            raise ValueError(f"isolation must be None or a zerolab.launch.Isolation, got {isolation!r}")
        self.isolation = isolation
        self.backend = resolve_backend(backend, self.world_size)
        self.threads = threads or _default_threads(self.world_size)
        self._ranks = None        # the live zerolab._protocol.Ranks, or None
        self._broken = False      # a failed run stopped the ranks: the next run replaces them
        self._finalizer = None
        self._run_id = 0
        self._lock = threading.Lock()  # one run (start, close) at a time
        self._lock_owner = None
        self.start()

    @contextlib.contextmanager
    def _exclusive(self):
        me = threading.get_ident()
        if self._lock_owner == me:
            raise RuntimeError("this Cluster is already busy in this thread (a run, start or close "
                               "called from a signal handler or a callback inside one?): runs "
                               "cannot nest")
        with self._lock:  # another thread's run: wait for it to finish
            self._lock_owner = me
            try:
                yield
            finally:
                self._lock_owner = None

    # -- lifecycle -------------------------------------------------------------------------
    def start(self):
        with self._exclusive():
            if self._ranks is None:
                self._start()

    def _start(self):
        iso = self.isolation
        store_dir = tempfile.mkdtemp(prefix="zerolab-", dir=iso.scratch if iso else None)
        if iso and iso.scratch:
            # a sandboxed rank may run as another (unprivileged) user. Through a descriptor opened
            # without following links: the folder sits where running ranks can write.
            fd = os.open(store_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
            try:
                os.fchmod(fd, 0o777)
            finally:
                os.close(fd)
        setup = {"sys_path": list(sys.path), "threads": self.threads, "backend": self.backend,
                 "store_path": os.path.join(store_dir, "store"),
                 "pg_timeout": self.timeout + _PG_MARGIN, "plain": iso is not None}
        env = dict(os.environ, WORLD_SIZE=str(self.world_size), PYTHONUNBUFFERED="1",
                   OMP_NUM_THREADS=str(self.threads), ZEROLAB_PARENT_PID=str(os.getpid()),
                   ZEROLAB_STORE_DIR=store_dir)
        env.pop("PYTEST_CURRENT_TEST", None)
        try:
            ranks = Ranks(self.world_size, setup, env, store_dir, prefix=iso.prefix if iso else ())
        except StartupFailure as exc:
            cls = RankTimeout if exc.timed_out else RankError
            raise cls(str(exc), ranks=exc.ranks) from None
        self._ranks, self._broken = ranks, False
        self._finalizer = weakref.finalize(self, ranks.stop)
        self._print_output(ranks.outputs(0, 5))

    def _stop(self, graceful):
        if self._ranks is not None:
            self._ranks.stop(graceful)  # if interrupted, the finalizer still holds the ranks
            self._finalizer.detach()
            self._ranks = self._finalizer = None

    def close(self):
        """Stop all ranks (idempotent)."""
        with self._exclusive():
            self._stop(graceful=True)
            self._broken = False

    def restart(self):
        with self._exclusive():
            self._stop(graceful=True)
            self._start()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        state = ("stopped after a failure (restarts on the next run)" if self._broken
                 else "running" if self._ranks is not None else "stopped")
        return f"Cluster(world_size={self.world_size}, backend={self.backend!r}, {state})"

    # -- running ---------------------------------------------------------------------------
    def run(self, fn, *args, timeout=None, **kwargs):
        """Run ``fn(*args, **kwargs)`` on every rank; return the per-rank results in rank order.

        ``timeout`` (seconds, default: the cluster's) bounds this run; the process group's own
        timeout follows it, so a run longer than the cluster's timeout is not cut short.
        """
        payload = _encode(fn, args, kwargs)
        return self._submit(payload, self.timeout if timeout is None else _check_timeout(timeout))

    def _submit(self, payload, timeout, one_shot=False):
        # one_shot: called by launch(), whose ranks stop after this run (no "next run" to announce)
        with self._exclusive():
            if self._broken or self._ranks is None:
                if self._broken:
                    print(f"[zerolab] restarting the cluster ({self.world_size} ranks) after the last "
                          f"failure", file=sys.stderr)
                self._stop(graceful=False)
                self._start()
            self._run_id += 1
            run_id, ranks = self._run_id, self._ranks
            try:
                ranks.send(run_id, timeout + _PG_MARGIN, payload)
                replies, died, stuck = ranks.collect(run_id, timeout)
            except BaseException as exc:
                # Interrupted while the ranks may be mid-run, some inside a collective (Ctrl-C, a
                # test's time limit, an error here): only stopping them all puts them back in step.
                self._broken = True
                self._stop(graceful=False)
                self._print_output(ranks.outputs(run_id, 0))
                print(f"[zerolab] {type(exc).__name__} while the ranks were running: stopped all "
                      f"{self.world_size} ranks" + ("" if one_shot else "; the cluster restarts on "
                                                    "its next run (rank_state is lost)"), file=sys.stderr)
                raise
            if died or stuck:
                self._broken = True
                self._stop(graceful=False)
            results, errors = {}, {}
            for rank, (kind, body) in replies.items():
                if kind == "err":
                    errors[rank] = body
                    continue
                if ranks.plain:  # already read, as plain data, by Ranks.collect
                    results[rank] = body
                    continue
                try:
                    results[rank] = cloudpickle.loads(body)
                except Exception as exc:  # e.g. a class only the ranks can import
                    errors[rank] = {"type": type(exc).__name__, "message": str(exc), "local": True,
                                    "traceback": traceback.format_exc(), "exception": exc}
            self._print_output(ranks.outputs(run_id, 2.0))
            if errors or died or stuck:
                raise self._error(errors, died, stuck, timeout, one_shot)
            return [results[i] for i in range(self.world_size)]

    def _error(self, errors, died, stuck, timeout, one_shot):
        parts = []
        # A dead rank is the cause; errors on the others (connection reset) are its consequence.
        for rank, code in sorted(died.items()):
            # a sentence: a plain-mode rank stopped for breaking the protocol (zerolab._protocol)
            parts.append(f"rank {rank} {code if isinstance(code, str) else _how_it_ended(code)}")
        by_cause = {}
        for rank, e in sorted(errors.items()):
            by_cause.setdefault((e["type"], e["message"], e.get("local", False)), []).append(rank)
        for (etype, msg, local), ranks in by_cause.items():
            parts.append(f"{_who(ranks)} returned a value that cannot be unpickled in this process "
                         f"({etype}: {msg})" if local else f"{_who(ranks)} raised {etype}: {msg}")
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
        if self._broken and not one_shot:
            parts.append("the cluster restarts on its next run")
        message = "; ".join(parts)
        if errors:
            first = min(errors)
            where = ("unpickling its return value here" if errors[first].get("local")
                     else "remote traceback")
            message += (f"\n\n--- {where} (rank {first}) ---\n" + errors[first]["traceback"].rstrip())
        ranks = sorted(died) + sorted(errors) + (stuck if not (errors or died) else [])
        exceptions = {}
        for rank, e in errors.items():
            if self._ranks is not None and self._ranks.plain:
                continue  # isolated ranks are not trusted: their errors are text, never unpickled
            if e.get("local"):
                exceptions[rank] = e["exception"]
                continue
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


def launch(fn, world_size, *args, backend="auto", timeout=DEFAULT_TIMEOUT, threads=None, **kwargs):
    """Run ``fn(*args, **kwargs)`` on ``world_size`` fresh ranks and return their results.

    Each rank is a new process with the default process group initialised (gloo on CPU; nccl
    when CUDA has a GPU per rank and ``backend`` is 'auto' or 'nccl'). ``fn`` may come from a
    notebook cell, a test or a module: it is sent by value with cloudpickle. Rank output is
    printed here, prefixed ``[rank r]``, in rank order. Raises :class:`RankError` (with the
    remote traceback) if any rank raises or dies, :class:`RankTimeout` if ranks are still
    running after ``timeout`` seconds. ``threads`` sets each rank's intra-op threads (default:
    the machine's cores shared fairly among the ranks). Bad options and an unpicklable ``fn``
    are refused before any rank starts.
    """
    payload = _encode(fn, args, kwargs)
    with Cluster(world_size, backend=backend, timeout=timeout, threads=threads) as cluster:
        return cluster._submit(payload, cluster.timeout, one_shot=True)


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

"""The parent's side of the launcher: start a set of ranks, talk to them, stop them.

:class:`zerolab.Cluster` builds what the user sees (results, errors, restarts) on :class:`Ranks`.
The wire protocol, per rank (the worker's side is zerolab/_worker.py):

* a control socket: parent -> worker a setup dict once, then ``("run", run_id, pg_timeout,
  payload)`` or ``("exit",)``; worker -> parent ``("ready", rank)`` once, then one
  ``("ok" | "err", run_id, body)`` per run;
* the worker's stdout/stderr pipes: whatever the rank prints, then an end marker with the run id.

Run ids make the protocol self-checking: a reply whose id is not the run being collected is stale
(from a run the parent gave up on) and is dropped, never read as this run's answer. The parent
gives up on a run only by stopping every rank, so the ranks it talks to are always in step.

Nothing is left behind. Each worker leads its own session and process group, and :meth:`Ranks.stop`
ends every whole group with SIGKILL on every path, clean or not, so processes started by rank code
die with their rank (and release its output pipes). Before that it ends each live worker's
descendants that left the group (a new session, a double fork: the worker is their subreaper, see
zerolab/_worker.py) while the worker still lives to hold them; a worker whose rank ended, even
killed, ends them itself. A watchdog process does the same, and removes the rendezvous folder, if
the parent dies without stopping them (SIGKILL, a kernel restart).
"""
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection, wait

STARTUP_TIMEOUT = 180.0  # importing torch in 4 processes on 2 busy cores can take a while
GRACE = 2.0  # after one rank fails, how long the others get to finish on their own
_LINE_BYTES = 64 * 1024  # a longer line of a rank's output is kept as several
_KEEP_CHARS = 16 << 20   # characters kept per stream between two runs (the last lines)
_ERR_KEYS = {"type", "message", "traceback", "exception"}
_ERR_CHARS = 200_000     # an isolated rank's error text, at most (its last characters)
_END = "\x1ezerolab-end:"  # the worker's end-of-run marker on stdout/stderr (see _worker._marker)
# A worker's exit status when the rank's code closed its stdout or stderr (zerolab/_worker.py exits
# with it; zerolab.launch names it). Outside the codes Python and the shells use (1, 2, 126-128+n).
OUTPUT_CLOSED = 86


class StartupFailure(Exception):
    """Ranks could not start: ``ranks`` names them; ``timed_out`` says whether they were too slow."""

    def __init__(self, message, ranks, timed_out):
        super().__init__(message)
        self.ranks, self.timed_out = ranks, timed_out


class _Garbled(Exception):
    """A plain-mode worker sent something that is not a well-formed reply."""


class _Rank:
    """Parent-side handle of one worker: its process, control connection and output buffers."""

    def __init__(self, rank, proc, conn):
        self.rank, self.proc, self.conn = rank, proc, conn
        self.lines = {"stdout": [], "stderr": []}
        self.chars = {"stdout": 0, "stderr": 0}
        self.ended = {"stdout": -1, "stderr": -1}  # last run id whose end marker was read
        self.cond = threading.Condition()
        self.readers = [threading.Thread(target=self._read, args=(name, stream), daemon=True)
                        for name, stream in (("stdout", proc.stdout), ("stderr", proc.stderr))]
        for t in self.readers:
            t.start()

    def _read(self, name, stream):
        # Bounded: a line is read in pieces of at most _LINE_BYTES and each stream keeps its last
        # last _KEEP_CHARS characters, so a rank that prints gigabytes (with or without newlines)
        # costs this
        # process a fixed amount of memory.
        piece = b""
        for raw in iter(lambda: stream.readline(_LINE_BYTES), b""):
            piece += raw
            if not raw.endswith(b"\n") and len(piece) < _LINE_BYTES:
                continue  # the rest of this line is on its way
            line, piece = piece.decode("utf-8", "replace").rstrip("\n"), b""
            with self.cond:
                if _END in line:
                    head, _, tail = line.partition(_END)
                    if head:
                        self.lines[name].append(head)
                    try:
                        self.ended[name] = int(tail.strip("\x1e"))
                    except ValueError:
                        self.lines[name].append(line)
                else:
                    self.lines[name].append(line)
                self.chars[name] += len(line)
                if self.chars[name] > _KEEP_CHARS:
                    kept, size = self.lines[name], 0
                    for i in range(len(kept) - 1, -1, -1):
                        size += len(kept[i])
                        if size > _KEEP_CHARS // 2:
                            break
                    del kept[:i + 1]
                    kept.insert(0, f"[earlier output of {name} dropped: more than {_KEEP_CHARS >> 20} MB]")
                    self.chars[name] = sum(map(len, kept))
                self.cond.notify_all()
        with self.cond:
            self.ended[name] = float("inf")  # EOF: the process (and all its group) is gone
            self.cond.notify_all()

    def take_output(self, run_id, wait_s):
        """Wait (bounded) until both streams reached run_id's end marker, then hand over the lines."""
        deadline = time.monotonic() + wait_s
        with self.cond:
            while min(self.ended.values()) < run_id and time.monotonic() < deadline:
                self.cond.wait(max(0.0, deadline - time.monotonic()))
            out = self.lines
            self.lines = {"stdout": [], "stderr": []}
            self.chars = {"stdout": 0, "stderr": 0}
        return out


class Ranks:
    """One started set of ``world_size`` workers (plus their watchdog), ready to run.

    Starting waits until every rank joined the process group; on any failure, or an interrupt,
    what was started is stopped and :class:`StartupFailure` (or the interrupt) is raised.
    """

    def __init__(self, world_size, setup, env, store_dir, prefix=()):
        self.store_dir = store_dir
        # Plain mode: each message from a worker is bytes read without unpickling (zerolab/_plain.py)
        self.plain = bool(setup.get("plain"))
        self.owner = os.getpid()  # a forked copy of the parent must never stop our ranks
        self.ranks = []
        self._watchdog = self._watch = None
        try:
            self._start_watchdog(env)
            for rank in range(world_size):
                parent_end, child_end = socket.socketpair()
                env = dict(env, RANK=str(rank), LOCAL_RANK=str(rank),
                           ZEROLAB_CONTROL_FD=str(child_end.fileno()))
                proc = subprocess.Popen([*prefix, sys.executable, "-m", "zerolab._worker"], env=env,
                                        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, pass_fds=[child_end.fileno()],
                                        start_new_session=True)  # its own group: killpg ends it all
                self.ranks.append(_Rank(rank, proc, Connection(parent_end.detach())))  # stop() sees it
                child_end.close()
                self._tell_watchdog(f"watch {proc.pid}")  # pgid == pid for a session leader
            for r in self.ranks:
                r.conn.send(setup)
            self._wait_ready()
        except BaseException:
            self.stop(graceful=False)
            raise

    def _start_watchdog(self, env):
        read_end, write_end = os.pipe()  # not inherited by the workers (O_CLOEXEC)
        try:
            self._watchdog = subprocess.Popen(
                [sys.executable, "-m", "zerolab._worker", "--watchdog", str(os.getpid()), self.store_dir],
                env=env, stdin=read_end, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                start_new_session=True)  # no terminal Ctrl-C reaches it
        finally:
            os.close(read_end)
        self._watch = os.fdopen(write_end, "wb", buffering=0)

    def _tell_watchdog(self, line):
        try:
            self._watch.write(line.encode() + b"\n")
        except (OSError, ValueError, AttributeError):
            pass  # no watchdog: each worker's own orphan check remains

    def _wait_ready(self):
        pending = {r.conn: r for r in self.ranks}
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while pending:
            ready = wait(list(pending), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                stuck = sorted(r.rank for r in pending.values())
                raise StartupFailure(f"{who(stuck)} did not start within {STARTUP_TIMEOUT:.0f} s",
                                     stuck, timed_out=True)
            for conn in ready:
                r = pending.pop(conn)
                try:
                    self._recv(conn)
                except (EOFError, OSError, _Garbled):
                    r.proc.wait()
                    out = r.take_output(0, 2)
                    raise StartupFailure(f"rank {r.rank} failed to start (exit code {r.proc.returncode}):\n"
                                         + "\n".join(out["stderr"][-30:]), [r.rank], timed_out=False)

    def _recv(self, conn):
        """One message from a worker. In plain mode it is decoded without unpickling, and a message
        that is not a well-formed reply ends the conversation as a dead rank would."""
        if not self.plain:
            return conn.recv()
        from zerolab import _plain
        try:
            message = _plain.loads(conn.recv_bytes(_plain.MAX_BYTES))
        except (EOFError, OSError):
            raise
        except Exception as exc:  # not plain data, too long, truncated: this rank is not trusted
            raise _Garbled(f"{type(exc).__name__} on reading it") from None
        if not (isinstance(message, tuple) and message and message[0] in ("ready", "ok", "err")
                and (message[0] == "ready" or (len(message) == 3 and isinstance(message[1], int)))):
            raise _Garbled(f"not a reply: {type(message).__name__}")
        if message[0] == "err":
            body = message[2]
            if not (isinstance(body, dict) and set(body) <= _ERR_KEYS and all(
                    isinstance(body.get(k), str) for k in ("type", "message", "traceback"))
                    and body.get("exception") is None):
                raise _Garbled("an error reply other than its type, message and traceback as text")
            # text only, and bounded: nothing in an untrusted error is ever unpickled or grows here
            message = ("err", message[1], {k: body[k][-_ERR_CHARS:] for k in ("type", "message", "traceback")}
                       | {"exception": None})
        return message

    @property
    def pids(self):
        return [r.proc.pid for r in self.ranks]

    # -- one run ---------------------------------------------------------------------------
    def send(self, run_id, pg_timeout, payload):
        for r in self.ranks:
            r.conn.send(("run", run_id, pg_timeout, payload))

    def collect(self, run_id, timeout):
        """Wait for every rank's reply to run ``run_id``.

        Returns (replies, died, stuck): replies maps rank -> (kind, body) with kind "ok" (body: the
        pickled result, or in plain mode the result itself) or "err" (body: the remote error); died
        maps rank -> exit code (or a sentence, for a rank stopped for breaking the protocol); stuck
        lists the ranks still running when the deadline passed.
        """
        pending = {r.conn: r for r in self.ranks}
        replies, died = {}, {}
        deadline = time.monotonic() + timeout
        while pending:
            ready = wait(list(pending), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            for conn in ready:
                r = pending[conn]
                try:
                    kind, rid, body = self._recv(conn)
                except _Garbled as exc:  # a plain-mode rank broke the protocol: stop it, say why
                    del pending[conn]
                    try:
                        os.killpg(r.proc.pid, signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass
                    died[r.rank] = f"stopped: it sent a reply that is not plain data, {exc}"
                    continue
                except (EOFError, OSError):
                    del pending[conn]
                    try:
                        r.proc.wait(timeout=2)
                    except subprocess.TimeoutExpired:
                        pass
                    died[r.rank] = r.proc.returncode
                    continue
                if rid != run_id:
                    continue  # stale: the answer to a run the parent gave up on
                del pending[conn]
                replies[r.rank] = (kind, body)
            if (died or any(kind == "err" for kind, _ in replies.values())) and pending:
                # One rank failed: the others may be blocked in a collective waiting for it.
                deadline = min(deadline, time.monotonic() + GRACE)
        return replies, died, sorted(r.rank for r in pending.values())

    def outputs(self, run_id, wait_s):
        """rank -> {"stdout": lines, "stderr": lines} printed up to the end of run ``run_id``."""
        return {r.rank: r.take_output(run_id, wait_s) for r in self.ranks}

    # -- stopping --------------------------------------------------------------------------
    def stop(self, graceful=True):
        """Stop every rank and everything its code started; remove the rendezvous folder.

        ``graceful`` first asks each worker to leave its process group and exit (5 s at most).
        Then each worker still running gets its whole tree killed, wherever its members moved (a
        session of their own), and, whatever happened, each rank's whole process group gets
        SIGKILL: a worker that exited may have left children holding its output pipes.
        Idempotent; safe to call again after an interrupted call.
        """
        if os.getpid() != self.owner:
            return
        if graceful:
            for r in self.ranks:
                try:
                    r.conn.send(("exit",))
                except (OSError, ValueError):
                    pass
            deadline = time.monotonic() + 5
            for r in self.ranks:
                try:
                    r.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
        for r in self.ranks:
            # A worker still running: first its whole tree, while it lives to hold it (it is the
            # subreaper of what its rank detached: a new session, a double fork + setsid, which
            # killpg would miss). A worker that exited ended its tree itself (_worker._keep).
            if r.proc.poll() is None:
                kill_descendants(r.proc.pid)
        for r in self.ranks:
            try:
                # A group id stays reserved while any member lives, so this never hits a stranger.
                os.killpg(r.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for r in self.ranks:
            try:
                r.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            r.conn.close()
            for t, stream in zip(r.readers, (r.proc.stdout, r.proc.stderr)):
                t.join(timeout=2)
                if not t.is_alive():  # (one still blocked: a process that left our groups holds it)
                    stream.close()
        shutil.rmtree(self.store_dir, ignore_errors=True)
        if self._watchdog is not None:
            self._tell_watchdog("exit")
            self._watch.close()
            try:
                self._watchdog.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._watchdog.kill()
                self._watchdog.wait()


def who(ranks):
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(str(r) for r in ranks)


def kill_descendants(pid, rounds=20):
    """SIGKILL every descendant of process ``pid`` (children, theirs, ...; not ``pid`` itself),
    whatever session or process group they moved to. Repeated until none is left (a process
    killed mid-fork leaves children, which a subreaper ``pid`` inherits), at most ``rounds``
    times. Called while ``pid`` still lives: once it is gone its orphans belong to init."""
    import psutil
    try:
        root = psutil.Process(pid)
    except psutil.Error:
        return
    for _ in range(rounds):
        try:
            procs = [p for p in root.children(recursive=True) if _running(p)]
        except psutil.Error:
            return
        if not procs:
            return
        for p in procs:
            try:
                p.kill()                 # psutil checks the pid still names that process
            except psutil.Error:
                pass
        deadline = time.monotonic() + 2  # dead (a zombie counts) before their children are looked up
        while any(_running(p) for p in procs) and time.monotonic() < deadline:
            time.sleep(0.01)


def _running(proc):
    import psutil
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False

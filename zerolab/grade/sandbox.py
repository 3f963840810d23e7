"""The sandbox a submission's code runs in under the grader: it sees only what it needs, writes only
its own scratch folder, runs as nobody, and everything it starts ends with it.

    python -m zerolab.grade.sandbox SPEC_JSON COMMAND...     (the prefix of each sandboxed rank)

Started by the grader (:class:`zerolab.launch.Isolation` ``prefix``), never by hand. Linux only.
Per process started this way (each rank of a submission):

* **A file system of its own** (a mount namespace with a fresh root, ``pivot_root``): read-only
  binds of the system (``/usr``, ``/etc``, ...), the Python installation, the ``zerolab`` package,
  the graded tests and the submission's copy, and nothing else: not the checkout (``solutions/``,
  ``tests/graded/wrong/``, ``.git``), not the other submissions, not the grader's files. ``/tmp``
  (and ``/var/tmp``, ``/dev/shm``) is the submission's scratch folder, shared by its ranks and
  deleted with it: nothing it writes survives it.
* **Its own process tree** (a PID namespace): a small init (this module) is process 1 and runs the
  command as its child; when either ends, the kernel ends every process in the namespace, detached
  ones (``setsid``, double forks) included. The processes of the grader are not visible.
* **Less privilege**: as root, the command runs as a user id of its own that no one else has
  (:func:`fresh_uid`; no supplementary groups, ``no_new_privs``); otherwise the whole sandbox lives in an unprivileged user namespace
  and the command in a nested one that holds no capability over the sandbox's mounts. Limits: a
  bounded number of processes (a fork bomb stops there), file size, no core dumps; out of memory,
  the kernel ends the sandbox's processes first (``oom_score_adj`` 1000).

Anchors: PrairieLearn runs student code as an unprivileged user in a separate process; Gradescope
in a fresh container per submission. This is the same idea with the kernel's namespaces, which
need root or unprivileged user namespaces; :func:`available` says whether this machine has them.
"""
import ctypes
import json
import os
import resource
import signal
import stat
import sys

CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID = 0x00020000, 0x10000000, 0x20000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
SYS_PIVOT_ROOT, SYS_MOUNT_SETATTR = 155, 442          # x86_64 and aarch64 share 442; pivot_root below
AT_RECURSIVE, MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID, MOUNT_ATTR_NODEV = 0x8000, 1, 2, 4
NOBODY = 65534
EXIT_SETUP = 70  # the sandbox could not be built (the command never ran)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.syscall.restype = ctypes.c_long


class SandboxUnavailable(RuntimeError):
    """This machine cannot build the sandbox (no root, no unprivileged user namespaces, not Linux)."""


def _check(result, what):
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(source, target, fstype, flags, data=None):
    enc = lambda s: None if s is None else os.fsencode(s)  # noqa: E731
    _check(_libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)),
           f"mount {source} -> {target}")


def _read_only(target, *, nodev=True):
    """Make the bind at ``target`` and every mount below it read-only (and nosuid, nodev)."""
    attr = MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | (MOUNT_ATTR_NODEV if nodev else 0)

    class MountAttr(ctypes.Structure):
        _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                    ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]
    ma = MountAttr(attr, 0, 0, 0)
    number = {"x86_64": 442, "aarch64": 442}.get(os.uname().machine)
    if number is not None and _libc.syscall(number, -100, os.fsencode(target), AT_RECURSIVE,
                                            ctypes.byref(ma), ctypes.sizeof(ma)) == 0:
        return
    # Older kernels (< 5.12): the top mount only (submounts of /usr, /sys are rare and read-only).
    _mount(None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | (MS_NODEV if nodev else 0))


def _bind(root, path, *, writable=False, at=None, nodev=True):
    """Bind the host's ``path`` into the new root at ``at`` (default: the same path)."""
    target = root + (at or path)
    if os.path.isdir(path):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        open(target, "a").close()
    _mount(path, target, None, MS_BIND | MS_REC)
    if not writable:
        _read_only(target, nodev=nodev)


def _write(path, text):
    with open(path, "w") as f:
        f.write(text)


def _build_root(spec):
    """Mount the sandbox's file system at spec['root'] and make it this process's root."""
    root = spec["root"]
    _mount(None, "/", None, MS_REC | MS_PRIVATE)     # nothing we mount leaks back to the host
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755")
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):                        # merged /usr: keep the links
            os.symlink(os.readlink(top), root + top)
        elif os.path.isdir(top):
            _bind(root, top)
    scratch = spec["scratch"]
    for at in ("/tmp", "/var/tmp", "/dev/shm", scratch):  # writable first: read-only paths may lie
        _bind(root, scratch, writable=True, at=at)         # below /tmp, and are bound on top of it
    seen = set()
    for path in ["/usr", "/etc", "/sys", *spec["read_only"]]:
        path = os.path.realpath(path)
        if os.path.exists(path) and path not in seen and not any(path.startswith(s + "/") for s in seen):
            _bind(root, path)
            seen.add(path)
    for dev in ("null", "zero", "full", "random", "urandom"):
        _bind(root, f"/dev/{dev}", writable=True, at=f"/dev/{dev}", nodev=False)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                         ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"{root}/dev/{name}")
    os.makedirs(root + "/proc")
    # A fresh /proc of this PID namespace: the grader's processes (and their /proc/PID/root, a way
    # back to the host's files) are not in it.
    _mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    os.chdir(root)
    os.mkdir(".old")
    _check(_libc.syscall(SYS_PIVOT_ROOT if os.uname().machine == "x86_64" else 41, b".", b".old"),
           "pivot_root")
    os.chdir("/")
    _check(_libc.umount2(b"/.old", MNT_DETACH), "umount the host's root")
    os.rmdir("/.old")
    _mount(None, "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def _limit(spec):
    try:  # out of memory, the kernel ends the submission's processes first, never the grader's
        _write("/proc/self/oom_score_adj", "1000")
    except OSError:
        pass
    nproc = spec.get("max_processes", 512)
    if os.geteuid() != 0:  # counted per real user: leave room above what this user runs already
        nproc += sum(1 for d in os.listdir("/proc") if d.isdigit())
    for what, value in ((resource.RLIMIT_NPROC, nproc), (resource.RLIMIT_CORE, 0),
                        (resource.RLIMIT_FSIZE, spec.get("max_file_bytes", 4 << 30))):
        resource.setrlimit(what, (value, value))


def _drop_privileges(as_root, uid):
    if as_root:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    else:
        # A nested user namespace: the command is uid 1000 there, with no capability over the
        # sandbox's mounts (they belong to the outer one), and loses the rest at exec.
        uid, gid = os.geteuid(), os.getegid()
        _check(_libc.unshare(CLONE_NEWUSER), "unshare a nested user namespace")
        _write("/proc/self/setgroups", "deny")
        _write("/proc/self/uid_map", f"1000 {uid} 1")
        _write("/proc/self/gid_map", f"1000 {gid} 1")
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")


def _init(spec, argv, as_root):
    """Process 1 of the sandbox: build it, start the command, reap, and end with the command."""
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    try:
        _build_root(spec)
        _limit(spec)
    except OSError as exc:
        os.write(2, f"zerolab sandbox: could not be built: {exc}\n".encode())
        os._exit(EXIT_SETUP)
    child = os.fork()
    if child == 0:
        try:
            _drop_privileges(as_root, spec.get("uid", NOBODY))
            env = dict(os.environ, HOME="/tmp", TMPDIR="/tmp", ZEROLAB_PARENT_PID="1")
            os.execve(argv[0], argv, env)
        except OSError as exc:
            os.write(2, f"zerolab sandbox: could not start {argv[0]}: {exc}\n".encode())
        os._exit(EXIT_SETUP)
    while True:  # reap every orphan; when the command ends, so does the namespace
        try:
            pid, status = os.wait()
        except ChildProcessError:
            os._exit(EXIT_SETUP)
        if pid == child:
            os._exit(os.waitstatus_to_exitcode(status) % 256 if os.WIFEXITED(status)
                     else 128 + os.WTERMSIG(status))


def enter(spec, argv):
    """Run ``argv`` in a new sandbox described by ``spec`` (see the module docstring); returns
    (never: exits) with the command's exit status."""
    as_root = os.geteuid() == 0
    uid, gid = os.geteuid(), os.getegid()
    flags = CLONE_NEWNS | CLONE_NEWPID | (0 if as_root else CLONE_NEWUSER)
    if _libc.unshare(flags) != 0:
        err = ctypes.get_errno()
        if as_root and spec.get("user_only_fallback"):
            _user_only(spec, argv)
        os.write(2, f"zerolab sandbox: unshare failed: {os.strerror(err)} ({unavailable_reason()})\n".encode())
        os._exit(EXIT_SETUP)
    if not as_root:  # this process is root inside its own user namespace: enough to mount
        _write("/proc/self/setgroups", "deny")
        _write("/proc/self/uid_map", f"0 {uid} 1")
        _write("/proc/self/gid_map", f"0 {gid} 1")
    pid = os.fork()  # the child is process 1 of the new PID namespace
    if pid == 0:
        _init(spec, argv, as_root)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _, status = os.waitpid(pid, 0)
    os._exit(os.waitstatus_to_exitcode(status) % 256 if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))


def _user_only(spec, argv):
    """The lesser sandbox, for root without namespaces (a container without CAP_SYS_ADMIN, as many
    autograders run): the command runs as the submission's own user id and nothing more. It then
    sees every file its user may read (world-readable ones included), so the grading tree must hold
    no answers; what it writes in /tmp is removed by the grader after it (by owner)."""
    try:
        _limit(spec)
        scratch = spec["scratch"]
        env = dict(os.environ, HOME=scratch, TMPDIR=scratch)
        _drop_privileges(True, spec.get("uid", NOBODY))
        os.execve(argv[0], argv, env)
    except OSError as exc:
        os.write(2, f"zerolab sandbox: could not start {argv[0]} as the submission's user: {exc}\n".encode())
    os._exit(EXIT_SETUP)


def mode():
    """How this machine isolates a submission: "namespaces" (the full sandbox), "user" (root
    without namespaces: the submission's own user id only, :func:`_user_only`; it needs a Python
    installation other users may run) or None."""
    if unavailable_reason() is None:
        return "namespaces"
    if not (sys.platform.startswith("linux") and os.geteuid() == 0):
        return None
    return "user" if others_may(sys.executable, stat.S_IROTH | stat.S_IXOTH) else None


def others_may(path, bits):
    """Whether a user with no rights of its own has the permission ``bits`` (stat.S_IROTH,
    S_IXOTH, or both) on ``path``, every folder on the way searchable by others."""
    try:
        path = os.path.realpath(path)
        if os.stat(path).st_mode & bits != bits:
            return False
        folder = os.path.dirname(path)
        while folder not in ("/", ""):
            if not os.stat(folder).st_mode & stat.S_IXOTH:
                return False
            folder = os.path.dirname(folder)
    except OSError:
        return False
    return True


def unavailable_reason():
    """Why the sandbox cannot be built here, or None if it can (checked by trying, in a child)."""
    if not sys.platform.startswith("linux"):
        return f"the grader's sandbox needs Linux (this is {sys.platform})"
    pid = os.fork()
    if pid == 0:
        flags = CLONE_NEWNS | CLONE_NEWPID | (0 if os.geteuid() == 0 else CLONE_NEWUSER)
        os._exit(0 if _libc.unshare(flags) == 0 else 1)
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) == 0:
        return None
    return ("the grader's sandbox needs root (a container, as Gradescope runs) or unprivileged user "
            "namespaces (sysctl kernel.unprivileged_userns_clone=1; on Ubuntu 24.04 also "
            "kernel.apparmor_restrict_unprivileged_userns=0)")


def fresh_uid():
    """A user id no one has (as root, each submission runs as its own): its process limit is its
    own, and every process it leaves is found by it. Far above the ranges systems and rootless
    containers hand out (below 2**31), and below uid_t's reserved values."""
    import secrets
    return 3_000_000_000 + secrets.randbelow(1_000_000_000)


def write_spec(path, *, root, scratch, read_only, uid=NOBODY, user_only_fallback=False, max_processes=512,
               max_file_bytes=4 << 30):
    """The JSON spec :func:`enter` reads: the empty folder the root is mounted on, the scratch
    folder (writable; /tmp inside), the host paths to show read-only, (as root) the user id the
    command runs as, and whether to fall back to that user id alone without namespaces."""
    with open(path, "w") as f:
        json.dump({"root": str(root), "scratch": str(scratch), "read_only": [str(p) for p in read_only],
                   "uid": uid, "user_only_fallback": user_only_fallback, "max_processes": max_processes,
                   "max_file_bytes": max_file_bytes}, f)


def main(argv):
    if len(argv) < 2:
        sys.exit("usage: python -m zerolab.grade.sandbox SPEC_JSON COMMAND...")
    with open(argv[0]) as f:
        spec = json.load(f)
    enter(spec, argv[1:])


if __name__ == "__main__":
    main(sys.argv[1:])

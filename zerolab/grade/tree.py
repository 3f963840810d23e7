"""A fresh grading tree per submission: what one submission is graded with, made before it runs and
discarded after it (:func:`make_tree`).

    TMP/tree/tests/conftest.py, tests/graded/{conftest.py, test_exNN_*.py}   copies of the graded tests
    TMP/tree/submission/*.py                 copies of the submission's regular .py files (no links)
    TMP/scratch/                             the submission's only writable folder (/tmp in the sandbox)
    TMP/root/                                where the sandbox mounts its root
    TMP/sandbox.json                         the sandbox's spec (zerolab.grade.sandbox)

The copies make each submission's grading independent of the last one's (nothing it did to a
file can reach the next), and leave ``solutions/`` and ``tests/graded/wrong/`` out. The sandbox
shows the submission's copy, the Python installation and the ``zerolab`` package; the tests stay with the trusted process (their probes
reach the ranks by value).
"""
import os
import pathlib
import shutil
import stat
import sys
import sysconfig

from zerolab.grade.sandbox import fresh_uid, write_spec

SUBMISSION_LIMIT = 50 << 20  # bytes of .py files a submission may hold
PACKAGE = pathlib.Path(__file__).resolve().parents[1]  # the zerolab package the ranks import


def _copy_regular(src, dst):
    """Copy ``src`` to ``dst`` if it is a regular file (a link is never followed: a submission
    could point one at a file only the grader may read). Returns the bytes copied."""
    st = os.lstat(src)
    if not stat.S_ISREG(st.st_mode):
        return 0
    shutil.copyfile(src, dst, follow_symlinks=False)
    return st.st_size


def copy_submission(impl, dst):
    """The submission's top-level .py files (exNN_*.py and any module of its own) into ``dst``."""
    dst.mkdir(parents=True)
    total = 0
    for path in sorted(impl.glob("*.py")):
        total += _copy_regular(path, dst / path.name)
        if total > SUBMISSION_LIMIT:
            raise ValueError(f"the submission's .py files hold more than {SUBMISSION_LIMIT} bytes")
    return dst


def copy_tests(graded, files, dst):
    """The graded test files ``files`` of the folder ``graded``, its conftest.py and its parent's
    (the fixtures), into ``dst/tests/graded``; returns the copies of ``files``."""
    (dst / "tests" / "graded").mkdir(parents=True)
    for conftest, target in ((graded.parent / "conftest.py", dst / "tests" / "conftest.py"),
                             (graded / "conftest.py", dst / "tests" / "graded" / "conftest.py")):
        if conftest.is_file():
            _copy_regular(conftest, target)
    copies = []
    for f in files:
        copies.append(dst / "tests" / "graded" / f.name)
        _copy_regular(f, copies[-1])
    return copies


def make_tree(tmp, impl, graded, files, *, sandboxed, shown=()):
    """Build the grading tree in the empty folder ``tmp``; returns (submission, test files,
    scratch, marks, spec or None, the submission's user id or None). ``sandboxed``: None, or the
    sandbox's mode (zerolab.grade.sandbox.mode()); ``shown``: more folders it shows, read-only."""
    tree = tmp / "tree"
    submission = copy_submission(impl, tree / "submission")
    tests = copy_tests(graded, files, tree)
    scratch, marks = tmp / "scratch", tmp / "scratch" / ".marks"
    marks.mkdir(parents=True)
    spec = uid = None
    if sandboxed:
        if os.geteuid() == 0:  # the submission runs as a user of its own: its folder is the one it may write
            uid = fresh_uid()
            for p in (scratch, marks):
                os.chown(p, uid, uid)
        scratch.chmod(0o700)
        if sandboxed == "user":  # no namespaces: that user reads the tree through the real folders
            tmp.chmod(0o711)
            (tree / "tests").chmod(0o700)  # the tests (and their expected values) stay the grader's
        (tmp / "root").mkdir()
        spec = tmp / "sandbox.json"
        # the submission, not the tests: probes reach the ranks by value (zerolab.grade.helpers)
        shown = {sys.base_prefix, sys.prefix, str(PACKAGE), str(submission), *map(str, shown)}
        shown |= {sysconfig.get_path(k) for k in ("purelib", "platlib", "stdlib", "platstdlib")}
        write_spec(spec, root=tmp / "root", scratch=scratch, read_only=sorted(p for p in shown if p),
                   user_only_fallback=sandboxed == "user", **({"uid": uid} if uid is not None else {}))
    return submission, tests, scratch, marks, spec, uid

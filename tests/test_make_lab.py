"""`make lab`, the README's first command, as a student runs it, and what it stands on: set-up's
choice of torch (tools/setup_env.py), the student's own copy of the course (tools/jupyter/mywork.py:
made once, never overwritten, what the lab opens and what the grade cell grades), a port checked
before anything starts, and each lesson's link to its stub. JupyterLab itself is checked over plain
HTTP here (the browser: tests/test_browser.py)."""
import importlib.util
import json
import os
import pathlib
import re
import secrets
import shutil
import subprocess
import sys
import time
import urllib.request

import pytest

from helpers import free_port, jupyter_env, kill_tree, wait_for_jupyter

REPO = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((REPO / "notebooks").glob("[0-9][0-9]*_*.ipynb"))
MAKE_LAB = (pathlib.Path(sys.prefix) / ".zerolab-installed").exists() and shutil.which("make") is not None
needs_make = pytest.mark.skipif(not MAKE_LAB, reason="needs make and the environment `make` set up "
                                                     "(run through `make test`)")


def _tool(path, name):
    spec = importlib.util.spec_from_file_location(name, REPO / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


mywork = _tool("tools/jupyter/mywork.py", "mywork")
setup_env = _tool("tools/setup_env.py", "setup_env")


def _git_state():
    """What git sees of the checkout (status and the diff of tracked files), to compare before and after."""
    if shutil.which("git") is None or not (REPO / ".git").exists():
        return None
    status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=REPO,
                            capture_output=True, text=True).stdout
    diff = subprocess.run(["git", "diff", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout
    return status, diff


# --- make lab, end to end (HTTP) -------------------------------------------------------------------

@needs_make
def test_make_lab_opens_lesson_00_in_the_students_copy_with_the_stubs_in_its_file_browser(tmp_path):
    port, token = free_port(), secrets.token_hex(16)
    copy = tmp_path / "mywork"
    before = _git_state()
    proc = subprocess.Popen(
        ["make", "--no-print-directory", "lab", f"PORT={port}", f"VENV={sys.prefix}", f"MYWORK={copy}",
         f"LAB_ARGS=--no-browser --ip=127.0.0.1 --IdentityProvider.token={token}"],
        cwd=REPO, env=jupyter_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for_jupyter(proc, base, token)              # fails with what make lab printed
        # the server's root is the copy: notebooks/ and exercises/ at the top of the file browser
        with urllib.request.urlopen(f"{base}/api/contents?content=1&token={token}") as r:
            top = {item["name"]: item["type"] for item in json.load(r)["content"]}
        assert top.get("notebooks") == "directory" and top.get("exercises") == "directory", top
        with urllib.request.urlopen(f"{base}/api/contents/exercises?content=1&token={token}") as r:
            stubs = {item["name"] for item in json.load(r)["content"]}
        assert {p.name for p in (REPO / "exercises").glob("ex[0-9][0-9]_*.py")} <= stubs
        with urllib.request.urlopen(f"{base}/api/contents/notebooks/exercises?content=1&token={token}") as r:
            beside = {item["name"] for item in json.load(r)["content"]}   # the lesson folder's shortcut
        assert stubs == beside
        with urllib.request.urlopen(f"{base}/api/contents/notebooks/00_collectives.ipynb?content=0&token={token}") as r:
            assert r.status == 200
        # what the browser opens (and where "/" leads): lesson 00 of the copy
        with urllib.request.urlopen(f"{base}/?token={token}") as r:
            assert r.status == 200 and r.geturl().startswith(f"{base}/lab/tree/notebooks/00_collectives.ipynb"), r.geturl()
        # the decks' stylesheets RISE asks for exist (no 404 in the deck's console)
        for css in ("rise.css", "00_collectives.css"):
            with urllib.request.urlopen(f"{base}/files/notebooks/{css}?token={token}") as r:
                assert r.status == 200
    finally:
        kill_tree(proc)
    assert (copy / "notebooks" / "00_collectives.ipynb").read_bytes() == (
        REPO / "notebooks" / "00_collectives.ipynb").read_bytes()
    assert _git_state() == before, "make lab changed a file of the checkout"


@needs_make
@pytest.mark.parametrize("port", ["70000", "-1", "abc", "0", "65536", "", "8888x"])
def test_make_lab_refuses_a_port_that_is_not_one_before_anything_starts(port, tmp_path):
    copy = tmp_path / "mywork"
    t0 = time.monotonic()
    done = subprocess.run(["make", "--no-print-directory", "lab", f"PORT={port}", f"VENV={sys.prefix}",
                           f"MYWORK={copy}", "LAB_ARGS=--no-browser"],
                          cwd=REPO, env=jupyter_env(tmp_path), capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert f"PORT={port} is not a port: use a whole number from 1 to 65535" in done.stderr, done.stderr
    assert not copy.exists(), "make lab went on after refusing the port"
    assert time.monotonic() - t0 < 30


@needs_make
@pytest.mark.parametrize("port", ["1", "8888", "65535"])
def test_a_valid_port_passes_the_check(port):
    done = subprocess.run(["make", "--no-print-directory", "check-port", f"PORT={port}"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


@needs_make
def test_make_grade_grades_the_students_copy_once_it_exists(tmp_path):
    def command(copy):
        out = subprocess.run(["make", "-n", "--no-print-directory", "grade", f"VENV={sys.prefix}",
                              f"MYWORK={copy}"], cwd=REPO, capture_output=True, text=True, timeout=60).stdout
        return [line for line in out.splitlines() if "zerolab grade" in line][-1]
    assert command(tmp_path / "none").rstrip().endswith("zerolab grade"), "no copy: the stubs, by default"
    mywork.sync(tmp_path / "mywork")
    assert command(tmp_path / "mywork").rstrip().endswith(f"{tmp_path / 'mywork'}/exercises")


# --- the student's copy ---------------------------------------------------------------------------

def test_the_copy_is_made_once_and_never_overwritten(tmp_path):
    repo = tmp_path / "repo"
    for folder in ("notebooks", "notebooks/data", "exercises", "benchmarks", "presenter"):
        (repo / folder).mkdir(parents=True)
    (repo / "notebooks" / "00_a.ipynb").write_text("lesson 0")
    (repo / "notebooks" / "data" / "d.json").write_text("{}")
    (repo / "exercises" / "ex00_a.py").write_text("def f(): raise NotImplementedError")
    (repo / "benchmarks" / "RESULTS.md").write_text("results")
    (repo / "presenter" / "00_a.md").write_text("guide")
    dest = tmp_path / "mywork"

    lines = mywork.sync(dest, repo)
    assert "your copy of the course" in lines[0] and "1 lessons, 1 exercise" in lines[0]
    for rel in ("notebooks/00_a.ipynb", "exercises/ex00_a.py", "notebooks/data/d.json",
                "benchmarks/RESULTS.md", "presenter/00_a.md", "notebooks/rise.css", "notebooks/00_a.css"):
        assert (dest / rel).is_file(), rel

    (dest / "exercises" / "ex00_a.py").write_text("my answer")                  # the student works
    (dest / "notebooks" / "00_a.ipynb").write_text("lesson 0, with my outputs")
    assert mywork.sync(dest, repo) == []                                         # nothing new: silent
    assert (dest / "exercises" / "ex00_a.py").read_text() == "my answer"

    (repo / "notebooks" / "00_a.ipynb").write_text("lesson 0, version 2")       # a git pull
    (repo / "notebooks" / "01_b.ipynb").write_text("lesson 1")
    (repo / "benchmarks" / "RESULTS.md").write_text("new results")
    lines = mywork.sync(dest, repo)
    assert (dest / "notebooks" / "00_a.ipynb").read_text() == "lesson 0, with my outputs"   # kept
    assert (dest / "notebooks" / "01_b.ipynb").read_text() == "lesson 1"                    # added
    assert (dest / "benchmarks" / "RESULTS.md").read_text() == "new results"                # course data
    assert any("new in the course" in line and "notebooks/01_b.ipynb" in line for line in lines), lines
    assert any("notebooks/00_a.ipynb changed in the checkout" in line and "yours is kept" in line
               for line in lines), lines

    (dest / "notebooks" / "00_a.ipynb").rename(dest / "notebooks" / "00_a.ipynb.old")      # take the new one
    mywork.sync(dest, repo)
    assert (dest / "notebooks" / "00_a.ipynb").read_text() == "lesson 0, version 2"
    assert not any("00_a.ipynb changed" in line for line in mywork.sync(dest, repo))


@pytest.mark.parametrize("where", ["", "notebooks", "exercises", "solutions"])
def test_the_copy_never_goes_into_the_checkouts_own_folders(where):
    with pytest.raises(ValueError, match="checkout's own folder"):
        mywork.sync(REPO / where if where else REPO)


def test_the_grade_cell_grades_the_exercises_beside_the_lessons_folder(tmp_path, monkeypatch):
    from zerolab.grade import cli
    mywork.sync(tmp_path / "mywork")
    monkeypatch.chdir(tmp_path / "mywork" / "notebooks")          # the kernel's cwd in make lab
    assert cli.lesson_exercises() == (tmp_path / "mywork" / "exercises").resolve()
    monkeypatch.chdir(REPO / "notebooks")                         # nbval's and make notebooks' cwd
    assert cli.lesson_exercises() == REPO / "exercises"
    monkeypatch.chdir(tmp_path)                                   # no exercises/ beside: the checkout's
    assert cli.lesson_exercises() == REPO / "exercises"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_each_lessons_exercises_section_links_its_stub(path):
    stubs = sorted((REPO / "exercises").glob(f"ex{path.name.split('_')[0]}_*.py"))
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    section = [("".join(c["source"])) for c in cells if "".join(c["source"]).startswith("## Exercises")]
    if not stubs:
        assert not section or "../exercises/" not in section[0]
        return
    assert len(section) == 1, f"{path.name}: one Exercises section"
    links = re.findall(r"\]\((\.\./exercises/[^)]+)\)", section[0])
    assert links == [f"../exercises/{stubs[0].name}"], f"{path.name}: the section links {links}"
    assert (path.parent / links[0]).resolve() == stubs[0].resolve()


# --- set-up: which torch ----------------------------------------------------------------------------

def test_a_cuda_build_is_recognised_by_its_version_or_its_nvidia_requirements():
    assert setup_env.is_cuda_build("2.13.0", ["nvidia-cublas-cu12==12.8; platform_system == 'Linux'"])
    assert setup_env.is_cuda_build("2.13.0+cu128", [])
    assert not setup_env.is_cuda_build("2.13.0+cpu", ["filelock", "sympy>=1.13"])
    assert not setup_env.is_cuda_build("2.13.0", ["filelock"])


@pytest.fixture
def pip_says(monkeypatch, capsys):
    """torch_choice with pip's answers made up: the build it would install, the user's pip sources,
    whether PyTorch's CPU index answers."""
    def configure(version, url, requires=(), sources=(), reachable=True):
        monkeypatch.setattr(setup_env, "resolve_torch", lambda *a: (version, url, list(requires)))
        monkeypatch.setattr(setup_env, "pip_sources", lambda *a, **k: list(sources))
        monkeypatch.setattr(setup_env, "reachable", lambda *a, **k: reachable)
    return configure


CUDA = ("2.13.0", "https://files.pythonhosted.org/packages/x/torch-2.13.0-cp311-linux_x86_64.whl",
        ["nvidia-cudnn-cu12==9.1"])


def test_setup_keeps_a_cpu_build_and_says_where_it_comes_from(pip_says, capsys):
    pip_says("2.13.0+cpu", "file:///opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl",
             sources=["global.find-links=/opt/wheels"])
    assert setup_env.torch_choice("python", "c.txt", [], True) == ([], "torch")
    assert "torch 2.13.0+cpu from /opt/wheels (a file on this machine): a CPU build" in capsys.readouterr().out


def test_setup_takes_the_cpu_build_only_where_pip_uses_pypi_as_it_comes_and_the_index_answers(pip_says, capsys):
    pip_says(*CUDA)
    extra, requirement = setup_env.torch_choice("python", "c.txt", [], True)
    assert extra == ["--extra-index-url", setup_env.CPU_INDEX] and requirement == "torch==2.13.0+cpu"
    assert "a CUDA build, several GB" in capsys.readouterr().out


@pytest.mark.parametrize("case", ["own index", "index unreachable", "PIP_ARGS given"])
def test_setup_never_overrides_a_mirror_and_says_exactly_how_to_take_the_cpu_build(pip_says, capsys, case):
    pip_says(*CUDA, sources=["global.index-url=https://mirror.example/simple"] if case == "own index" else (),
             reachable=case != "index unreachable")
    pip_args = ["--no-cache-dir"] if case == "PIP_ARGS given" else []
    assert setup_env.torch_choice("python", "c.txt", pip_args, True) == ([], "torch")
    said = capsys.readouterr().out
    assert "CUDA build" in said and setup_env.HOW_TO_CPU in said, said


def test_setup_changes_nothing_with_a_gpu_or_off_linux(pip_says, capsys):
    pip_says(*CUDA)
    assert setup_env.torch_choice("python", "c.txt", [], False) == ([], "torch")
    assert "CPU index" not in capsys.readouterr().out


def test_setup_goes_on_as_configured_when_pip_cannot_be_asked(monkeypatch, capsys):
    def fail(*a):
        raise RuntimeError("no --dry-run in this pip")
    monkeypatch.setattr(setup_env, "resolve_torch", fail)
    assert setup_env.torch_choice("python", "c.txt", [], True) == ([], "torch")
    assert setup_env.HOW_TO_CPU in capsys.readouterr().out


def test_the_users_pip_sources_are_read_from_the_environment_and_pips_configuration(tmp_path):
    config = tmp_path / "pip.conf"
    config.write_text("[global]\nextra-index-url = https://mirror.example/simple\ntimeout = 60\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=str(config), PIP_FIND_LINKS="/somewhere")
    found = setup_env.pip_sources(sys.executable, env)
    assert "PIP_FIND_LINKS=/somewhere" in found
    assert any("extra-index-url" in f and "mirror.example" in f for f in found), found
    assert not any("timeout" in f for f in found)

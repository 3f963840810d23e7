"""Set up the course's environment in .venv/ (what `make setup`, and so `make lab` and `make test`,
run the first time): one printed line per stage, pip's own progress bar for torch, the one big
download.

    python3 tools/setup_env.py [--venv .venv] [--pip-args "..."]

Stages: (1) the virtual environment, (2) pip brought up to date, (3) torch, (4) zerolab with the
pinned versions of everything else (constraints.txt), (5) the course's Jupyter kernel.

torch on Linux without an NVIDIA GPU. PyPI's torch for Linux is a CUDA build of several GB; the
course needs only the CPU build (about 200 MB). Before anything is downloaded this says which
case the machine is in, then asks pip which torch it *would* install (a dry run: no wheel is
downloaded) and:
- a CPU build (a local wheel, a mirror that serves one, PIP_ARGS that name PyTorch's CPU index):
  installs it, saying from where;
- PyPI's CUDA build, with pip using PyPI as it comes (no index, extra index or find-links of the
  user's own) and PyTorch's CPU index reachable: installs torch's CPU build from that index instead;
- otherwise (pip configured with its own index or mirror, which may not reach PyTorch's, or the CPU
  index unreachable): changes nothing, and says exactly how to take the CPU build.
Only the standard library: this runs on the system's Python, before the environment exists.
"""
import argparse
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
PIP_SOURCE_KEYS = ("index-url", "extra-index-url", "find-links", "no-index")
HOW_TO_CPU = f'make setup PIP_ARGS="--extra-index-url {CPU_INDEX}"'
MIN_PYTHON = (3, 10)


def say(text):
    print(f"[setup] {text}", flush=True)


def nvidia_gpu():
    """Why we think this machine has an NVIDIA GPU (a string), or None."""
    for path in ("/proc/driver/nvidia/version", "/dev/nvidia0", "/usr/lib/wsl/lib/nvidia-smi"):
        if os.path.exists(path):
            return path
    return shutil.which("nvidia-smi")


def pip_sources(python, env=None):
    """Where the user's pip configuration points pip besides plain PyPI: a list of 'key=value'
    (environment variables PIP_INDEX_URL, ... and `pip config list`); empty for pip as it comes."""
    env = os.environ if env is None else env
    found = [f"{k}={env[k]}" for k in ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "PIP_NO_INDEX")
             if env.get(k)]
    try:
        listed = subprocess.run([python, "-m", "pip", "config", "list"], capture_output=True, text=True,
                                timeout=60, env=env).stdout
    except (OSError, subprocess.SubprocessError):
        listed = ""
    for line in listed.splitlines():
        key = line.split("=", 1)[0]
        if key.split(".")[-1] in PIP_SOURCE_KEYS and not key.startswith(":env:"):
            found.append(line.strip())
    return found


def is_cuda_build(version, requires):
    """A torch distribution built for CUDA: a +cuXXX local version, or NVIDIA's runtime wheels among
    its requirements (PyPI's Linux wheels)."""
    local = version.partition("+")[2]
    return local.startswith("cu") or any(r.lower().startswith("nvidia-") for r in requires or ())


def resolve_torch(python, constraints, pip_args):
    """What `pip install torch` would take, without downloading the wheel: (version, url, requires)
    from pip's installation report, or raise RuntimeError saying why it could not be asked."""
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.json")
        cmd = [python, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--no-deps", "--quiet",
               "--report", report, "-c", constraints, *pip_args, "torch"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if done.returncode != 0 or not os.path.exists(report):
            lines = [l for l in (done.stderr or done.stdout).splitlines() if l.strip()]
            raise RuntimeError(lines[-1] if lines else f"pip exited with {done.returncode}")
        with open(report, encoding="utf-8") as f:
            item = json.load(f)["install"][0]
    meta = item.get("metadata", {})
    return meta.get("version", "?"), item.get("download_info", {}).get("url", "?"), meta.get("requires_dist", [])


def reachable(url, timeout=5.0):
    try:
        urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout).close()
        return True
    except Exception:
        return False


def where(url):
    if url.startswith("file://"):
        return os.path.dirname(urllib.request.url2pathname(url[len("file://"):])) + " (a file on this machine)"
    return re.sub(r"^(\w+://[^/]+).*", r"\1", url)


def torch_choice(python, constraints, pip_args, linux_without_gpu):
    """(extra pip arguments, requirement) for the torch stage, after saying what will be installed."""
    try:
        version, url, requires = resolve_torch(python, constraints, pip_args)
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        say(f"torch: could not ask pip which build it would install ({exc}); installing as pip is "
            f"configured." + (f" For the CPU build: Ctrl-C, then {HOW_TO_CPU}" if linux_without_gpu else ""))
        return [], "torch"
    cuda = is_cuda_build(version, requires)
    kind = "a CUDA build, several GB" if cuda else "a CPU build" if linux_without_gpu or "+cpu" in version else "the default build"
    if not (linux_without_gpu and cuda):
        say(f"torch {version} from {where(url)}: {kind}")
        return [], "torch"
    if pip_args:
        say(f"torch {version} from {where(url)} is {kind}, as PIP_ARGS={shlex.join(pip_args)!r} asks; "
            f"for the CPU build: Ctrl-C, then {HOW_TO_CPU}")
        return [], "torch"
    own = pip_sources(python)
    if own:
        say(f"torch {version} from {where(url)} is {kind}. pip here uses its own sources ({'; '.join(own)}), "
            f"which set-up does not override (PyTorch's index may be unreachable from them). To take the "
            f"CPU build instead: Ctrl-C, then {HOW_TO_CPU}")
        return [], "torch"
    if not reachable(f"{CPU_INDEX}/torch/"):
        say(f"torch {version} from {where(url)} is {kind}, and PyTorch's CPU index ({CPU_INDEX}) does "
            f"not answer from here: installing it. To take the CPU build where that index answers: {HOW_TO_CPU}")
        return [], "torch"
    public = version.partition("+")[0]
    say(f"torch {version} from {where(url)} would be {kind}: taking torch {public}+cpu from {CPU_INDEX} "
        f"instead (any PIP_ARGS turns this choice off: pip then installs what they say)")
    return ["--extra-index-url", CPU_INDEX], f"torch=={public}+cpu"


def run(cmd, stage, quiet=False):
    done = subprocess.run(cmd, stdout=subprocess.PIPE if quiet else None, stderr=subprocess.STDOUT if quiet else None,
                          text=True)
    if done.returncode != 0:
        if quiet:
            print(done.stdout, file=sys.stderr)
        say(f"FAILED in stage {stage}: {shlex.join(cmd)} exited with {done.returncode}")
        sys.exit(done.returncode)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--venv", default=".venv")
    ap.add_argument("--pip-args", default="", help="extra pip options, one string (make's PIP_ARGS)")
    args = ap.parse_args(argv)
    if sys.version_info < MIN_PYTHON:
        say(f"zerolab needs Python >= {'.'.join(map(str, MIN_PYTHON))}, found {platform.python_version()} "
            f"({sys.executable}): run make with PYTHON=python3.11 (or any 3.10+)")
        return 1
    t0 = time.monotonic()
    pip_args = shlex.split(args.pip_args)
    constraints = os.path.join(REPO, "constraints.txt")
    python = os.path.join(args.venv, "bin", "python")
    linux_without_gpu = sys.platform.startswith("linux") and nvidia_gpu() is None
    if linux_without_gpu:     # before any download: this decides which torch is worth downloading
        say("Linux without an NVIDIA GPU (no nvidia-smi, no /proc/driver/nvidia): the course needs only "
            "torch's CPU build; set-up checks which build pip would install before downloading it")
    n_pins = sum(1 for l in open(constraints, encoding="utf-8") if l.strip() and not l.startswith("#"))

    if os.access(python, os.X_OK):
        say(f"1/5 virtual environment {args.venv}/ exists (Python {platform.python_version()} made it or an earlier one)")
    else:
        say(f"1/5 creating the virtual environment {args.venv}/ with Python {platform.python_version()} ({sys.executable})")
        made = subprocess.run([sys.executable, "-m", "venv", args.venv], capture_output=True, text=True)
        if made.returncode != 0:
            print(made.stdout + made.stderr, file=sys.stderr)
            shutil.rmtree(args.venv, ignore_errors=True)
            hint = (f"on Debian/Ubuntu install the venv module first: sudo apt install python3-venv "
                    f"(or python{sys.version_info.major}.{sys.version_info.minor}-venv)"
                    if "ensurepip" in made.stdout + made.stderr else "see pip's message above")
            say(f"FAILED to create {args.venv}/: {hint}")
            return 1
    say("2/5 pip, up to date")
    run([python, "-m", "pip", "install", "--quiet", "--upgrade", "pip"], 2)
    extra, requirement = torch_choice(python, constraints, pip_args, linux_without_gpu)
    say("3/5 torch (pip's progress below)")
    run([python, "-m", "pip", "install", "--progress-bar", "on", "-c", constraints, *pip_args, *extra,
         requirement], 3)
    say(f"4/5 zerolab and the pinned versions of everything else ({n_pins} pins in constraints.txt: "
        f"JupyterLab, Sphinx, pytest, ...)")
    run([python, "-m", "pip", "install", "--quiet", "-c", constraints, *pip_args, "-e", f"{REPO}[lab,test,site]"], 4)
    say('5/5 the Jupyter kernel "Python 3 (zerolab)"')
    run([python, "-m", "ipykernel", "install", "--sys-prefix", "--name", "python3",
         "--display-name", "Python 3 (zerolab)"], 5, quiet=True)
    say(f"done in {time.monotonic() - t0:.0f} s: {args.venv}/ is ready")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`make lab`, the README's first command, as a student runs it: JupyterLab starts on the course's
notebooks, as root too (in a container, typically), and sends the browser to lesson 00.
Plain HTTP: no browser needed."""
import pathlib
import secrets
import shutil
import subprocess
import sys
import urllib.request

import pytest

from helpers import free_port, jupyter_env, kill_tree, wait_for_jupyter

REPO = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.skipif(not (pathlib.Path(sys.prefix) / ".zerolab-installed").exists() or shutil.which("make") is None,
                    reason="needs make and the environment `make` set up (run through `make test`)")
def test_make_lab_serves_the_notebooks_and_opens_lesson_00(tmp_path):
    port, token = free_port(), secrets.token_hex(16)
    proc = subprocess.Popen(
        ["make", "--no-print-directory", "lab", f"PORT={port}", f"VENV={sys.prefix}",
         f"LAB_ARGS=--no-browser --ip=127.0.0.1 --IdentityProvider.token={token}"],
        cwd=REPO, env=jupyter_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for_jupyter(proc, base, token)              # fails with what make lab printed
        # the server's root is notebooks/: lesson 00 is at the top of its file browser
        with urllib.request.urlopen(f"{base}/api/contents/00_collectives.ipynb?content=0&token={token}") as r:
            assert r.status == 200
        # what the browser opens (and where "/" leads): lesson 00 in JupyterLab
        with urllib.request.urlopen(f"{base}/?token={token}") as r:
            assert r.status == 200 and r.geturl().startswith(f"{base}/lab/tree/00_collectives.ipynb"), r.geturl()
    finally:
        kill_tree(proc)

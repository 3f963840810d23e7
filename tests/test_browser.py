"""The lessons in JupyterLab, in a real (headless) browser, the way a student meets them.

Opt-in: runs when Debian's chromium (or CHROMIUM=/path) and the playwright package are present
(.ci/run installs chromium; playwright comes with the test extras; no browser is downloaded).
Screenshots of failures go to test-artifacts/browser/.
"""
import os
import pathlib
import secrets
import shutil
import subprocess
import sys
import time

import pytest

from helpers import free_port, jupyter_env, kill_tree, wait_for_jupyter

REPO = pathlib.Path(__file__).resolve().parent.parent
ARTIFACTS = REPO / "test-artifacts" / "browser"
CHROMIUM = os.environ.get("CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
playwright = pytest.importorskip("playwright.sync_api")
pytestmark = [pytest.mark.browser,
              pytest.mark.skipif(CHROMIUM is None, reason="no chromium on this machine")]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """JupyterLab started as `make lab` starts it, on a free port with a token and no browser."""
    port, token = free_port(), secrets.token_hex(16)
    home = tmp_path_factory.mktemp("jupyter")
    settings = home / "settings" / "@jupyterlab" / "apputils-extension"
    settings.mkdir(parents=True)
    (settings / "notification.jupyterlab-settings").write_text('{"fetchNews": "false", "checkForUpdates": false}')
    # Every cell in the page (no virtual scrolling), so "no cell is still running" can be checked.
    nb_settings = home / "settings" / "@jupyterlab" / "notebook-extension"
    nb_settings.mkdir(parents=True)
    (nb_settings / "tracker.jupyterlab-settings").write_text('{"windowingMode": "none"}')
    proc = subprocess.Popen(
        [sys.executable, "-m", "jupyter", "lab", "--no-browser", f"--port={port}", "--ip=127.0.0.1",
         f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={REPO / 'notebooks'}",
         "--ServerApp.allow_root=True"],
        env=jupyter_env(home), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for_jupyter(proc, base, token)
        yield base, token
    finally:
        kill_tree(proc)


@pytest.fixture
def page(lab, request):
    from playwright.sync_api import sync_playwright
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync"])
        pg = browser.new_page(viewport={"width": 1400, "height": 1000})
        try:
            yield pg
        finally:
            if getattr(request.node, "rep_call", None) is None or request.node.rep_call.failed:
                ARTIFACTS.mkdir(parents=True, exist_ok=True)
                try:
                    pg.screenshot(path=str(ARTIFACTS / f"{request.node.name}.png"), full_page=True)
                except Exception:
                    pass
            browser.close()


def _open(page, lab, name):
    base, token = lab
    page.goto(f"{base}/lab/tree/{name}?token={token}&reset")
    page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=90_000)
    page.wait_for_timeout(1500)
    # JupyterLab may ask which kernel to start even for a notebook whose kernelspec exists. Accept
    # only if it offers the declared one ("Python 3", kernelspec python3): a missing or misnamed
    # kernelspec would preselect something else and fail here.
    dialog = page.locator(".jp-Dialog")
    if dialog.count() and "Select Kernel" in dialog.first.inner_text():
        offered = dialog.locator("select option:checked").first.inner_text()
        assert offered.startswith("Python 3"), f"{name}: JupyterLab offers kernel {offered!r}"
        dialog.locator("button", has_text="Select").first.click()
    page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=90_000)


def _run_all(page, timeout_s):
    page.click(".lm-MenuBar-itemLabel:text-is('Run')", timeout=30_000)      # the Run menu
    page.click(".lm-Menu-itemLabel:text-is('Run All Cells')", timeout=30_000)
    page.wait_for_timeout(1000)
    deadline = time.monotonic() + timeout_s
    n_code = page.locator(".jp-CodeCell").count()
    while time.monotonic() < deadline:  # done: idle, and every code cell has a fresh number
        busy = page.locator(".jp-InputPrompt", has_text="[*]").count()
        idle = page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']").count()
        done = page.locator(".jp-CodeCell .jp-InputPrompt", has_text="]").count()
        if busy == 0 and idle and done >= n_code:
            break
        page.wait_for_timeout(1000)
    else:
        raise AssertionError(f"cells still running after {timeout_s} s")
    errors = page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']",
                          has_text="Traceback").count()
    assert errors == 0, "a cell raised an exception in JupyterLab"


def test_every_notebook_opens_without_errors(page, lab):
    for nb in sorted((REPO / "notebooks").glob("*.ipynb")):
        _open(page, lab, nb.name)
        dialogs = page.locator(".jp-Dialog")
        assert dialogs.count() == 0, f"{nb.name}: a dialog opened: {dialogs.first.inner_text()[:200]}"
        # the notebook's declared kernelspec (python3) must start: the toolbar then names it
        name = page.locator(".jp-Toolbar-kernelName:visible").first
        for _ in range(30):
            if "No Kernel" not in name.inner_text():
                break
            page.wait_for_timeout(1000)
        assert "Python 3" in name.inner_text(), f"{nb.name}: kernel is {name.inner_text()!r}"


def test_lesson_00_shows_per_rank_output(page, lab):
    _open(page, lab, "00_collectives.ipynb")
    _run_all(page, timeout_s=400)
    outputs = page.locator(".jp-OutputArea-output").all_inner_texts()
    text = "\n".join(outputs)
    for r in range(4):
        assert f"[rank {r}] I am rank {r} of 4" in text
    assert "Exercise 00: 0 / 21 points" in text  # the last cell ran too


def test_lesson_01_calculator_slider_redraws_the_chart(page, lab):
    nb = "01_memory_anatomy.ipynb"
    if not (REPO / "notebooks" / nb).exists():
        pytest.skip(f"{nb} not written yet")
    _open(page, lab, nb)
    _run_all(page, timeout_s=400)
    slider = page.locator(".widget-slider .noUi-handle, .widget-slider input[type='range']").first
    slider.scroll_into_view_if_needed()
    widget = page.locator(".jp-OutputArea-output", has=page.locator(".widget-slider")).first
    before = widget.locator("img").first.get_attribute("src")
    slider.focus()
    for _ in range(3):
        page.keyboard.press("ArrowRight")
    page.wait_for_timeout(3000)
    after = widget.locator("img").first.get_attribute("src")
    assert before and after and before != after, "moving the slider did not redraw the chart"

"""The lessons in JupyterLab, in a real (headless) browser, the way a student meets them: a quiet
first start on lesson 00, every lesson opening, lessons running, and a lesson's slide deck (RISE).

Opt-in: runs when Debian's chromium (or CHROMIUM=/path) and the playwright package are present
(.ci/run installs chromium; playwright comes with the test extras; no browser is downloaded).
JupyterLab is started by `make lab` itself when make and the environment `make` set up are there
(as under `make test`), so the configuration it installs is what is tested; the user settings
folder is a fresh temporary one. Screenshots of failures go to test-artifacts/browser/.
"""
import os
import pathlib
import secrets
import shutil
import subprocess
import sys
import json
import re
import time
import urllib.request

import pytest

from helpers import free_port, jupyter_env, kill_tree, wait_for_jupyter

REPO = pathlib.Path(__file__).resolve().parent.parent
ARTIFACTS = REPO / "test-artifacts" / "browser"
CHROMIUM = os.environ.get("CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
playwright = pytest.importorskip("playwright.sync_api")
pytestmark = [pytest.mark.browser,
              pytest.mark.skipif(CHROMIUM is None, reason="no chromium on this machine")]


MAKE_LAB = (pathlib.Path(sys.prefix) / ".zerolab-installed").exists() and shutil.which("make") is not None


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """JupyterLab as `make lab` starts it (through `make lab` when it can), on a free port with a
    token and no browser, with empty user settings: nothing here hides a pop-up."""
    port, token = free_port(), secrets.token_hex(16)
    home = tmp_path_factory.mktemp("jupyter")
    # Every cell in the page (no virtual scrolling), so "no cell is still running" can be checked.
    nb_settings = home / "settings" / "@jupyterlab" / "notebook-extension"
    nb_settings.mkdir(parents=True)
    (nb_settings / "tracker.jupyterlab-settings").write_text('{"windowingMode": "none"}')
    if MAKE_LAB:
        cmd = ["make", "--no-print-directory", "lab", f"PORT={port}", f"VENV={sys.prefix}",
               f"LAB_ARGS=--no-browser --ip=127.0.0.1 --IdentityProvider.token={token}"]
    else:
        cmd = [sys.executable, "-m", "jupyter", "lab", "--no-browser", f"--port={port}", "--ip=127.0.0.1",
               f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={REPO / 'notebooks'}",
               "--ServerApp.allow_root=True"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=jupyter_env(home), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
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


def test_first_start_is_quiet_on_lesson_00_with_the_zerolab_kernel(page, lab):
    """What a student sees after `make lab`: the browser opens the server's root; lesson 00 is open,
    its kernel "Python 3 (zerolab)" starts, and nothing asks anything: no news or update
    notification, no "build recommended", no kernel choice; no error in the console."""
    if not MAKE_LAB:
        pytest.skip("needs `make lab` and the environment `make setup` installs (run through `make test`)")
    base, token = lab
    errors = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(f"{base}/?token={token}")
    page.wait_for_url("**/lab/tree/00_collectives.ipynb*", timeout=60_000)
    page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=90_000)
    page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=90_000)
    # The toolbar shows "No Kernel" until the session's kernel has started: on a loaded machine that
    # can be after the indicator first reads idle. A kernel choice dialog is checked for below.
    from playwright.sync_api import expect
    expect(page.locator(".jp-Toolbar-kernelName:visible").first).to_have_text("Python 3 (zerolab)",
                                                                             timeout=90_000)
    page.wait_for_timeout(5000)           # the news question and the build check come after start-up
    tab = page.locator(".lm-DockPanel-tabBar .lm-TabBar-tab.lm-mod-current").first.inner_text()
    assert "00_collectives.ipynb" in tab, f"the open document is {tab!r}"
    dialogs = page.locator(".jp-Dialog")
    assert dialogs.count() == 0, f"a dialog opened: {dialogs.first.inner_text()[:200]}"
    toasts = page.locator(".Toastify__toast").all_inner_texts()
    assert not toasts, f"notifications shown: {toasts}"
    assert not errors, f"console errors: {errors}"


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
    assert re.search(r"Exercise 00: 0 / \d+ points", text), text[-500:]  # the last cell ran too


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


def _kernel_frames(ws, sent):
    """Record which kernel messages cross a JupyterLab kernel websocket (JSON or binary frames)."""
    def record(payload):
        data = payload.encode() if isinstance(payload, str) else payload
        for kind in (b"execute_request", b"execute_reply"):
            if kind in data:
                sent.append(kind.decode())
    ws.on("framesent", record)
    ws.on("framereceived", record)


def test_a_lessons_slide_deck_opens_advances_and_runs_a_cell(page, lab):
    """Lesson 00 as a RISE deck (jupyterlab-rise's /rise/ page, what its toolbar button opens): the
    title slide first, then the second slide of the deck tools/slides.py derived, and the title
    slide's setup cell runs on a kernel (an execute_request answered by an execute_reply)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("slides", REPO / "tools" / "slides.py")
    slides = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(slides)
    nb_path = REPO / "notebooks" / "00_collectives.ipynb"
    cells = json.loads(nb_path.read_text(encoding="utf-8"))["cells"]
    starts = [i for i, t in enumerate(slides.slide_types(cells)) if t in ("slide", "subslide")]

    def heading(index):
        return "".join(cells[index]["source"]).splitlines()[0].lstrip("# ").strip()

    base, token = lab
    frames = []
    page.on("websocket", lambda ws: _kernel_frames(ws, frames))
    page.goto(f"{base}/rise/{nb_path.name}?token={token}")
    present = page.locator(".reveal .slides section.present")
    page.wait_for_selector(".reveal .slides section.present .jp-Cell", timeout=90_000)
    page.wait_for_timeout(1000)
    assert heading(starts[0]).lower() in present.last.inner_text().lower(), "not on the title slide"
    first = page.evaluate("() => window.location.hash")

    page.keyboard.press("Space")                         # RISE's "next": the deck's second slide
    page.wait_for_function(f"() => window.location.hash !== {json.dumps(first)}", timeout=30_000)
    page.wait_for_timeout(500)
    assert heading(starts[1]).lower() in present.last.inner_text().lower(), (
        f"second slide shows {present.last.inner_text()[:200]!r}, expected {heading(starts[1])!r}")

    page.keyboard.press("Shift+Space")                   # RISE's "previous": back to the title slide
    page.wait_for_function(f"() => window.location.hash === {json.dumps(first)}", timeout=30_000)
    present.last.locator(".jp-CodeCell .jp-InputArea-editor").first.click()   # its setup cell: run it
    page.keyboard.press("Shift+Enter")
    deadline = time.monotonic() + 120
    while "execute_reply" not in frames and time.monotonic() < deadline:
        page.wait_for_timeout(500)
    assert "execute_request" in frames and "execute_reply" in frames, f"no cell ran: {frames}"
    with urllib.request.urlopen(f"{base}/api/sessions?token={token}") as r:
        sessions = json.load(r)
    assert any(s["path"].endswith(nb_path.name) and s["kernel"]["name"] == "python3" for s in sessions)

"""`make site`: the course as a static website (tools/build_site.py, site/conf.py, tools/check_site.py).

The real site, both editions (English, and Chinese under zh/), is built once (about 30 s of CPU time;
from 28 s to 2 minutes measured on 2 cores shared with other jobs) with every proxy pointed at a
closed port, so a build that reached for the network would fail. Every page of both editions carries
a language switch that leads to the same page in the other edition (or to its landing page where
there is none); a small course proves that a switch to a missing page fails the build. Small
throw-away courses prove that the build fails on a broken link or a missing image, and the link
checker is tested on hand-written pages. The built site is then read in headless Chromium (skipped
without chromium, like tests/test_browser.py): pages load with no console error and nothing fetched
from another host, every image of a lesson loads, math is typeset, "next" leads to the next lesson,
the switch keeps the page and the section, and the Chinese search finds Chinese words.
"""
import contextlib
import functools
import http.server
import importlib.util
import json
import os
import pathlib
import re
import shutil
import threading
from unittest import mock

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((REPO / "notebooks").glob("[0-9][0-9]*_*.ipynb"))   # 07b too
CHROMIUM = os.environ.get("CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
ARTIFACTS = REPO / "test-artifacts" / "site"
pytest.importorskip("myst_nb", reason="the site extra is not installed (make setup installs it)")


def _tool(name):
    spec = importlib.util.spec_from_file_location(name, REPO / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


build_site = _tool("build_site")
check_site = build_site.check_site
NO_NETWORK = {"HTTP_PROXY": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9",
              "http_proxy": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9", "NO_PROXY": "", "no_proxy": ""}


@pytest.fixture(scope="session")
def site(tmp_path_factory):
    work = tmp_path_factory.mktemp("site-work")
    with mock.patch.dict(os.environ, NO_NETWORK):
        return build_site.build(work / "out", work=work / "build")


def _html(site, rel):
    return (site / rel).read_text(encoding="utf-8")


def test_every_lesson_is_a_page_linked_from_the_landing_page(site):
    index = _html(site, "index.html")
    readme_title = (REPO / "README.md").read_text(encoding="utf-8").splitlines()[0][2:]
    assert readme_title.split(" — ")[0] in index and "Take the course" in index and "Teach it" in index
    assert "JupyterLab options" not in index, "the reference sections belong on the Reference page"
    reference = _html(site, "reference.html")
    for section in ("JupyterLab options", "Troubleshooting", "Checkpoints", "The code: modules and API"):
        assert section in reference, f"{section!r} is not on the Reference page"
    assert 'href="reference.html#troubleshooting"' in index, "README's #troubleshooting must lead there"
    for nb in NOTEBOOKS:
        assert (site / "notebooks" / f"{nb.stem}.html").is_file(), f"no page for {nb.name}"
        assert f'href="notebooks/{nb.stem}.html"' in index, f"the landing page does not link {nb.name}"
    assert 'href="exercises.html"' in index and 'href="benchmarks/RESULTS.html"' in index
    exercises = _html(site, "exercises.html")
    for ex in sorted((REPO / "exercises").glob("ex[0-9][0-9]_*.py")):
        assert ex.name in exercises
    assert (site / ".nojekyll").is_file(), "GitHub Pages would hide _static/ without .nojekyll"


def test_the_presenter_guides_and_both_licences_are_on_the_site(site):
    index = _html(site, "index.html")
    assert 'href="presenter/README.html"' in index
    for guide in sorted((REPO / "presenter").glob("*.md")):
        page = site / "presenter" / f"{guide.stem}.html"
        assert page.is_file(), f"no page for presenter/{guide.name}"
    assert "Slide notes" in _html(site, "presenter/03_zero1.html")
    assert "MIT License" in index and "CC BY 4.0" in index                    # the footer, every page
    assert "Creative Commons Attribution 4.0" in index                        # README's licence line
    assert (site / "AGENTS.html").is_file()


def test_lesson_pages_leave_out_the_presenter_notes_and_link_stubs_to_the_exercises_page(site):
    exercises = _html(site, "exercises.html")
    for nb in NOTEBOOKS:
        page = _html(site, f"notebooks/{nb.stem}.html")
        assert "Presenter notes" not in page, f"{nb.name}: the decks' notes are on the lesson page"
        number = nb.name.split("_")[0]
        stubs = sorted((REPO / "exercises").glob(f"ex{number}_*.py"))
        for stub in stubs:
            links = re.findall(r'href="\.\./exercises\.html#([^"]+)"', page)
            assert links, f"{nb.name}: its Exercises section does not link {stub.name} on the site"
            assert all(f'id="{anchor}"' in exercises for anchor in links)


def test_the_built_site_is_whole_and_needs_no_network(site):
    assert check_site.check(site) == []
    assert not list(site.rglob("*.ipynb")), "the site serves pages, not notebooks"


def test_a_lesson_page_has_navigation_contents_math_and_highlighted_code(site):
    page = _html(site, "notebooks/00_collectives.html")
    assert 'class="right-next"' in page and 'class="left-prev"' in page          # previous / next
    assert "bd-toc" in page and "#a-process-group" in page                      # this lesson's contents
    assert 'class="math notranslate nohighlight"' in page                       # $...$ became math
    assert '<script defer="defer" src="../_static/mathjax/tex-chtml.js' in page or \
           'src="../_static/mathjax/tex-chtml.js' in page                         # MathJax from the site
    assert '<span class="kn">import</span>' in page                             # Pygments ran
    assert page.count("<img") >= 5                                              # the committed figures


def test_the_calculator_widget_is_frozen_with_a_note(site):
    page = _html(site, "notebooks/01_memory_anatomy.html")
    assert "A frozen copy of an interactive widget" in page and "open this lesson in JupyterLab" in page
    assert "widget-view+json" not in page and "jupyter-widgets" not in page
    nb = json.loads((REPO / "notebooks" / "01_memory_anatomy.ipynb").read_text(encoding="utf-8"))
    state = nb["metadata"]["widgets"]["application/vnd.jupyter.widget-state+json"]["state"]
    labels = [m["state"]["description"] for m in state.values()
              if m["model_name"].endswith("SliderModel") or m["model_name"] == "BoundedIntTextModel"]
    assert labels and all(label in page for label in labels), "the controls' values are not shown"


# --- the Chinese edition and the language switch --------------------------------------------------

def _pages(root):
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*.html") if "_static" not in p.parts)


SWITCH = re.compile(r'<nav class="zerolab-language-switch"[^>]*>(.*?)</nav>', re.S)


def _switch(site, rel):
    """(the label shown as current, {label: the page the link leads to, relative to the site}) of a page."""
    found = SWITCH.findall(_html(site, rel))
    assert len(found) == 1, f"{rel}: {len(found)} language switches"
    current = re.findall(r"<strong[^>]*>([^<]+)</strong>", found[0])
    links = {label: (site / rel).parent.joinpath(href).resolve().relative_to(site.resolve()).as_posix()
             for href, label in re.findall(r'<a href="([^"#]+)"[^>]*>([^<]+)</a>', found[0])}
    return current, links


def test_the_chinese_edition_has_every_lesson_in_chinese_and_sphinx_speaks_chinese(site):
    zh = site / "zh"
    index = _html(site, "zh/index.html")
    title = (REPO / "README.zh-CN.md").read_text(encoding="utf-8").splitlines()[0][2:]
    assert '<html lang="zh-CN"' in index and title.split(" —— ")[-1] in index
    assert '<html lang="en"' in _html(site, "index.html")
    assert "上一页" in _html(site, "zh/notebooks/01_memory_anatomy.html")        # Sphinx's own words, in Chinese
    assert "下一页" in _html(site, "zh/notebooks/01_memory_anatomy.html")
    built = build_site.i18n
    for nb in NOTEBOOKS:
        page = zh / "notebooks" / f"{nb.stem}.html"
        assert page.is_file(), f"no Chinese page for {nb.name}"
        assert f'href="notebooks/{nb.stem}.html"' in index, f"the Chinese landing page does not link {nb.name}"
        po = built.po_path(nb.stem)
        if po.is_file():      # the lesson's title, as translated
            english = built.read_notebook(nb)
            first = built.build_notebook(english, built.load_catalog(po), nb.stem)["cells"][0]
            heading = built.source(first).splitlines()[0].lstrip("# ").split("——")[0].strip()
            assert heading in page.read_text(encoding="utf-8"), f"{nb.name}: {heading!r} is not on its Chinese page"
    assert "第 00 课" in _html(site, "zh/notebooks/00_collectives.html")
    assert "Presenter notes" not in _html(site, "zh/notebooks/03_zero1.html")
    exercises = _html(site, "zh/exercises.html")
    for ex in sorted((REPO / "exercises").glob("ex[0-9][0-9]_*.py")):
        assert ex.name in exercises
    for guide in sorted((REPO / "presenter").glob("*.md")):
        assert (zh / "presenter" / f"{guide.stem}.html").is_file(), f"no Chinese-site page for presenter/{guide.name}"
    assert (zh / "benchmarks" / "RESULTS.html").is_file() and 'href="exercises.html"' in index
    assert 'href="../reference.html"' in index, "the Chinese landing page leads to the English reference"
    assert "交互控件的静态快照" in _html(site, "zh/notebooks/01_memory_anatomy.html")  # the frozen calculator


def test_every_page_of_both_editions_switches_to_the_same_page_in_the_other(site):
    """English / 中文 on every page, the current one in bold, the other a link to this same page
    in the other edition, or to its landing page where there is no such page."""
    english, chinese = _pages(site), _pages(site / "zh")
    english = [p for p in english if not p.startswith("zh/")]
    assert len(english) > 30 and len(chinese) > 30
    fallbacks = []
    for rel in english:
        current, links = _switch(site, rel)
        assert current == ["English"], rel
        expected = f"zh/{rel}" if rel in chinese else "zh/index.html"
        assert links == {"中文": expected}, f"{rel}: {links}"
        assert (site / expected).is_file()
        if rel not in chinese:
            fallbacks.append(rel)
    for rel in chinese:
        current, links = _switch(site, f"zh/{rel}")
        assert current == ["中文"], rel
        expected = rel if rel in english else "index.html"
        assert links == {"English": expected}, f"zh/{rel}: {links}"
    assert set(fallbacks) >= {"reference.html", "CHANGELOG.html", "AGENTS.html"}, fallbacks
    for nb in NOTEBOOKS:                              # every lesson has its counterpart
        assert f"notebooks/{nb.stem}.html" not in fallbacks


def _search_terms(root):
    text = (root / "searchindex.js").read_text(encoding="utf-8")
    index = json.loads(text[text.index("(") + 1:text.rindex(")")])
    return set(index["terms"])


def test_the_chinese_search_index_holds_chinese_words(site):
    """Sphinx's Chinese search cuts the text into words with jieba: without it the index would hold
    only the Latin words, and a search for 分片 would find nothing."""
    terms = _search_terms(site / "zh")
    assert {"分片", "并行", "梯度", "显存"} <= terms, sorted(t for t in terms if not t.isascii())[:20]
    assert "all" in terms or "gather" in terms                  # the Latin words too


def test_a_translated_lesson_keeps_the_english_anchors(site):
    """The translations keep their links' English targets (#a-process-group, 05_zero3.ipynb#...):
    the Chinese headings carry the English anchors, so those links work and the switch keeps the
    reader's section."""
    for nb in NOTEBOOKS:
        english = _html(site, f"notebooks/{nb.stem}.html")
        chinese = _html(site, f"zh/notebooks/{nb.stem}.html")
        toc = english.split('id="pst-page-navigation-heading', 1)[-1]
        anchors = sorted(set(re.findall(r'class="reference internal nav-link" href="#([^"]+)"', toc)))
        assert anchors, f"{nb.name}: no table of contents"
        missing = [a for a in anchors if f'id="{a}"' not in chinese]
        assert not missing, f"{nb.name}: the Chinese page has no anchor {missing[:5]}"
    assert 'onclick="this.hash = location.hash"' in _html(site, "notebooks/00_collectives.html")


# --- the build fails on broken content: small courses built from scratch ------------------------

TINY_README = """# Tiny course

What it is.

## Take the course

`make lab`

## Teach it

With the slides.

## The lessons

| # | lesson | you will measure |
|---|---|---|
| 00 | tiny | nothing |

## Exercises and grading

Stubs.
"""


def _tiny_course(root, markdown):
    (root / "notebooks").mkdir(parents=True)
    (root / "exercises").mkdir()
    (root / "benchmarks").mkdir()
    (root / "README.md").write_text(TINY_README)
    (root / "exercises" / "ex00_tiny.py").write_text("def f():\n    raise NotImplementedError\n")
    (root / "benchmarks" / "RESULTS.md").write_text("# Benchmark results\n\nNone.\n")
    (root / "CHANGELOG.md").write_text("# Changelog\n\nNone yet.\n")
    nb = {"cells": [{"cell_type": "markdown", "id": "c0", "metadata": {}, "source": markdown}],
          "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    (root / "notebooks" / "00_tiny.ipynb").write_text(json.dumps(nb))
    return root


GOOD = "# Lesson 00 — tiny\n\n$x^2$, [the results](../benchmarks/RESULTS.md), [exercises](../exercises.md)\n"


def test_the_build_fails_on_a_broken_link_or_a_missing_image(tmp_path):
    """One small course builds (the control); the same course with a link to a missing lesson, a
    missing image and a raw-HTML image that Sphinx does not check fails, naming all three."""
    good = _tiny_course(tmp_path / "good", GOOD)
    out = build_site.build(tmp_path / "out", repo=good, work=tmp_path / "work-good", jobs="1")
    assert (out / "notebooks" / "00_tiny.html").is_file()

    broken = _tiny_course(tmp_path / "broken", GOOD + "\n[lesson 01](01_missing.ipynb)\n\n"
                          "![a figure](missing.png)\n\n<img src=\"gone.png\" alt=\"raw HTML\">\n")
    with pytest.raises(build_site.SiteError) as failure:
        build_site.build(tmp_path / "out2", repo=broken, work=tmp_path / "work-broken", jobs="1")
    message = str(failure.value)
    assert "01_missing" in message                        # Sphinx: a link to no document
    assert "missing.png" in message                       # Sphinx: an image that is not there
    assert "gone.png'> is missing" in message             # check_site: raw HTML Sphinx never looks at
    assert not (tmp_path / "out2").exists(), "a failed build must not leave a site behind"


TINY_README_ZH = """# 小课程

[English](README.md) · 中文

## 课程

| # | 课程 | 内容 |
|---|---|---|
| 00 | 小 | 无 |
"""


def test_a_switch_to_a_missing_page_fails_the_build(tmp_path):
    """A small course with a Chinese edition builds (the control: its lesson's switch leads to the
    lesson in the other language, its Reference page's to the Chinese landing page). A switch that
    leads to a page the other edition lacks (its page list wrong: here the Chinese edition claims a
    Reference page) fails the build, naming the page and the link; and the link check finds a
    switch whose target page is gone."""
    course = _tiny_course(tmp_path / "zh-course", GOOD)
    (course / "README.zh-CN.md").write_text(TINY_README_ZH, encoding="utf-8")
    readme = (course / "README.md").read_text()        # README's own link to the Chinese README
    (course / "README.md").write_text(readme.replace("What it is.", "What it is. [中文](README.zh-CN.md)"))
    out = build_site.build(tmp_path / "out", repo=course, work=tmp_path / "work", jobs="1")
    assert '<a href="zh/index.html">中文</a>' in _html(out, "index.html")
    assert '<a href="../index.html">English</a> · 中文' in _html(out, "zh/index.html")
    assert _switch(out, "notebooks/00_tiny.html")[1] == {"中文": "zh/notebooks/00_tiny.html"}
    assert _switch(out, "zh/notebooks/00_tiny.html")[1] == {"English": "notebooks/00_tiny.html"}
    assert _switch(out, "reference.html")[1] == {"中文": "zh/index.html"}
    assert check_site.check(out) == []
    (out / "zh" / "notebooks" / "00_tiny.html").unlink()
    problems = check_site.check(out)
    assert "notebooks/00_tiny.html: <a href='../zh/notebooks/00_tiny.html'> is missing" in problems, problems

    real = build_site.pages
    with mock.patch.object(build_site, "pages", lambda staged: sorted(set(real(staged)) | {"reference"})), \
            pytest.raises(build_site.SiteError) as failure:
        build_site.build(tmp_path / "out2", repo=course, work=tmp_path / "work2", jobs="1")
    assert "reference.html: <a href='zh/reference.html'> is missing" in str(failure.value)
    assert not (tmp_path / "out2").exists()


def test_check_site_finds_broken_links_anchors_and_network_loads(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "style.css").write_text("@font-face { src: url(fonts/gone.woff2); }\n"
                                        "body { background: url('https://cdn.example.org/bg.png'); }\n")
    (tmp_path / "sub" / "page.html").write_text('<h1 id="top">Page</h1><a href="../index.html#intro">up</a>')
    (tmp_path / "index.html").write_text(
        '<html><head><link rel="stylesheet" href="style.css">'
        '<script src="https://cdn.example.org/lib.js"></script></head><body id="intro">'
        '<a href="sub/page.html#top">ok</a> <a href="sub/page.html#nowhere">bad anchor</a>'
        '<a href="gone.html">gone</a> <img src="sub/missing.png"> <a href="#intro">self</a>'
        '<a href="https://arxiv.org/abs/1910.02054">a paper: a link, not a load</a>'
        '<img src="data:image/png;base64,iVBOR"></body></html>')
    problems = "\n".join(check_site.check(tmp_path))
    for expected in ["lib.js'> loads from the network", "no id 'nowhere' in sub/page.html", "gone.html'> is missing",
                     "sub/missing.png'> is missing", "fonts/gone.woff2) is missing", "bg.png) loads from the network"]:
        assert expected in problems, f"not reported: {expected}\n{problems}"
    assert "arxiv" not in problems and "#top" not in problems and "data:" not in problems
    assert len(check_site.check(tmp_path)) == 6


# --- the built site in a browser -----------------------------------------------------------------

@contextlib.contextmanager
def _serve(root):
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def _images_loaded(page):
    """[(src, naturalWidth)] of every image of the page, each made to load now (not lazily)."""
    return page.evaluate("""async () => {
        const out = [];
        for (const img of document.images) {
            img.loading = 'eager';
            try { await img.decode(); } catch (e) {}
            out.push([img.getAttribute('src'), img.naturalWidth]);
        }
        return out;
    }""")


@pytest.mark.browser
@pytest.mark.skipif(CHROMIUM is None, reason="no chromium on this machine")
def test_the_site_in_a_browser_landing_lesson_images_math_and_next(site, request):
    sync_api = pytest.importorskip("playwright.sync_api")
    with _serve(site) as base, sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
            "--disable-component-update", "--disable-sync"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        errors, elsewhere = [], []
        page.on("console", lambda m: errors.append(f"{page.url}: {m.text}") if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(f"{page.url}: {e}"))
        page.on("requestfailed", lambda r: errors.append(f"{page.url}: failed {r.url}"))

        def only_this_site(route):
            if route.request.url.startswith(base) or route.request.url.startswith("data:"):
                route.continue_()
            else:
                elsewhere.append(route.request.url)
                route.abort()
        page.route("**/*", only_this_site)
        try:
            page.goto(f"{base}/index.html", wait_until="load")
            assert "zerolab" in page.title()
            page.wait_for_timeout(500)
            assert not errors, f"the landing page: {errors}"

            page.locator('article a[href="notebooks/00_collectives.html"]').first.click()
            page.wait_for_url("**/notebooks/00_collectives.html")
            page.wait_for_selector("mjx-container", timeout=30_000)        # MathJax typeset the math
            assert "Lesson 00" in page.locator("h1").first.inner_text()
            toc = page.locator(".bd-toc a").all_inner_texts()
            assert any("A process group" in t for t in toc), f"no table of contents: {toc}"
            images = _images_loaded(page)
            assert len(images) >= 5 and all(width > 0 for _, width in images), f"images not loaded: {images}"

            page.locator("a.right-next").first.click()                         # "next" at the page's end
            page.wait_for_url("**/notebooks/01_memory_anatomy.html")
            assert "Lesson 01" in page.locator("h1").first.inner_text()
            images = _images_loaded(page)
            assert images and all(width > 0 for _, width in images), f"images not loaded: {images}"
            page.wait_for_timeout(500)
            assert not errors, "\n".join(errors)
            assert not elsewhere, f"the site fetched from other hosts: {elsewhere}"
        except Exception:
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / f"{request.node.name}.png"), full_page=False)
            raise
        finally:
            browser.close()


@pytest.mark.browser
@pytest.mark.skipif(CHROMIUM is None, reason="no chromium on this machine")
def test_the_language_switch_and_the_chinese_search_in_a_browser(site, request):
    """On lesson 00 at a section, 中文 leads to the Chinese lesson 00 at the same section, English
    back; on the Reference page (English only) 中文 leads to the Chinese landing page; the Chinese
    search finds the lessons that speak of 分片 (sharding)."""
    sync_api = pytest.importorskip("playwright.sync_api")
    with _serve(site) as base, sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
            "--disable-component-update", "--disable-sync"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        errors = []
        page.on("pageerror", lambda e: errors.append(f"{page.url}: {e}"))
        # a request cut short because the test moved on to the next page (ERR_ABORTED) is no error
        page.on("requestfailed", lambda r: None if "ERR_ABORTED" in (r.failure or "") else
                errors.append(f"{page.url}: failed {r.url}: {r.failure}"))
        try:
            page.goto(f"{base}/notebooks/00_collectives.html#a-process-group", wait_until="load")
            page.locator(".zerolab-language-switch a", has_text="中文").click()
            page.wait_for_url("**/zh/notebooks/00_collectives.html#a-process-group")
            assert "第 00 课" in page.locator("h1").first.inner_text()
            assert page.evaluate("() => document.getElementById('a-process-group') !== null")
            assert page.evaluate("() => document.documentElement.lang") == "zh-CN"
            page.locator(".zerolab-language-switch a", has_text="English").click()
            page.wait_for_url("**/notebooks/00_collectives.html#a-process-group")
            assert "/zh/" not in page.url and "Lesson 00" in page.locator("h1").first.inner_text()

            page.goto(f"{base}/reference.html", wait_until="load")
            page.locator(".zerolab-language-switch a", has_text="中文").click()
            page.wait_for_url("**/zh/index.html")

            page.goto(f"{base}/zh/search.html?q=分片", wait_until="load")
            page.wait_for_selector("#search-results li", timeout=30_000)
            found = page.locator("#search-results li a").all_inner_texts()
            assert any("ZeRO" in t or "课" in t for t in found), found
            assert not errors, "\n".join(errors)
        except Exception:
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / f"{request.node.name}.png"), full_page=False)
            raise
        finally:
            browser.close()


@pytest.mark.browser
@pytest.mark.skipif(CHROMIUM is None, reason="no chromium on this machine")
def test_a_wide_output_shows_that_it_goes_on(site, request):
    """Lessons print tables up to ~330 characters wide: they scroll inside their box. Where scrollbars
    are hidden until one scrolls (macOS, phones, and headless Chromium, used here), the box must still
    show that the text goes on: a shadow at the edge where more text is, and none at an edge reached.
    Read from the pixels of the box's top padding (no text there), on every lesson page."""
    sync_api = pytest.importorskip("playwright.sync_api")
    import io
    from PIL import Image

    def edges(page, index):
        box = page.locator("div.cell_output pre").nth(index)
        box.scroll_into_view_if_needed()
        shot = Image.open(io.BytesIO(box.screenshot())).convert("L")
        w = shot.size[0]
        return shot.getpixel((2, 3)), shot.getpixel((w // 2, 3)), shot.getpixel((w - 3, 3))

    with _serve(site) as base, sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
            "--disable-component-update", "--disable-sync"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        try:
            checked = 0
            for nb in NOTEBOOKS:
                page.goto(f"{base}/notebooks/{nb.stem}.html", wait_until="load")
                wide = page.evaluate("""() => [...document.querySelectorAll('div.cell_output pre')]
                    .map((p, i) => [i, p.scrollWidth - p.clientWidth]).filter(([i, extra]) => extra > 40)""")
                if not wide:
                    continue
                index = wide[0][0]
                left, middle, right = edges(page, index)
                assert right < middle - 8 and abs(left - middle) <= 2, (
                    f"{nb.name}: a wide output's right edge shows no shadow (left, middle, right: "
                    f"{left}, {middle}, {right})")
                page.evaluate(f"() => {{ const p = document.querySelectorAll('div.cell_output pre')[{index}]; "
                              f"p.scrollLeft = p.scrollWidth; }}")
                left, middle, right = edges(page, index)
                assert left < middle - 8 and abs(right - middle) <= 2, (
                    f"{nb.name}: scrolled to its end, the shadow should move to the left edge "
                    f"(left, middle, right: {left}, {middle}, {right})")
                checked += 1
            assert checked >= 5, f"only {checked} lesson(s) with a wide output: this test checks little"
        except Exception:
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / f"{request.node.name}.png"), full_page=False)
            raise
        finally:
            browser.close()

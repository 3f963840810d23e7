"""Sphinx configuration of the course website (`make site`, tools/build_site.py).

The sources are staged by tools/build_site.py into build/site/src (the committed notebooks as they
are, README's opening sections as the landing page, benchmarks/RESULTS.md, the exercise stubs); this
file only says how to render them. Nothing is executed and nothing is fetched: math is rendered by
MathJax 3 copied from the sphinx-mathjax-offline wheel, the theme ships its own fonts and scripts.

Two editions are built with this file: the English, and the Chinese (build_site.py runs it with
`-D language=zh_CN`, so Sphinx's and the theme's own words are Chinese). site/_ext/editions.py
gives every page its language switch (site/_templates/language-switch.html).
"""
import importlib.util
import pathlib
import shutil
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent / "_ext"))   # editions.py

project = "zerolab"
author = "the zerolab authors"
copyright = ("the zerolab authors. Code: MIT License; lessons' text and figures, guides and documentation: "
             "CC BY 4.0")

extensions = [
    "myst_nb",               # .ipynb and .md (MyST) pages; outputs as committed
    "sphinx.ext.mathjax",
    "sphinx.ext.githubpages",  # writes .nojekyll, so GitHub Pages serves _static/
    "editions",              # site/_ext/editions.py: the language switch, the Chinese edition's anchors
]
root_doc = "index"
exclude_patterns = ["**/.ipynb_checkpoints"]

# Notebooks: render the committed outputs, never execute (`make notebooks` is what executes).
nb_execution_mode = "off"
nb_merge_streams = True
nb_ipywidgets_js = {}          # no widget JavaScript from a CDN: build_site.py freezes widgets
myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence"]
myst_heading_anchors = 3       # [text](#heading) links inside a lesson
# RESULTS.md (written by `make bench`) goes from its title straight to ### tables: a style choice,
# not a broken page. Every other warning fails the build (-W).
suppress_warnings = ["myst.header"]

# Math, offline: MathJax 3.2.2 (the last 3.x release) from the sphinx-mathjax-offline wheel, a pinned
# data package. Its own Sphinx hook would copy all 24 MB of it; we copy the tex-chtml component and
# what it may load on demand (TeX extensions, fonts, menu, assistive MathML): about 4 MB.
mathjax_path = "mathjax/tex-chtml.js"
_MATHJAX = pathlib.Path(importlib.util.find_spec("sphinx-mathjax-offline").origin).parent / "static" / "mathjax"
_MATHJAX_FILES = ["tex-chtml.js", "input", "output/chtml", "ui", "a11y"]

html_theme = "sphinx_book_theme"
html_title = "zerolab"
html_favicon = "_static/favicon.svg"   # else the browser asks for /favicon.ico and logs a 404
html_static_path = ["_static"]     # zerolab.css, the favicon
templates_path = ["_templates"]    # language-switch.html
html_css_files = ["zerolab.css"]
html_context = {"default_mode": "light"}   # the figures have white backgrounds; the reader can switch
html_last_updated_fmt = None
html_copy_source = False       # no _sources/ copies of 300 kB notebooks
html_show_sourcelink = False
html_theme_options = {
    "home_page_in_toc": True,
    "show_navbar_depth": 1,
    "show_toc_level": 2,       # the per-lesson table of contents (right column): sections and subsections
    "use_download_button": False,
    "use_fullscreen_button": False,
    "navigation_with_keys": True,
    # the language switch at the top of every page, before the theme's own buttons
    "article_header_end": ["language-switch.html", "article-header-buttons.html"],
}


def _copy_mathjax(app, exc):
    if exc is not None or app.builder.format != "html":
        return
    dest = pathlib.Path(app.outdir) / "_static" / "mathjax"
    for rel in _MATHJAX_FILES:
        src = _MATHJAX / rel
        if src.is_dir():
            shutil.copytree(src, dest / rel, dirs_exist_ok=True)
        else:
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


def setup(app):
    app.connect("build-finished", _copy_mathjax)

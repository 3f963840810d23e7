"""Build the course website: every lesson as committed (outputs and figures as they are; nothing is
executed), README's opening sections as the landing page and the rest as a Reference page, the
exercises, the presenter guides and the benchmark results; and the Chinese edition under zh/: the
lessons `tools/i18n.py build` makes from i18n/zh_CN/*.po, README.zh-CN.md as its landing page, the
exercises, the presenter guides and the benchmark results (these two in English, as they are). Every
page of both editions has a language switch (English / 中文) that leads to the same page in the
other edition, or to its landing page where that page has no counterpart.

    python tools/build_site.py              # -> _site/ (what `make site` runs)
    python tools/build_site.py --out DIR

Three steps, each of which fails the build:
1. stage the sources in build/site/src, the repository's layout kept (so a link that works on
   GitHub, e.g. README's `benchmarks/RESULTS.md`, works on the site): the notebooks with their
   ipywidgets frozen to a static snapshot (see `freeze_widgets`) and their links to exercise stubs
   pointed at the exercises page, the landing page and the Reference page from README.md (its links
   to its own sections pointed at the page that holds each), an exercises page that includes the
   stubs, presenter/ as it is;
   The Chinese edition is staged the same way in build/site/src-zh (its headings keep the English
   anchors, so the translations' links, which keep the English targets, resolve), where the checkout
   has a README.zh-CN.md; each edition's sources carry `_edition.json`, the switch's table (see
   `edition`), which site/_ext/editions.py reads;
2. Sphinx + MyST-NB (site/conf.py) with -W --keep-going, once per edition (the two run side by side;
   the Chinese with `-D language=zh_CN`, so Sphinx's and the theme's own words are Chinese): any
   warning (a broken cross-reference, an unreadable image, a bad toctree entry) fails it; cells
   tagged `remove-cell` (the decks' presenter notes) are left out;
3. tools/check_site.py on the built HTML of both editions together: every internal link (the
   language switch's included), anchor, image, script and stylesheet resolves to a file of the
   site, and nothing is loaded from the network.
The output folder is a static site for GitHub Pages (with .nojekyll) or any web server.
"""
import argparse
import base64
import functools
import html
import json
import pathlib
import re
import shutil
import subprocess
import sys
import time

import nbformat

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import check_site  # noqa: E402  (tools/check_site.py, beside this file)
import i18n  # noqa: E402  (tools/i18n.py: builds the Chinese lessons)

REPO = pathlib.Path(__file__).resolve().parent.parent
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
# README sections shown on the landing page, in README's order (matched by the start of the heading);
# the text before the first section (what the course is) always comes first. Every other section but
# the exercises' makes the Reference page, in README's order.
LANDING_SECTIONS = ("Take the course", "Teach it", "The lessons")
EXERCISES_SECTION = "Exercises and grading"
# Files of the checkout the README links to, published as they are (downloads, not pages).
LINKED_FILES = ("LICENSE", "LICENSE-CC-BY-4.0")
# A lesson's link to its stub (../exercises/exNN_name.py: the student's copy in the lab, the file on
# GitHub) leads, on the site, to that stub on the exercises page.
STUB_LINK = re.compile(r"\]\(\.\./exercises/(ex\d\d[a-z]?_\w+\.py)\)")
WIDGET_NOTE = ("*A frozen copy of an interactive widget.* Its controls call Python, so they need a "
               "running kernel: open this lesson in JupyterLab (`make lab`) to use them. Below, the "
               "widget as it was when the lesson was executed: {controls}.")
WIDGET_NOTE_ZH = ("*交互控件的静态快照。* 控件要调用 Python，需要运行中的内核：在 JupyterLab 中打开这一课"
                  "（`make lab COURSE_LANG=zh`）才能使用。下面是执行这一课时控件的样子：{controls}。")
# The Chinese edition: its folder in the site, its landing page's source, Sphinx's language for it.
ZH_DIR = "zh"
ZH_README = "README.zh-CN.md"
ZH_LANGUAGE = "zh_CN"
EDITION_FILE = "_edition.json"     # staged beside each edition's sources; site/_ext/editions.py reads it


class SiteError(Exception):
    """The sources cannot make a correct site (the message says what to fix)."""


# ---------------------------------------------------------------------------------------------
# ipywidgets -> a static snapshot, from the widget state the notebook saved when it was executed
# ---------------------------------------------------------------------------------------------

def _control_value(state):
    """The value a control shows, as text (None for a model that is not a control)."""
    if "_options_labels" in state and state.get("index") is not None:
        return state["_options_labels"][state["index"]]
    if "value" not in state or state.get("_model_name", "").startswith(("HTML", "Label", "Image")):
        return None
    value = state["value"]
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float) and state.get("readout_format"):
        fmt = state["readout_format"]
        try:
            return format(value, fmt)
        except ValueError:
            return repr(value)
    return str(value)


def _snapshot(model_id, models, where):
    """Walk the widget tree from ``model_id`` in display order: a list of ("control", label, value),
    ("html", markup) and ("png", base64) items."""
    if model_id not in models:
        raise SiteError(f"{where}: widget {model_id} has no saved state; re-execute the notebook with "
                        f"widget state saved (`make notebooks` does)")
    model = models[model_id]
    state = model["state"]
    items = []
    if model["model_name"] == "ImageModel":
        buffers = {tuple(b["path"]): b for b in model.get("buffers", [])}
        data = buffers.get(("value",))
        if data is None or state.get("format") != "png":
            raise SiteError(f"{where}: image widget {model_id} without a saved PNG")
        items.append(("png", data["data"] if data.get("encoding") == "base64"
                      else base64.b64encode(bytes.fromhex(data["data"])).decode()))
    elif model["model_name"] in ("HTMLModel", "HTMLMathModel", "LabelModel"):
        if state.get("value"):
            markup = state["value"] if model["model_name"] != "LabelModel" else html.escape(state["value"])
            items.append(("html", markup))
    else:
        value = _control_value(state)
        if value is not None:
            items.append(("control", state.get("description") or "value", value))
    for child in state.get("children", []):
        items += _snapshot(child.removeprefix("IPY_MODEL_"), models, where)
    return items


def _snapshot_outputs(items, note=WIDGET_NOTE):
    """Notebook outputs for a snapshot: a note naming the controls' values, then the widget's HTML
    and images in their order (images as image/png outputs, so they become files of the site)."""
    controls = "; ".join(f"{label} = {value}" for kind, label, value in
                         (i for i in items if i[0] == "control"))
    outputs = [nbformat.v4.new_output("display_data", data={
        "text/markdown": note.format(controls=controls or "no controls"),
        "text/plain": "frozen widget"})]
    markup = []
    for item in items:
        if item[0] == "html":
            markup.append(item[1])
            continue
        if markup:
            outputs.append(nbformat.v4.new_output("display_data", data={
                "text/html": "\n".join(markup), "text/plain": "widget text"}))
            markup = []
        if item[0] == "png":
            outputs.append(nbformat.v4.new_output("display_data", data={
                "image/png": item[1], "text/plain": "widget image"}))
    if markup:
        outputs.append(nbformat.v4.new_output("display_data", data={
            "text/html": "\n".join(markup), "text/plain": "widget text"}))
    return outputs


def freeze_widgets(nb, where="notebook", note=WIDGET_NOTE):
    """Replace every ipywidgets output of ``nb`` by a static snapshot taken from the widget state
    saved in the notebook's metadata, and drop that state (nothing on the site loads widget
    JavaScript, which would come from a CDN, and a page without a kernel could not run the
    Python callbacks that redraw the figures anyway). Returns the number of widgets frozen."""
    models = nb.metadata.get("widgets", {}).get(WIDGET_STATE, {}).get("state", {})
    frozen = 0
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        outputs = []
        for out in cell.get("outputs", []):
            view = out.get("data", {}).get(WIDGET_VIEW)
            if view is None:
                outputs.append(out)
                continue
            outputs += _snapshot_outputs(_snapshot(view["model_id"], models, f"{where}, cell {index}"), note)
            frozen += 1
        cell.outputs = outputs
    nb.metadata.pop("widgets", None)
    return frozen


# ---------------------------------------------------------------------------------------------
# README -> landing page and exercises page
# ---------------------------------------------------------------------------------------------

def readme_sections(text):
    """(title, intro, {heading: section text including its heading line}) of a README."""
    lines = text.splitlines(keepends=True)
    if not lines or not lines[0].startswith("# "):
        raise SiteError("README.md must open with its '# ' title")
    title, sections, current, intro = lines[0], {}, None, []
    in_code = False
    for line in lines[1:]:
        if line.startswith("```"):
            in_code = not in_code
        if not in_code and line.startswith("## "):
            current = line[3:].strip()
            sections[current] = [line]
        elif current is None:
            intro.append(line)
        else:
            sections[current].append(line)
    return title, "".join(intro), {k: "".join(v) for k, v in sections.items()}


def _section(sections, start):
    found = [k for k in sections if k.startswith(start)]
    if len(found) != 1:
        raise SiteError(f"README.md: expected one '## {start}...' section, found {found or 'none'}")
    return sections[found[0]]


def link_lessons(table_text, notebooks):
    """In README's lesson table, link each lesson's name (second column) to its notebook."""
    by_number = {nb.name.split("_")[0]: nb.name for nb in notebooks}   # "07", "07b", ...

    def link(match):
        number, name = match.group(1), match.group(2).strip()
        if number not in by_number:
            raise SiteError(f"README.md lists lesson {number}, but there is no notebooks/{number}_*.ipynb")
        return f"| {number} | [{name}](notebooks/{by_number[number]}) |"
    return re.sub(r"^\| (\d\d[a-z]?) \|([^|]+)\|", link, table_text, flags=re.M)


def _slug(title):
    """The anchor MyST gives a heading (GitHub's rule), as README's own links use it."""
    from myst_parser.slugs import github_slugify
    return github_slugify(title)


def _relink(text, sections):
    """README's links to its own sections (#anchor), pointed at the site page that holds each."""
    where = {_slug(h): ("exercises.md" if h.startswith(EXERCISES_SECTION) else
                        "" if h.startswith(LANDING_SECTIONS) else "reference.md") for h in sections}

    def target(match):
        anchor = match.group(1)
        page = where.get(anchor)
        if page is None:
            raise SiteError(f"README.md links to #{anchor}, which is no section of it")
        if page == "exercises.md" and anchor == _slug(EXERCISES_SECTION):
            return "](exercises.md)"
        return f"]({page}#{anchor})"
    return re.sub(r"\]\(#([\w-]+)\)", target, text)


def landing_page(readme, notebooks, exercises, guides=()):
    title, intro, sections = readme_sections(readme)
    body = [title, _relink(intro, sections)]
    for start in LANDING_SECTIONS:
        text = _relink(_section(sections, start), sections)
        body.append(link_lessons(text, notebooks) if start == "The lessons" else text)
    body.append("## On this site\n\n"
                "* **The lessons**, one page each (sidebar, or the table above), as committed: the outputs "
                "and figures measured when each lesson was last executed. To run them, `make lab`.\n"
                f"* **[The exercises](exercises.md)**: the {len(exercises)} stubs you complete, and how they are graded.\n"
                + ("* **[The presenter guide](presenter/README.md)**: a 50-minute class, a 3-lecture sequence, "
                   "and notes for every slide of every lesson.\n" if guides else "") +
                "* **[Reference](reference.md)**: the code's modules and API, checkpoints, set-up, the slides, "
                "the website, troubleshooting.\n"
                "* **[Benchmark results](benchmarks/RESULTS.md)**: what `make bench` measured.\n\n")
    lessons = "\n".join(f"notebooks/{nb.stem}" for nb in notebooks)
    body.append(f"```{{toctree}}\n:hidden:\n:caption: Lessons\n\n{lessons}\n```\n\n")
    if guides:
        entries = "\n".join(f"presenter/{g.stem}" for g in guides)
        body.append(f"```{{toctree}}\n:hidden:\n:caption: Teach it\n\n{entries}\n```\n\n")
    more = "exercises\nreference\nbenchmarks/RESULTS\nCHANGELOG" + ("\nAGENTS" if "AGENTS.md" in readme else "")
    body.append(f"```{{toctree}}\n:hidden:\n:caption: More\n\n{more}\n```\n")
    return "".join(body)


def reference_page(readme):
    """Every README section that is neither on the landing page nor the exercises page's."""
    _, _, sections = readme_sections(readme)
    body = ["# Reference\n\nThe README's reference sections: the code, set-up in detail, the slides, "
            "the website, troubleshooting.\n\n"]
    for heading, text in sections.items():
        if not heading.startswith(LANDING_SECTIONS) and not heading.startswith(EXERCISES_SECTION):
            body.append(_relink(text, sections))
    return "".join(body)


def link_stubs(nb):
    """Point each markdown link to ../exercises/exNN_*.py at that stub on the exercises page."""
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            cell.source = STUB_LINK.sub(lambda m: f"](../exercises.md#{_slug(m.group(1))})", cell.source)


def exercises_page(readme, notebooks, exercises):
    _, _, sections = readme_sections(readme)
    intro = _relink(_section(sections, EXERCISES_SECTION).split("\n", 1)[1], sections)   # its own title dropped
    intro = intro.replace("](exercises.md#", "](#")
    lessons = {nb.name[:2]: nb for nb in notebooks}
    body = ["# Exercises\n", intro]
    for ex in exercises:
        number = ex.name[2:4]
        lesson = lessons.get(number)
        body.append(f"\n## {ex.name}\n\n")
        if lesson is not None:
            body.append(f"For [lesson {number}](notebooks/{lesson.name}); graded by its last cell or "
                        f"`make grade`.\n\n")
        body.append(f"```{{literalinclude}} exercises/{ex.name}\n:language: python\n```\n")
    return "".join(body)


# ---------------------------------------------------------------------------------------------
# build
# ---------------------------------------------------------------------------------------------

def _write(path, data):
    """Write only when the content changes (Sphinx then rebuilds only what changed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = data.encode() if isinstance(data, str) else data
    if not path.exists() or path.read_bytes() != data:
        path.write_bytes(data)


def english_sources(repo=REPO):
    """{relative path: content} of the English edition's sources, from the checkout ``repo``."""
    notebooks = sorted((repo / "notebooks").glob("[0-9][0-9]*_*.ipynb"))   # 07b_at_scale too
    exercises = sorted((repo / "exercises").glob("ex[0-9][0-9]_*.py"))
    if not notebooks:
        raise SiteError("no notebooks/NN_*.ipynb to publish")
    readme = (repo / "README.md").read_text(encoding="utf-8")
    if (repo / ZH_README).is_file():       # README's link to the Chinese README: the Chinese edition
        readme = cross_links(readme, "", {ZH_README: f"{ZH_DIR}/index.html"})
    guides = _guides(repo)
    staged = {}
    for path in notebooks:
        nb = nbformat.read(path, as_version=4)
        freeze_widgets(nb, where=f"notebooks/{path.name}")
        link_stubs(nb)
        staged[f"notebooks/{path.name}"] = nbformat.writes(nb)
    for path in exercises:
        staged[f"exercises/{path.name}"] = path.read_bytes()
    for path in guides:
        staged[f"presenter/{path.name}"] = path.read_bytes()
    staged["benchmarks/RESULTS.md"] = (repo / "benchmarks" / "RESULTS.md").read_bytes()
    staged["CHANGELOG.md"] = (repo / "CHANGELOG.md").read_bytes()     # README links to it
    for name in LINKED_FILES + ("AGENTS.md",):
        if (repo / name).is_file():
            staged[name] = (repo / name).read_bytes()
    staged["index.md"] = landing_page(readme, notebooks, exercises, guides)
    staged["reference.md"] = reference_page(readme)
    staged["exercises.md"] = exercises_page(readme, notebooks, exercises)
    return staged


def _guides(repo):
    return sorted((repo / "presenter").glob("*.md"), key=lambda g: (g.stem != "README", g.stem))


# ---------------------------------------------------------------------------------------------
# The Chinese edition
# ---------------------------------------------------------------------------------------------

# A markdown link (not an image) to a file of the checkout: [text](path) or [text](path#anchor).
MD_LINK = re.compile(r"(?<!!)\[([^\]]*)\]\(([^()\s#]+)(#[^()\s]*)?\)")


def cross_links(text, up, targets):
    """Point each markdown link to a checkout file named in ``targets`` ({path: page of the site,
    from the site's root}) at that page, as raw HTML (MyST checks a markdown link against this
    edition's own sources; the other edition's pages are checked by tools/check_site.py). ``up``
    leads from the page to the site's root. A target may be a callable of the link's #anchor."""
    def link(match):
        label, path, anchor = match.group(1), match.group(2), match.group(3) or ""
        if path not in targets:
            return match.group(0)
        page = targets[path]
        href = page(anchor) if callable(page) else page + anchor
        return f'<a href="{html.escape(up + href)}">{label}</a>'
    return MD_LINK.sub(link, text)


def _readme_page(english_readme):
    """README.md#anchor -> the English page that holds that section (README's own link rule)."""
    _, _, sections = readme_sections(english_readme)
    where = {_slug(h): ("exercises.html" if h.startswith(EXERCISES_SECTION) else
                        "index.html" if h.startswith(LANDING_SECTIONS) else "reference.html") for h in sections}

    def page(anchor):
        if not anchor:
            return "index.html"
        if anchor[1:] not in where:
            raise SiteError(f"{ZH_README} links to README.md{anchor}, which is no section of README.md")
        return where[anchor[1:]] + anchor
    return page


def zh_landing_page(readme, english_readme, notebooks, exercises, guides, english_only):
    """README.zh-CN.md, whole (it holds only the student-facing parts), its lessons linked, its
    links to English-only files pointed at the English edition, then what is on this site."""
    if not readme.startswith("# "):
        raise SiteError(f"{ZH_README} must open with its '# ' title")
    targets = {"README.md": _readme_page(english_readme)}
    targets.update({rel: rel.rsplit(".", 1)[0] + ".html" if rel.endswith(".md") else rel for rel in english_only})
    body = [link_lessons(cross_links(readme, "../", targets), notebooks).rstrip("\n") + "\n\n"]
    body.append("## 本站内容\n\n"
                "* **课程**，每课一页（见侧边栏或上面的课程表），内容与仓库中提交的版本一致：图表和输出是这一课"
                "上次执行时的实测结果。要自己运行，用 `make lab COURSE_LANG=zh`。\n"
                f"* **[练习](exercises.md)**：你要完成的 {len(exercises)} 个存根文件，以及它们怎样评分。\n"
                + ("* **[讲师指南](presenter/README.md)**（英文）：50 分钟的一堂课、三讲的安排，以及每一课每一张"
                   "幻灯片的讲稿。\n" if guides else "") +
                "* **[基准测试结果](benchmarks/RESULTS.md)**（英文）：`make bench` 的实测结果。\n"
                '* **<a href="../reference.html">参考</a>**（英文版）：代码的模块与 API、检查点、环境准备、'
                "幻灯片、网站、常见问题的完整列表。\n\n")
    lessons = "\n".join(f"notebooks/{nb.stem}" for nb in notebooks)
    body.append(f"```{{toctree}}\n:hidden:\n:caption: 课程\n\n{lessons}\n```\n\n")
    if guides:
        entries = "\n".join(f"presenter/{g.stem}" for g in guides)
        body.append(f"```{{toctree}}\n:hidden:\n:caption: 讲课（英文）\n\n{entries}\n```\n\n")
    body.append("```{toctree}\n:hidden:\n:caption: 更多\n\nexercises\nbenchmarks/RESULTS\n```\n")
    return "".join(body)


ZH_EXERCISES_INTRO = """每一课（07b 除外）都以“练习”一节结尾，要完成的代码就在下面这些存根文件里。`make lab COURSE_LANG=zh` \
打开的是你自己的副本：`mywork-zh/exercises/exNN_*.py`。每个存根的 docstring 就是契约：说明要做什么、评什么，\
而不说怎么做。写好答案并保存后，运行那一课的最后一个单元格，或在终端运行 `make grade COURSE_LANG=zh`：\
每个被评判的性质一行 PASS 或 FAIL，并给出得分。存根与英文版是同一份文件，所以代码和 docstring 保持英文；\
评分程序的提示信息也是英文。评分怎样进行、每个测试检查什么，见英文版的<a href="../exercises.html">练习页</a>。
"""


def zh_exercises_page(notebooks, exercises):
    lessons = {nb.name[:2]: nb for nb in notebooks}
    body = ["# 练习\n\n", ZH_EXERCISES_INTRO]
    for ex in exercises:
        number = ex.name[2:4]
        lesson = lessons.get(number)
        body.append(f"\n## {ex.name}\n\n")
        if lesson is not None:
            body.append(f"对应[第 {number} 课](notebooks/{lesson.name})；由这一课的最后一个单元格或 "
                        f"`make grade COURSE_LANG=zh` 评分。\n\n")
        body.append(f"```{{literalinclude}} exercises/{ex.name}\n:language: python\n```\n")
    return "".join(body)


@functools.cache
def _myst_parser():
    """MyST's markdown parser, with the extensions site/conf.py enables (myst_enable_extensions)."""
    from markdown_it.renderer import RendererHTML
    from myst_parser.config.main import MdParserConfig
    from myst_parser.parsers.mdit import create_md_parser
    return create_md_parser(MdParserConfig(enable_extensions={"dollarmath", "amsmath", "colon_fence"}),
                            RendererHTML)


def _heading_titles(markdown, kinds=("text", "code_inline")):
    """The titles MyST makes anchors of (levels 1-3, site/conf.py's myst_heading_anchors), as MyST
    gives them to its slug function: the heading's text and inline code, in order (with
    ``math_inline`` in ``kinds`` too: the text docutils makes the section's id of)."""
    tokens = _myst_parser().parse(markdown)
    return ["".join(child.content for child in tokens[i + 1].children or []
                    if child.type in kinds)
            for i, token in enumerate(tokens) if token.type == "heading_open" and int(token.tag[1:]) <= 3]


def english_anchors(pairs):
    """{"slugs": {Chinese heading title: the English heading's anchor}, "ids": {that anchor: the id
    docutils gives the English section, which the English page's contents link to}}, from (English notebook, Chinese
    notebook) pairs, cell by cell (the translation keeps each cell's sequence of headings: the gate
    checks it). The Chinese site gives each translated heading its English anchor, so the links the
    translations keep ([...](#a-process-group), [...](05_zero3.ipynb#...)) resolve, and a section's
    address is the same in both editions. A title translated from two different English titles is
    left out (its heading gets an anchor of its own). The Chinese section gets the English id too, so
    the switch keeps the section a reader chose in the English contents."""
    from docutils.nodes import fully_normalize_name, make_id
    from myst_parser.slugs import github_slugify
    table, ambiguous, ids = {}, set(), {}
    for english, chinese in pairs:
        for a, b in zip(english["cells"], chinese["cells"]):
            if a["cell_type"] != "markdown" or a.get("source") == b.get("source"):
                continue
            en_titles, zh_titles = _heading_titles(i18n.source(a)), _heading_titles(i18n.source(b))
            if len(en_titles) != len(zh_titles):
                continue              # not a current translation (i18n check reports it)
            en_texts = _heading_titles(i18n.source(a), ("text", "code_inline", "math_inline"))
            for en, zh, text in zip(en_titles, zh_titles, en_texts):
                slug = github_slugify(en)
                ids[slug] = make_id(fully_normalize_name(text))   # docutils' id: the one the English contents use
                if table.setdefault(zh, slug) != slug:
                    ambiguous.add(zh)
    table = {zh: slug for zh, slug in table.items() if zh not in ambiguous}
    return {"slugs": table, "ids": {slug: ids[slug] for slug in table.values() if ids[slug] and ids[slug] != slug}}


def chinese_sources(repo, lessons, english):
    """{relative path: content} of the Chinese edition, from the lessons `tools/i18n.py build` wrote
    into ``lessons`` (a folder), README.zh-CN.md and, as they are, the exercise stubs, the presenter
    guides and the benchmark results; and the anchors table (see `english_anchors`)."""
    notebooks = sorted(pathlib.Path(lessons).glob("[0-9][0-9]*_*.ipynb"))
    exercises = sorted((repo / "exercises").glob("ex[0-9][0-9]_*.py"))
    guides = _guides(repo)
    staged, pairs = {}, []
    for path in notebooks:
        pairs.append((i18n.read_notebook(repo / "notebooks" / path.name), i18n.read_notebook(path)))
        nb = nbformat.read(path, as_version=4)
        freeze_widgets(nb, where=f"{ZH_DIR}/notebooks/{path.name}", note=WIDGET_NOTE_ZH)
        link_stubs(nb)
        staged[f"notebooks/{path.name}"] = nbformat.writes(nb)
    for path in exercises:
        staged[f"exercises/{path.name}"] = path.read_bytes()
    for path in guides:
        staged[f"presenter/{path.name}"] = path.read_bytes()
    staged["benchmarks/RESULTS.md"] = english["benchmarks/RESULTS.md"]
    readme = (repo / ZH_README).read_text(encoding="utf-8")
    english_only = [rel for rel in english if rel not in staged and not rel.startswith(("notebooks/", "exercises/"))
                    and rel not in ("index.md", "exercises.md")]
    staged["index.md"] = zh_landing_page(readme, (repo / "README.md").read_text(encoding="utf-8"), notebooks,
                                         exercises, guides, english_only)
    staged["exercises.md"] = zh_exercises_page(notebooks, exercises)
    return staged, english_anchors(pairs)


# ---------------------------------------------------------------------------------------------
# The language switch: each edition's table
# ---------------------------------------------------------------------------------------------

def pages(staged):
    """The page names (Sphinx's docnames) of an edition's staged sources."""
    return sorted(rel.rsplit(".", 1)[0] for rel in staged if rel.endswith((".md", ".ipynb")))


def edition(name, editions, anchors=None):
    """What site/conf.py needs to draw the switch on every page of edition ``name``: every edition
    in the switch's order (label, HTML language, where its root is from this edition's root, its
    pages), and for the Chinese edition its headings' English anchors."""
    here = editions[name]
    table = {"current": name, "editions": []}
    for other, info in editions.items():
        root = "" if other == name else ("../" * here["root"].count("/")) + info["root"]
        table["editions"].append({"name": other, "label": info["label"], "lang": info["lang"],
                                  "root": root, "pages": info["pages"]})
    if anchors:
        table["english_anchors"] = anchors
    return json.dumps(table, ensure_ascii=False, indent=1, sort_keys=True) + "\n"


# ---------------------------------------------------------------------------------------------
# build
# ---------------------------------------------------------------------------------------------

def _write(path, data):
    """Write only when the content changes (Sphinx then rebuilds only what changed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = data.encode() if isinstance(data, str) else data
    if not path.exists() or path.read_bytes() != data:
        path.write_bytes(data)


def _publish(src, staged):
    for rel, data in staged.items():
        _write(src / rel, data)
    for old in [p for p in src.rglob("*") if p.is_file() and p.relative_to(src).as_posix() not in staged]:
        old.unlink()                                       # a lesson renamed or removed


def stage_all(work, repo=REPO, say=print):
    """Stage every edition into ``work``: {edition: (its sources' folder, its folder in the site,
    Sphinx -D options)}. The Chinese edition is made where the checkout has README.zh-CN.md."""
    english = english_sources(repo)
    builds = {"en": (work / "src", "", [])}
    editions = {"en": {"label": "English", "lang": "en", "root": "", "pages": pages(english)}}
    staged = {"en": english}
    anchors = None
    if (repo / ZH_README).is_file():
        lessons = work / "zh-lessons"
        try:
            i18n.build(lessons, with_english=True, repo=repo, say=say)
        except RuntimeError as exc:          # a built lesson differs from the English beyond its prose
            raise SiteError(f"the Chinese lessons: {exc}") from exc
        chinese, anchors = chinese_sources(repo, lessons / "notebooks", english)
        builds["zh"] = (work / "src-zh", ZH_DIR, ["-D", f"language={ZH_LANGUAGE}"])
        editions["zh"] = {"label": "中文", "lang": "zh-CN", "root": f"{ZH_DIR}/", "pages": pages(chinese)}
        staged["zh"] = chinese
    for name, sources in staged.items():
        sources[EDITION_FILE] = edition(name, editions, anchors if name == "zh" else None)
        _publish(builds[name][0], sources)
    return builds


def build(out, *, repo=REPO, work=None, jobs="2", quiet=True):
    """Stage ``repo``'s lessons (both editions), build them with Sphinx (-W: warnings are errors)
    and check the HTML; raise SiteError on any failure. ``work`` holds the staged sources and
    Sphinx's caches."""
    out = pathlib.Path(out).resolve()
    work = pathlib.Path(work).resolve() if work else repo / "build" / "site"
    html_dir = work / "html"
    notes = []
    builds = stage_all(work, repo, say=notes.append)
    # Each edition is built in a folder of its own (MyST-NB writes the outputs' figures beside the
    # output folder: two editions in one would write the same files), then moved into its place.
    outdirs = {name: html_dir if not folder else work / name / "html" for name, (_, folder, _) in builds.items()}
    for stale in (*outdirs.values(), out):   # no page of a removed lesson left behind, no stale site on failure
        if stale.exists():
            shutil.rmtree(stale)
    # -E: read every source each time, so every warning is reported on every build (a saved
    # environment would skip unchanged pages, and their warnings with them). Sphinx writes into the
    # work folder, then the HTML is copied. The editions build side by side (their serial parts overlap).
    running = {}
    for name, (src, folder, options) in builds.items():
        doctrees = work / "doctrees" if not folder else work / name / "doctrees"
        cmd = [sys.executable, "-m", "sphinx", "-b", "html", "-E", "-W", "--keep-going", "-j", jobs,
               "-c", str(REPO / "site"), "-d", str(doctrees), *options, str(src), str(outdirs[name])]
        if quiet:
            cmd.insert(3, "-q")
        running[name] = subprocess.Popen(cmd, cwd=repo, stderr=subprocess.PIPE, text=True)
    errors = []
    for name, sphinx in running.items():
        _, stderr = sphinx.communicate()
        label = f"the {name} edition: " if len(running) > 1 else ""
        if sphinx.returncode != 0:       # with -W any warning fails; its lines (stderr, -q) say which
            errors += [label + line for line in stderr.splitlines() if line.strip()] or [
                f"{label}sphinx-build exited with {sphinx.returncode}"]
        elif stderr.strip():
            sys.stderr.write(stderr)
    for name, (_, folder, _) in builds.items():
        if folder and outdirs[name].is_dir() and html_dir.is_dir():
            shutil.move(outdirs[name], html_dir / folder)
    # The link check runs on what Sphinx wrote even after a warning (--keep-going): one build reports all.
    problems = check_site.check(html_dir) if (html_dir / "index.html").is_file() else []
    if errors or problems:
        raise SiteError("\n  ".join(
            (["Sphinx (warnings are errors; paths are of the staged copy):"] + errors if errors else []) +
            ([f"link check: {len(problems)} broken link(s), image(s) or network load(s)"] + problems[:50]
             if problems else [])))
    for line in notes:                # lessons that stay (partly) English in the Chinese edition
        print(f"make site: {ZH_DIR}/: {line}", file=sys.stderr)
    shutil.copytree(html_dir, out, ignore=shutil.ignore_patterns(".buildinfo", "_sources"))
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(REPO / "_site"), help="output folder (default: _site/)")
    parser.add_argument("--verbose", action="store_true", help="Sphinx's full output")
    args = parser.parse_args(argv)
    t0 = time.monotonic()
    try:
        out = build(args.out, quiet=not args.verbose)
    except SiteError as exc:
        print(f"make site: FAILED: {exc}", file=sys.stderr)
        return 1
    print(f"site built in {time.monotonic() - t0:.0f} s: {out}/index.html "
          f"(links and images checked; to browse it: python -m http.server -d {out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

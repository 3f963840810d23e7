"""Build the course website: every lesson as committed (outputs and figures as they are; nothing is
executed), README's opening sections as the landing page and the rest as a Reference page, the
exercises, the presenter guides and the benchmark results.

    python tools/build_site.py              # -> _site/ (what `make site` runs)
    python tools/build_site.py --out DIR

Three steps, each of which fails the build:
1. stage the sources in build/site/src, the repository's layout kept (so a link that works on
   GitHub, e.g. README's `benchmarks/RESULTS.md`, works on the site): the notebooks with their
   ipywidgets frozen to a static snapshot (see `freeze_widgets`) and their links to exercise stubs
   pointed at the exercises page, the landing page and the Reference page from README.md (its links
   to its own sections pointed at the page that holds each), an exercises page that includes the
   stubs, presenter/ as it is;
2. Sphinx + MyST-NB (site/conf.py) with -W --keep-going: any warning (a broken cross-reference, an
   unreadable image, a bad toctree entry) fails it; cells tagged `remove-cell` (the decks' presenter
   notes) are left out;
3. tools/check_site.py on the built HTML: every internal link, anchor, image, script and stylesheet
   resolves to a file of the site, and nothing is loaded from the network.
The output folder is a static site for GitHub Pages (with .nojekyll) or any web server.
"""
import argparse
import base64
import html
import pathlib
import re
import shutil
import subprocess
import sys
import time

import nbformat

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import check_site  # noqa: E402  (tools/check_site.py, beside this file)

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


def _snapshot_outputs(items):
    """Notebook outputs for a snapshot: a note naming the controls' values, then the widget's HTML
    and images in their order (images as image/png outputs, so they become files of the site)."""
    controls = "; ".join(f"{label} = {value}" for kind, label, value in
                         (i for i in items if i[0] == "control"))
    outputs = [nbformat.v4.new_output("display_data", data={
        "text/markdown": WIDGET_NOTE.format(controls=controls or "no controls"),
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


def freeze_widgets(nb, where="notebook"):
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
            outputs += _snapshot_outputs(_snapshot(view["model_id"], models, f"{where}, cell {index}"))
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


def stage(src, repo=REPO):
    """Write the site's sources (from the checkout ``repo``) into ``src``; return the files staged."""
    notebooks = sorted((repo / "notebooks").glob("[0-9][0-9]*_*.ipynb"))   # 07b_at_scale too
    exercises = sorted((repo / "exercises").glob("ex[0-9][0-9]_*.py"))
    if not notebooks:
        raise SiteError("no notebooks/NN_*.ipynb to publish")
    readme = (repo / "README.md").read_text(encoding="utf-8")
    guides = sorted((repo / "presenter").glob("*.md"), key=lambda g: (g.stem != "README", g.stem))
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
    for rel, data in staged.items():
        _write(src / rel, data)
    for old in [p for p in src.rglob("*") if p.is_file() and p.relative_to(src).as_posix() not in staged]:
        old.unlink()                                       # a lesson renamed or removed
    return sorted(staged)


def build(out, *, repo=REPO, work=None, jobs="2", quiet=True):
    """Stage ``repo``'s lessons, build them with Sphinx (-W: warnings are errors) and check the HTML;
    raise SiteError on any failure. ``work`` holds the staged sources and Sphinx's caches."""
    out = pathlib.Path(out).resolve()
    work = pathlib.Path(work).resolve() if work else repo / "build" / "site"
    src, html_dir = work / "src", work / "html"
    stage(src, repo)
    # -E: read every source each time, so every warning is reported on every build (a saved
    # environment would skip unchanged pages, and their warnings with them). Sphinx writes into the
    # work folder (MyST-NB puts the outputs' figures beside its output folder), then the HTML is copied.
    cmd = [sys.executable, "-m", "sphinx", "-b", "html", "-E", "-W", "--keep-going", "-j", jobs,
           "-c", str(REPO / "site"), "-d", str(work / "doctrees"), str(src), str(html_dir)]
    if quiet:
        cmd.insert(3, "-q")
    for stale in (html_dir, out):     # no page of a removed lesson left behind, no stale site on failure
        if stale.exists():
            shutil.rmtree(stale)
    sphinx = subprocess.run(cmd, cwd=repo, stderr=subprocess.PIPE, text=True)
    errors = []
    if sphinx.returncode != 0:       # with -W any warning fails; its lines (stderr, -q) say which
        errors = [line for line in sphinx.stderr.splitlines() if line.strip()] or [
            f"sphinx-build exited with {sphinx.returncode}"]
    elif sphinx.stderr.strip():
        sys.stderr.write(sphinx.stderr)
    # The link check runs on what Sphinx wrote even after a warning (--keep-going): one build reports all.
    problems = check_site.check(html_dir) if (html_dir / "index.html").is_file() else []
    if errors or problems:
        raise SiteError("\n  ".join(
            (["Sphinx (warnings are errors; paths are of the staged copy):"] + errors if errors else []) +
            ([f"link check: {len(problems)} broken link(s), image(s) or network load(s)"] + problems[:50]
             if problems else [])))
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

"""Derive each lesson's slide deck (RISE) from the notebook's structure and its presenter guide.

    python tools/slides.py                   # all notebooks/NN_*.ipynb, in place
    python tools/slides.py --check           # exit 1 if a committed notebook differs (what tests/test_slides.py asserts)
    python tools/slides.py notebooks/03_zero1.ipynb

Re-run it after editing a lesson (adding, removing or moving cells, renaming a heading) or its guide
in presenter/; it is deterministic, and changes only three derived things, leaving every other
source, output, id and metadata byte for byte as it was:

A. Cells are cut at headings. A markdown cell with a `#`, `##` or `###` heading after some text is
   cut in two just before the heading (outside fenced code and `<details>` blocks), so that a slide
   never starts with the closing words of the section before. The first part keeps the cell's id;
   the new cell's id is derived from that id and the heading line.
B. Presenter notes. presenter/NN_<lesson>.md (the guide for that lesson) has a section
   "## Slide notes" with one `### <heading>` block per slide, named exactly as the lesson's heading
   (without the #'s). Each block becomes a markdown cell right after that heading's cell, with
   slide type `notes` (reveal.js notes: hidden in the slideshow) and the tags `presenter-notes` and
   `remove-cell` (the website leaves it out: the guide has a page of its own). A block naming no
   heading of the lesson is an error; notes cells no guide asks for are removed.
C. Every cell's `slideshow` metadata, by these rules, in order:
   1. a cell tagged `slides-slide`, `slides-subslide`, `slides-fragment`, `slides-skip`,
      `slides-notes` or `slides-continue` ("-": same slide as the cell before) gets that type;
      a presenter-notes cell is `notes`;
   2. a markdown cell opening with a `#` or `##` heading starts a slide (the lesson's title slide
      with its goals, each numbered section, the summary, the exercises);
   3. a markdown cell opening with a `###` heading starts a sub-slide;
   4. a markdown cell that opens with "Hint" (or a `<details>` block) is a fragment: shown on demand;
   5. a markdown cell after a code cell starts a sub-slide: one idea per slide, its text, its code,
      its measured output;
   6. a code cell right after a code cell that drew a figure, or after a long code cell (more than
      LONG_CODE lines: the deck scrolls it inside its own box, tools/jupyter/rise.css), starts a
      sub-slide, so a figure is never pushed below the fold by the code before it;
   7. every other cell continues the slide before it (the setup code stays on the title slide, the
      grading cell on the exercises slide).
"""
import argparse
import hashlib
import json
import pathlib
import re
import sys

REPO = pathlib.Path(__file__).resolve().parent.parent
PRESENTER = REPO / "presenter"
TYPES = {"slide": "slide", "subslide": "subslide", "fragment": "fragment", "skip": "skip",
         "notes": "notes", "continue": "-"}
TAG_PREFIX = "slides-"
NOTES_TAG = "presenter-notes"
SITE_REMOVE_TAG = "remove-cell"          # MyST-NB: not rendered on the website
NOTES_SECTION = "Slide notes"
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")    # one line: level, title
OPENS_WITH_HEADING = re.compile(r"#{1,6}\s")
CUT_LEVELS = 3                           # headings of levels 1-3 start a slide or sub-slide: cut there
LONG_CODE = 15                           # lines of code above which a cell's input scrolls in the deck


def _source(cell):
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


def _set_source(cell, text, like):
    """Store ``text`` as nbformat does: a list of lines when the original was a list."""
    cell["source"] = text.splitlines(keepends=True) if isinstance(like, list) else text


def _scan(text):
    """[(line index, level, title)] of the markdown headings in ``text`` outside fenced code and
    <details> blocks."""
    found, fenced, details = [], False, 0
    for index, line in enumerate(text.splitlines()):
        stripped = line.lstrip()
        if stripped.startswith(("```", "~~~")):
            fenced = not fenced
            continue
        if fenced:
            continue
        details += len(re.findall(r"<details\b", line)) - len(re.findall(r"</details>", line))
        m = HEADING.match(line)
        if m and details <= 0:
            found.append((index, len(m.group(1)), m.group(2)))
    return found


def _headings(text):
    """Levels of the markdown headings in ``text`` (outside fenced code), in order."""
    return [level for _, level, _ in _scan(text)]


def heading_titles(cells):
    """{heading title: index of the cell it opens} for every heading that opens a markdown cell."""
    titles = {}
    for index, cell in enumerate(cells):
        if cell["cell_type"] != "markdown":
            continue
        found = _scan(_source(cell))
        if found and found[0][0] == 0:
            titles.setdefault(found[0][2], index)
    return titles


def _has_figure(cell):
    return any("image/png" in out.get("data", {}) or "image/svg+xml" in out.get("data", {})
               for out in cell.get("outputs", []))


def _is_long_code(cell):
    return cell["cell_type"] == "code" and len(_source(cell).splitlines()) > LONG_CODE


def _tags(cell):
    return cell.get("metadata", {}).get("tags", [])


def is_notes(cell):
    return NOTES_TAG in _tags(cell)


def _override(cell, where):
    tags = [t for t in _tags(cell) if t.startswith(TAG_PREFIX)]
    if not tags:
        return None
    if len(tags) > 1 or tags[0][len(TAG_PREFIX):] not in TYPES:
        raise ValueError(f"{where}: slide tags {tags}: use one of "
                         f"{[TAG_PREFIX + t for t in TYPES]}")
    return TYPES[tags[0][len(TAG_PREFIX):]]


# --- A. cut cells at headings -------------------------------------------------------------------

def _new_id(base, line, taken):
    digest = hashlib.sha1(f"{base}\n{line}".encode()).hexdigest()
    for width in range(8, 41):
        candidate = digest[:width]
        if candidate not in taken:
            return candidate
    raise ValueError(f"cannot derive a unique cell id from {base!r}")


def split_at_headings(cells):
    """The cells with every markdown cell cut before each heading of level <= CUT_LEVELS that does
    not open it. Returns (cells, number of cuts)."""
    taken = {c.get("id") for c in cells if c.get("id")}
    out, cuts = [], 0
    for cell in cells:
        if cell["cell_type"] != "markdown" or is_notes(cell):
            out.append(cell)
            continue
        text = _source(cell)
        lines = text.splitlines(keepends=True)
        starts = [i for i, level, _ in _scan(text) if level <= CUT_LEVELS and i > 0
                  and "".join(lines[:i]).strip()]
        if not starts:
            out.append(cell)
            continue
        bounds = [0] + starts + [len(lines)]
        for k, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
            part_text = "".join(lines[lo:hi])
            if k < len(bounds) - 2:
                part_text = part_text.rstrip()    # the blank lines before the heading go with the cut
            if k == 0:
                part = cell
            else:
                meta = {key: value for key, value in cell.get("metadata", {}).items()
                        if key not in ("slideshow", "tags")}
                part = {"cell_type": "markdown", "metadata": meta}
                if "id" in cell:
                    part["id"] = _new_id(cell["id"], lines[lo].rstrip("\n"), taken)
                    taken.add(part["id"])
                attachments = {name: data for name, data in cell.get("attachments", {}).items()
                               if f"attachment:{name}" in part_text}
                if attachments:
                    part["attachments"] = attachments
            _set_source(part, part_text, cell.get("source", ""))
            out.append(part)
        if "attachments" in cell:
            kept = {name: data for name, data in cell["attachments"].items()
                    if f"attachment:{name}" in _source(cell)}
            if kept:
                cell["attachments"] = kept
            else:
                del cell["attachments"]
        cuts += len(starts)
    return out, cuts


# --- B. presenter notes ------------------------------------------------------------------------

def guide_path(notebook_path):
    return PRESENTER / (pathlib.Path(notebook_path).stem + ".md")


def read_notes(guide_text, where="guide"):
    """{heading title: notes markdown} from a presenter guide's "## Slide notes" section."""
    notes, current, inside, fenced = {}, None, False, False
    for line in guide_text.splitlines(keepends=True):
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
        if not fenced and line.startswith("## "):
            inside = line[3:].strip() == NOTES_SECTION
            current = None
            continue
        if not inside:
            continue
        if not fenced and line.startswith("### "):
            current = line[4:].strip()
            if current in notes:
                raise ValueError(f"{where}: two notes for the slide {current!r}")
            notes[current] = []
        elif current is not None:
            notes[current].append(line)
    return {title: "".join(body).strip() for title, body in notes.items()}


def _notes_cell(lesson, title, body, guide_name):
    digest = hashlib.sha1(f"{lesson}\n{title}".encode()).hexdigest()[:8]
    text = (f"<!-- Presenter notes for the slide \"{title}\": written in presenter/{guide_name}, "
            f"inserted by tools/slides.py (edit them there). -->\n"
            f"**Presenter notes** (hidden in the slideshow; [the whole guide](../presenter/{guide_name}))\n\n"
            f"{body}")
    return {"cell_type": "markdown", "id": f"notes-{digest}",
            "metadata": {"tags": [NOTES_TAG, SITE_REMOVE_TAG]}, "source": text.splitlines(keepends=True)}


def inject_notes(cells, notes, lesson, guide_name, where="notebook"):
    """The cells without old presenter-notes cells, with one after each heading ``notes`` names."""
    cells = [c for c in cells if not is_notes(c)]
    titles = heading_titles(cells)
    unknown = [t for t in notes if t not in titles]
    if unknown:
        raise ValueError(f"{where}: presenter/{guide_name} has notes for {unknown}, which no heading of "
                         f"the lesson opens. The lesson's headings: {list(titles)}")
    after = {titles[t]: t for t in notes}
    out = []
    for index, cell in enumerate(cells):
        out.append(cell)
        if index in after:
            out.append(_notes_cell(lesson, after[index], notes[after[index]], guide_name))
    return out


# --- C. slide types ----------------------------------------------------------------------------

def slide_types(cells, where="notebook"):
    """The slide type of each cell (the RISE / nbconvert `slideshow.slide_type` values)."""
    types, previous, height = [], None, 0
    for index, cell in enumerate(cells):
        kind = "notes" if is_notes(cell) else _override(cell, f"{where}, cell {index}")
        if kind is None:
            text = _source(cell).lstrip()
            levels = _headings(text) if cell["cell_type"] == "markdown" else []
            if cell["cell_type"] == "markdown" and any(level <= 2 for level in levels):
                kind = "slide"
            elif cell["cell_type"] == "markdown" and levels and OPENS_WITH_HEADING.match(text):
                kind = "subslide"
            elif cell["cell_type"] == "markdown" and re.match(r"(\*\*|_)?Hint|<details", text):
                kind = "fragment"
            elif previous is None:
                kind = "slide"                    # the deck's first cell, whatever it is
            elif cell["cell_type"] == "markdown" and previous["cell_type"] == "code":
                kind = "subslide"
            elif previous["cell_type"] == "code" and (_has_figure(previous) or _is_long_code(previous)):
                kind = "subslide"
            elif cell["cell_type"] == "code" and _has_figure(cell) and height + _input_height(cell) > FOLD:
                kind = "subslide"                 # the figure would open below the fold: next slide
            else:
                kind = "-"
        types.append(kind)
        if kind != "notes":
            previous = cell
            height = (0 if kind in ("slide", "subslide") else height) + _height(cell)
    return types


# How far down a slide a cell reaches, in pixels of a 1280x800 deck (RISE's white theme: text about
# 24 px a line, 110 characters wide; code 17 px a line, its box capped at 36vh by rise.css). An
# estimate from the sources, deterministic, checked in the browser by tests/test_browser.py.
FOLD = 520            # a figure whose code starts below this would open past the bottom of the slide
TEXT_LINE, CODE_LINE, CELL_GAP, CODE_BOX, FIGURE = 24, 17, 30, 290, 330


def _input_height(cell):
    return CELL_GAP + min(CODE_BOX, CODE_LINE * len(_source(cell).splitlines()))


def _height(cell):
    text = _source(cell)
    if cell["cell_type"] != "code":
        lines = sum(max(1, -(-len(line) // 110)) if line.strip() else 0.5 for line in text.splitlines())
        return CELL_GAP + TEXT_LINE * lines
    printed = sum("".join(o.get("text", "")).count("\n") + 1 for o in cell.get("outputs", [])
                  if o.get("output_type") == "stream")
    return (_input_height(cell) + min(CODE_BOX, CODE_LINE * printed)
            + FIGURE * sum("image/png" in o.get("data", {}) for o in cell.get("outputs", [])))


def apply(nb, where="notebook", notes=None, guide_name=None):
    """Cut ``nb``'s cells at headings, put in the presenter notes (``notes``: {heading: markdown},
    None: leave the notes cells as they are) and set every cell's slide type; return True if
    anything changed."""
    before = json.dumps(nb["cells"], sort_keys=True)
    cells, _ = split_at_headings(nb["cells"])
    if notes is not None:
        cells = inject_notes(cells, notes, pathlib.Path(where).stem, guide_name or f"{pathlib.Path(where).stem}.md",
                             where)
    for cell, kind in zip(cells, slide_types(cells, where)):
        meta = cell.setdefault("metadata", {})
        if meta.get("slideshow") != {"slide_type": kind}:
            meta["slideshow"] = {"slide_type": kind}
    nb["cells"] = cells
    return json.dumps(cells, sort_keys=True) != before


def dumps(nb):
    """The notebook as nbformat writes it (1-space indent, sorted keys, UTF-8, final newline)."""
    return json.dumps(nb, indent=1, sort_keys=True, ensure_ascii=False) + "\n"


def derive(path):
    """(notebook as committed, notebook as the tool makes it), both dicts."""
    path = pathlib.Path(path)
    nb = json.loads(path.read_text(encoding="utf-8"))
    derived = json.loads(json.dumps(nb))
    guide = guide_path(path)
    notes = read_notes(guide.read_text(encoding="utf-8"), f"presenter/{guide.name}") if guide.is_file() else {}
    apply(derived, where=path.name, notes=notes, guide_name=guide.name)
    return nb, derived


def process(path, *, check=False):
    """Apply the rules to one notebook file; with ``check`` only report. True if it was (or would be) changed."""
    path = pathlib.Path(path)
    nb, derived = derive(path)
    changed = dumps(nb) != dumps(derived)
    if changed and not check:
        path.write_text(dumps(derived), encoding="utf-8")
    return changed


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("notebooks", nargs="*", help="default: notebooks/NN_*.ipynb")
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a notebook would change")
    args = parser.parse_args(argv)
    paths = args.notebooks or sorted((REPO / "notebooks").glob("[0-9][0-9]*_*.ipynb"))
    try:
        stale = [pathlib.Path(p).name for p in paths if process(p, check=args.check)]
    except ValueError as exc:
        print(f"tools/slides.py: {exc}", file=sys.stderr)
        return 2
    if args.check and stale:
        print(f"slides out of date in {', '.join(stale)} (cells to cut, presenter notes or slide types): "
              f"run `python tools/slides.py`", file=sys.stderr)
        return 1
    print(f"{len(paths)} notebook(s): " + (f"updated {', '.join(stale)}" if stale else "slides up to date"))
    return 0


if __name__ == "__main__":
    sys.exit(main())

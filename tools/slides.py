"""Derive each lesson's slide deck (RISE) from the notebook's structure: writes every cell's
`slideshow` metadata, and nothing else.

    python tools/slides.py                   # all notebooks/NN_*.ipynb, in place
    python tools/slides.py --check           # exit 1 if a committed notebook differs (what tests/test_slides.py asserts)
    python tools/slides.py notebooks/03_zero1.ipynb

Re-run it after editing a lesson (adding, removing or moving cells); it is deterministic and leaves
sources, outputs and all other metadata byte for byte as they were. The rules, in order:

1. a cell tagged `slides-slide`, `slides-subslide`, `slides-fragment`, `slides-skip`,
   `slides-notes` or `slides-continue` ("-": same slide as the cell before) gets that type;
2. a markdown cell with a `#` or `##` heading starts a slide (the lesson's title slide with its
   goals, each numbered section, the summary, the exercises). A heading in the middle of a cell
   still starts the slide there: a cell is never split;
3. a markdown cell opening with a `###` heading starts a sub-slide;
4. a markdown cell that opens with "Hint" (or a `<details>` block) is a fragment: shown on demand;
5. a markdown cell after a code cell starts a sub-slide: one idea per slide, its text, its code,
   its measured output;
6. a code cell right after a code cell that drew a figure starts a sub-slide, so a key figure ends
   its slide;
7. every other cell continues the slide before it (the setup code stays on the title slide, the
   grading cell on the exercises slide).
"""
import argparse
import json
import pathlib
import re
import sys

REPO = pathlib.Path(__file__).resolve().parent.parent
TYPES = {"slide": "slide", "subslide": "subslide", "fragment": "fragment", "skip": "skip",
         "notes": "notes", "continue": "-"}
TAG_PREFIX = "slides-"
HEADING = re.compile(r"^(#{1,6})\s")


def _source(cell):
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


def _headings(text):
    """Levels of the markdown headings in ``text`` (outside fenced code), in order."""
    levels, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
        elif not fenced:
            m = HEADING.match(line)
            if m:
                levels.append(len(m.group(1)))
    return levels


def _has_figure(cell):
    return any("image/png" in out.get("data", {}) or "image/svg+xml" in out.get("data", {})
               for out in cell.get("outputs", []))


def _override(cell, where):
    tags = [t for t in cell.get("metadata", {}).get("tags", []) if t.startswith(TAG_PREFIX)]
    if not tags:
        return None
    if len(tags) > 1 or tags[0][len(TAG_PREFIX):] not in TYPES:
        raise ValueError(f"{where}: slide tags {tags}: use one of "
                         f"{[TAG_PREFIX + t for t in TYPES]}")
    return TYPES[tags[0][len(TAG_PREFIX):]]


def slide_types(cells, where="notebook"):
    """The slide type of each cell (the RISE / nbconvert `slideshow.slide_type` values)."""
    types, previous = [], None
    for index, cell in enumerate(cells):
        kind = _override(cell, f"{where}, cell {index}")
        if kind is None:
            text = _source(cell).lstrip()
            levels = _headings(text) if cell["cell_type"] == "markdown" else []
            if cell["cell_type"] == "markdown" and any(level <= 2 for level in levels):
                kind = "slide"
            elif cell["cell_type"] == "markdown" and levels and HEADING.match(text):
                kind = "subslide"
            elif cell["cell_type"] == "markdown" and re.match(r"(\*\*|_)?Hint|<details", text):
                kind = "fragment"
            elif previous is None:
                kind = "slide"                    # the deck's first cell, whatever it is
            elif cell["cell_type"] == "markdown" and previous["cell_type"] == "code":
                kind = "subslide"
            elif cell["cell_type"] == "code" and previous["cell_type"] == "code" and _has_figure(previous):
                kind = "subslide"
            else:
                kind = "-"
        types.append(kind)
        previous = cell
    return types


def apply(nb, where="notebook"):
    """Set every cell's metadata.slideshow.slide_type in ``nb`` (a dict); return True if any changed."""
    changed = False
    for cell, kind in zip(nb["cells"], slide_types(nb["cells"], where)):
        meta = cell.setdefault("metadata", {})
        if meta.get("slideshow") != {"slide_type": kind}:
            meta["slideshow"] = {"slide_type": kind}
            changed = True
    return changed


def dumps(nb):
    """The notebook as nbformat writes it (1-space indent, sorted keys, UTF-8, final newline)."""
    return json.dumps(nb, indent=1, sort_keys=True, ensure_ascii=False) + "\n"


def process(path, *, check=False):
    """Apply the rules to one notebook file; with ``check`` only report. True if it was (or would be) changed."""
    path = pathlib.Path(path)
    nb = json.loads(path.read_text(encoding="utf-8"))
    changed = apply(nb, where=path.name)
    if changed and not check:
        path.write_text(dumps(nb), encoding="utf-8")
    return changed


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("notebooks", nargs="*", help="default: notebooks/NN_*.ipynb")
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a notebook would change")
    args = parser.parse_args(argv)
    paths = args.notebooks or sorted((REPO / "notebooks").glob("[0-9][0-9]*_*.ipynb"))
    stale = [pathlib.Path(p).name for p in paths if process(p, check=args.check)]
    if args.check and stale:
        print(f"slide metadata out of date in {', '.join(stale)}: run `python tools/slides.py`", file=sys.stderr)
        return 1
    print(f"{len(paths)} notebook(s): " + (f"updated {', '.join(stale)}" if stale else "slide metadata up to date"))
    return 0


if __name__ == "__main__":
    sys.exit(main())

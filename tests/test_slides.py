"""The slide decks (RISE) are derived from the lessons by tools/slides.py: the committed notebooks
must equal the tool's output (so an edited lesson whose deck was not re-derived fails here), the
tool must touch nothing but `slideshow` metadata, and its rules must give each lesson a sensible
deck. Fast: no kernel, no browser (the deck in a browser: tests/test_browser.py)."""
import copy
import importlib.util
import json
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((REPO / "notebooks").glob("[0-9][0-9]*_*.ipynb"))


def _load_tool():
    spec = importlib.util.spec_from_file_location("slides", REPO / "tools" / "slides.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


slides = _load_tool()


def _md(text, **meta):
    return {"cell_type": "markdown", "metadata": meta, "source": text}


def _code(text="x = 1", figure=False, **meta):
    outputs = [{"output_type": "display_data", "data": {"image/png": "iVBOR", "text/plain": "<Figure>"},
                "metadata": {}}] if figure else []
    return {"cell_type": "code", "metadata": meta, "source": text, "outputs": outputs,
            "execution_count": None}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_notebook_has_the_derived_slide_metadata(path):
    nb = json.loads(path.read_text(encoding="utf-8"))
    derived = slides.slide_types(nb["cells"], path.name)
    committed = [c.get("metadata", {}).get("slideshow", {}).get("slide_type") for c in nb["cells"]]
    stale = [i for i, (a, b) in enumerate(zip(committed, derived)) if a != b]
    assert not stale, (f"{path.name}: cells {stale} have slide types {[committed[i] for i in stale]}, the "
                       f"lesson's structure gives {[derived[i] for i in stale]}: run `python tools/slides.py`")


@pytest.mark.parametrize("path", NOTEBOOKS[:2], ids=lambda p: p.name)
def test_tool_changes_only_slideshow_metadata_and_writes_nbformats_bytes(path):
    raw = path.read_text(encoding="utf-8")
    nb = json.loads(raw)
    assert slides.dumps(nb) == raw, "the tool would re-format the notebook, not only its metadata"
    stripped = copy.deepcopy(nb)
    for cell in stripped["cells"]:
        cell["metadata"].pop("slideshow", None)
    assert slides.apply(stripped) is True
    assert stripped == nb                      # the same cells, sources, outputs and other metadata
    assert slides.apply(stripped) is False     # deterministic: a second run changes nothing


def test_rules():
    cells = [
        _md("# Lesson 99 — Title\n\nGoals."),            # title: slide
        _code("import zerolab"),                         # setup stays on the title slide
        _md("## 1. First idea\n\nText."),                # section: slide
        _code("run()"),
        _md("What the output shows."),                   # text after code: sub-slide
        _code("plot()", figure=True),
        _code("more()"),                                 # after a figure: sub-slide
        _md("### A detail"),                             # ### heading: sub-slide
        _md("**Hint.** Look at the ring."),              # hint: fragment
        _md("Closing words.\n\n## Summary\n\n* one"),    # a ## heading mid-cell still starts a slide
        _md("## Exercises"),
        _code("zerolab.grade.check('99')"),              # grading cell: on the exercises slide
        _md("Instructor only.", tags=["slides-notes"]),  # explicit override
        _md("## Not a slide", tags=["slides-continue"]),
    ]
    assert slides.slide_types(cells) == ["slide", "-", "slide", "-", "subslide", "-", "subslide",
                                         "subslide", "fragment", "slide", "slide", "-", "notes", "-"]


def test_headings_inside_code_fences_do_not_count():
    cells = [_md("# T"), _code(), _md("Text\n```python\n## a comment\n```")]
    assert slides.slide_types(cells)[2] == "subslide"


def test_a_bad_override_tag_is_refused_with_the_valid_ones():
    with pytest.raises(ValueError, match="slides-subslide"):
        slides.slide_types([_md("# T", tags=["slides-sub"])], "lesson.ipynb")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_each_lesson_gets_a_sensible_deck(path):
    nb = json.loads(path.read_text(encoding="utf-8"))
    types = slides.slide_types(nb["cells"])
    sources = ["".join(c["source"]) for c in nb["cells"]]
    assert types[0] == "slide" and sources[0].startswith("# Lesson"), "the deck opens on the title slide"
    starts = [i for i, t in enumerate(types) if t in ("slide", "subslide")]
    assert len(starts) >= 5, f"only {len(starts)} slides"
    hint = [s.lstrip().startswith("<details>") for s in sources]   # collapsed hints: one line each
    biggest = max(sum(not hint[i] for i in range(a, b)) for a, b in zip(starts, starts[1:] + [len(types)]))
    assert biggest <= 6, f"a slide of {biggest} cells (collapsed hints aside): not one idea per slide"
    summary = [i for i, s in enumerate(sources) if "## Summary" in s or "## Exercises" in s]
    assert summary and all(types[i] == "slide" for i in summary), "summary and exercises open slides"
    grading = [i for i, s in enumerate(sources) if "zerolab.grade" in s]
    if list((REPO / "exercises").glob(f"ex{path.name.split('_')[0]}_*.py")):   # 07b has no exercise
        assert grading and types[grading[-1]] == "-", "the grading cell stays on the exercises slide"
    else:
        assert not grading, f"{path.name} grades an exercise that does not exist"

"""The slide decks (RISE) are derived from the lessons and their presenter guides by tools/slides.py:
the committed notebooks must equal the tool's output (so an edited lesson or guide whose deck was not
re-derived fails here), the tool must touch nothing but what it derives (cuts at headings, notes
cells, `slideshow` metadata), and its rules must give each lesson a sensible deck: every slide opens
on its own heading, every slide has presenter notes, and the guides' minutes add up. Fast: no
kernel, no browser (the decks in a browser: tests/test_browser.py)."""
import copy
import importlib.util
import json
import pathlib
import re

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((REPO / "notebooks").glob("[0-9][0-9]*_*.ipynb"))
GUIDES = sorted((REPO / "presenter").glob("[0-9][0-9]*_*.md"))


def _load_tool():
    spec = importlib.util.spec_from_file_location("slides", REPO / "tools" / "slides.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


slides = _load_tool()


def _md(text, id=None, **meta):
    cell = {"cell_type": "markdown", "metadata": meta, "source": text}
    if id:
        cell["id"] = id
    return cell


def _code(text="x = 1", figure=False, **meta):
    outputs = [{"output_type": "display_data", "data": {"image/png": "iVBOR", "text/plain": "<Figure>"},
                "metadata": {}}] if figure else []
    return {"cell_type": "code", "metadata": meta, "source": text, "outputs": outputs,
            "execution_count": None}


def _src(cell):
    return "".join(cell["source"])


# --- the committed lessons are what the tool derives -----------------------------------------------

@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_notebook_is_what_the_tool_derives(path):
    committed, derived = slides.derive(path)
    if slides.dumps(committed) != slides.dumps(derived):
        before = [(c.get("id"), c["metadata"].get("slideshow")) for c in committed["cells"]]
        after = [(c.get("id"), c["metadata"].get("slideshow")) for c in derived["cells"]]
        pytest.fail(f"{path.name}: the deck is stale (cells, notes or slide types differ from what the "
                    f"lesson and presenter/{path.stem}.md give): run `python tools/slides.py`.\n"
                    f"committed {before}\nderived   {after}")


@pytest.mark.parametrize("path", NOTEBOOKS[:2], ids=lambda p: p.name)
def test_the_tool_writes_nbformats_bytes_and_is_deterministic(path):
    raw = path.read_text(encoding="utf-8")
    nb = json.loads(raw)
    assert slides.dumps(nb) == raw, "the tool would re-format the notebook, not only what it derives"
    again = copy.deepcopy(nb)
    assert slides.apply(again, path.name, slides.read_notes(slides.guide_path(path).read_text()),
                        slides.guide_path(path).name) is False    # a second run changes nothing


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_code_cells_outputs_and_ids_are_never_touched(path):
    """Whatever the tool derives, a lesson's code cells (source, outputs, ids, metadata other than
    the slide type) are the lesson's: compare them with the same notebook stripped of every derived
    thing and derived again."""
    nb = json.loads(path.read_text(encoding="utf-8"))
    stripped = copy.deepcopy(nb)
    stripped["cells"] = [c for c in stripped["cells"] if not slides.is_notes(c)]
    for cell in stripped["cells"]:
        cell["metadata"].pop("slideshow", None)
    guide = slides.guide_path(path)
    slides.apply(stripped, path.name, slides.read_notes(guide.read_text()) if guide.is_file() else {},
                 guide.name)
    assert stripped == nb
    ids = [c.get("id") for c in nb["cells"]]
    assert len(ids) == len(set(ids)), "cell ids must be unique"


# --- the rules, on small made-up lessons --------------------------------------------------------

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
        _md("## Exercises"),
        _code("zerolab.grade.check('99')"),              # grading cell: on the exercises slide
        _md("Instructor only.", tags=["slides-notes"]),  # explicit override
        _md("## Not a slide", tags=["slides-continue"]),
    ]
    assert slides.slide_types(cells) == ["slide", "-", "slide", "-", "subslide", "-", "subslide",
                                         "subslide", "fragment", "slide", "-", "notes", "-"]


def test_a_heading_inside_a_cell_cuts_it_there_and_the_new_slide_opens_on_the_heading():
    nb = {"cells": [_md("# T", id="t"), _code(),
                    _md("Closing words of section 1.\n\n## 2. Next\n\nIts text.\n\n### 2.1 Detail\n\nMore.",
                        id="abc")]}
    assert slides.apply(nb) is True
    cells = nb["cells"]
    assert [_src(c) for c in cells[2:]] == ["Closing words of section 1.", "## 2. Next\n\nIts text.",
                                            "### 2.1 Detail\n\nMore."]
    assert cells[2]["id"] == "abc", "the first part keeps the cell's id"
    new_ids = [c["id"] for c in cells[3:]]
    assert len(set(new_ids + ["abc", "t"])) == 4 and all(re.fullmatch(r"[0-9a-f]{8}", i) for i in new_ids)
    assert [c["metadata"]["slideshow"]["slide_type"] for c in cells] == ["slide", "-", "subslide", "slide",
                                                                          "subslide"]
    again = copy.deepcopy(nb)
    assert slides.apply(again) is False and again == nb, "cutting is idempotent"


def test_headings_inside_code_fences_or_collapsed_hints_do_not_cut_or_count():
    fence = _md("Text\n```python\n## a comment\n```")
    hint = _md("<details><summary>Hint</summary>\n\n## not a heading here\n\n</details>")
    cells, cuts = slides.split_at_headings([_md("# T"), _code(), fence, hint])
    assert cuts == 0 and len(cells) == 4
    assert slides.slide_types(cells)[2:] == ["subslide", "fragment"]


def test_long_code_starts_the_next_sub_slide_so_a_figure_is_not_pushed_below_the_fold():
    long_code = "\n".join(f"x{i} = {i}" for i in range(slides.LONG_CODE + 1))
    short_code = "\n".join(f"x{i} = {i}" for i in range(slides.LONG_CODE))
    for code, expected in ((long_code, "subslide"), (short_code, "-")):
        cells = [_md("# T"), _md("## 1. A"), _code(code), _code("plot()", figure=True)]
        assert slides.slide_types(cells)[3] == expected


def test_notes_go_after_their_heading_and_leave_the_site():
    cells = [_md("# Lesson 99 — T", id="a"), _code(), _md("## 1. First", id="b"), _code()]
    notes = {"Lesson 99 — T": "- **Point.** p0", "1. First": "- **Point.** p1"}
    out = slides.inject_notes(cells, notes, "99_t", "99_t.md")
    assert [slides.is_notes(c) for c in out] == [False, True, False, False, True, False]
    note = out[4]
    assert "p1" in _src(note) and slides.SITE_REMOVE_TAG in note["metadata"]["tags"]
    assert slides.slide_types(out)[4] == "notes" and slides.slide_types(out)[5] == "-"
    assert slides.inject_notes(out, notes, "99_t", "99_t.md") == out, "re-injecting replaces, not adds"
    assert not any(slides.is_notes(c) for c in slides.inject_notes(out, {}, "99_t", "99_t.md"))


def test_notes_for_a_heading_the_lesson_does_not_have_are_refused_naming_the_headings():
    cells = [_md("# Lesson 99 — T"), _md("## 1. First")]
    with pytest.raises(ValueError, match=r"no heading.*'1\. First'"):
        slides.inject_notes(cells, {"1. Frist": "typo"}, "99_t", "99_t.md", "99_t.ipynb")


def test_a_bad_override_tag_is_refused_with_the_valid_ones():
    with pytest.raises(ValueError, match="slides-subslide"):
        slides.slide_types([_md("# T", tags=["slides-sub"])], "lesson.ipynb")


# --- every lesson's deck --------------------------------------------------------------------------

@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_each_lesson_gets_a_sensible_deck(path):
    nb = json.loads(path.read_text(encoding="utf-8"))
    cells = [c for c in nb["cells"] if not slides.is_notes(c)]
    types = slides.slide_types(cells)
    sources = [_src(c) for c in cells]
    assert types[0] == "slide" and sources[0].startswith("# Lesson"), "the deck opens on the title slide"
    starts = [i for i, t in enumerate(types) if t in ("slide", "subslide")]
    assert len(starts) >= 5, f"only {len(starts)} slides"
    hint = [s.lstrip().startswith("<details>") for s in sources]   # collapsed hints: one line each
    biggest = max(sum(not hint[i] for i in range(a, b)) for a, b in zip(starts, starts[1:] + [len(types)]))
    assert biggest <= 6, f"a slide of {biggest} cells (collapsed hints aside): not one idea per slide"
    for i, t in enumerate(types):
        if t == "slide":    # a slide never starts with the closing words of the section before
            assert re.match(r"#{1,2}\s", sources[i]), f"slide at cell {i} opens with {sources[i][:60]!r}"
    summary = [i for i, s in enumerate(sources) if s.startswith(("## Summary", "## Exercises"))]
    assert summary and all(types[i] == "slide" for i in summary), "summary and exercises open slides"
    grading = [i for i, s in enumerate(sources) if "zerolab.grade" in s]
    if list((REPO / "exercises").glob(f"ex{path.name.split('_')[0]}_*.py")):   # 07b has no exercise
        assert grading and types[grading[-1]] == "-", "the grading cell stays on the exercises slide"
    else:
        assert not grading, f"{path.name} grades an exercise that does not exist"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_every_slide_has_presenter_notes(path):
    """Every slide (the title, each section, the summary, the exercises) has a notes cell right
    after its heading, from the lesson's guide in presenter/."""
    assert slides.guide_path(path).is_file(), f"no presenter guide presenter/{path.stem}.md"
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    types = slides.slide_types(cells)
    for i, (cell, kind) in enumerate(zip(cells, types)):
        if kind == "slide":
            heading = _src(cell).splitlines()[0]
            assert i + 1 < len(cells) and slides.is_notes(cells[i + 1]), f"{path.name}: no notes for {heading!r}"
            assert "**Point.**" in _src(cells[i + 1]) and "**Minutes.**" in _src(cells[i + 1]), heading


@pytest.mark.parametrize("guide", GUIDES, ids=lambda p: p.name)
def test_a_guides_minutes_add_up_to_its_slot_in_the_3_lecture_sequence(guide):
    text = guide.read_text(encoding="utf-8")
    notes = slides.read_notes(text, guide.name)
    minutes = []
    for title, body in notes.items():
        m = re.search(r"\*\*Minutes\.\*\* (\d+(?:\.\d+)?)", body)
        assert m, f"{guide.name}: the notes of {title!r} give no minutes"
        minutes.append(float(m.group(1)))
    slot = re.search(r"\*\*In the 3-lecture sequence:\*\* (\d+) minutes", text)
    assert slot, f"{guide.name}: says nothing of its slot in the 3-lecture sequence"
    assert sum(minutes) == int(slot.group(1)), f"{guide.name}: slides add up to {sum(minutes)} minutes"
    plan = (REPO / "presenter" / "README.md").read_text(encoding="utf-8")
    number = guide.name.split("_")[0]
    assert re.search(rf"\b{number} \({slot.group(1)}\)", plan), (
        f"presenter/README.md's 3-lecture table does not give lesson {number} {slot.group(1)} minutes")


def test_every_lesson_has_a_guide_and_every_guide_a_lesson():
    assert [g.stem for g in GUIDES] == [n.stem for n in NOTEBOOKS]

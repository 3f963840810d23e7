"""No lesson's prose states the direction of a timing its notebook re-measures on every run.

A timing cell is a code cell tagged ``# NBVAL_IGNORE_OUTPUT`` whose committed output shows a time
(``12.3 ms``, ``0.8 s``, ``µs``): nbval does not check it because it changes from run to run, and a
re-execution on a busy machine can reverse it. Its *commentary* is the markdown that follows it, up
to the next code cell. The rule (the project's standard in one line: a sentence whose truth depends on a
measured time is printed by the cell that measures, or holds for either outcome):

    In a timing cell's commentary, no sentence may state a direction (faster, slower, saves, hides,
    overlaps, costs more, shorter, longer, fastest, ...) unless it says which outcome it rests on by
    pointing at the printout ("printed", "the line above"), holds for either outcome ("either",
    "whichever", "whether"), or speaks of other hardware or of a prediction ("GPU", "NCCL",
    "predicted", "cost model"). A question states no direction and is let through.

A heading line is a title, not a sentence of the commentary (the text under it is). A sentence
ends at . ! ? and at blank lines and line breaks that start a bullet or a heading. The
rule is deliberately blunt: where prose must state a direction about this machine, the cell that
measures prints that sentence from its numbers (and the prose points at it). Fast: committed
notebooks, no kernel. Run on the notebooks as they were before issue 32's fixes (commit 6f3c5d7), it
failed on lessons 02, 04, 05, 06, 08, 10 and 11, among them the four cases the issue names: lesson 04
"how much that saves here", lesson 05 "Why prefetch does not make the step faster here", lesson 06
"the paper (Sec. 5.2) overlaps them", lesson 10 "What recomputation costs is the FLOP count"."""
import json
import pathlib
import re

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((REPO / "notebooks").glob("[0-9][0-9]*.ipynb"))

TIME_IN_OUTPUT = re.compile(r"\d\s*(ms|µs|s)\b")
DIRECTION = re.compile(
    r"\b(faster|slower|quicker|speeds? up|speed-?ups?|slows? (it |the step |training )?down|saves?|saving|"
    r"hides?|hidden|hiding|overlap(s|ped|ping)?|costs? (more|less|little|nothing)|cheaper|shorter|"
    r"(?<!no )longer|small fraction|pays?( off)?|wins?|loses?|fastest|slowest)\b", re.I)
EITHER_WAY = re.compile(
    r"\b(printed|prints|printout|the line above|the lines above|either|whichever|whether|GPUs?|NCCL|"
    r"predicted|predicts?|prediction|cost model)\b", re.I)


def _text(field):
    return field if isinstance(field, str) else "".join(field)


def is_timing_cell(cell):
    if cell["cell_type"] != "code" or "NBVAL_IGNORE_OUTPUT" not in _text(cell["source"]):
        return False
    shown = [_text(o.get("text", "")) + _text(o.get("data", {}).get("text/plain", ""))
             for o in cell.get("outputs", [])]
    return any(TIME_IN_OUTPUT.search(s) for s in shown)


def sentences(markdown):
    markdown = re.sub(r"<details>.*?</details>", " ", markdown, flags=re.S)     # collapsed hints
    markdown = re.sub(r"```.*?```", " ", markdown, flags=re.S)                  # code blocks
    parts = re.split(r"(?<=[.!?])[*_)\]]*\s+|\n\s*\n|\n\s*(?=[-*] |#)", markdown)
    return [" ".join(p.split()) for p in parts if p and p.strip()]


def without_headings(markdown):
    """``markdown`` less its heading lines (``#`` to ``######``, outside code blocks). A heading is a
    title that names a section's topic, often the paper's own name for a design (lesson 13's
    "## 6. Overlap-centric design (Sec. 6.2)"), not a sentence about the timing above it; the text
    under the heading stays commentary (lesson 06's "the paper (Sec. 5.2) overlaps them" is still
    caught), and so does a bold lead-in (lesson 05's "**Why prefetch ... faster here.**")."""
    blocks = re.split(r"(```.*?```)", markdown, flags=re.S)
    return "".join(b if b.startswith("```") else re.sub(r"^#{1,6} .*$", "", b, flags=re.M) for b in blocks)


def directional_claims(cells):
    """[(index of the markdown cell, the sentence)] for every sentence of a timing cell's
    commentary that states a direction and does not say what it rests on."""
    found, after_timing = [], False
    for i, cell in enumerate(cells):
        if "presenter-notes" in cell.get("metadata", {}).get("tags", []):
            continue          # a presenter guide's notes (tools/slides.py), not the lesson's prose
        if cell["cell_type"] == "code":
            after_timing = is_timing_cell(cell)
        elif cell["cell_type"] == "markdown" and after_timing:
            found += [(i, s) for s in sentences(without_headings(_text(cell["source"])))
                      if DIRECTION.search(s) and not EITHER_WAY.search(s) and not s.rstrip("*_ ").endswith("?")]
    return found


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.name)
def test_no_directional_claim_after_a_timing_cell(notebook):
    cells = json.loads(notebook.read_text(encoding="utf-8"))["cells"]
    claims = directional_claims(cells)
    assert claims == [], (f"{notebook.name}: prose after a timing cell (NBVAL_IGNORE_OUTPUT) states a "
                          f"direction that a re-run can reverse; print it from the measurement or word it "
                          f"for either outcome:\n" + "\n".join(f"  cell {i}: {s}" for i, s in claims))


def _md(text):
    return {"cell_type": "markdown", "source": text}


def _timing(output):
    return {"cell_type": "code", "source": "# NBVAL_IGNORE_OUTPUT\nprint(t)",
            "outputs": [{"output_type": "stream", "text": output}]}


def test_the_rule_catches_and_spares():
    cells = [_timing("step 135.5 ms\n"),
             _md("**Why prefetch does not make the step faster here.** Read the printout above.\n\n"
                 "With async_op they run beside backward; how much that saves here varies."),
             {"cell_type": "code", "source": "x = 1", "outputs": []},
             _md("Prefetch is faster here.")]                       # not after a timing cell
    assert [s for _, s in directional_claims(cells)] == [
        "**Why prefetch does not make the step faster here.",
        "With async_op they run beside backward; how much that saves here varies."]
    spared = [_timing("12 ms\n"), _md("The line printed above says whether prefetch made the step faster. "
                                      "On a GPU, NCCL hides the gathers. No longer needed.")]
    assert directional_claims(spared) == []
    headed = [_timing("12 ms\n"), _md("## 6. Overlap-centric design (Sec. 6.2)\n\nThe paper (Sec. 5.2) overlaps them.")]
    assert [s for _, s in directional_claims(headed)] == ["5.2) overlaps them."]
    notes = {"cell_type": "markdown", "source": "**Presenter notes** (hidden in the slideshow)",
             "metadata": {"tags": ["presenter-notes", "remove-cell"]}}
    assert [s for _, s in directional_claims([_timing("12 ms\n"), notes, _md("It is faster.")])] == [
        "It is faster."], "a notes cell is skipped, and the lesson's prose after it is still checked"
    untimed = [{"cell_type": "code", "source": "# NBVAL_IGNORE_OUTPUT\nprint(x)",
                "outputs": [{"output_type": "stream", "text": "RSS 307 MB\n"}]}, _md("It is faster.")]
    assert directional_claims(untimed) == []

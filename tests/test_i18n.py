"""The Chinese edition's gate (tools/i18n.py): it passes on the checkout, and it can fail.

The checkout's translations must be current: `check` regenerates each template from the English
and fails on anything untranslated, stale (fuzzy), obsolete, on lost markup, on a glossary
violation and on a built notebook that differs from the English outside markdown prose. The other
tests prove each of those verdicts on a copy of the checkout (a temporary folder) where one thing
was changed: one English sentence, one code cell, one glossary term, one cell id.
"""
import copy
import importlib.util
import json
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import i18n  # noqa: E402

LESSON = "00_collectives"
CELL = "e612a3f6"                      # lesson 00, "## 1. A process group"
SENTENCE = "They stay alive until we close the\ncluster"
OTHER = "01_memory_anatomy"             # copied without its .po: a lesson not yet translated


def _copy(tmp_path, notebooks=(LESSON, OTHER), translated=(LESSON,)):
    """A checkout in miniature: some English notebooks, and the zh_CN catalogs of ``translated``."""
    (tmp_path / "notebooks").mkdir()
    for stem in notebooks:
        shutil.copy(ROOT / "notebooks" / f"{stem}.ipynb", tmp_path / "notebooks")
    (tmp_path / "i18n" / "zh_CN").mkdir(parents=True)
    shutil.copy(ROOT / "i18n" / "zh_CN" / "glossary", tmp_path / "i18n" / "zh_CN")
    for stem in translated:
        shutil.copy(ROOT / "i18n" / "zh_CN" / f"{stem}.po", tmp_path / "i18n" / "zh_CN")
    return tmp_path


def _edit_notebook(repo, stem, edit):
    path = repo / "notebooks" / f"{stem}.ipynb"
    nb = i18n.read_notebook(path)
    edit(nb)
    path.write_text(i18n.dumps_notebook(nb), encoding="utf-8")


def _cell(nb, cid):
    return next(c for c in nb["cells"] if c.get("id") == cid)


def _run_cli(*args):
    return subprocess.run([sys.executable, str(ROOT / "tools" / "i18n.py"), *args],
                          capture_output=True, text=True, timeout=120)


def test_the_gate_passes_on_the_checkout():
    done = _run_cli("check")
    print(done.stdout)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "OK:" in done.stdout
    assert f"{LESSON} " in done.stdout                          # the per-notebook table
    assert "OK:" in done.stdout


def test_every_catalog_is_what_update_would_write():
    """The committed .po files are merged (no pending `update`) and in the tool's own format."""
    for catalog in sorted((ROOT / "i18n" / "zh_CN").glob("*.po")):
        nb = i18n.read_notebook(ROOT / "notebooks" / f"{catalog.stem}.ipynb")
        po = i18n.load_catalog(catalog)
        merged = i18n.merge(po, i18n.template(nb, catalog.stem), catalog.stem)
        assert str(merged) == str(po), f"{catalog}: run python tools/i18n.py update"


def test_one_changed_english_sentence_fails_the_gate_and_names_the_cell(tmp_path):
    repo = _copy(tmp_path)
    assert i18n.check(repo=repo).ok
    _edit_notebook(repo, LESSON, lambda nb: _cell(nb, CELL).__setitem__(
        "source", i18n.split_source(i18n.source(_cell(nb, CELL)).replace(SENTENCE, "They live until we close the\ncluster"))))
    report = i18n.check(repo=repo)
    assert not report.ok
    assert [w for w, _ in report.problems] == [f"{LESSON}#{CELL}"]     # that cell, and only it
    text = i18n.format_report(report)
    row = next(r for r in report.rows if r["notebook"] == LESSON)
    assert row["fuzzy"] == 1 and row["translated"] == row["cells"] - 1
    # the English diff, line by line
    diff = [line.strip() for line in text.splitlines()]
    assert any(line.startswith("-") and "They stay alive until" in line for line in diff), text
    assert any(line.startswith("+") and "They live until" in line for line in diff), text
    done = _run_cli("check", "--repo", str(repo))
    assert done.returncode == 1 and f"{LESSON}#{CELL}" in done.stdout
    # the stale translation is not built: that cell stays English, the others are Chinese
    built = i18n.build_notebook(i18n.read_notebook(repo / "notebooks" / f"{LESSON}.ipynb"),
                                i18n.load_catalog(repo / "i18n" / "zh_CN" / f"{LESSON}.po"), LESSON)
    assert "They live until" in i18n.source(_cell(built, CELL))
    assert "进程组" in i18n.source(_cell(built, "a1381a17"))
    # update marks it fuzzy and keeps the English it was translated from; the gate still fails
    i18n.update(repo=repo, say=lambda *a: None)
    po = i18n.load_catalog(repo / "i18n" / "zh_CN" / f"{LESSON}.po")
    entry = next(e for e in po if e.msgctxt == f"{LESSON}#{CELL}")
    assert "fuzzy" in entry.flags and SENTENCE in entry.previous_msgid and "They live" in entry.msgid
    assert entry.msgstr                                           # the old translation, to revise
    assert not i18n.check(repo=repo).ok
    # the translator revises it and clears the flag: the gate passes again
    entry.flags.remove("fuzzy")
    entry.previous_msgid = None
    i18n.save_catalog(po, repo / "i18n" / "zh_CN" / f"{LESSON}.po")
    assert i18n.check(repo=repo).ok


def _join_before_split(repo, first, second):
    """The state before tools/slides.py split a cell at its heading: cells ``first`` (prose) and
    ``second`` (starting with a heading) as one cell ``first``, in the notebook and in its catalog,
    with the two translations joined the same way."""
    path = repo / "i18n" / "zh_CN" / f"{LESSON}.po"
    po = i18n.load_catalog(path)
    a, b = (next(e for e in po if e.msgctxt == f"{LESSON}#{cid}") for cid in (first, second))
    a.msgid, a.msgstr = a.msgid + "\n\n" + b.msgid, a.msgstr + "\n\n" + b.msgstr
    po.remove(b)
    i18n.save_catalog(po, path)

    def join(nb):
        one, two = _cell(nb, first), _cell(nb, second)
        one["source"] = i18n.split_source(i18n.source(one) + "\n\n" + i18n.source(two))
        nb["cells"].remove(two)
    _edit_notebook(repo, LESSON, join)
    assert i18n.check(repo=repo).ok
    return a.msgid


def test_removed_new_and_split_cells(tmp_path):
    repo = _copy(tmp_path, notebooks=(LESSON,))
    first, second = "bf0de310", "5167a224"   # prose, then "## 2. The four collectives"
    text = _join_before_split(repo, first, second)
    head, tail = text.split("## 2.", 1)

    def edit(nb):                             # split again (under a new id), add a cell, remove one
        index = nb["cells"].index(_cell(nb, first))
        _cell(nb, first)["source"] = i18n.split_source(head.rstrip("\n"))
        nb["cells"].insert(index + 1, {"cell_type": "markdown", "id": "c0ffee01", "metadata": {},
                                       "source": i18n.split_source("## 2." + tail)})
        nb["cells"].insert(0, {"cell_type": "markdown", "id": "c0ffee02", "metadata": {},
                               "source": ["A new cell nobody has translated."]})
        nb["cells"].remove(_cell(nb, "33e2f39f"))
    _edit_notebook(repo, LESSON, edit)
    saved = (repo / "i18n" / "zh_CN" / f"{LESSON}.po").read_text(encoding="utf-8")
    i18n.update(repo=repo, say=lambda *a: None)
    po = {e.msgctxt.split("#")[1]: e for e in i18n.load_catalog(repo / "i18n" / "zh_CN" / f"{LESSON}.po")}
    assert po["c0ffee02"].msgstr == "" and not po["c0ffee02"].obsolete           # new: untranslated
    assert po["33e2f39f"].obsolete and po["33e2f39f"].msgstr                       # removed: obsolete
    assert "fuzzy" in po[first].flags and po[first].previous_msgid == text         # shortened: fuzzy
    # each half is offered its part of the translation, cut at the same heading, for review
    assert "fuzzy" in po["c0ffee01"].flags and po["c0ffee01"].previous_msgctxt == f"{LESSON}#{first}"
    assert po["c0ffee01"].msgstr.startswith("## 2. ") and "四个进程" not in po["c0ffee01"].msgstr
    assert po[first].msgstr.startswith("四个进程") and "## 2." not in po[first].msgstr
    assert i18n.cut_translation("a\n\n## B\nb", "甲\n\n## 乙\n乙乙", "## B\nb") == "## 乙\n乙乙"
    assert i18n.cut_translation("a\n\n## B\nb", "甲乙乙", "## B\nb") is None      # headings lost
    assert i18n.cut_translation("a\n\n## B\nb", "甲\n\n## 乙\n乙乙", "## B\nc") is None   # not a cut
    report = i18n.check(repo=repo)
    kinds = {(w.split("#")[1], what.split(":")[0]) for w, what in report.problems}
    assert kinds == {("c0ffee02", "untranslated"), ("33e2f39f", "obsolete"), (first, "stale"),
                     ("c0ffee01", "stale")}
    # --accept-splits: the exact cuts are current; what is really new or gone still fails
    (repo / "i18n" / "zh_CN" / f"{LESSON}.po").write_text(saved, encoding="utf-8")
    i18n.update(repo=repo, say=lambda *a: None, accept_splits=True)
    kinds = {(w.split("#")[1], what.split(":")[0]) for w, what in i18n.check(repo=repo).problems}
    assert kinds == {("c0ffee02", "untranslated"), ("33e2f39f", "obsolete")}
    built = i18n.build_notebook(i18n.read_notebook(repo / "notebooks" / f"{LESSON}.ipynb"),
                                i18n.load_catalog(repo / "i18n" / "zh_CN" / f"{LESSON}.po"), LESSON)
    assert i18n.source(_cell(built, "c0ffee01")).startswith("## 2. ")
    assert i18n.source(_cell(built, first)).startswith("四个进程")


def test_a_zh_build_cannot_change_a_code_cell(tmp_path):
    repo = _copy(tmp_path, notebooks=(LESSON,))
    english = i18n.read_notebook(repo / "notebooks" / f"{LESSON}.ipynb")
    code = next(c for c in english["cells"] if c["cell_type"] == "code" and c["outputs"])
    # a catalog entry keyed to a code cell (a hand edit, a mistake) is never applied
    path = repo / "i18n" / "zh_CN" / f"{LESSON}.po"
    po = i18n.load_catalog(path)
    po.append(i18n.polib.POEntry(msgctxt=f"{LESSON}#{code['id']}", msgid=i18n.source(code),
                                 msgstr="print('改过的代码')"))
    i18n.save_catalog(po, path)
    built = i18n.build_notebook(english, i18n.load_catalog(path), LESSON)
    assert i18n.code_problems(english, built, LESSON) == []
    for a, b in zip(english["cells"], built["cells"]):
        assert a["id"] == b["id"] and a["cell_type"] == b["cell_type"]
        if a["cell_type"] != "markdown":
            assert i18n.dumps_notebook(a) == i18n.dumps_notebook(b)      # byte for byte
        else:
            assert {k: v for k, v in a.items() if k != "source"} == {k: v for k, v in b.items() if k != "source"}
    assert any(i18n.source(a) != i18n.source(b) for a, b in zip(english["cells"], built["cells"]))
    # ...and the gate reports that entry (its cell is no translatable cell: obsolete)
    report = i18n.check(repo=repo)
    assert (f"{LESSON}#{code['id']}", "obsolete") in {(w, what.split(":")[0]) for w, what in report.problems}
    # the comparison the gate makes does see a changed code cell, output or tag
    for change in (lambda c: c.__setitem__("source", ["print('改过的代码')"]),
                   lambda c: c.__setitem__("outputs", []),
                   lambda c: c["metadata"].setdefault("tags", []).append("x")):
        tampered = json.loads(json.dumps(built))
        change(next(c for c in tampered["cells"] if c["id"] == code["id"]))
        assert i18n.code_problems(english, tampered, LESSON), change


def test_the_build_writes_the_translation_and_keeps_a_students_copy(tmp_path):
    repo = _copy(tmp_path)
    out = tmp_path / "out"
    messages = []
    written = i18n.build(out, repo=repo, say=messages.append)
    assert [p.name for p in written] == [f"{LESSON}.ipynb"]                # only the translated
    built = i18n.read_notebook(out / "notebooks" / f"{LESSON}.ipynb")
    assert i18n.source(built["cells"][0]).startswith("# 第 00 课")
    assert i18n.code_problems(i18n.read_notebook(repo / "notebooks" / f"{LESSON}.ipynb"), built, LESSON) == []
    assert (out / "notebooks" / "data").is_symlink() or not (repo / "notebooks" / "data").exists()
    # with the English of the others
    written = i18n.build(out, repo=repo, with_english=True, say=messages.append)
    assert [p.name for p in written] == [f"{OTHER}.ipynb"]
    # a student ran the lesson (outputs saved): the next build leaves it alone and says so
    target = out / "notebooks" / f"{LESSON}.ipynb"
    target.write_text(target.read_text(encoding="utf-8").replace("第 00 课", "第 00 课（我的笔记）"),
                      encoding="utf-8")
    _edit_notebook(repo, LESSON, lambda nb: nb["metadata"].__setitem__("x", 1))
    messages.clear()
    assert i18n.build(out, repo=repo, say=messages.append) == []
    assert "我的笔记" in target.read_text(encoding="utf-8")
    assert any("kept as it is" in m for m in messages)


def test_glossary_violations_fail_the_gate(tmp_path):
    repo = _copy(tmp_path, notebooks=(LESSON,))
    path = repo / "i18n" / "zh_CN" / f"{LESSON}.po"
    po = i18n.load_catalog(path)
    entry = next(e for e in po if e.msgctxt == f"{LESSON}#a1381a17")   # says "data parallelism"
    entry.msgstr = entry.msgstr.replace("数据并行", "数据平行")
    i18n.save_catalog(po, path)
    report = i18n.check(repo=repo)
    assert not report.ok
    found = [what for where, what in report.problems if where == f"{LESSON}#a1381a17"]
    assert any("'data parallel'" in w and "数据并行" in w for w in found), found
    assert any("数据平行" in w for w in found), found


def test_glossary_rules(tmp_path):
    rules = i18n.load_glossary(ROOT / "i18n" / "zh_CN" / "glossary")
    problems = i18n.glossary_problems
    assert problems("Data-parallel training with sharded optimizer states.",
                    "数据并行训练，优化器状态分片。", rules) == []
    # a term in code, math, a link target or an HTML tag is not prose
    assert problems("Call `offload_params` and read [the docs](offload.html).", "调用 `offload_params`，见[文档](offload.html)。", rules) == []
    # a hyphenated name is not its parts; the longest term wins
    assert problems("ZeRO-Offload moves it.", "ZeRO-Offload 把它搬走。", rules) == []
    assert problems("activation recomputation", "激活重计算", rules) == []
    assert problems("activation recomputation", "重新计算激活", rules)
    # collectives, ZeRO and rank stay in English
    assert problems("a ring all-reduce", "环形全规约", rules)
    assert problems("ZeRO shards states", "零冗余优化器对状态分片", rules)
    assert problems("ZeRO-1 shards states", "零冗余优化器第一阶段对状态分片", rules)
    assert problems("ZeRO-1 shards states", "ZeRO-1 对状态分片", rules) == []
    assert problems("every rank", "每个进程", rules)
    assert problems("every rank", "每个 rank", rules) == []
    assert problems("data parallel", "数据平行，数据并行", rules) == ["'数据平行': the glossary says 数据并行 for 'data parallel'"]
    # a title kept in English is not prose; the same words outside it are
    assert problems("*Trillion Parameter Models*", "*Trillion Parameter Models*", rules) == []
    assert problems("*Trillion Parameter Models* has parameters", "*Trillion Parameter Models*", rules)
    bad = tmp_path / "glossary"
    bad.write_text("data parallel 数据并行\n", encoding="utf-8")
    with pytest.raises(ValueError, match="is not a rule"):
        i18n.load_glossary(bad)


def test_lost_markup_fails_the_gate(tmp_path):
    repo = _copy(tmp_path, notebooks=(LESSON,))
    path = repo / "i18n" / "zh_CN" / f"{LESSON}.po"
    po = i18n.load_catalog(path)
    entry = next(e for e in po if e.msgctxt == f"{LESSON}#{CELL}")
    entry.msgstr = entry.msgstr.replace("`cluster.run(fn)`", "cluster.run(fn)").replace("## 1.", "1.")
    i18n.save_catalog(po, path)
    found = [what for where, what in i18n.check(repo=repo).problems if where == f"{LESSON}#{CELL}"]
    assert any("inline code" in w and "cluster.run(fn)" in w for w in found), found
    assert any(w.startswith("headings differ") for w in found), found


@pytest.mark.parametrize("damage, expected", [
    (lambda nb: nb["cells"][3].pop("id"), "has no id"),
    (lambda nb: nb["cells"][3].__setitem__("id", nb["cells"][0]["id"]), "share the id"),
])
def test_notebooks_without_unique_cell_ids_are_rejected(tmp_path, damage, expected):
    repo = _copy(tmp_path)
    _edit_notebook(repo, OTHER, damage)                        # not even a translated one
    report = i18n.check(repo=repo)
    assert any(expected in what for _, what in report.problems), report.problems


def test_every_english_notebook_has_unique_cell_ids():
    for path in i18n.english_notebooks(ROOT):
        assert i18n.cell_id_problems(i18n.read_notebook(path), path.name) == []


def test_a_catalog_without_its_notebook_fails(tmp_path):
    repo = _copy(tmp_path)
    shutil.copy(repo / "i18n" / "zh_CN" / f"{LESSON}.po", repo / "i18n" / "zh_CN" / "99_gone.po")
    assert any("99_gone" in what for _, what in i18n.check(repo=repo).problems)


def test_a_translation_that_loses_a_number_fails():
    assert i18n.markup_problems("It takes 3.64 s, not 2.46 s, on a 2-D mesh.", "耗时 3.64 s，而不是 2.46 s，在二维网格上。") == []
    found = i18n.markup_problems("It takes 3.64 s, not 2.46 s.", "耗时 3.46 s，而不是 2.46 s。")
    assert found == ["numbers of the English missing from the translation: ['3.64']"]


def test_emphasis_that_does_not_render_in_chinese_fails():
    """CommonMark's flanking rules: a closing ** after Chinese punctuation and before a Chinese
    character stays two literal asterisks. The gate renders each translation and refuses that."""
    assert i18n.markup_problems("**Learning goals.** After", "**学习目标。** 学完") == []
    found = i18n.markup_problems("**Learning goals.** After", "**学习目标。**学完")
    assert any("renders with literal ['**']" in p for p in found), found


def test_a_cell_split_and_edited_is_offered_its_sections_with_their_own_diff():
    """Split at a heading AND edited: the new cell gets the translation of the sections it came
    from (fuzzy), and the diff shows the edit against those sections only, not the whole old cell."""
    old_en = "Intro text here.\n\n## Exercises\n\nDo the exercise in `ex.py`."
    old_zh = "介绍文字。\n\n## 练习\n\n在 `ex.py` 中完成练习。"
    ratio, en_run, zh_run = i18n.closest_sections(old_en, old_zh, "## Exercises\n\nDo the exercise in [`ex.py`](ex.py).")
    assert ratio > 0.6 and en_run == "## Exercises\n\nDo the exercise in `ex.py`." and zh_run.startswith("## 练习")
    po = i18n.new_catalog("x")
    po.append(i18n.polib.POEntry(msgctxt="x#a", msgid=old_en, msgstr=old_zh))
    merged = {e.msgctxt: e for e in i18n.merge(po, [("x#a", "Intro text here."),
                                                    ("x#b", "## Exercises\n\nDo the exercise in [`ex.py`](ex.py).")],
                                               "x", accept_splits=True)}
    assert merged["x#a"].msgstr == "介绍文字。" and "fuzzy" not in merged["x#a"].flags   # an exact cut
    b = merged["x#b"]
    assert "fuzzy" in b.flags and b.msgstr.startswith("## 练习") and "介绍" not in b.msgstr
    assert b.previous_msgid == en_run and b.previous_msgctxt == "x#a"


def test_make_lab_in_chinese_makes_the_students_own_copy_and_never_overwrites_it(tmp_path):
    """`make lab COURSE_LANG=zh` (tools/i18n.py lab): make lab's copy rule, on the Chinese lessons."""
    (tmp_path / "checkout").mkdir()
    repo = _copy(tmp_path / "checkout")
    (repo / "exercises").mkdir()
    stub = ROOT / "exercises" / "ex00_collectives.py"
    shutil.copy(stub, repo / "exercises")
    dest, said = tmp_path / "mywork-zh", []
    i18n.lab(dest, repo=repo, say=said.append)
    lesson = dest / "notebooks" / f"{LESSON}.ipynb"
    assert i18n.source(i18n.read_notebook(lesson)["cells"][0]).startswith("# 第 00 课")     # Chinese
    assert (dest / "notebooks" / f"{OTHER}.ipynb").is_file()                          # English, not yet translated
    assert (dest / "exercises" / stub.name).read_bytes() == stub.read_bytes()         # the student's own stub
    # the student's work is never overwritten, even when the translation changes
    lesson.write_text(lesson.read_text(encoding="utf-8").replace("第 00 课", "第 00 课（我的）"), encoding="utf-8")
    (dest / "exercises" / stub.name).write_text("# my answer\n", encoding="utf-8")
    path = repo / "i18n" / "zh_CN" / f"{LESSON}.po"
    path.write_text(path.read_text(encoding="utf-8").replace("集合通信：rank 之间如何对话", "集合通信"),
                    encoding="utf-8")
    said.clear()
    i18n.lab(dest, repo=repo, say=said.append)
    assert "（我的）" in lesson.read_text(encoding="utf-8")
    assert (dest / "exercises" / stub.name).read_text(encoding="utf-8") == "# my answer\n"
    assert any("make lab COURSE_LANG=zh" in line for line in said), said     # how to take the new one
    # never into the checkout's own folders
    with pytest.raises(ValueError, match="checkout's own folder"):
        i18n.lab(repo / "notebooks", repo=repo, say=said.append)


def test_a_lesson_without_a_translation_is_listed_not_failed(tmp_path):
    repo = _copy(tmp_path)
    report = i18n.check(repo=repo)
    assert report.ok and report.untranslated_notebooks == [OTHER]
    assert f"not yet translated (not a failure" in i18n.format_report(report)
    assert OTHER in i18n.format_report(report).split("not yet translated", 1)[1]


def test_every_chinese_lesson_is_the_same_slide_deck():
    """The decks are RISE metadata on the cells (tools/slides.py derives it from the English headings
    and inserts the presenter notes): a Chinese lesson carries every cell's metadata as it is, so it
    is the same deck; and since the translation keeps each cell's headings, a slide that opens on a
    heading in English opens on a heading of the same level in Chinese, and no Chinese cell has a
    heading after text (which would start a slide with the section before's closing words)."""
    slides = importlib.util.spec_from_file_location("slides", ROOT / "tools" / "slides.py")
    slides_mod = importlib.util.module_from_spec(slides)
    slides.loader.exec_module(slides_mod)
    checked = 0
    for path in i18n.english_notebooks():
        catalog = i18n.po_path(path.stem)
        if not catalog.is_file():
            continue
        english = i18n.read_notebook(path)
        chinese = i18n.build_notebook(english, i18n.load_catalog(catalog), path.stem)
        assert [c.get("metadata") for c in chinese["cells"]] == [c.get("metadata") for c in english["cells"]]
        types = [c["metadata"].get("slideshow", {}).get("slide_type") for c in english["cells"]]
        assert types.count("slide") >= 3, f"{path.name}: no deck to compare"
        _, cuts = slides_mod.split_at_headings(copy.deepcopy(chinese["cells"]))
        assert cuts == 0, f"{path.stem}: a Chinese cell has a heading after text ({cuts} cut(s) needed)"
        for a, b in zip(english["cells"], chinese["cells"]):
            if a["cell_type"] != "markdown":
                continue
            opens = [h[1] for h in slides_mod._scan(i18n.source(a)) if h[0] == 0]
            assert opens == [h[1] for h in slides_mod._scan(i18n.source(b)) if h[0] == 0], (
                f"{path.stem}#{a['id']}: opens with heading level {opens} in English, not in Chinese")
            if "presenter-notes" in a["metadata"].get("tags", []):
                assert b == a                                # the notes stay English
        checked += 1
    assert checked >= 10

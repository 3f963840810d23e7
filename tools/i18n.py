"""The lessons in other languages (the Chinese edition first): one gettext catalog per lesson, a
build that swaps in the translated prose, and the gate that keeps the translation from drifting.

    python tools/i18n.py check                      # the CI gate (tests/test_i18n.py runs it): exit 1 on a problem
    python tools/i18n.py update                     # after editing an English lesson: merge its changes into the .po files
    python tools/i18n.py init notebooks/01_memory_anatomy.ipynb   # start translating a lesson (an empty .po)
    python tools/i18n.py build [--out build/zh] [--with-english]  # `make zh`: the Chinese lessons
    python tools/i18n.py lab [mywork-zh]             # `make lab COURSE_LANG=zh`: the student's own copy

The English notebooks in notebooks/ stay the only source of code. A translation is one file per
lesson, ``i18n/<lang>/<notebook stem>.po``, with one entry per markdown cell:

    msgctxt "00_collectives#e612a3f6"        the notebook and the cell's nbformat id
    msgid   "## 1. A process group\n..."     the English markdown, exactly as in the notebook
    msgstr  "## 1. 进程组\n..."               the translation

Because the English text is the key, any edit of the English makes its entry stale: ``update``
marks it fuzzy and keeps the English it was translated from (``#| msgid``), so the translator sees
the English diff; a cell that no longer exists becomes obsolete (``#~``); a new cell is
untranslated, or fuzzy with the translation of the cell it was cut from: a cell split at its
headings (as tools/slides.py splits them) gets, on each part, the translation cut at the same
headings, to be reviewed (``update --accept-splits`` takes such exact cuts as current); otherwise
the most similar old cell's whole translation. Cells tagged ``presenter-notes`` (generated from
presenter/*.md) and empty cells are not translated: the build keeps them as they are.

``build`` copies each English notebook that has a .po and replaces the ``source`` of each markdown
cell whose entry is translated and current; it touches nothing else (cell order, ids, code,
outputs, metadata, tags), so a zh notebook cannot differ from the English in a code cell. A cell
whose entry is stale or untranslated stays English in the build (and ``check`` fails). A lesson
with no .po is "not yet translated": listed, not a failure; ``--with-english`` puts its English
notebook in the tree too. A notebook in the output folder that was changed since this tool wrote
it is never overwritten. ``lab`` builds that tree (build/zh, a mirror of the checkout's layout) and
makes the student's copy from it with `make lab`'s own copy rule (tools/jupyter/mywork.py), in a
folder of its own (mywork-zh/: lessons and exercise stubs copied once, never overwritten).

``check`` fails on: a notebook with a missing or duplicate cell id; a .po without its notebook; an
untranslated, fuzzy or obsolete entry, or one whose English no longer matches the notebook (the
template is regenerated from the English every time, so an edit fails the gate before anyone runs
``update``); a translation that loses the English's markup (inline code, math, link targets, HTML
tags, the sequence of headings: the decks are cut at headings) or one of its numbers, or that
renders with a stray emphasis mark (CommonMark's flanking rules bite Chinese punctuation); a
glossary violation
(``i18n/<lang>/glossary``); a built notebook whose cells, code, outputs or metadata differ from the
English. It prints a table per notebook and, for each stale cell, the English diff.
"""
import argparse
import copy
import dataclasses
import difflib
import hashlib
import json
import pathlib
import re
import sys

import polib

REPO = pathlib.Path(__file__).resolve().parent.parent
LANGS = ("zh_CN",)
SKIP_TAGS = frozenset({"presenter-notes"})   # generated cells (tools/slides.py from presenter/*.md)
MANIFEST = ".i18n-build.json"                 # {notebook file name: sha256 of what build wrote}


# ---------------------------------------------------------------------------------------------
# Notebooks
# ---------------------------------------------------------------------------------------------

def read_notebook(path):
    return json.loads(pathlib.Path(path).read_text(encoding="utf-8"))


def dumps_notebook(nb):
    """nbformat's own serialization (sorted keys, indent 1, UTF-8 as is, a final newline): an
    English notebook written back by this function is byte-identical to the committed file."""
    return json.dumps(nb, sort_keys=True, indent=1, ensure_ascii=False) + "\n"


def source(cell):
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


def split_source(text):
    """Text as nbformat stores a source: a list of lines, each but the last ending in '\\n'."""
    return text.splitlines(keepends=True)


def english_notebooks(repo=REPO):
    return sorted((pathlib.Path(repo) / "notebooks").glob("[0-9][0-9]*_*.ipynb"))


def cell_id_problems(nb, name):
    """Every cell needs a unique nbformat id (nbformat >= 4.5): the translation is keyed by it."""
    problems, seen = [], {}
    if (nb.get("nbformat"), nb.get("nbformat_minor", 0)) < (4, 5):
        problems.append(f"{name}: nbformat {nb.get('nbformat')}.{nb.get('nbformat_minor')} has no cell ids: "
                        f"upgrade it to 4.5 (nbformat.validator.normalize, or save it in JupyterLab 4)")
    for index, cell in enumerate(nb.get("cells", [])):
        cid = cell.get("id")
        if not isinstance(cid, str) or not cid:
            problems.append(f"{name}: cell {index} ({cell.get('cell_type')}) has no id: give it one "
                            f"(nbformat.validator.normalize adds them)")
        elif cid in seen:
            problems.append(f"{name}: cells {seen[cid]} and {index} share the id {cid!r}: give cell {index} "
                            f"a new one (the translation of a cell is keyed by its id)")
        else:
            seen[cid] = index
    return problems


def translatable(cell):
    tags = set(cell.get("metadata", {}).get("tags", []))
    return cell["cell_type"] == "markdown" and not tags & SKIP_TAGS and source(cell).strip() != ""


def template(nb, stem):
    """[(msgctxt, msgid)] of the notebook's translatable cells, in order."""
    return [(f"{stem}#{cell['id']}", source(cell)) for cell in nb["cells"] if translatable(cell)]


# ---------------------------------------------------------------------------------------------
# Catalogs
# ---------------------------------------------------------------------------------------------

def po_path(stem, lang="zh_CN", repo=REPO):
    return pathlib.Path(repo) / "i18n" / lang / f"{stem}.po"


def new_catalog(stem, lang="zh_CN"):
    po = polib.POFile(wrapwidth=0)
    po.metadata = {
        "Project-Id-Version": f"zerolab notebooks/{stem}.ipynb",
        "Language": lang,
        "MIME-Version": "1.0",
        "Content-Type": "text/plain; charset=UTF-8",
        "Content-Transfer-Encoding": "8bit",
        "Plural-Forms": "nplurals=1; plural=0;",
    }
    po.header = (f"The {lang} translation of notebooks/{stem}.ipynb: one entry per markdown cell.\n"
                 f"Edit the msgstr lines only; after an English edit run: python tools/i18n.py update")
    return po


def load_catalog(path):
    po = polib.pofile(str(path), wrapwidth=0)
    po.wrapwidth = 0
    return po


def save_catalog(po, path):
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    po.wrapwidth = 0
    path.write_text(str(po) + "\n" if not str(po).endswith("\n") else str(po), encoding="utf-8")


def _similar(new, old):
    """How well an old English text fits a new cell: 1.0 when the new text is a part of the old one
    (a cell split at a heading), else difflib's ratio."""
    a, b = new.strip(), old.strip()
    if a and a in b:
        return 1.0
    return difflib.SequenceMatcher(None, a, b, autojunk=False).ratio()


def _sections(text):
    """``text`` cut before each markdown heading (outside fenced code): the pieces, in order."""
    pieces, current, fenced = [], [], False
    for line in text.splitlines(keepends=True):
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,6}\s", line) and current:
            pieces.append("".join(current))
            current = []
        current.append(line)
    pieces.append("".join(current))
    return pieces


def cut_translation(old_english, translation, new_english):
    """The part of ``translation`` that translates ``new_english`` when that is a run of whole
    sections of ``old_english`` (a cell split at its headings, as tools/slides.py splits them), or
    None. The translation keeps the English's headings (the gate checks it), so section k of one is
    section k of the other."""
    en, zh = _sections(old_english), _sections(translation)
    if len(en) != len(zh) or len(en) < 2:
        return None
    want = new_english.strip()
    for i in range(len(en)):
        for j in range(i + 1, len(en) + 1):
            if (i, j) != (0, len(en)) and "".join(en[i:j]).strip() == want:
                return "".join(zh[i:j]).strip("\n")
    return None


def closest_sections(old_english, translation, new_english):
    """(ratio, English, translation) of the run of whole sections of ``old_english`` most similar
    to ``new_english``, with the same run of ``translation`` (the whole texts when their sections
    do not pair up): what to offer a cell cut from an old one and edited too, and the English to
    diff it against."""
    en, zh = _sections(old_english), _sections(translation)
    runs = [(old_english, translation)]
    if len(en) == len(zh):
        runs += [("".join(en[i:j]), "".join(zh[i:j])) for i in range(len(en))
                 for j in range(i + 1, len(en) + 1) if (i, j) != (0, len(en))]
    ratio, en_run, zh_run = max(((_similar(new_english, a), a, b) for a, b in runs),
                                key=lambda found: found[0])
    return ratio, en_run.strip("\n"), zh_run.strip("\n")


def merge(po, entries, stem, *, accept_splits=False):
    """The catalog ``update`` writes: ``entries`` ([(msgctxt, msgid)] from the English) in order,
    each carrying what ``po`` knew about it. Returns a new POFile; ``po`` is left as it was.
    ``accept_splits``: a cell whose English is exactly a run of whole sections of a translated
    cell's English (a split at headings, nothing else changed) takes the same sections of its
    translation as current, not fuzzy."""
    out = new_catalog(stem, po.metadata.get("Language", "zh_CN") if po is not None else "zh_CN")
    if po is not None:
        out.metadata.update(po.metadata)
        out.header = po.header or out.header
    old = {e.msgctxt: e for e in (po or []) if not e.obsolete}
    old_obsolete = {e.msgctxt: e for e in (po or []) if e.obsolete}
    wanted = dict(entries)
    # Translations that lost their cell or their English: candidates for a new cell cut from them.
    donors = [e for e in old.values() if e.msgstr and e.msgid != wanted.get(e.msgctxt)]
    donors += [e for e in old_obsolete.values() if e.msgstr and e.msgctxt not in wanted]
    for ctxt, msgid in entries:
        prev = old.get(ctxt) or old_obsolete.get(ctxt)
        entry = polib.POEntry(msgctxt=ctxt, msgid=msgid, msgstr="")
        if prev is not None and prev.msgstr:
            entry.msgstr = prev.msgstr
            if prev.msgid != msgid or "fuzzy" in prev.flags:
                entry.flags.append("fuzzy")
                # the English it was translated from: the oldest one known
                entry.previous_msgid = prev.previous_msgid if "fuzzy" in prev.flags and prev.previous_msgid \
                    else prev.msgid
                if prev.previous_msgctxt:
                    entry.previous_msgctxt = prev.previous_msgctxt
                elif "fuzzy" not in prev.flags:      # shortened by a split: keep its own sections
                    cut = cut_translation(prev.msgid, prev.msgstr, msgid)
                    if cut and accept_splits:
                        entry.msgstr = cut
                        entry.flags.remove("fuzzy")
                        entry.previous_msgid = None
                    elif cut:
                        entry.msgstr = cut
                    else:                            # split and edited: the closest sections, to revise
                        ratio, en_run, zh_run = closest_sections(prev.msgid, prev.msgstr, msgid)
                        if ratio >= 0.6:
                            entry.msgstr, entry.previous_msgid = zh_run, en_run
        elif prev is None and donors:
            def source_of(e):
                return e.previous_msgid if "fuzzy" in e.flags and e.previous_msgid else e.msgid
            # a donor whose sections this cell is, else the most similar English
            cuts = [(e, cut_translation(source_of(e), e.msgstr, msgid)) for e in donors]
            cuts = [(e, c) for e, c in cuts if c]
            if cuts and accept_splits and "fuzzy" not in cuts[0][0].flags:
                entry.msgstr = cuts[0][1]
            elif cuts:
                best = cuts[0][0]
                entry.msgstr = cuts[0][1]
                entry.flags.append("fuzzy")
                entry.previous_msgid = source_of(best)
                entry.previous_msgctxt = best.previous_msgctxt or best.msgctxt
            else:                                    # cut from an old cell and edited: its closest sections
                ratio, en_run, zh_run, best = max(
                    ((*closest_sections(source_of(e), e.msgstr, msgid), e) for e in donors),
                    key=lambda found: found[0])
                if ratio >= 0.6:
                    entry.msgstr = zh_run
                    entry.flags.append("fuzzy")
                    entry.previous_msgid = en_run
                    entry.previous_msgctxt = best.previous_msgctxt or best.msgctxt
        out.append(entry)
    for e in list(old.values()) + list(old_obsolete.values()):
        if e.msgctxt not in wanted and e.msgstr:
            gone = copy.deepcopy(e)
            gone.obsolete = True
            out.append(gone)
    return out


# ---------------------------------------------------------------------------------------------
# Markup and glossary
# ---------------------------------------------------------------------------------------------

FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.M | re.S)
CODE = re.compile(r"(`+)(.+?)\1", re.S)
MATH = re.compile(r"\$\$.+?\$\$|\$(?:[^$\n]|\n(?!\s*\n))+?\$", re.S)   # inline math may span a line break
LINK_TARGET = re.compile(r"\]\(([^)\s]+)[^)]*\)")
URL = re.compile(r"https?://\S+")
HTML_TAG = re.compile(r"</?([A-Za-z][A-Za-z0-9]*)\b[^>]*>")
HEADING = re.compile(r"^(#{1,6})\s", re.M)
NUMBER = re.compile(r"(?<![\w.])\d+(?:[.,]\d+)*(?!-D\b)")      # 2,048 · 1.5 · 02; not the 2 of "2-D"


def _strip_fences(text):
    return FENCE.sub(" ", text)


def markup(text):
    """What a translation must carry over unchanged."""
    body = _strip_fences(text)
    code_spans = [" ".join(m.group(2).split()) for m in CODE.finditer(body)]   # as CommonMark reads them
    rest = CODE.sub(" ", body)
    return {
        "fenced code": [m.group(0) for m in FENCE.finditer(text)],
        "inline code": code_spans,
        "math": [" ".join(m.group(0).split()) for m in MATH.finditer(rest)],
        "link targets": LINK_TARGET.findall(rest),
        "HTML tags": sorted(m.group(0).split()[0].rstrip(">").lower() for m in HTML_TAG.finditer(rest)),
        "headings": [len(m.group(1)) for m in HEADING.finditer(rest)],
    }


def _rendered_leftovers(text):
    """Emphasis and code marks that CommonMark left as literal characters: in Chinese, ``**粗体**，``
    renders but a closing ``**`` after punctuation and before a letter does not (the flanking rules)."""
    from markdown_it import MarkdownIt
    html = MarkdownIt("commonmark").enable("table").render(MATH.sub(" ", text))
    html = re.sub(r"<code>.*?</code>|<pre>.*?</pre>", " ", html, flags=re.S)
    return sorted(set(re.findall(r"\*+|_{2,}|`+", html)))


def markup_problems(msgid, msgstr):
    en, zh = markup(msgid), markup(msgstr)
    problems = []
    # every number of the English prose is in the translation: a sentence never loses its number
    numbers = set(NUMBER.findall(msgstr))
    lost = [n for n in dict.fromkeys(NUMBER.findall(prose(msgid))) if n not in numbers]
    if lost:
        problems.append(f"numbers of the English missing from the translation: {lost}")
    left = [m for m in _rendered_leftovers(msgstr) if m not in _rendered_leftovers(msgid)]
    if left:
        problems.append(f"renders with literal {left}: an emphasis or code mark does not close "
                        f"(in Chinese put a space or no punctuation next to the closing mark)")
    for kind in ("fenced code", "inline code", "math", "link targets"):
        missing = [x for x in dict.fromkeys(en[kind]) if x not in zh[kind]]
        if missing:
            problems.append(f"{kind} of the English missing from the translation: {missing}")
    for kind in ("HTML tags", "headings"):
        if en[kind] != zh[kind]:
            problems.append(f"{kind} differ: English {en[kind]}, translation {zh[kind]}")
    return problems


def prose(text):
    """The English a reader reads as words: without code, math, link targets, URLs and HTML tags."""
    text = _strip_fences(text)
    text = CODE.sub(" ", text)
    text = MATH.sub(" ", text)
    text = LINK_TARGET.sub("] ", text)
    text = URL.sub(" ", text)
    return HTML_TAG.sub(" ", text)


@dataclasses.dataclass(frozen=True)
class Rule:
    term: str                 # as written in the glossary
    pattern: re.Pattern       # matches the term in English prose
    required: str             # what the translation must contain
    keep: bool                # the term stays in English
    avoid: tuple = ()         # renderings the translation must not use
    case_sensitive: bool = False


def _term_pattern(term, case_sensitive):
    words = [re.escape(w) for w in re.split(r"[ -]", term)]
    body = r"(?:\s+|-)".join(words)      # a line break may fall between the words
    # whole words, English endings allowed (shard -> sharded, sharding); not inside a longer
    # hyphenated name (offload in ZeRO-Offload)
    return re.compile(rf"(?<![\w-]){body}[a-z]*(?!\w)", 0 if case_sensitive else re.I)


def load_glossary(path):
    """Rules from a glossary file; see i18n/zh_CN/glossary for the format."""
    rules = []
    for number, line in enumerate(pathlib.Path(path).read_text(encoding="utf-8").splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        if line.startswith("keep:"):
            for term in (t.strip() for t in line[len("keep:"):].split(",")):
                if term:
                    cs = term != term.lower()
                    rules.append(Rule(term, _term_pattern(term, cs), term, True, (), cs))
            continue
        if "=" not in line:
            raise ValueError(f"{path}:{number}: {line!r} is not a rule: write 'english term = 中文' "
                             f"(optionally '| avoid X, Y') or 'keep: term, term'")
        left, right = line.split("=", 1)
        required, _, avoid = right.partition("|")
        avoid = avoid.strip()
        if avoid and not avoid.startswith("avoid "):
            raise ValueError(f"{path}:{number}: after '|' write 'avoid X, Y', not {avoid!r}")
        avoid = tuple(a.strip() for a in avoid[len("avoid "):].split(",") if a.strip()) if avoid else ()
        term = left.strip()
        rules.append(Rule(term, _term_pattern(term, False), required.strip(), False, avoid))
    # the longest term first: "activation recomputation" before "activation"
    return sorted(rules, key=lambda r: -len(r.term))


ITALIC = re.compile(r"(?<![*\w])\*([^*]+?)\*(?!\*)")


def glossary_problems(msgid, msgstr, rules):
    zh = msgstr if msgstr is not None else ""
    text = prose(msgid)
    # a title kept in English, in italics (*ZeRO: Memory Optimizations Toward Training Trillion
    # Parameter Models*), is not prose to translate
    flat = " ".join(zh.split())
    text = ITALIC.sub(lambda m: " " * len(m.group(0)) if " ".join(m.group(0).split()) in flat
                      else m.group(0), text)
    problems = []
    for rule in rules:
        if not rule.pattern.search(text):
            continue
        text = rule.pattern.sub(lambda m: " " * len(m.group(0)), text)   # consumed
        have = zh if rule.case_sensitive else zh.lower()
        need = rule.required if rule.case_sensitive else rule.required.lower()
        if need not in have:
            how = "keeps it in English" if rule.keep else f"says {rule.required}"
            problems.append(f"the English says {rule.term!r}: the glossary {how}, the translation does not")
        for bad in rule.avoid:          # only where the English uses the term: 碎片 is fine for fragmentation
            if bad in zh:
                problems.append(f"{bad!r}: the glossary says {rule.required} for {rule.term!r}")
    return problems


# ---------------------------------------------------------------------------------------------
# Build
# ---------------------------------------------------------------------------------------------

def current_translations(po, stem, nb):
    """{cell id: msgstr} of the entries that are translated, not fuzzy and match today's English."""
    english = dict(template(nb, stem))
    found = {}
    for e in po:
        if e.obsolete or "fuzzy" in e.flags or not e.msgstr or english.get(e.msgctxt) != e.msgid:
            continue
        found[e.msgctxt.split("#", 1)[1]] = e.msgstr
    return found


def build_notebook(nb, po, stem):
    """The translated notebook: a deep copy of ``nb`` whose translatable markdown cells have the
    current translation as their source. Nothing else is assigned."""
    out = copy.deepcopy(nb)
    translations = current_translations(po, stem, nb)
    for cell in out["cells"]:
        if translatable(cell) and cell["id"] in translations:
            cell["source"] = split_source(translations[cell["id"]])
    return out


def _without_prose(nb):
    """The notebook with every markdown source blanked: what must be equal across languages."""
    nb = copy.deepcopy(nb)
    for cell in nb["cells"]:
        if cell["cell_type"] == "markdown":
            cell["source"] = None
    return nb


def code_problems(english, built, stem):
    """Differences between a built notebook and its English beyond markdown sources: none by
    construction; checked on the serialized cells so that a change of the build cannot slip by."""
    a, b = _without_prose(english), _without_prose(built)
    problems = []
    if len(a["cells"]) != len(b["cells"]):
        return [f"{stem}: {len(b['cells'])} cells built, {len(a['cells'])} in the English"]
    for index, (x, y) in enumerate(zip(a["cells"], b["cells"])):
        if dumps_notebook(x) != dumps_notebook(y):
            what = "code cell" if x["cell_type"] == "code" else f"{x['cell_type']} cell"
            problems.append(f"{stem}#{x.get('id')}: the built {what} {index} differs from the English "
                            f"(source, outputs or metadata)")
    for key in set(a) | set(b):
        if key != "cells" and dumps_notebook(a.get(key)) != dumps_notebook(b.get(key)):
            problems.append(f"{stem}: the notebook's {key!r} differs from the English")
    return problems


def _sha(text):
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def build(out_dir, *, lang="zh_CN", with_english=False, repo=REPO, say=print):
    """Write the translated notebooks into ``out_dir``/notebooks (and, with ``with_english``, the
    English of the others). Returns the paths written. A notebook there that differs from what this
    function wrote last time (its outputs saved by a student) is left as it is, with a line saying so."""
    out = pathlib.Path(out_dir) / "notebooks"
    out.mkdir(parents=True, exist_ok=True)
    manifest_path = out / MANIFEST
    manifest = json.loads(manifest_path.read_text(encoding="utf-8")) if manifest_path.is_file() else {}
    written, kept = [], []
    for path in english_notebooks(repo):
        stem = path.stem
        nb = read_notebook(path)
        catalog = po_path(stem, lang, repo)
        if catalog.is_file():
            po = load_catalog(catalog)
            built = build_notebook(nb, po, stem)
            problems = code_problems(nb, built, stem)
            if problems:       # cannot happen by construction; refuse rather than write
                raise RuntimeError("; ".join(problems))
            english_cells = {c for c, _ in template(nb, stem)}
            n_stale = len(english_cells) - len(current_translations(po, stem, nb))
            if n_stale:
                say(f"{stem}: {n_stale} cell(s) stay English (stale or untranslated): "
                    f"python tools/i18n.py check lists them")
            text = dumps_notebook(built)
        elif with_english:
            text = path.read_text(encoding="utf-8")
        else:
            continue
        target = out / path.name
        if target.is_file():
            on_disk = target.read_text(encoding="utf-8")
            if on_disk == text:
                continue
            if manifest.get(path.name) != _sha(on_disk):
                kept.append(path.name)
                say(f"{target}: changed since it was built (your outputs or edits): kept as it is; to "
                    f"get the new version move it aside and build again")
                continue
        target.write_text(text, encoding="utf-8")
        manifest[path.name] = _sha(text)
        written.append(target)
    manifest_path.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    # the relative paths lessons use: data/ beside the notebooks, ../benchmarks, ../exercises
    links = {out / "data": pathlib.Path(repo) / "notebooks" / "data",
             out.parent / "benchmarks": pathlib.Path(repo) / "benchmarks",
             out.parent / "exercises": pathlib.Path(repo) / "exercises"}
    for link, target in links.items():
        if target.exists() and not link.exists() and not link.is_symlink():
            link.symlink_to(target.resolve(), target_is_directory=True)
    return written


def lab(dest, *, lang="zh_CN", repo=REPO, say=print):
    """`make lab COURSE_LANG=zh`: the student's own copy of the course in ``dest`` (default
    mywork-zh/), made by make lab's own copy rule (tools/jupyter/mywork.py: lessons and exercise
    stubs copied once and never overwritten, course material refreshed), from a mirror of the
    checkout in build/zh whose notebooks/ are the translated lessons (and the English of those not
    yet translated)."""
    repo = pathlib.Path(repo).resolve()
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent / "jupyter"))
    import mywork                                    # noqa: E402  (make lab's copy rule: tools/jupyter/)
    dest = pathlib.Path(dest).resolve()
    inside = dest.relative_to(repo).parts if repo in dest.parents else ()
    if dest == repo or inside and inside[0] in mywork.COURSE_FOLDERS + ("build", "i18n"):
        raise ValueError(f"MYWORK={dest} is the checkout's own folder: choose a folder of its own "
                         f"(the default is {repo / 'mywork-zh'})")
    mirror = repo / "build" / "zh"
    build(mirror, lang=lang, with_english=True, repo=repo, say=say)
    for name in ("presenter",):                      # the rest of the layout mywork.sync reads
        link, target = mirror / name, repo / name
        if target.exists() and not link.exists() and not link.is_symlink():
            link.symlink_to(target, target_is_directory=True)
    for line in mywork.sync(dest, repo=mirror):
        say(line.replace("&& make lab", "&& make lab COURSE_LANG=zh"))
    return dest


# ---------------------------------------------------------------------------------------------
# Check
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Report:
    rows: list = dataclasses.field(default_factory=list)          # per translated notebook
    untranslated_notebooks: list = dataclasses.field(default_factory=list)
    problems: list = dataclasses.field(default_factory=list)      # (where, what)
    details: list = dataclasses.field(default_factory=list)       # text blocks (diffs)

    @property
    def ok(self):
        return not self.problems


def _diff(old, new):
    lines = difflib.unified_diff(old.splitlines(), new.splitlines(), "translated English",
                                 "current English", lineterm="", n=1)
    return "\n".join("    " + line for line in lines)


def check(*, lang="zh_CN", repo=REPO, notebooks=None):
    """Everything the gate checks, without writing a file. Returns a Report."""
    repo = pathlib.Path(repo)
    report = Report()
    paths = notebooks if notebooks is not None else english_notebooks(repo)
    by_stem = {}
    for path in paths:
        path = pathlib.Path(path)
        nb = read_notebook(path)
        by_stem[path.stem] = (path, nb)
        for p in cell_id_problems(nb, path.name):
            report.problems.append((path.name, p))
    catalogs = sorted((repo / "i18n" / lang).glob("*.po"))
    for catalog in catalogs:
        if catalog.stem not in by_stem:
            report.problems.append((catalog.name, f"{catalog} translates notebooks/{catalog.stem}.ipynb, "
                                                  f"which does not exist: rename or delete it"))
    glossary_file = repo / "i18n" / lang / "glossary"
    rules = load_glossary(glossary_file) if glossary_file.is_file() else []
    translated_stems = {c.stem for c in catalogs}
    for stem, (path, nb) in by_stem.items():
        if stem not in translated_stems:
            report.untranslated_notebooks.append(stem)
            continue
        if any(p for w, p in report.problems if w == path.name):
            continue                                   # ids broken: nothing can be keyed
        po = load_catalog(repo / "i18n" / lang / f"{stem}.po")
        entries = template(nb, stem)
        merged = merge(po, entries, stem)
        row = {"notebook": stem, "cells": len(entries), "translated": 0, "fuzzy": 0,
               "untranslated": 0, "obsolete": 0, "markup": 0, "glossary": 0, "code": "ok"}
        for e in merged:
            where = e.msgctxt
            if e.obsolete:
                row["obsolete"] += 1
                report.problems.append((where, "obsolete: its cell is gone from the English; delete the "
                                               "#~ entry once its text is reused"))
                report.details.append(f"{where}  obsolete (cell removed); was:\n" +
                                      "\n".join("    " + x for x in e.msgid.splitlines()))
            elif not e.msgstr:
                row["untranslated"] += 1
                report.problems.append((where, "untranslated"))
                report.details.append(f"{where}  untranslated; the English:\n" +
                                      "\n".join("    " + x for x in e.msgid.splitlines()))
            elif "fuzzy" in e.flags:
                row["fuzzy"] += 1
                old = e.previous_msgid or ""
                moved = f" (text taken from {e.previous_msgctxt})" if e.previous_msgctxt and \
                    e.previous_msgctxt != e.msgctxt else ""
                report.problems.append((where, f"stale: the English changed since it was translated{moved}"))
                report.details.append(f"{where}  stale{moved}; the English diff:\n{_diff(old, e.msgid)}")
            else:
                row["translated"] += 1
                for p in markup_problems(e.msgid, e.msgstr):
                    row["markup"] += 1
                    report.problems.append((where, p))
                for p in glossary_problems(e.msgid, e.msgstr, rules):
                    row["glossary"] += 1
                    report.problems.append((where, p))
        built = build_notebook(nb, po, stem)
        code = code_problems(nb, built, stem)
        if code:
            row["code"] = f"{len(code)} DIFFER"
            report.problems += [(stem, p) for p in code]
        report.rows.append(row)
    return report


def format_report(report, lang="zh_CN"):
    cols = ["notebook", "cells", "translated", "fuzzy", "untranslated", "obsolete", "markup", "glossary",
            "code"]
    total = len(report.rows) + len(report.untranslated_notebooks)
    lines = [f"{lang}: {len(report.rows)} of {total} notebooks translated "
             f"(fuzzy = stale: the English changed since)"]
    if report.rows:
        widths = [max(len(c), *(len(str(r[c])) for r in report.rows)) for c in cols]
        lines.append("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
        for r in report.rows:
            lines.append("  ".join(str(r[c]).ljust(w) for c, w in zip(cols, widths)))
    if report.untranslated_notebooks:
        lines.append("not yet translated (not a failure; the zh build leaves them out, "
                     "--with-english adds them in English): " + ", ".join(report.untranslated_notebooks))
    if report.details:
        lines.append("")
        lines.append("stale cells (update the msgstr, then remove the fuzzy flag and the #| lines):")
        lines.extend(report.details)
    if report.problems:
        lines.append("")
        lines.append(f"FAILED: {len(report.problems)} problem(s):")
        lines.extend(f"  {where}: {what}" for where, what in report.problems)
    else:
        lines.append("OK: every translated cell is current, the glossary holds, the code cells are the English's")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------

def update(*, lang="zh_CN", repo=REPO, say=print, accept_splits=False):
    """Merge every existing .po with its notebook's English (the msgmerge step)."""
    changed = []
    for catalog in sorted((pathlib.Path(repo) / "i18n" / lang).glob("*.po")):
        path = pathlib.Path(repo) / "notebooks" / f"{catalog.stem}.ipynb"
        if not path.is_file():
            say(f"{catalog}: notebooks/{catalog.stem}.ipynb does not exist: left as it is")
            continue
        nb = read_notebook(path)
        problems = cell_id_problems(nb, path.name)
        if problems:
            raise ValueError("; ".join(problems))
        po = load_catalog(catalog)
        merged = merge(po, template(nb, catalog.stem), catalog.stem, accept_splits=accept_splits)
        if str(merged) != str(po):
            save_catalog(merged, catalog)
            changed.append(catalog)
            fuzzy = sum(1 for e in merged if "fuzzy" in e.flags and not e.obsolete)
            new = sum(1 for e in merged if not e.msgstr and not e.obsolete)
            gone = sum(1 for e in merged if e.obsolete)
            say(f"{catalog}: {fuzzy} stale, {new} untranslated, {gone} obsolete")
    return changed


def init(notebook, *, lang="zh_CN", repo=REPO):
    path = pathlib.Path(notebook)
    target = po_path(path.stem, lang, repo)
    if target.exists():
        raise ValueError(f"{target} exists: run `python tools/i18n.py update` instead")
    nb = read_notebook(path)
    problems = cell_id_problems(nb, path.name)
    if problems:
        raise ValueError("; ".join(problems))
    save_catalog(merge(None, template(nb, path.stem), path.stem), target)
    return target


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--lang", default="zh_CN", choices=LANGS)
    common.add_argument("--repo", default=str(REPO), help="the checkout (default: this one)")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("check", parents=[common], help="the CI gate: exit 1 on anything stale, missing or wrong")
    p_update = sub.add_parser("update", parents=[common], help="merge the English's changes into every existing .po")
    p_update.add_argument("--accept-splits", action="store_true",
                          help="a cell split at its headings (and nothing else changed) keeps its part of "
                               "the translation as current, not fuzzy")
    p_init = sub.add_parser("init", parents=[common], help="an empty .po for a lesson not yet translated")
    p_init.add_argument("notebook")
    p_build = sub.add_parser("build", parents=[common], help="the translated notebooks, into OUT/notebooks")
    p_build.add_argument("--out", default=None, help="default: REPO/build/zh")
    p_build.add_argument("--with-english", action="store_true",
                         help="also the lessons not yet translated, in English")
    p_lab = sub.add_parser("lab", parents=[common],
                           help="`make lab COURSE_LANG=zh`: make or update the student's copy DEST")
    p_lab.add_argument("dest", nargs="?", default=None, help="default: REPO/mywork-zh")
    args = parser.parse_args(argv)
    repo = pathlib.Path(args.repo)
    if args.command == "check":
        report = check(lang=args.lang, repo=repo)
        print(format_report(report, args.lang))
        return 0 if report.ok else 1
    if args.command == "update":
        update(lang=args.lang, repo=repo, accept_splits=args.accept_splits)
        return 0
    if args.command == "init":
        print(init(args.notebook, lang=args.lang, repo=repo))
        return 0
    if args.command == "lab":
        try:
            lab(args.dest or repo / "mywork-zh", lang=args.lang, repo=repo)
        except (ValueError, OSError) as exc:
            print(f"make lab: {exc}", file=sys.stderr)
            return 1
        return 0
    out = pathlib.Path(args.out) if args.out else repo / "build" / "zh"
    written = build(out, lang=args.lang, with_english=args.with_english, repo=repo)
    report = check(lang=args.lang, repo=repo)
    print(f"built {len(written)} notebook(s) into {out / 'notebooks'}"
          + (f"; not yet translated: {', '.join(report.untranslated_notebooks)}"
             if report.untranslated_notebooks else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())

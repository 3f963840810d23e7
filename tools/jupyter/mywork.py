"""Your own copy of the course, made by `make lab`: the lessons and exercise stubs you run and edit.

    python tools/jupyter/mywork.py [DEST]          # default: mywork/ beside this checkout's notebooks/

JupyterLab (`make lab`) opens DEST, never the checkout's notebooks/: running a lesson saves outputs
and widget state into the notebook (autosave), and editing an exercise changes its file, so a
student working on the committed files would turn `git status` dirty, make `git pull` conflict and
publish half-run lessons on the site. DEST mirrors the checkout's layout, so that a lesson's
relative links and paths work in both (`../exercises/ex00_collectives.py`,
`../benchmarks/RESULTS.md`, `data/...`):

    DEST/notebooks/NN_*.ipynb     the lessons         copied once, NEVER overwritten
    DEST/exercises/*.py           the exercise stubs  copied once, NEVER overwritten
    DEST/notebooks/NN_*.css       each deck's own style (RISE loads it): created once, empty
    DEST/notebooks/exercises      a symbolic link to ../exercises, for the lab's file browser
    DEST/notebooks/rise.css       the decks' shared style      } course material, not your work:
    DEST/notebooks/data/...       data the lessons read        } refreshed from the checkout
    DEST/benchmarks/RESULTS.md    results lesson 07 reads      } whenever it changes there
    DEST/presenter/*.md           the presenter guides         }

A lesson or exercise that appears in the checkout later (a `git pull`) is copied in at the next
`make lab`; one that changed in the checkout since it was copied is left as it is, with a line
saying how to take the new version (move yours aside, then `make lab`). DEST is in .gitignore.
A lesson's grade cell grades DEST/exercises (`zerolab.grade.check` grades the `exercises/` beside
the lesson's folder), and `make grade` grades it too once it exists.
"""
import hashlib
import json
import pathlib
import shutil
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]
MANIFEST = ".zerolab-copy.json"   # {relative path: sha256 of the checkout's file when it was copied}
COURSE_FOLDERS = ("notebooks", "exercises", "solutions", "tests", "zerolab", "tools", "benchmarks",
                  "site", "presenter")   # the checkout's own: never a copy's destination
RISE_CSS = pathlib.Path(__file__).resolve().parent / "rise.css"
DECK_CSS = ("/* RISE loads this file after rise.css when this lesson is shown as slides: put styles\n"
            "   for this deck only here (make lab never overwrites it). */\n")


def _sha256(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _owned(repo):
    """(relative path, source) of every file copied once and then the student's: lessons, exercises."""
    lessons = sorted((repo / "notebooks").glob("[0-9][0-9]*_*.ipynb"))
    exercises = sorted(p for p in (repo / "exercises").glob("*.py"))
    return [(p.relative_to(repo).as_posix(), p) for p in lessons + exercises]


def _refreshed(repo):
    """(relative path, source) of the course material kept equal to the checkout's."""
    files = [(f"notebooks/{p.relative_to(repo / 'notebooks').as_posix()}", p)
             for p in sorted((repo / "notebooks" / "data").rglob("*")) if p.is_file()]
    results = repo / "benchmarks" / "RESULTS.md"
    if results.is_file():
        files.append(("benchmarks/RESULTS.md", results))
    files += [(f"presenter/{p.name}", p) for p in sorted((repo / "presenter").glob("*.md"))]
    files.append(("notebooks/rise.css", RISE_CSS))
    return files


def sync(dest, repo=REPO):
    """Make or update the copy in ``dest``; return the lines to print (what was done, what to know)."""
    dest = pathlib.Path(dest).resolve()
    repo = pathlib.Path(repo).resolve()
    inside = dest.relative_to(repo).parts if repo in dest.parents else ()
    if dest == repo or inside and inside[0] in COURSE_FOLDERS:
        raise ValueError(f"MYWORK={dest} is the checkout's own folder: choose a folder of its own "
                         f"(the default is {repo / 'mywork'})")
    first = not (dest / MANIFEST).is_file()
    manifest = {} if first else json.loads((dest / MANIFEST).read_text(encoding="utf-8"))
    added, changed, lines = [], [], []
    for rel, src in _owned(repo):
        target, digest = dest / rel, _sha256(src)
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, target)
            manifest[rel] = digest
            added.append(rel)
        elif rel in manifest and manifest[rel] != digest:
            changed.append(rel)
        else:
            manifest.setdefault(rel, digest)
    for rel, src in _refreshed(repo):
        target = dest / rel
        if not target.is_file() or target.read_bytes() != src.read_bytes():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, target)
    # The lab opens a lesson, and its file browser then shows the lesson's folder, notebooks/: a link
    # there to ../exercises puts the stubs one double-click away (the Exercises section's own link
    # opens a stub in one click).
    shortcut = dest / "notebooks" / "exercises"
    if not shortcut.exists() and not shortcut.is_symlink():
        try:
            shortcut.symlink_to(pathlib.Path("..") / "exercises", target_is_directory=True)
        except OSError:
            pass                               # no symbolic links here: the link in each lesson still works
    for lesson in sorted((dest / "notebooks").glob("[0-9][0-9]*_*.ipynb")):
        css = lesson.with_suffix(".css")      # RISE asks for <lesson>.css: without it, a 404 per deck
        if not css.exists():
            css.write_text(DECK_CSS, encoding="utf-8")
    (dest / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n", encoding="utf-8")

    shown = _shown(dest)
    if first:
        n_lessons = sum(r.endswith(".ipynb") for r in added)
        n_ex = sum(pathlib.PurePath(r).name.startswith("ex") for r in added)
        lines.append(f"make lab: your copy of the course is {shown}/ ({n_lessons} lessons, {n_ex} exercise "
                     f"stubs): you run and edit these; the committed notebooks/ and exercises/ stay as they are.")
    elif added:
        lines.append(f"make lab: new in the course, copied into {shown}/: {', '.join(added)}")
    for rel in changed:
        lines.append(f"make lab: {rel} changed in the checkout since your copy was made; yours is kept. "
                     f"To take the new one: mv {shown}/{rel} {shown}/{rel}.old && make lab")
    return lines


def _shown(dest):
    try:
        return dest.relative_to(pathlib.Path.cwd().resolve()).as_posix()
    except ValueError:
        return str(dest)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) > 1 or argv and argv[0].startswith("-"):
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    try:
        lines = sync(argv[0] if argv else REPO / "mywork")
    except (ValueError, OSError) as exc:
        print(f"make lab: {exc}", file=sys.stderr)
        return 1
    for line in lines:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Check a built static site: every internal link, anchor and image resolves, nothing needs the network.

    python tools/check_site.py _site

For every HTML page: each relative `href`/`src` (links, images, scripts, stylesheets, sources)
must name a file inside the site, and a `#fragment` must name an `id` of the target page; a
resource the page *loads* (script, stylesheet, image, iframe, media, font in a local CSS file) must
not come from another host. Links a reader may follow to other sites (`<a href="https://...">`,
arXiv papers) are allowed. `tools/build_site.py` runs this after Sphinx; exit status 1 on a problem.
"""
import html.parser
import pathlib
import re
import sys
import urllib.parse

# (tag, attribute) pairs whose URL the browser fetches when the page loads
LOADED = {("script", "src"), ("img", "src"), ("iframe", "src"), ("source", "src"), ("video", "src"),
          ("audio", "src"), ("embed", "src"), ("object", "data"), ("input", "src"), ("video", "poster")}
LOADING_RELS = {"stylesheet", "icon", "preload", "modulepreload", "prefetch", "manifest", "apple-touch-icon"}
CSS_URL = re.compile(r"""url\(\s*['"]?([^'")]+)['"]?\s*\)|@import\s+['"]([^'"]+)['"]""")


class _Page(html.parser.HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.ids, self.urls = set(), []     # urls: (tag, attribute, url, loaded)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        for key in ("id", "name"):
            if attrs.get(key):
                self.ids.add(attrs[key])
        for attr in ("href", "src", "data", "poster"):
            url = attrs.get(attr)
            if not url:
                continue
            loaded = (tag, attr) in LOADED or (
                tag == "link" and attr == "href" and LOADING_RELS & set((attrs.get("rel") or "").lower().split()))
            self.urls.append((tag, attr, url, loaded))
        if attrs.get("srcset"):
            for part in attrs["srcset"].split(","):
                if part.strip():
                    self.urls.append((tag, "srcset", part.split()[0], True))


def _parse(path):
    page = _Page()
    page.feed(path.read_text(encoding="utf-8", errors="replace"))
    return page


def _external(url):
    return url.startswith("//") or bool(urllib.parse.urlsplit(url).scheme)


def check(root):
    """A list of problems (empty: the site is whole and offline), each naming the page and the URL."""
    root = pathlib.Path(root).resolve()
    if not (root / "index.html").is_file():
        return [f"{root}: no index.html"]
    problems, pages = [], {}

    def page(path):
        if path not in pages:
            pages[path] = _parse(path)
        return pages[path]

    for html_file in sorted(root.rglob("*.html")):
        rel_page = html_file.relative_to(root)
        if "_static" in rel_page.parts[:-1]:     # theme assets (template snippets), not pages (zh/_static too)
            continue
        for tag, attr, url, loaded in page(html_file).urls:
            where = f"{rel_page}: <{tag} {attr}={url!r}>"
            if _external(url):
                scheme = urllib.parse.urlsplit(url).scheme
                if loaded and scheme not in ("data", "blob"):
                    problems.append(f"{where} loads from the network")
                continue
            parts = urllib.parse.urlsplit(url)
            if not parts.path:                            # "#fragment" on the same page
                target = html_file
            else:
                target = (html_file.parent / urllib.parse.unquote(parts.path)).resolve()
                if target.is_dir():
                    target = target / "index.html"
                if root not in target.parents and target != root:
                    problems.append(f"{where} points outside the site")
                    continue
                if not target.is_file():
                    problems.append(f"{where} is missing")
                    continue
            fragment = urllib.parse.unquote(parts.fragment)
            if fragment and target.suffix == ".html" and fragment not in page(target).ids:
                problems.append(f"{where}: no id {fragment!r} in {target.relative_to(root)}")
    for css in sorted(root.rglob("*.css")):
        text = re.sub(r"/\*.*?\*/", "", css.read_text(encoding="utf-8", errors="replace"), flags=re.S)
        for match in CSS_URL.finditer(text):
            url = (match.group(1) or match.group(2)).strip()
            where = f"{css.relative_to(root)}: url({url})"
            if _external(url):
                if urllib.parse.urlsplit(url).scheme != "data":
                    problems.append(f"{where} loads from the network")
                continue
            path = urllib.parse.unquote(urllib.parse.urlsplit(url).path)
            if path and not (css.parent / path).resolve().is_file():
                problems.append(f"{where} is missing")
    return problems


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    problems = check(argv[0])
    for p in problems:
        print(p)
    print(f"{argv[0]}: {len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

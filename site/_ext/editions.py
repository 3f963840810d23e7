"""The site's two editions (English, and Chinese under zh/): a Sphinx extension of site/conf.py.

Each edition's sources carry `_edition.json`, written by tools/build_site.py (`edition`): the
editions in the switch's order, each with its label, its HTML language, where its root is from this
edition's root, and its pages. From it:
- every page gets `zerolab_switch` (site/_templates/language-switch.html draws it at the top of the
  page): a link to this same page in the other edition, or to that edition's landing page where it
  has no such page; and a `<link rel="alternate" hreflang>` where it has;
- the Chinese edition's headings get the anchors of the English headings they translate (the table
  `english_anchors`), so the links the translations keep (`#1-a-process-group`,
  `05_zero3.ipynb#...`) resolve, and the English section's docutils id (`#a-process-group`, what
  the contents link to), so a section has the same addresses in both editions.
A module of its own (not conf.py) so that Sphinx's parallel readers can pickle the slug function.
"""
import json
import logging
import pathlib

EDITION_FILE = "_edition.json"             # tools/build_site.py: EDITION_FILE
SPECIAL_PAGES = ("search", "genindex")     # Sphinx's own pages, in every edition


class EnglishAnchors:
    """MyST's heading slug function for the Chinese edition: a translated heading gets its English
    heading's anchor; any other heading the usual GitHub-style anchor."""

    def __init__(self, table):
        self.table = dict(table)

    def __call__(self, title):
        from myst_parser.slugs import github_slugify
        return self.table.get(title) or github_slugify(title)


def read_edition(app, config):
    path = pathlib.Path(app.srcdir) / EDITION_FILE
    if not path.is_file():                 # sources staged by hand: one edition, no switch
        return
    config.zerolab_edition = json.loads(path.read_text(encoding="utf-8"))
    anchors = config.zerolab_edition.get("english_anchors")
    if anchors:
        config.myst_heading_slug_func = EnglishAnchors(anchors["slugs"])
    if config.language.startswith("zh"):
        # Sphinx's Chinese search index cuts the text into words with jieba (the `site` extra);
        # without it the index would hold only the Latin words. jieba logs its dictionary's
        # loading at DEBUG level on stderr: quiet.
        try:
            import jieba
        except ImportError:
            raise RuntimeError("the Chinese edition's search needs jieba (pip install jieba; `make setup` "
                               "installs it with the site extra)") from None
        jieba.setLogLevel(logging.WARNING)


def english_ids(app, doctree):
    """A Chinese section with an English anchor also gets the id docutils gave the English section
    (`1. A process group` -> `a-process-group`: the id the English contents link to), so that the
    switch, which keeps the URL's #section, lands on the same section."""
    table = (app.config.zerolab_edition or {}).get("english_anchors")
    if not table:
        return
    from docutils import nodes
    for section in doctree.findall(nodes.section):
        extra = table["ids"].get(section.get("slug"))
        if extra and extra not in section["ids"] and extra not in doctree.ids:
            section["ids"].append(extra)
            doctree.ids[extra] = section


def language_switch(app, pagename, templatename, context, doctree):
    """The switch of one page: each edition's label, and a link to this same page in each other
    edition, or to that edition's landing page where it has no such page. A lesson page keeps the
    reader's section (the anchors are the same in both editions)."""
    table = app.config.zerolab_edition
    if not table:
        return
    up = "../" * pagename.count("/")
    items, alternates = [], []
    for other in table["editions"]:
        if other["name"] == table["current"]:
            items.append({"label": other["label"], "lang": other["lang"], "href": None})
            continue
        same = pagename in other["pages"] or pagename in SPECIAL_PAGES
        href = f"{up}{other['root']}{pagename if same else 'index'}.html"
        items.append({"label": other["label"], "lang": other["lang"], "href": href,
                      "keep_section": same and pagename.startswith("notebooks/")})
        if same:
            alternates.append(f'<link rel="alternate" hreflang="{other["lang"]}" href="{href}" />')
    context["zerolab_switch"] = {"items": items,
                                 "aria": "语言" if table["current"] == "zh" else "Language"}
    context["metatags"] = context.get("metatags", "") + "\n".join(alternates)


def _chinese_search():
    """Sphinx's Chinese search language, its JavaScript stemmer named right. Sphinx 9.0 (the pinned
    9.0.4) writes `window.Stemmer = ChineseStemmer;` into language_data.js from the language's name,
    but the Chinese search ships English's stemmer (Latin words are stemmed as English), whose class
    is EnglishStemmer: the search page stops with "ChineseStemmer is not defined" and finds nothing
    (sphinx-doc/sphinx#14229, fixed by #14416: the class named from the stemmer's file). The same
    class, named for the stemmer it uses; drop this once the pinned Sphinx has the fix."""
    from sphinx.search.zh import SearchChinese

    class SearchChineseWithItsStemmer(SearchChinese):
        language_name = "English"          # only makes the JS class name: EnglishStemmer
    return SearchChineseWithItsStemmer


def setup(app):
    app.add_search_language(_chinese_search())
    app.add_config_value("zerolab_edition", None, "html")
    app.connect("config-inited", read_edition)
    app.connect("doctree-read", english_ids)
    app.connect("html-page-context", language_switch)
    return {"parallel_read_safe": True, "parallel_write_safe": True}

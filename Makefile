# zerolab — the two commands a user needs:
#   make lab    set up (first time only) and open the course in JupyterLab
#   make test   set up (first time only) and run the whole test suite
# and, for publishing: make site (the lessons as a static website in _site/).
# Set-up creates .venv/ in the repo and installs the pinned, tested versions (constraints.txt).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.zerolab-installed
# JupyterLab's configuration, installed into the venv (never the user's home): settings overrides (no
# news pop-up, the slides' look) and page config (no build prompt; no JupyterLab-3 MathJax extension).
LAB_SETTINGS := $(VENV)/share/jupyter/lab/settings/overrides.json $(VENV)/etc/jupyter/labconfig/page_config.json
# Extra pip options, e.g. PIP_ARGS="--extra-index-url https://download.pytorch.org/whl/cpu" for a
# CPU-only torch on Linux (a plain PyPI torch is a multi-GB CUDA build).
PIP_ARGS ?=
PORT ?= 8888
# Extra JupyterLab options for `make lab`, e.g. LAB_ARGS=--no-browser
LAB_ARGS ?=
# The lessons' language for `make lab`: en, or zh (the Chinese edition, README.zh-CN.md). Not LANG:
# that is the locale every program here reads.
COURSE_LANG ?= en

.PHONY: lab test test-fast grade bench demo notebooks clean setup site slides zh

setup: $(STAMP) $(LAB_SETTINGS)

$(STAMP): pyproject.toml constraints.txt
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 10), "zerolab needs Python >= 3.10, found " + sys.version.split()[0]'
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt $(PIP_ARGS) -e ".[lab,test,site]"
	$(PY) -m ipykernel install --sys-prefix --name python3 --display-name "Python 3 (zerolab)" >/dev/null
	touch $(STAMP)

$(VENV)/share/jupyter/lab/settings/overrides.json: tools/jupyter/overrides.json $(STAMP)
	mkdir -p $(@D) && cp $< $@

$(VENV)/etc/jupyter/labconfig/page_config.json: tools/jupyter/page_config.json $(STAMP)
	mkdir -p $(@D) && cp $< $@

# Opens lesson 00 (LabApp.default_url: a file named on the command line does not open in JupyterLab 4).
# As root (a container, typically) JupyterLab refuses to start without --allow-root.
# COURSE_LANG=zh: the Chinese lessons built into build/zh/notebooks/ (with the English of those not
# yet translated); a lesson you ran there is never overwritten by the next build.
lab: setup
	@case '$(COURSE_LANG)' in en|zh) ;; *) echo "make lab: COURSE_LANG=$(COURSE_LANG) is not a language of the course: use en or zh" >&2; exit 2;; esac
	$(if $(filter zh,$(COURSE_LANG)),$(PY) tools/i18n.py build --with-english --out build/zh)
	$(VENV)/bin/jupyter lab --notebook-dir=$(if $(filter zh,$(COURSE_LANG)),build/zh/notebooks,notebooks) --port=$(PORT) \
		--LabApp.default_url=/lab/tree/00_collectives.ipynb $(if $(filter 0,$(shell id -u)),--allow-root) $(LAB_ARGS)

# Unit + multi-process tests, graded tests on solutions/ (must pass) and on the untouched
# exercises/ (every graded test must fail), then every notebook under nbval.
test: setup
	$(PY) -m pytest tests -q --impl solutions
	$(PY) -m pytest tests/graded -q --impl exercises --stubs-must-fail
	$(PY) -m pytest -q --nbval --nbval-sanitize-with tests/nbval_sanitize.cfg --nbval-cell-timeout=600 notebooks

# The inner loop: unit + multi-process tests and the graded tests both ways, without the browser
# test, the `make lab` test and the notebooks (nbval). CI runs `make test`.
test-fast: $(STAMP)
	$(PY) -m pytest tests -q --impl solutions --ignore=tests/test_browser.py --ignore=tests/test_make_lab.py
	$(PY) -m pytest tests/graded -q --impl exercises --stubs-must-fail

# Your own exercises, graded (the same tests the autograder runs).
grade: $(STAMP)
	$(PY) -m zerolab grade

bench: $(STAMP)
	$(PY) -m benchmarks.run_all

demo: $(STAMP)
	$(PY) -m zerolab demo

# The Chinese edition: each lesson with a translation (i18n/zh_CN/*.po) into build/zh/notebooks/, code
# cells and outputs the English's by construction. `make test` runs the gate (tests/test_i18n.py);
# `python tools/i18n.py check` prints what is stale, `python tools/i18n.py update` merges English edits.
zh: setup
	$(PY) tools/i18n.py build --out build/zh

# Re-execute every notebook top to bottom and save its outputs (after editing a lesson).
notebooks: $(STAMP)
	$(PY) tools/execute_notebooks.py notebooks/*.ipynb

# The course as a static website in _site/ (GitHub Pages-ready): every lesson as committed, nothing
# executed; fails on a Sphinx warning, a broken internal link or image, or anything loaded from the net.
site: setup
	$(PY) tools/build_site.py --out _site

# Re-derive every lesson's slide metadata (RISE) from its headings, after editing a lesson.
slides: setup
	$(PY) tools/slides.py

clean:
	rm -rf $(VENV) .pytest_cache _site build/site

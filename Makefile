# zerolab — the two commands a user needs:
#   make lab    set up (first time only) and open the course in JupyterLab, on your own copy (mywork/)
#   make test   set up (first time only) and run the whole test suite
# and, for publishing: make site (the lessons as a static website in _site/).
# Set-up (tools/setup_env.py) creates .venv/ in the repo and installs the pinned, tested versions
# (constraints.txt), one printed line per stage; on Linux without an NVIDIA GPU it says so before any
# download and takes torch's CPU build where that is safe (see the script's docstring).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.zerolab-installed
# JupyterLab's configuration, installed into the venv (never the user's home): settings overrides (no
# news pop-up, the slides' look) and page config (no build prompt; no JupyterLab-3 MathJax extension).
LAB_SETTINGS := $(VENV)/share/jupyter/lab/settings/overrides.json $(VENV)/etc/jupyter/labconfig/page_config.json
# Extra pip options, e.g. PIP_ARGS="--extra-index-url https://download.pytorch.org/whl/cpu" for a
# CPU-only torch on Linux (a plain PyPI torch is a multi-GB CUDA build; set-up says which you get).
PIP_ARGS ?=
PORT ?= 8888
# Extra JupyterLab options for `make lab`, e.g. LAB_ARGS=--no-browser
LAB_ARGS ?=
# The lessons' language for `make lab` and `make grade`: en, or zh (the Chinese edition,
# README.zh-CN.md). Not LANG: that is the locale every program here reads.
COURSE_LANG ?= en
# Your copy of the lessons and exercises (gitignored): made on the first `make lab`, never overwritten;
# the Chinese edition's is a copy of its own.
MYWORK ?= $(if $(filter zh,$(COURSE_LANG)),mywork-zh,mywork)

.PHONY: lab test test-fast grade bench demo notebooks clean setup site slides check-port zh

setup: $(STAMP) $(LAB_SETTINGS)

$(STAMP): pyproject.toml constraints.txt
	@$(PYTHON) tools/setup_env.py --venv $(VENV) --pip-args '$(PIP_ARGS)'
	@touch $(STAMP)

$(VENV)/share/jupyter/lab/settings/overrides.json: tools/jupyter/overrides.json $(STAMP)
	@mkdir -p $(@D) && cp $< $@

$(VENV)/etc/jupyter/labconfig/page_config.json: tools/jupyter/page_config.json $(STAMP)
	@mkdir -p $(@D) && cp $< $@

# A port is a whole number from 1 to 65535: anything else is refused before set-up or JupyterLab start.
check-port:
	@case '$(PORT)' in \
	  [1-9]|[1-9][0-9]|[1-9][0-9][0-9]|[1-9][0-9][0-9][0-9]|[1-9][0-9][0-9][0-9][0-9]) \
	    [ '$(PORT)' -le 65535 ] && exit 0;; \
	esac; \
	echo "make lab: PORT=$(PORT) is not a port: use a whole number from 1 to 65535, e.g. make lab PORT=9999" >&2; \
	exit 2

# JupyterLab on your copy of the course (tools/jupyter/mywork.py makes it, or adds new lessons to it),
# opening lesson 00 (LabApp.default_url: a file named on the command line does not open in JupyterLab 4).
# As root (a container, typically) JupyterLab refuses to start without --allow-root.
# COURSE_LANG=zh: the copy is made from the Chinese lessons (tools/i18n.py lab builds them into
# build/zh/ first, with the English of those not yet translated), by the same copy rule.
lab: check-port setup
	@case '$(COURSE_LANG)' in en|zh) ;; *) echo "make lab: COURSE_LANG=$(COURSE_LANG) is not a language of the course: use en or zh" >&2; exit 2;; esac
	@$(if $(filter zh,$(COURSE_LANG)),$(PY) tools/i18n.py lab $(MYWORK),$(PY) tools/jupyter/mywork.py $(MYWORK))
	$(VENV)/bin/jupyter lab --notebook-dir=$(MYWORK) --port=$(PORT) \
		--LabApp.default_url=/lab/tree/notebooks/00_collectives.ipynb $(if $(filter 0,$(shell id -u)),--allow-root) $(LAB_ARGS)

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

# Your own exercises, graded (the same tests the autograder runs): your copy, $(MYWORK)/exercises,
# once `make lab` has made it; before that, the stubs in exercises/.
grade: $(STAMP)
	$(PY) -m zerolab grade $(if $(wildcard $(MYWORK)/exercises/ex[0-9][0-9]_*.py),$(MYWORK)/exercises)

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
# executed; and the Chinese edition in _site/zh/ (the lessons `make zh` builds, README.zh-CN.md as its
# landing page; presenter guides and benchmark results in English), with an English / 中文 switch on
# every page leading to the same page in the other language (else to its landing page). Fails on a
# Sphinx warning, a broken internal link or image (the switch's included), or anything loaded from the net.
site: setup
	$(PY) tools/build_site.py --out _site

# Re-derive every lesson's slide metadata (RISE) from its headings, after editing a lesson.
slides: setup
	$(PY) tools/slides.py

clean:
	rm -rf $(VENV) .pytest_cache _site build/site

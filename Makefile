# Set-up and tests on a fresh machine. `make serve` and `make test` each
# create what they need; nothing is downloaded at run time, except that the
# tests fetch the installed mlx-lm's sdist for its own server tests
# (tests/test_stock_server_suite.py).

PYTHON ?= python3
VENV := .venv
# The incident's mlx-lm: the failure tests run against it as well.
VENV_0313 := .venv-0313
# Stock's tests/test_server.py talks to the server with requests.
STOCK_TEST_DEPS := requests
# The optional first-party plugins (plugins/), each its own distribution: the
# tests run them as a third party's would be, loaded through their entry points.
FIRST_PARTY_PLUGINS := plugins/notifier plugins/example
PLUGIN_PROJECTS := $(addsuffix /pyproject.toml,$(FIRST_PARTY_PLUGINS))
PORT ?= 8080
ARGS ?=

.PHONY: serve test test-fast test-newest test-0313 bench docs clean system-packages gpu-wheels

# macOS's own python3 (Command Line Tools) is 3.9: say so before pip refuses.
PYTHON_NEW_ENOUGH = $(PYTHON) -c 'import sys; v = sys.version_info; sys.exit(0 if v >= (3, 10) else \
	f"mlx-guardian needs Python 3.10 or newer, and $(PYTHON) is {v.major}.{v.minor}: run make PYTHON=python3.12 (or another)")'

$(VENV)/.installed: pyproject.toml Makefile $(PLUGIN_PROJECTS)
	@$(PYTHON_NEW_ENOUGH)
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e '.[test]' $(addprefix -e ,$(FIRST_PARTY_PLUGINS)) $(STOCK_TEST_DEPS)
	# Everything serving needs is in: a later `make serve` installs nothing again.
	touch $(VENV)/.serving $@

$(VENV_0313)/.installed: pyproject.toml Makefile $(PLUGIN_PROJECTS)
	@$(PYTHON_NEW_ENOUGH)
	$(PYTHON) -m venv $(VENV_0313)
	$(VENV_0313)/bin/pip install -q --upgrade pip
	$(VENV_0313)/bin/pip install -q -e '.[test]' $(addprefix -e ,$(FIRST_PARTY_PLUGINS)) $(STOCK_TEST_DEPS) 'mlx-lm==0.31.3'
	touch $@

# What serving needs, without the test extras: a first `make serve` installs
# less. `make test` adds the rest to the same venv.
$(VENV)/.serving: pyproject.toml
	@$(PYTHON_NEW_ENOUGH)
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e .
	touch $@

serve: $(VENV)/.serving
	$(VENV)/bin/mlx-guardian --port $(PORT) $(ARGS)

# Both venvs installed at once, then the suite in two lanes at once, each over workers
# (tools/test_lanes.sh says which); test-newest and test-0313 run one venv alone.
test: system-packages
	$(MAKE) -j2 $(VENV)/.installed $(VENV_0313)/.installed
	tools/test_lanes.sh

# The unit tier: every test that needs no model (no engine, no server serving
# one), in under a minute; `make test` runs them too.
test-fast: $(VENV)/.installed
	$(VENV)/bin/python -m pytest -m unit

# Real components some tests run (HAProxy, Open MPI), from Homebrew or apt-get
# where they can be installed; their tests skip, naming what is missing, where not.
system-packages:
	@tools/system_packages.sh

test-newest: $(VENV)/.installed system-packages
	$(VENV)/bin/python -m pytest

# The supervisor imports no mlx_lm, and tests marked one_version check nothing
# that depends on mlx-lm's version: they run against one mlx-lm only (`make test`
# runs a few in its 0.31.3 lane, tools/test_lanes.sh), which keeps it within CI's time.
test-0313: $(VENV_0313)/.installed
	$(VENV_0313)/bin/python -m pytest -m "not subprocess_mode and not one_version"

bench: $(VENV)/.installed
	$(VENV)/bin/python bench/bench_prompt_guard.py

# The docs site (mkdocs.yml, docs/) into site/ (ignored): first the reference
# pages written from the code (settings, hooks, exit codes, metrics, --help),
# which tests/test_docs_site.py checks are current.
docs: $(VENV)/.installed
	$(VENV)/bin/python tools/docs_reference.py
	$(VENV)/bin/python -m mkdocs build --strict --site-dir site

# The wheels the lent CUDA machine lacks, in .whl/ (ignored), cut to fit the device
# tool's 64 MiB a call; tools/gpu/run_on_device.md says how to run there.
gpu-wheels:
	tools/gpu/fetch_wheels.sh

clean:
	rm -rf $(VENV) $(VENV_0313)

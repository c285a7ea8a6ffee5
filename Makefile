# Set-up and tests on a fresh machine. `make serve` and `make test` each
# create what they need; nothing is downloaded at run time.

PYTHON ?= python3
VENV := .venv
# The incident's mlx-lm: the failure tests run against it as well.
VENV_0313 := .venv-0313
PORT ?= 8080
ARGS ?=

.PHONY: serve test test-newest test-0313 bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e '.[test]'
	touch $@

$(VENV_0313)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV_0313)
	$(VENV_0313)/bin/pip install -q --upgrade pip
	$(VENV_0313)/bin/pip install -q -e '.[test]' 'mlx-lm==0.31.3'
	touch $@

serve: $(VENV)/.installed
	$(VENV)/bin/mlx-guardian --port $(PORT) $(ARGS)

test: test-newest test-0313

test-newest: $(VENV)/.installed
	$(VENV)/bin/python -m pytest

test-0313: $(VENV_0313)/.installed
	$(VENV_0313)/bin/python -m pytest

bench: $(VENV)/.installed
	$(VENV)/bin/python bench/bench_prompt_guard.py

clean:
	rm -rf $(VENV) $(VENV_0313)

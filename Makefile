# Every target creates/uses the local virtual environment .venv and installs what it needs.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.k3-installed

.PHONY: demo test lint protos clean

$(STAMP): pyproject.toml setup.py
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install -e ".[dev]"
	touch $(STAMP)

# Train a small model (first run only, a few minutes), serve it with `k3 up`, chat with it, stop.
demo: $(STAMP)
	$(PY) ops/demo.py

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -ra

lint: $(STAMP)
	$(VENV)/bin/ruff check .

protos: $(STAMP)
	$(PY) protos/generate.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache

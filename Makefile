# Two commands on a fresh machine: `make demo` (the main job) and `make test` (every suite).
PYTHON ?= python3
TOOLS := .venv-tools
NOX := $(TOOLS)/bin/nox

.PHONY: demo test

$(NOX):
	$(PYTHON) -m venv $(TOOLS)
	$(TOOLS)/bin/python -m pip install -q nox

demo: $(NOX)
	$(NOX) -s demo

test: $(NOX)
	$(NOX)

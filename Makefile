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

# One environment at a time, as CI runs them: make test SESSIONS=xla
test: $(NOX)
	$(NOX) $(if $(SESSIONS),--sessions $(SESSIONS))

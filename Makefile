# Two commands on a fresh machine: `make demo` (the main job) and `make test` (every suite).
PYTHON ?= python3
TOOLS := .venv-tools
NOX := $(TOOLS)/bin/nox

.PHONY: demo test chromium

$(NOX):
	$(PYTHON) -m venv $(TOOLS)
	$(TOOLS)/bin/python -m pip install -q nox

demo: $(NOX)
	$(NOX) -s demo

# The report's browser test needs Debian's chromium; install it where we may (root + apt).
chromium:
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 \
	  && (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) >/dev/null; } \
	  || echo "note: chromium is not installed; the report's browser test will be skipped"

# One environment at a time, as CI runs them: make test SESSIONS=xla
test: $(NOX) chromium
	$(NOX) $(if $(SESSIONS),--sessions $(SESSIONS))

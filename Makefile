# `make demo`: set up .venv and run the default demo.  `make test`: set up and run the tests.
# Both are idempotent; the environment lives in .venv at the repository root.
VENV := .venv
STAMP := $(VENV)/.forgerl-setup

.PHONY: setup demo test test-fast test-stress lint clean

setup: $(STAMP)

$(STAMP): scripts/setup.sh pyproject.toml constraints.txt scripts/verifiers-constraints.txt
	bash scripts/setup.sh
	@touch $@

demo: setup
	OMP_WAIT_POLICY=PASSIVE $(VENV)/bin/forge run

# Bytecode of the checkout's modules first: every `forge run` of the suite starts several
# Python processes, and where PYTHONDONTWRITEBYTECODE is set (as on our shared machines) each
# one compiled forgerl's sources again (about 2.5 CPU-s of a tiny two-step run's 20).
test: setup
	$(VENV)/bin/python -m compileall -q core plugins tests contrib >/dev/null
	OMP_WAIT_POLICY=PASSIVE $(VENV)/bin/python -m pytest -q -p no:cacheprovider -n 2 tests contrib/countdown/tests contrib/openai_compat/tests contrib/reasoning_gym/tests contrib/units/tests

# The suite under load: two busy loops on the cores, deadlines x3 (scripts/stress.sh).
test-stress: setup
	bash scripts/stress.sh

# Static checks, as CI runs them: ruff's lint rules and mypy's type checks (both
# configured in pyproject.toml).
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

test-fast: setup
	$(VENV)/bin/python -m pytest -q -m "not integration" tests

clean:
	rm -rf $(VENV) .venv-verifiers build *.egg-info

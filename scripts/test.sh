#!/usr/bin/env bash
# The project's test command (README quick start, .ci/run): set up .venv, lint, run the suite.
#
#   scripts/test.sh            # everything
#   scripts/test.sh -k ledger  # extra arguments go to pytest
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
scripts/bootstrap.sh
py=.venv/bin/python
echo "== lint" >&2
"$py" -m ruff format --check .
"$py" -m ruff check .
"$py" -m mypy
# tests/conftest.py sets the quiet sglang environment (sglang_integration.testing.sglang_env)
echo "== tests" >&2
"$py" -m pytest "$@"

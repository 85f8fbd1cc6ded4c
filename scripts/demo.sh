#!/usr/bin/env bash
# The project's main job (README quick start): set up .venv and run the CPU end-to-end demo
# (scripts/demo.py sets the quiet sglang environment itself, sglang_integration.testing.sglang_env).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
scripts/bootstrap.sh
exec .venv/bin/python scripts/demo.py "$@"

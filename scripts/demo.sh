#!/usr/bin/env bash
# The project's main job (README quick start): set up .venv and run the CPU end-to-end demo.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
scripts/bootstrap.sh
export GLOO_SOCKET_IFNAME="${GLOO_SOCKET_IFNAME:-lo}"
export SGLANG_DISABLED_MODEL_ARCHS="${SGLANG_DISABLED_MODEL_ARCHS:-falcon_mamba,inkling,mamba,midashenglm}"
exec .venv/bin/python scripts/demo.py "$@"

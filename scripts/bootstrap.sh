#!/usr/bin/env bash
# Create .venv and install the pinned dependencies; idempotent and fast when already done.
#
#   scripts/bootstrap.sh          # creates/refreshes ./.venv
#
# sglang 0.5.23 is installed with --no-deps from requirements/sglang-cpu.txt: its declared dependency tree
# is the CUDA stack, which a CPU machine neither needs nor can use. torch 2.14.1 and torchvision 0.29.1
# come from this machine's local wheel store when present (pip's find-links), else from PyPI.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="${LAYOUT_LEDGER_VENV:-$root/.venv}"
python="${PYTHON:-python3.11}"
command -v "$python" >/dev/null 2>&1 || python=python3

stamp_inputs() {
  cat requirements/sglang-cpu.txt requirements/project.txt setup.cfg scripts/bootstrap.sh
}
want="$(stamp_inputs | sha256sum | cut -d' ' -f1)"
stamp="$venv/.bootstrap-stamp"
if [ -x "$venv/bin/python" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi

echo "bootstrap: preparing $venv (first run takes a few minutes)" >&2
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
pip_install() {
  # pip warns once per package about index locations this machine lists but does not have.
  "$venv/bin/python" -m pip --disable-pip-version-check -q install "$@" 2>&1 \
    | { grep -v -e "is ignored: it is neither a file nor a directory" -e "requires .*, which is not installed" -e "incompatible\.$" -e "dependency resolver does not currently" || true; }
  return "${PIPESTATUS[0]}"
}
pip_install --no-deps -r requirements/sglang-cpu.txt
pip_install -r requirements/project.txt
pip_install --no-deps --no-build-isolation -e .
echo "$want" >"$stamp"
echo "bootstrap: ready ($venv)" >&2

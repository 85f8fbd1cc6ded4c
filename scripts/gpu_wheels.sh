#!/usr/bin/env bash
# Download the wheels the one-GPU check (scripts/gpu_check_single.sh) needs beyond what the GPU
# machine has, for its Python 3.12 on manylinux x86_64, into .gpu_wheels/ (git-ignored), check
# that they fit the 64 MiB a device command may carry, and write REVISION (this checkout's git
# revision, for a machine that gets the tree without .git) and MANIFEST (name and size of each).
#
#   scripts/gpu_wheels.sh                    # this package's deps + sglang 0.5.23's import chain
#   scripts/gpu_wheels.sh --without-sglang   # this package's deps only (stand-in daemon)
#   scripts/gpu_wheels.sh --list             # print the pinned list, download nothing
#   scripts/gpu_wheels.sh --dir DIR          # somewhere else than .gpu_wheels/
#
# Versions: the pins of requirements/project.txt and requirements/sglang-cpu.txt (one place);
# greenlet (SQLAlchemy's dependency on x86_64, unpinned there) is pinned below. The sglang list
# is what `python -m sglang_integration.testing.daemon` and the engines' client import of sglang,
# minus what the GPU image already has (torch 2.11, transformers 5.17, numpy, aiohttp, requests,
# psutil, ... per /work/.library/device/KINDS.md): measured by importing that chain under Python
# 3.12 with torch 2.11, transformers 5.17 and huggingface_hub 1.33 on a CPU (2026-12, see
# docs/development.md "GPU check (one GPU)"). Rerun this after every commit you mean to check on the GPU: the
# REVISION it writes is what the check prints when the machine has no .git.
#
# Use on the GPU machine (no network): carry .gpu_wheels, then
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#       --target /tmp/site .gpu_wheels/*.whl
#   GPU_SITE=/tmp/site GPU_WHEELS=.gpu_wheels scripts/gpu_check_single.sh
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py="${PYTHON:-python3}"
dir="$root/.gpu_wheels"
with_sglang=1
list_only=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --without-sglang) with_sglang=0 ;;
    --list) list_only=1 ;;
    --dir) dir="$2"; shift ;;
    *) echo "usage: $0 [--without-sglang] [--list] [--dir DIR]" >&2; exit 2 ;;
  esac
  shift
done
limit=$((64 * 1024 * 1024))

own=(SQLAlchemy alembic Mako typing_extensions)
own_fixed=(greenlet==3.5.6)
sglang_chain=(sglang msgspec pydantic pydantic_core annotated-types typing-inspection pyzmq orjson
  pybase64 ipython traitlets dill httpx2 httpcore2 truststore starlette sniffio)

pin() {  # NAME -> NAME==VERSION from the requirements files (- and _ alike, any case)
  local pattern="^${1//[-_]/[-_]}=="
  local found
  found="$(grep -i -h -E "$pattern" requirements/project.txt requirements/sglang-cpu.txt | head -1)"
  if [[ -z "$found" ]]; then
    echo "gpu_wheels: $1 is pinned in no requirements file" >&2
    exit 2
  fi
  echo "$found"
}

specs=()
for name in "${own[@]}"; do specs+=("$(pin "$name")"); done
specs+=("${own_fixed[@]}")
if [[ $with_sglang -eq 1 ]]; then
  for name in "${sglang_chain[@]}"; do specs+=("$(pin "$name")"); done
fi
if [[ $list_only -eq 1 ]]; then
  printf '%s\n' "${specs[@]}"
  exit 0
fi

rm -rf "$dir"
mkdir -p "$dir"
"$py" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp \
  --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 \
  -d "$dir" "${specs[@]}" 2>&1 | grep -v "^WARNING: Location" || true
count="$(find "$dir" -name '*.whl' | wc -l)"
if [[ "$count" -ne "${#specs[@]}" ]]; then
  echo "gpu_wheels: expected ${#specs[@]} wheels, got $count in $dir" >&2
  exit 1
fi
revision="$(git describe --always --dirty --abbrev=12 2>/dev/null || echo unknown)"
echo "$revision built $(date -u +%Y-%m-%dT%H:%M:%SZ)" >"$dir/REVISION"
(cd "$dir" && stat -c '%s %n' ./*.whl | sort -rn | sed 's|\./||' >MANIFEST)
wheels="$(cat "$dir"/*.whl | wc -c)"
tree="$(git ls-files -z | xargs -0 cat 2>/dev/null | wc -c)"
mib() { awk -v b="$1" 'BEGIN { printf "%.1f MiB", b / 1048576 }'; }
echo "gpu_wheels: ${count} wheels in $dir, $(mib "$wheels") (revision $revision)"
cat "$dir/MANIFEST"
echo "gpu_wheels: wheels + tracked tree = $(mib $((wheels + tree))) of the 64 MiB a device command carries"
if [[ $((wheels + tree)) -gt $limit ]]; then
  echo "gpu_wheels: over the 64 MiB limit" >&2
  exit 1
fi

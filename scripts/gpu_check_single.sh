#!/usr/bin/env bash
# The one-GPU check: what the project can run on the one-H200 machine it can sometimes use.
#
# NOT YET RUN ON A GPU: written and tested on a CPU-only machine (its --device cpu path runs in
# the test suite, tests/test_gpu_check_single.py). docs/development.md "GPU check (one GPU)" has the results
# once it has run.
#
#   scripts/gpu_check_single.sh [--device cuda|cpu] [--daemon auto|sglang|ledger-service]
#       [--stages ipc,fingerprints,bench] [--scale N] [--fingerprint-layers N]
#       [--json PATH] [--keep]
#
# Stages (scripts/gpu_single/, one module each; one table each, expected vs measured):
# 1. CUDA IPC (ipc_stage): a holder process allocates expert tensors on the GPU whose bytes name
#    their expert (the CPU demo's 8 layers x 12 slots, and one DeepSeek-V3 layer at the size one
#    GPU of EP 8 holds: 36 slots of fp8 w13/w2 + fp32 scales, 1.59 GB) and serializes them once
#    with torch's IPC reductions (CUDA IPC handles). Engine A maps them, moves experts in place
#    and commits each chunk through a model-less daemon with a SQLite ledger (the CPU demo's
#    case-1 commits on the small shape); engine B, started after A exited, maps the same memory,
#    adopts the ledger's layout and reads every slot; B ignoring the record reads the moved slots
#    wrongly. The counts are the CPU demo's case 1, on CUDA memory.
# 2. Fingerprints (fingerprint_stage): every slot of 58 layers x 36 slots (91.97 GB) fingerprinted
#    on the device, GB/s against the copy bandwidth of the same run; a half-overwritten slot and a
#    zeroed replica detected. Until sglang_integration.content.fingerprints.fingerprint_slots exists the
#    stage says "skipped: fingerprints not available in this version".
# 3. scripts/bench_ledger.py --quick, as is (bench_stage).
#
# Daemon (--daemon, default auto): "sglang" runs `python -m sglang_integration.testing.daemon`
# (sglang 0.5.23's real WeightCacheDaemon serve loop with this package's hooks); "ledger-service"
# runs scripts/gpu_single/standin_daemon.py (this package's ledger, LayoutService, attach watcher
# and connection hook; sglang's serve loop, ping handler and framing restated, and said so in the
# output). auto = sglang when its import chain imports in this interpreter, else ledger-service.
# The engines use this package's client and startup/rebalance decisions in both.
#
# --device cpu: the same processes and the same torch IPC reductions on CPU tensors (shared-memory
# files, torch's file_system strategy), DeepSeek-V3 sizes divided by 16, 4 fingerprint layers.
#
# On the GPU machine (one H200, Python 3.12, torch 2.11 CUDA; no network): carry the wheels that
# `scripts/gpu_wheels.sh` builds into .gpu_wheels/ (46.5 MiB: sglang 0.5.23 and the packages its
# import chain needs that the machine lacks, SQLAlchemy, alembic, Mako, greenlet, ...):
#
#   run(carry=[".gpu_wheels"], timeout_s=600, command=
#     "python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade
#      --target /tmp/site .gpu_wheels/*.whl && GPU_SITE=/tmp/site GPU_WHEELS=.gpu_wheels
#      scripts/gpu_check_single.sh --json $OUT/gpu_check.json 2>&1 | tee $OUT/gpu_check.log")
#
# Environment: PYTHON (interpreter; default .venv/bin/python if present, else python3), GPU_SITE
# (a --target dir of carried wheels, put on PYTHONPATH after this tree), GPU_WHEELS (where the
# wheels' REVISION file is, when there is no .git), GPU_CHECK_TIMEOUT (seconds, default 480).
# Exit: 0 every check held, 1 a check failed, 2 a stage could not run to its end or timed out.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
if [[ -n "${PYTHON:-}" ]]; then
  py="$PYTHON"
elif [[ -x "$root/.venv/bin/python" ]]; then
  py="$root/.venv/bin/python"
else
  py="python3"
fi
site="${GPU_SITE:-}"
export PYTHONPATH="$root:$root/scripts${site:+:$site}${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
exec timeout --kill-after=20 "${GPU_CHECK_TIMEOUT:-480}" "$py" -m gpu_single.run "$@"

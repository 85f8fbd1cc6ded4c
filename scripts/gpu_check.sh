#!/usr/bin/env bash
# GPU check of case 1 with real CUDA IPC: weight cache daemons, engine A rebalancing, engine B.
#
# PREPARED, NOT RUN: the session that wrote it had no GPU. Nothing here has been measured.
#
#   scripts/gpu_check.sh            # PYTHON=... to pick the interpreter; GPU_CHECK_TIMEOUT=s
#
# What it does, with a tiny Qwen3-MoE of random weights (--load-format dummy, a config.json
# written here, no tokenizer: --skip-tokenizer-init and token ids over HTTP):
#
# 1. `python -m sglang_integration.daemon` (sglang's daemon with the ledger hooks) with
#    --enable-eplb, one daemon per GPU, ledgers and sockets in a temp dir;
# 2. engine A: `python -m sglang.launch_server --weight-cache-mode client --enable-eplb
#    --ep-num-redundant-experts 2 --eplb-rebalance-num-iterations 20`; greedy requests until the
#    ledger (`layout-ledger status --json`) is at version >= 3 on every daemon, then a last greedy
#    pass (8 prompts x 8 tokens) repeated until one ran with no rebalance in it; A is stopped;
# 3. engine B on the same daemons (no rebalance of its own before its pass): its log must say on
#    every rank that it routes with the daemon's layout at the ledger's version, and its greedy
#    tokens must equal A's last pass (prints x/8).
#
# Assumptions (from reading sglang 0.5.23, not tested):
# - An interpreter whose sglang 0.5.23 has its GPU dependencies (sgl-kernel, flashinfer, ...)
#   and this package installed: the repository's CPU .venv (sglang --no-deps) cannot serve on a
#   GPU. The device machine has no network, so that environment must already be there.
# - --enable-eplb needs ep_size > 1 (arg_groups/parallel_hook.py:790-791, checked here on the
#   CPU: publish() rejects ep_size 1), sglang puts one TP rank per GPU (NCCL refuses two ranks on
#   one device), and daemons are keyed by GPU UUID (one daemon per GPU). So case 1 needs 2 GPUs
#   (TP2/EP2, the proposal's shape). On a 1-GPU machine the script runs a compatibility check
#   instead: a daemon without --enable-eplb (it keeps no record), engine A and then engine B on
#   it through CUDA IPC, B's greedy tokens equal to A's, and the plugin's "keep no expert layout
#   record" warning; it says so in its first lines.
# - No a2a backend: moe_a2a_backend none with dynamic dispatch. TopK resolves the expert
#   location dispatch info from the layer id itself (layers/moe/topk.py:655-671), so Qwen3 MoE
#   routes by the current metadata without DeepEP (the proposal's #39580 concern).
# - Dummy weights are identical in A and B because both map the daemon's tensors; the check is
#   B = A's last pass on the same weights and layout, as in the proposal.
# - The default rebalance threshold (1.0) rebalances at every interval; 8 decode steps of a pass
#   are fewer than the 20-iteration interval, so a pass without a rebalance comes within a few.
#
# Exit: 0 every check held, 1 a check failed, 2 a process failed or timed out (logs' tails are
# printed). Everything runs under one timeout (default 480 s) and is killed on the way out.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py="${PYTHON:-$root/.venv/bin/python}"
exec timeout --kill-after=15 "${GPU_CHECK_TIMEOUT:-480}" "$py" - <<'PY'
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from sglang_integration.testing.sglang_env import DISABLED_MODEL_ARCHS_ENV, QUIET_ARCHS

# sglang's import noise off in the daemons and engines started below (they inherit it).
os.environ.setdefault(DISABLED_MODEL_ARCHS_ENV, QUIET_ARCHS)

T0 = time.monotonic()
PY = sys.executable
LEDGER_CLI = str(Path(PY).parent / "layout-ledger")
WORK = Path(tempfile.mkdtemp(prefix="gpu-check-"))
TARGET_VERSION = 3
INTERVAL = 20
PROMPTS = [[10 + (7 * i + 3 * j) % 900 for j in range(12)] for i in range(8)]
processes: list[subprocess.Popen] = []
checks: list[tuple[str, str, str, bool]] = []


def say(message: str) -> None:
    print(f"[{time.monotonic() - T0:6.1f} s] {message}", flush=True)


def check(what: str, expected: object, measured: object, ok: bool) -> None:
    checks.append((what, str(expected), str(measured), ok))
    say(f"{'ok    ' if ok else 'FAILED'} {what}: expected {expected}, measured {measured}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(name: str, argv: list[str]) -> subprocess.Popen:
    log = open(WORK / f"{name}.log", "wb")
    say(f"start {name}: {' '.join(argv)}")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    proc.name = name  # type: ignore[attr-defined]
    processes.append(proc)
    return proc


def stop(proc: subprocess.Popen, timeout: float = 60) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(15)


def tail(name: str, lines: int = 40) -> str:
    path = WORK / f"{name}.log"
    text = path.read_text(errors="replace").splitlines()[-lines:] if path.exists() else []
    return f"--- last lines of {path}:\n" + "\n".join(text)


def wait_for(what: str, ready, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.name} exited ({proc.returncode}) before {what}\n{tail(proc.name)}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"no {what} within {timeout} s\n{tail(proc.name)}")
        time.sleep(1)
    say(what)


def http_ok(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as reply:
            return reply.status == 200
    except OSError:
        return False


def greedy(port: int, max_new_tokens: int) -> list[list[int]]:
    body = {
        "input_ids": PROMPTS,
        "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True},
    }
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/generate",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as reply:
        return [item["output_ids"] for item in json.loads(reply.read())]


def ledgers() -> list[dict]:
    states = []
    for path in sorted(WORK.glob("ledger_*.sqlite")):
        out = subprocess.run([LEDGER_CLI, "status", "--json", str(path)], capture_output=True, text=True)
        states.append(json.loads(out.stdout)["ledgers"][0])
    return states


def main() -> int:
    gpus = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=True)
    num_gpus = len([line for line in gpus.stdout.splitlines() if line.startswith("GPU ")])
    case1 = num_gpus >= 2
    tp = 2 if case1 else 1
    say(f"{num_gpus} GPU(s); work dir {WORK}")
    if not case1:
        say("case 1 NOT run: --enable-eplb needs ep_size > 1, i.e. 2 GPUs in sglang 0.5.23; "
            "running the 1-GPU compatibility check (daemon without a record) instead")
    model = WORK / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 128,
        "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "num_experts": 16, "num_experts_per_tok": 4, "vocab_size": 1024,
        "max_position_embeddings": 1024, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "norm_topk_prob": True, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "torch_dtype": "bfloat16", "tie_word_embeddings": False,
    }))
    os.environ["SGLANG_WEIGHT_CACHE_SOCKET_TEMPLATE"] = str(WORK / "wc_{device_uuid}.sock")
    os.environ["SGLANG_WEIGHT_CACHE_READY_TEMPLATE"] = str(WORK / "wc_{device_uuid}.ready")
    common = ["--model-path", str(model), "--load-format", "dummy", "--tp-size", str(tp),
              "--random-seed", "42", "--skip-tokenizer-init", "--mem-fraction-static", "0.3",
              "--disable-cuda-graph", "--disable-radix-cache"]
    eplb = ["--ep-size", "2", "--enable-eplb", "--ep-num-redundant-experts", "2"] if case1 else []

    daemon = start("daemons", [PY, "-m", "sglang_integration.daemon.launcher", *common, *eplb,
                               "--expert-layout-ledger", str(WORK / "ledger_{device_uuid}.sqlite")])
    wait_for(f"{tp} daemon(s) ready", lambda: len(list(WORK.glob("wc_*.ready"))) >= tp, daemon, 240)

    port_a = free_port()
    engine_a = start("engine-A", [PY, "-m", "sglang.launch_server", *common, *eplb,
                                  "--weight-cache-mode", "client", "--port", str(port_a),
                                  *(["--eplb-rebalance-num-iterations", str(INTERVAL)] if case1 else [])])
    wait_for("engine A serving", lambda: http_ok(port_a), engine_a, 300)
    if case1:
        passes = 0
        while min(s["version"] for s in ledgers()) < TARGET_VERSION:
            if passes >= 20:
                reached = [s["version"] for s in ledgers()]
                raise RuntimeError(f"A reached only {reached} after 20 passes\n{tail('engine-A')}")
            greedy(port_a, 32)
            passes += 1
        say(f"A rebalanced: ledger versions {[s['version'] for s in ledgers()]} after {passes} passes")
    for attempt in range(8):
        before = [s["version"] for s in ledgers()]
        last_a = greedy(port_a, 8)
        after = [s["version"] for s in ledgers()]
        if before == after:
            break
        say(f"A's pass {attempt} included a rebalance ({before} -> {after}); again")
    versions = [s["version"] for s in ledgers()]
    if case1:
        check("A's last greedy pass ran without a rebalance", "yes",
              "yes" if before == after else f"no ({before} -> {after})", before == after)
    stop(engine_a)
    wait_for("A detached from every daemon", lambda: all(not s["attached"] for s in ledgers()), daemon, 60)
    if case1:
        check("daemon versions after A (equal, >= 3)", f">= {TARGET_VERSION}, equal", versions,
              len(set(versions)) == 1 and versions[0] >= TARGET_VERSION)
        check("daemons clean after A stopped", "clean", [s["state"] for s in ledgers()],
              all(s["state"] == "clean" for s in ledgers()))

    port_b = free_port()
    engine_b = start("engine-B", [PY, "-m", "sglang.launch_server", *common, *eplb,
                                  "--weight-cache-mode", "client", "--port", str(port_b),
                                  *(["--eplb-rebalance-num-iterations", "100000",
                                     "--expert-distribution-recorder-buffer-size", "100"] if case1 else [])])
    wait_for("engine B serving", lambda: http_ok(port_b), engine_b, 300)
    log_b = (WORK / "engine-B.log").read_text(errors="replace")
    if case1:
        adopted = re.findall(r"Routing with the weight cache daemon's expert layout at version (\d+)", log_b)
        check("B's log: routes with the daemon's layout at the ledger version, every rank",
              f"{[versions[0]] * tp}", [int(v) for v in adopted],
              [int(v) for v in adopted] == [versions[0]] * tp)
    else:
        warned = "keep no expert layout record" in log_b
        check("B's log: the daemon keeps no record (warning)", "yes", "yes" if warned else "no", warned)
    out_b = greedy(port_b, 8)
    equal = sum(a == b for a, b in zip(last_a, out_b, strict=True))
    check("B's greedy tokens equal to A's last pass", f"{len(PROMPTS)}/{len(PROMPTS)}",
          f"{equal}/{len(PROMPTS)}", equal == len(PROMPTS))
    stop(engine_b)
    if case1:
        for path in sorted(WORK.glob("ledger_*.sqlite"))[:1]:
            out = subprocess.run([LEDGER_CLI, "history", "--last", "6", str(path)], capture_output=True, text=True)
            say(f"$ layout-ledger history --last 6 {path}\n{out.stdout}")
    failed = [c for c in checks if not c[3]]
    say(f"{len(checks) - len(failed)}/{len(checks)} checks held"
        + ("" if case1 else " (compatibility check only; case 1 needs 2 GPUs)"))
    return 1 if failed else 0


def cleanup(*_: object) -> None:
    for proc in reversed(processes):
        try:
            stop(proc, 30)
        except (ProcessLookupError, OSError):
            pass
    if not os.environ.get("GPU_CHECK_KEEP"):
        shutil.rmtree(WORK, ignore_errors=True)


signal.signal(signal.SIGTERM, lambda *_: sys.exit(2))  # timeout: clean up, exit 2
code = 2
try:
    code = main()
except Exception as exc:
    print(f"gpu_check: {exc}", flush=True)
finally:
    cleanup()
sys.exit(code)
PY

"""The proposal's three GPU cases, run on the CPU with real processes (``scripts/demo.py``).

Per EP rank a model-backed daemon (``sglang_integration.testing.daemons``: sglang's own
``WeightCacheDaemon`` loading a tiny Qwen3-MoE or DeepSeek-V3 checkpoint written for the run,
with this plugin's hooks and a ledger) whose routed-expert tensors every engine maps from shared
memory; a slot holds expert e when its bytes equal the checkpoint's expert e as sglang's loader
places it (``testing.checkpoint_experts``). With ``DemoConfig.model`` None the same cases run on
the synthetic stand-in (model-less daemons, ``testing.shared_experts`` whose bytes carry their
id): the suite's reduced demo does, for its time. Engines of 2 ranks on gloo
(``sglang_integration.testing.cpu_engine``) run sglang's real startup method, ``EPLBManager``,
``init_by_eplb`` and ``ExpertLocationUpdater``, through the plugin's real hooks.

One module per case (``case1``, ``case2``, ``case3``, ``forensics``), the ``workspace`` they
run in (temp dirs, processes, cleanup), their ``results``, the model shape (``config``) and the
whole ``run``:

- Case 1: engine A rebalances N times and stops; engine B starts on the same daemons. With the
  plugin B adopts the ledger's version and every slot holds the expert B's metadata names. The
  same run with the plugin disabled (sglang's own daemon and engines, no hook) shows the bug:
  B routes with the initial layout over moved experts.
- Case 2: a warm standby C attaches; A's begins come back busy and nothing moves; C matches A;
  after C exits, A rebalances again.
- Case 3: A is SIGKILLed between two chunks (B adopts the committed version) and, on fresh
  daemons, inside a move after begin (B refuses to start with the dirty reason).
- Forensics: ``layout-ledger status``, ``history`` and ``verify`` on the dirty daemon's ledger,
  and the runbook's ``sqlite3`` query naming the engine that left it dirty.
- Case 4: repair instead of restart (``case4``).
- Case 5: a warm standby C (``SGLANG_EXPERT_LAYOUT_ROLE=standby``) beside a rebalancing A: A
  keeps moving, C takes over after A's SIGKILL with its first forward pass; (b) a warmup batch
  holds A's begins only until C's lease idles out; (c) C's first forward repairs daemons A left
  mid-move (``case5``).
- Case 6: a restart keeps the balance: A rebalances, every daemon stops and starts again and
  restores A's last version (B starts on it, balanced, every slot right); with the plugin
  disabled the restarted daemons load the initial layout; then the restore's fallbacks (rows
  edited, ``--expert-layout-restore initial``, another geometry) each say why (``case6``).
- Case 7 (a): a dirty daemon heals itself from its checkpoint: A SIGKILLed mid-move with
  half-written and zero-filled slots; the same daemon processes reload those layers' experts
  and are clean at the last committed version; B starts on them (``case7``).
- Case 7 (b): daemons at different versions converge: A SIGKILLed between its ranks' commits,
  rank 1's daemon back clean a version behind (healed, or restarted alone); B brings it to the
  newest version (a reload from its checkpoint here) and starts on it on both ranks
  (``case7b``).

Every function returns data (``CaseResult``: checks with expected and measured values, notes,
seconds); ``scripts/demo.py`` renders it. A check whose expectation fails is a failed check,
never an exception; a process that fails or hangs raises (``EngineRankError`` and friends).
"""

from demo_cases.config import MODELS, DemoConfig
from demo_cases.results import CaseResult, Check
from demo_cases.run import DemoRun, run_demo
from demo_cases.workspace import Workspace

__all__ = ["MODELS", "CaseResult", "Check", "DemoConfig", "DemoRun", "Workspace", "run_demo"]

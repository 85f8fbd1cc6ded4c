"""The environment sglang is imported with on a CPU: its import noise off, gloo on the loopback.

The one place these values are written. Who sets them, each from here, before importing sglang:
``layout-ledger export --check`` (``sglang_export_check``, the architecture list only), the test
suite (``tests/conftest.py``), the CPU harness's forkserver (``scripts/harness``), the demo
(``scripts/demo.py``), ``scripts/gpu_check.sh`` (the architecture list only) and the one-GPU
check (``scripts/gpu_single/run.py``). The plugin's
daemons and engines set nothing: there the operator's environment rules.

Importing this module imports nothing beyond ``os``.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

DISABLED_MODEL_ARCHS_ENV = "SGLANG_DISABLED_MODEL_ARCHS"
# sglang's model registry logs an import error per optional architecture it cannot load on a
# CPU-only install; these are the ones of 0.5.23 (reference/sglang-on-cpu-facts.md).
QUIET_ARCHS = "falcon_mamba,inkling,mamba,midashenglm"

# The CPU engines of the tests and the demo run every gloo rank on this machine.
GLOO_SOCKET_IFNAME_ENV = "GLOO_SOCKET_IFNAME"
LOOPBACK = "lo"

QUIET_SGLANG_ENV: dict[str, str] = {
    DISABLED_MODEL_ARCHS_ENV: QUIET_ARCHS,
    GLOO_SOCKET_IFNAME_ENV: LOOPBACK,
}


def set_quiet_sglang_env(environ: MutableMapping[str, str] | None = None) -> None:
    """Set every entry of ``QUIET_SGLANG_ENV`` that ``environ`` (default ``os.environ``) lacks;
    a value already there wins."""
    target = os.environ if environ is None else environ
    for key, value in QUIET_SGLANG_ENV.items():
        target.setdefault(key, value)

"""The environment sglang is imported with on a CPU: its import noise off, gloo on the loopback.

Who sets it, from here, before importing sglang: the test suite (``tests/conftest.py``), the
toolkit's forkserver (``daemon_control``), the demo, the benchmarks and the GPU checks. The
architecture list is the CLI's (``layout-ledger export --check`` needs it too). The plugin's
daemons and engines set nothing: there the operator's environment rules.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

from layout_ledger.cli.sglang_export_check import DISABLED_MODEL_ARCHS_ENV, QUIET_ARCHS

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

"""The suite's environment: sglang imported quietly, gloo on the loopback.

``pytest_configure`` runs before any test module is imported, so every import of sglang in this
process and in every process it starts sees
``sglang_integration.testing.sglang_env.QUIET_SGLANG_ENV`` (a value already set in the environment
wins).
"""

from __future__ import annotations

import pytest

from sglang_integration.testing.sglang_env import set_quiet_sglang_env


def pytest_configure(config: pytest.Config) -> None:
    set_quiet_sglang_env()

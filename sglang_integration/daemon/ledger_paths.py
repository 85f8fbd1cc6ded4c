"""Where a weight cache daemon keeps its expert layout ledger, how much history it keeps, and how
long it waits for a client's request and reply.

One ledger file per daemon, i.e. per physical GPU. Like sglang's own daemon files
(``sglang/srt/weight_cache/protocol.py``: ``get_socket_path`` fills
``SGLANG_WEIGHT_CACHE_SOCKET_TEMPLATE``, default ``/tmp/sglang_weight_cache_{device_uuid}.sock``,
and refuses a template without ``{device_uuid}``), the path comes from a template keyed by the
device UUID. By default the ledger lies beside the daemon's socket, in a private directory
(0700, this user's, created when missing, refused when someone else's or loosened: sglang's
default socket directory, ``/tmp``, is world-writable):
``<socket template's directory>/sglang_expert_layouts/sglang_expert_layout_{device_uuid}.sqlite``.

Overrides, strongest first: the daemon launcher's ``--expert-layout-ledger`` flag (which sets the
environment variable below, so the daemons it spawns see it too), then
``SGLANG_EXPERT_LAYOUT_LEDGER_TEMPLATE``. Retention works the same way with
``--expert-layout-keep-versions`` / ``SGLANG_EXPERT_LAYOUT_KEEP_VERSIONS`` and
``--expert-layout-prune-every`` / ``SGLANG_EXPERT_LAYOUT_PRUNE_EVERY``, defaulting to the ledger
library's ``DEFAULT_KEEP_VERSIONS`` and ``DEFAULT_PRUNE_EVERY``. The connection deadline
(``bounded_connections``) likewise: ``--expert-layout-request-timeout`` /
``SGLANG_EXPERT_LAYOUT_REQUEST_TIMEOUT``, in seconds, default ``DEFAULT_REQUEST_TIMEOUT``.

The settings travel in the environment on purpose: an engine in ``--weight-cache-mode daemon``
and sglang's standalone launcher start each daemon with ``multiprocessing`` spawn, and a spawned
child inherits the environment but none of the parent's parsed flags.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from layout_ledger.store.retention import DEFAULT_KEEP_VERSIONS, DEFAULT_PRUNE_EVERY, Retention

LEDGER_TEMPLATE_ENV = "SGLANG_EXPERT_LAYOUT_LEDGER_TEMPLATE"
KEEP_VERSIONS_ENV = "SGLANG_EXPERT_LAYOUT_KEEP_VERSIONS"
PRUNE_EVERY_ENV = "SGLANG_EXPERT_LAYOUT_PRUNE_EVERY"
REQUEST_TIMEOUT_ENV = "SGLANG_EXPERT_LAYOUT_REQUEST_TIMEOUT"

# Seconds a client has for its whole request (from the accept) and, separately, for taking its
# reply. An engine's exchange is a few kilobytes over a local socket and takes milliseconds.
DEFAULT_REQUEST_TIMEOUT = 5.0

LEDGER_FILE_TEMPLATE = "sglang_expert_layout_{device_uuid}.sqlite"
LEDGER_DIRECTORY = "sglang_expert_layouts"
PLACEHOLDER = "{device_uuid}"


class LedgerSettingError(ValueError):
    """A ledger template or retention setting that cannot be used."""


def socket_template() -> str:
    """sglang's daemon socket template, read the way sglang reads it (its env field)."""
    from sglang.srt.environ import envs

    return str(envs.SGLANG_WEIGHT_CACHE_SOCKET_TEMPLATE.get())


def default_ledger_template(socket_path_template: str) -> str:
    """The ledger template beside a socket template (its private subdirectory)."""
    directory = os.path.join(os.path.dirname(socket_path_template), LEDGER_DIRECTORY)
    return os.path.join(directory, LEDGER_FILE_TEMPLATE)


def prepare_ledger_path(device_uuid: str) -> str:
    """The daemon's ledger path; the default location's private directory is made ready."""
    path = ledger_path(device_uuid)
    if not os.environ.get(LEDGER_TEMPLATE_ENV):
        from layout_ledger.store.files import ensure_private_directory

        ensure_private_directory(Path(path).parent)
    return path


def ledger_template() -> str:
    """The template in force: the env var (set by the launcher's flag) or beside the socket."""
    configured = os.environ.get(LEDGER_TEMPLATE_ENV)
    if configured:
        return configured
    return default_ledger_template(socket_template())


def ledger_path(device_uuid: str, template: str | None = None) -> str:
    """The ledger file of the daemon on the GPU ``device_uuid``."""
    template = ledger_template() if template is None else template
    if PLACEHOLDER not in template:
        raise LedgerSettingError(
            f"the expert layout ledger template {template!r} must contain '{PLACEHOLDER}': each "
            f"daemon (one per GPU) needs its own ledger file, and a second daemon on one file "
            f"cannot start (set {LEDGER_TEMPLATE_ENV} or --expert-layout-ledger)"
        )
    try:
        return template.format(device_uuid=device_uuid)
    except (KeyError, IndexError, ValueError) as exc:
        raise LedgerSettingError(
            f"the expert layout ledger template {template!r} has a placeholder other than "
            f"'{PLACEHOLDER}' ({exc!r}); use only '{PLACEHOLDER}'"
        ) from exc


def _positive_int_from_env(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise LedgerSettingError(f"{name}={raw!r} must be a positive integer")
    return value


def retention_from_env() -> Retention:
    """The daemon's ledger retention: the env vars (set by the launcher's flags) or defaults."""
    return Retention(
        keep_versions=_positive_int_from_env(KEEP_VERSIONS_ENV, DEFAULT_KEEP_VERSIONS),
        prune_every=_positive_int_from_env(PRUNE_EVERY_ENV, DEFAULT_PRUNE_EVERY),
    )


def check_request_timeout(value: float, name: str = REQUEST_TIMEOUT_ENV) -> float:
    """A request timeout must be a finite, positive number of seconds."""
    if not math.isfinite(value) or value <= 0:
        raise LedgerSettingError(f"{name} must be a positive number of seconds, got {value!r}")
    return value


def request_timeout_from_env() -> float:
    """The daemon's connection deadline in seconds: the env var (set by the flag) or 5."""
    raw = os.environ.get(REQUEST_TIMEOUT_ENV)
    if raw is None or raw == "":
        return DEFAULT_REQUEST_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        raise LedgerSettingError(
            f"{REQUEST_TIMEOUT_ENV}={raw!r} must be a positive number of seconds"
        ) from None
    return check_request_timeout(value)


def export_settings(
    template: str | None = None,
    keep_versions: int | None = None,
    prune_every: int | None = None,
    request_timeout: float | None = None,
) -> None:
    """Hand the launcher's flags to this process and every daemon it spawns (None: unchanged)."""
    if template is not None:
        ledger_path("probe", template)  # fail on the command line, not in a spawned daemon
        os.environ[LEDGER_TEMPLATE_ENV] = template
    for name, value in ((KEEP_VERSIONS_ENV, keep_versions), (PRUNE_EVERY_ENV, prune_every)):
        if value is not None:
            if value < 1:
                raise LedgerSettingError(f"{name} must be a positive integer, got {value}")
            os.environ[name] = str(value)
    if request_timeout is not None:
        check_request_timeout(request_timeout, "--expert-layout-request-timeout")
        os.environ[REQUEST_TIMEOUT_ENV] = repr(request_timeout)

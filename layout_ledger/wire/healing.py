"""A daemon's reloads from its checkpoint as its service sees them: whether it can reload at
all, whether it heals by itself, and the thread a heal of its own runs on.

The daemon decides at load (``sglang_integration.daemon.checkpoint_reload``): ``reloader`` is
None, with ``cannot_reload`` saying why, where it has no checkpoint or its backend does not
leave loaded experts as loaded. ``mode`` is ``--expert-layout-heal`` (``auto`` or ``off``);
``expert_layout_heal`` and ``expert_layout_reload`` work with either.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from layout_ledger.core.reloads import SlotReloader

# Seconds a stopping daemon waits for its heal's thread once its reads were cancelled.
STOP_WAIT = 10.0

HEAL_AUTO = "auto"
HEAL_OFF = "off"
HEAL_MODES = (HEAL_AUTO, HEAL_OFF)
# ``incarnations.heal`` of a daemon that cannot reload: this prefix, then why.
HEAL_UNAVAILABLE = "unavailable: "


@dataclass
class Healing:
    """``reloader`` rewrites local slots from the checkpoint (None: ``cannot_reload`` says why)."""

    mode: str
    reloader: SlotReloader | None
    cannot_reload: str | None = None
    _thread: threading.Thread | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.mode not in HEAL_MODES:
            raise ValueError(f"heal mode must be one of {HEAL_MODES}, got {self.mode!r}")
        if self.reloader is None and self.cannot_reload is None:
            self.cannot_reload = "no checkpoint reloader"

    @classmethod
    def unavailable_because(cls, reason: str, mode: str = HEAL_AUTO) -> Healing:
        """A daemon that cannot reload (the reason is logged and shown by ``status``)."""
        return cls(mode, None, reason)

    @property
    def auto(self) -> bool:
        """It heals by itself when it may (``--expert-layout-heal auto`` and able to reload)."""
        return self.mode == HEAL_AUTO and self.cannot_reload is None

    def describe(self) -> str:
        """``auto``, ``off``, or ``unavailable: REASON`` (the ledger's ``incarnations.heal``)."""
        if self.cannot_reload is not None:
            return HEAL_UNAVAILABLE + self.cannot_reload
        return self.mode

    def start(self, heal: Callable[[], None]) -> None:
        """Run ``heal`` on its own thread (one at a time: a heal already running is enough)."""
        running = self._thread
        if running is not None and running.is_alive():
            return
        thread = threading.Thread(target=heal, name="expert-layout-heal", daemon=True)
        self._thread = thread
        thread.start()

    def wait(self, timeout: float | None = None) -> None:
        """Wait for the heal of its own that runs now, if any (tests, a clean shutdown)."""
        running = self._thread
        if running is not None:
            running.join(timeout)

    def stop(self, timeout: float = STOP_WAIT) -> None:
        """The daemon stops: every checkpoint read ends now (the reloader's ``cancel``, when it
        has one), so a heal or reload that waits on a blocked file fails at once and records
        its end before the incarnation's; then wait for the heal of its own."""
        cancel = getattr(self.reloader, "cancel", None)
        if callable(cancel):
            cancel()
        self.wait(timeout)

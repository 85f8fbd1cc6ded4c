"""What a case returns (checks with expected and measured values, notes, facts), and how it
says per-rank values."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from demo_cases.config import DemoConfig


@dataclass(frozen=True)
class Check:
    """One expected outcome; ``ok`` is None for a measurement shown for information only."""

    what: str
    expected: str
    measured: str
    ok: bool | None


@dataclass
class CaseResult:
    title: str
    checks: list[Check] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    facts: dict[str, Any] = field(default_factory=dict)  # values tests assert on

    def check(self, what: str, expected: Any, measured: Any, ok: bool) -> bool:
        self.checks.append(Check(what, str(expected), str(measured), bool(ok)))
        return bool(ok)

    def info(self, what: str, measured: Any) -> None:
        self.checks.append(Check(what, "-", str(measured), None))

    @property
    def failed(self) -> list[Check]:
        return [check for check in self.checks if check.ok is False]


def per_rank(values: Iterable[Any]) -> str:
    """One value per EP rank, in rank order; the same value on every rank is said once."""
    texts = [str(value) for value in values]
    if len(texts) > 1 and len(set(texts)) == 1:
        return f"{'both' if len(texts) == 2 else f'all {len(texts)}'}: {texts[0]}"
    return ", ".join(texts)


def both(value: Any, ep_size: int) -> str:
    """What ``per_rank`` shows when every rank has ``value``."""
    return per_rank([value] * ep_size)


def slots(count: int, config: DemoConfig) -> str:
    return f"{count}/{config.all_slots}"


def yes(value: bool) -> str:
    return "yes" if value else "no"

"""The proposal's table measured by what engines answer: greedy tokens against the reference.

Every engine of the demo that holds the model computes tokens with sglang's own forward pass on
the CPU (``testing.greedy``): the same 8 prompts, 32 new tokens each, float32. The reference R
loads everything from disk and never rebalances; an engine is right when its greedy tokens equal
R's. ``Answers`` collects one row per engine (rows of one ``group`` are one row: A's passes after
each rebalance), each also a check of the case it belongs to.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from demo_cases.results import CaseResult


@dataclass
class Answer:
    """One row: an engine (or a group of its passes), the versions it routed with, how many of
    the prompts gave R's tokens (the least over the group's passes), and what was expected."""

    label: str
    expect_equal: bool
    routes: list[str] = field(default_factory=list)  # per pass: "v20", "the initial layout"...
    equal: list[int] = field(default_factory=list)
    total: int = 0

    @property
    def least_equal(self) -> int:
        return min(self.equal) if self.equal else 0

    @property
    def ok(self) -> bool:
        if self.expect_equal:
            return all(count == self.total for count in self.equal)
        return all(count < self.total for count in self.equal)

    def routes_with(self) -> str:
        named = self.routes
        if len(named) > 3:
            return f"{named[0]} .. {named[-1]} ({len(named)} passes)"
        return ", ".join(named)

    def measured(self) -> str:
        text = f"{self.least_equal}/{self.total}"
        return text + (" at each pass" if len(self.equal) > 1 else "")


@dataclass
class Answers:
    """R's tokens and every row so far (in the order they were first answered)."""

    reference: list[list[int]] | None = None
    rows: list[Answer] = field(default_factory=list)

    def row(self, label: str, expect_equal: bool) -> Answer:
        for row in self.rows:
            if row.label == label:
                return row
        row = Answer(label, expect_equal)
        self.rows.append(row)
        return row


def tokens_of(replies: list[dict[str, Any]]) -> list[list[int]]:
    """The tokens every rank decoded (they must agree: each computes the same logits)."""
    tokens: list[list[int]] = replies[0]["tokens"]
    for reply in replies[1:]:
        if reply["tokens"] != tokens:
            raise RuntimeError(f"rank {reply['rank']} decoded other tokens than rank 0")
    return tokens


def equal_prompts(tokens: list[list[int]], reference: list[list[int]]) -> int:
    return sum(1 for mine, theirs in zip(tokens, reference, strict=True) if mine == theirs)


def record_answer(
    answers: Answers,
    result: CaseResult,
    label: str,
    replies: list[dict[str, Any]],
    *,
    expect_equal: bool = True,
    routes: str | None = None,
    check: bool = True,
) -> int:
    """Add one pass's replies to ``label``'s row and (unless ``check`` is off: a group's passes,
    checked once by ``check_row``) a check to ``result``; the prompts whose tokens equal R's.
    ``routes``: what the engine routes with where no daemon gives its map a version (weights
    from disk); else the daemons' version, or "the initial layout"."""
    if answers.reference is None:
        raise RuntimeError("the reference R has not answered yet")
    tokens = tokens_of(replies)
    equal = equal_prompts(tokens, answers.reference)
    total = len(answers.reference)
    version = replies[0]["routed_version"]
    row = answers.row(label, expect_equal)
    row.total = total
    row.equal.append(equal)
    if version is not None:
        row.routes.append(f"v{version}")
    else:
        row.routes.append(routes or "the initial layout")
    if check:
        check_row(result, row)
    return equal


def check_row(result: CaseResult, row: Answer) -> bool:
    """One check of ``result``: ``row``'s passes gave R's tokens (or, expected wrong, did not)."""
    return result.check(
        f"{row.label}: prompts whose greedy tokens equal R's ({row.routes_with()})",
        f"{row.total}/{row.total}" if row.expect_equal else f"< {row.total}/{row.total} (the bug)",
        row.measured(),
        row.ok,
    )

"""Text for a terminal: what a ledger holds is shown, never obeyed.

A ledger is a file; anything may have been written into it. Before any of its text reaches a
person's terminal, every character a terminal could act on (C0 and C1 controls such as ESC and
the line breaks, DEL, the Unicode format characters such as bidirectional overrides, the line
and paragraph separators) is written as a visible backslash escape: ``\\n``, ``\\x1b``,
``\\u202e``. ``--json`` needs none of this: ``json.dumps`` escapes them itself.
"""

from __future__ import annotations

import logging
import unicodedata

_SHORT = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
_ACTIVE_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})


def _escape(char: str) -> str:
    if char in _SHORT:
        return _SHORT[char]
    code = ord(char)
    if code < 0x100:
        return f"\\x{code:02x}"
    if code < 0x10000:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def printable(text: str) -> str:
    """``text`` with every character a terminal could act on written as a backslash escape."""
    if text.isprintable():
        return text
    return "".join(
        _escape(char) if unicodedata.category(char) in _ACTIVE_CATEGORIES else char for char in text
    )


class PrintableFormatter(logging.Formatter):
    """A log formatter whose lines pass through ``printable``."""

    def format(self, record: logging.LogRecord) -> str:
        return printable(super().format(record))

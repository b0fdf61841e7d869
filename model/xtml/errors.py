"""Errors of the XTML renderer and parser.

Both are ``ValueError`` subclasses so that a front end can map them to INVALID_ARGUMENT without knowing
XTML. A parse error carries where it happened (``position`` in ``unit`` — characters of the text fed, or
tokens when ids are fed) and what the grammar expected there, so a malformed model output can be reported
and debugged precisely.
"""

from __future__ import annotations


class XTMLRenderError(ValueError):
    """A conversation that cannot be rendered (the message names the offending field)."""


class XTMLParseError(ValueError):
    """Malformed model output in strict mode."""

    def __init__(self, problem: str, *, position: int, unit: str, expected: str, found: str) -> None:
        self.problem = problem
        self.position = position
        self.unit = unit
        self.expected = expected
        self.found = found
        super().__init__(f"{problem} at {unit} {position}: expected {expected}, found {found}")

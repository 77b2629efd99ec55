"""Context on errors that pass through optimshift: which entry a failing copy hit, and that nothing changed."""

from __future__ import annotations


def add_note(error: BaseException, note: str) -> None:
    """``error.add_note(note)`` where Python has it (3.11+); a no-op on 3.10, where the error stands alone."""
    adder = getattr(error, "add_note", None)
    if adder is not None:
        adder(note)

"""Context on errors that pass through optimshift: which entry a failing copy hit, and that nothing changed; the
article a name takes in a message; a dtype's name in one; where a warning points."""

from __future__ import annotations

import sys
import warnings

# Modules that only relay a call to optimshift, and optimshift's own: a warning points past them (a ``with``
# block's contextlib, torch's ``no_grad`` decorator over a patch's function, the import that ran a patch on import).
_RELAYS = (f"{__name__.split('.')[0]}.", "importlib.", "contextlib.", "torch.utils._contextlib.")


def warn(message: str, category: type[Warning] = RuntimeWarning) -> None:
    """A warning at the first frame outside optimshift and its relays: the user's line, whichever of optimshift's
    functions, framework patches or ``with`` blocks the call went through."""
    frame = sys._getframe(1)
    while frame.f_back is not None and f"{frame.f_globals.get('__name__', '')}.".startswith(_RELAYS):
        frame = frame.f_back
    registry = frame.f_globals.setdefault("__warningregistry__", {})
    module = frame.f_globals.get("__name__", "<string>")
    warnings.warn_explicit(message, category, frame.f_code.co_filename, frame.f_lineno, module, registry)


def dtype_name(dtype: object) -> str:
    """``torch.float32`` as ``float32``."""
    return str(dtype).replace("torch.", "")


def add_note(error: BaseException, note: str) -> None:
    """``error.add_note(note)`` where Python has it (3.11+); a no-op on 3.10, where the error stands alone."""
    adder = getattr(error, "add_note", None)
    if adder is not None:
        adder(note)


# Consonants whose spoken name starts with a vowel sound: an initialism that starts with one takes "an" (an SGD,
# an LBFGS, an RMSprop, an NAdam).
_VOWEL_SOUNDING_LETTERS = frozenset("FHLMNRSX")


def with_article(word: str) -> str:
    """``word`` after the indefinite article its sound takes: "an Adam", "a SparseAdam", "an SGD", "an int"."""
    initialism = len(word) > 1 and word[0].isupper() and word[1].isupper()
    first = word[:1]
    vowel = bool(first) and (first.lower() in "aeiou" or (initialism and first in _VOWEL_SOUNDING_LETTERS))
    return f"{'an' if vowel else 'a'} {word}"

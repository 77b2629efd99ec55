"""Context on errors that pass through optimshift: which entry a failing copy hit, and that nothing changed; the
article a name takes in a message; a dtype's name in one."""

from __future__ import annotations


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

"""Imported first by :mod:`optimshift`: imports torch without the one warning a clean install prints."""

import sys
import warnings
from typing import cast


def _import_torch() -> None:
    """Import torch without the "Failed to initialize NumPy" warning it gives where NumPy is missing (optional for
    torch, never used here: a clean install warned on every command). The filter matches only that message and goes
    once torch is imported; every other filter and warning is left as it was. A torch imported earlier has warned."""
    if "torch" in sys.modules:
        return
    before = list(warnings.filters)
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)
    quiet = warnings.filters[0]
    try:
        import torch  # noqa: F401
    finally:
        if quiet not in before:  # the caller's own identical filter stays
            try:
                cast("list[object]", warnings.filters).remove(quiet)  # a list (typeshed says Sequence)
            except ValueError:  # someone reset the filters meanwhile
                pass
        mutated = getattr(warnings, "_filters_mutated", None)  # invalidate the warning caches, as filterwarnings does
        if mutated is not None:
            mutated()


_import_torch()

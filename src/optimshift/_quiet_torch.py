"""Imported first by :mod:`optimshift`: imports torch without the one warning a clean install prints."""

import sys
import warnings


def _import_torch() -> None:
    """Import torch without its "Failed to initialize NumPy" warning, and nothing else changed.

    NOTE: torch warns at import when NumPy is not installed (NumPy is optional for torch, and optimshift
    never uses it), so every command printed a warning on a clean install. The filter matches only that
    message and is removed once torch is imported; torch's own filters and every other warning are left as
    they are. When torch was imported before optimshift, its warning has already been shown.
    """
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
                warnings.filters.remove(quiet)
            except ValueError:  # someone reset the filters meanwhile
                pass
        mutated = getattr(warnings, "_filters_mutated", None)  # invalidate the warning caches, as filterwarnings does
        if mutated is not None:
            mutated()


_import_torch()

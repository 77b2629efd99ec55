"""The one patching idiom (``optimshift.integrations._common.Patch``)."""

from __future__ import annotations

from typing import Any

import pytest

from optimshift.integrations._common import Patch, Swap


def test_a_patch_interrupted_half_way_can_be_undone() -> None:
    """An error (a Ctrl-C) between two swaps undoes the first: it was made before it was recorded, so undo() knew
    of none and the framework stayed half patched (and a patch applied half way said it was applied)."""

    class Refusing(type):
        def __setattr__(cls, name: str, value: Any) -> None:
            if name == "second":
                raise KeyboardInterrupt
            super().__setattr__(name, value)

    class Framework(metaclass=Refusing):
        def first(self) -> str:
            return "original first"

        def second(self) -> str:
            return "original second"

    original_first, original_second = Framework.__dict__["first"], Framework.__dict__["second"]

    def ours(self: Any) -> str:
        return "ours"

    patch = Patch()
    with pytest.raises(KeyboardInterrupt):
        patch.apply(
            lambda: [
                Swap(Framework, "first", original_first, ours),
                Swap(Framework, "second", original_second, ours),
            ]
        )
    assert Framework().first() == "original first"  # (made before the interrupt, undone)
    assert Framework().second() == "original second"
    assert not patch.applied()  # (so that patching again applies every swap)

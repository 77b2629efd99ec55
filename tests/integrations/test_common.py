"""The one patching idiom (``optimshift.integrations._common.Patch``)."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch

from optimshift.integrations._common import Patch, Swap, follow_params


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


class _Lookahead(torch.optim.Optimizer):
    """A Lookahead-style wrapper: the inner optimizer's param groups, a state of its own (none here)."""

    def __init__(self, inner: torch.optim.Optimizer):
        self.optimizer = inner
        super().__init__([p for g in inner.param_groups for p in g["params"]], {})
        self.param_groups = inner.param_groups


def test_a_move_an_integration_makes_warns_at_the_line_that_called_it() -> None:
    """follow_params (Lightning's, Accelerate's move) of a wrapper: the warning that the move does not reach the
    inner optimizer's state named follow_params' own line, not its caller's."""
    opt = _Lookahead(torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1))
    with pytest.warns(RuntimeWarning, match=r"optimshift\.move: .* does not reach") as warned:
        follow_params(opt)
    assert [(w.filename, w.lineno) for w in warned] == [(__file__, inspect.currentframe().f_lineno - 1)]


@pytest.mark.parametrize("name", ["accelerate", "lightning"])
def test_every_public_function_of_an_integration_has_a_docstring(name: str) -> None:
    """``unpatch`` is the Patch's own ``undo`` since the wrappers went: it had none, so help() said nothing."""
    import importlib
    import inspect

    module = importlib.import_module(f"optimshift.integrations.{name}")  # (neither patches on import)
    public = [n for n in module.__all__ if callable(getattr(module, n)) and not inspect.isclass(getattr(module, n))]
    assert "unpatch" in public
    assert [n for n in public if not inspect.getdoc(getattr(module, n))] == []

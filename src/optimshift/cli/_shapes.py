"""Param shapes the benchmarks use (one place for ``bench`` and its cases)."""

from __future__ import annotations

__all__ = ["transformer_shapes"]


def transformer_shapes(n_params: int) -> list[tuple[int, ...]]:
    """Param shapes of a GPT-like model with about ``n_params`` parameters."""
    hidden = 256
    while 12 * (hidden * 2) ** 2 * 4 <= n_params and hidden < 4096:
        hidden *= 2
    layers = max(1, n_params // (12 * hidden * hidden))
    shapes: list[tuple[int, ...]] = []
    for _ in range(layers):
        shapes += [
            (3 * hidden, hidden),
            (3 * hidden,),
            (hidden, hidden),
            (hidden,),
            (4 * hidden, hidden),
            (4 * hidden,),
            (hidden, 4 * hidden),
            (hidden,),
            (hidden,),
            (hidden,),
            (hidden,),
            (hidden,),
        ]
    return shapes

"""How streamed state is laid out in host memory: chunks of consecutive params of one group on one device
(:func:`partition`), their state tensors in one flat uint8 host pool buffer (pinned where the device pins host
memory), each at a 64-byte-aligned offset; a device window of the same layout holds them during a step, and
:func:`views` gives each tensor's place in either."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import torch

from ._device_streams import pins_host_for
from ._dtensor import tensor_bytes
from .pool import host_pool

# NOTE: every tensor starts at a multiple of 64 bytes in its chunk, on the host and in the window alike, so that
# a window view is as aligned as the vectorized multi-tensor kernels need (16 bytes x 4 lanes for complex128).
_ALIGN = 64

T = TypeVar("T")

Group = dict[str, Any]
"""A param group (an entry of ``optimizer.param_groups``)."""
ParamState = dict[Any, Any]
"""One param's state (``optimizer.state[p]``), keyed as the optimizer keys it."""
Item = tuple[Group, torch.Tensor, ParamState, list[tuple[Any, torch.Tensor]]]
"""A param to lay out: its group, the param, its state and the (key, tensor) entries of it to stream."""


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class Entry:
    """One streamed state tensor: where it sits (``state[key]``), its object, its place in the chunk."""

    __slots__ = ("state", "key", "obj", "host", "offset", "nbytes", "dtype", "shape", "stride")

    def __init__(self, state: ParamState, key: Any, obj: torch.Tensor, offset: int) -> None:
        self.state, self.key, self.obj, self.offset = state, key, obj, offset
        self.nbytes = tensor_bytes(obj)
        self.dtype, self.shape = obj.dtype, tuple(obj.shape)
        # Strides kept when the tensor is dense (as a fresh optimizer's zeros_like(p) of a permuted param is).
        self.stride = obj.stride() if obj.is_contiguous() else torch.empty_like(obj, device="meta").stride()
        self.host: torch.Tensor | None = None  # a view of the host buffer (what the object points at between steps)


def views(flat: torch.Tensor, entries: Sequence[Entry]) -> list[torch.Tensor]:
    """Each entry's place in ``flat`` (a whole uint8 buffer laid out like its chunk, its size a multiple of 64:
    the host buffer or a window): one ``as_strided`` per tensor over a view of the buffer in the tensor's dtype."""
    typed: dict[torch.dtype, torch.Tensor] = {}
    out = []
    for e in entries:
        t = typed.get(e.dtype)
        if t is None:
            t = typed[e.dtype] = flat.view(e.dtype)
        out.append(t.as_strided(e.shape, e.stride, e.offset // t.element_size()))
    return out


class Chunk:
    """Params of one group on one device whose streamed state shares one host buffer (and, in a step, one
    window). ``counts``: each param with the state dict laid out and how many tensors it held (a step that adds
    or drops one, or another dict in its place, makes the chunk laid out again); ``laid``: that dict by id(param).
    ``oversized``: one param whose state is larger than ``chunk_bytes``."""

    __slots__ = ("group", "device", "params", "entries", "nbytes", "buffer", "counts", "laid", "oversized")

    def __init__(
        self,
        group: Group,
        device: torch.device,
        params: list[torch.Tensor],
        entries: list[Entry],
        nbytes: int,
        buffer: torch.Tensor,
        counts: list[tuple[torch.Tensor, dict[Any, Any], int]],
        oversized: bool,
    ) -> None:
        self.group, self.device, self.params, self.entries = group, device, params, entries
        self.nbytes, self.buffer, self.counts, self.oversized = nbytes, buffer, counts, oversized
        self.laid = {id(p): st for p, st, _ in counts}


def item_bytes(item: Item) -> int:
    """Bytes of ``item``'s streamed state in a chunk (alignment included)."""
    return sum(_aligned(tensor_bytes(t)) for _, t in item[3])


def partition(items: Sequence[T], chunk_bytes: int, nbytes: Callable[[T], int]) -> Iterator[list[T]]:
    """Consecutive ``items`` (params of one group and device), cut where the next one's ``nbytes`` would take the
    part past ``chunk_bytes`` (a param is never split: its step needs all its state)."""
    part: list[T] = []
    size = 0
    for item in items:
        n = nbytes(item)
        if part and size + n > chunk_bytes:
            yield part
            part, size = [], 0
        part.append(item)
        size += n
    if part:
        yield part


def new_chunk(part: list[Item], chunk_bytes: int) -> Chunk:
    """A chunk for ``part`` with a host buffer from the pool, each entry given its host view (the destination
    the engine copies its tensor into: ``engine.run(into=...)``). Nothing in the state changes here."""
    group, device = part[0][0], part[0][1].device
    entries: list[Entry] = []
    offset = 0
    for _, _, st, streamed in part:
        for key, t in streamed:
            entries.append(Entry(st, key, t, offset))
            offset += _aligned(entries[-1].nbytes)
    buffer = host_pool.acquire(max(offset, 1), pinned=pins_host_for(device))
    counts = [(p, st, sum(isinstance(v, torch.Tensor) for v in st.values())) for _, p, st, _ in part]
    params = [p for _, p, _, _ in part]
    oversized = len(part) == 1 and offset > chunk_bytes
    chunk = Chunk(group, device, params, entries, offset, buffer, counts, oversized)
    for e, host in zip(entries, views(buffer, entries)):
        e.host = host
    return chunk


def release(chunks: Sequence[Chunk]) -> None:
    """Give the chunks' host buffers back to the pool (reused only once nothing looks into them)."""
    for c in chunks:
        for e in c.entries:
            e.host = None
        host_pool.release(c.buffer)

"""The host layout of streamed state (``optimshift._chunks``): chunks never split a param, every tensor sits at a
64-byte-aligned place of its own in the chunk's buffer, with its dtype, shape and dense strides."""

from __future__ import annotations

import torch

from optimshift import _chunks
from optimshift.pool import host_pool


def _item(group, shape, dtype=torch.float32, keys=("exp_avg", "exp_avg_sq")):
    p = torch.zeros(shape, dtype=dtype)
    st = {k: torch.randn(shape).to(dtype) for k in keys}
    return (group, p, st, list(st.items()))


def test_partition_cuts_at_chunk_bytes_and_never_splits_a_param():
    group = {"params": []}
    items = [_item(group, (4,)) for _ in range(5)] + [_item(group, (100,))] + [_item(group, (4,))]
    # (4,) float32: two 16-byte moments, each aligned to 64: 128 bytes; (100,): 2 x 448 = 896 bytes
    parts = list(_chunks.partition(items, 256, _chunks.item_bytes))
    assert [len(part) for part in parts] == [2, 2, 1, 1, 1]
    assert [x for part in parts for x in part] == items, "consecutive, in order, every param once"
    assert parts[3][0] is items[5], "a param larger than a chunk gets a chunk of its own"


def test_new_chunk_places_each_tensor_aligned_apart_with_its_layout():
    group = {"params": []}
    permuted = torch.randn(3, 5).t()  # dense but not contiguous, as zeros_like of a permuted param is
    st = {"m": permuted, "n": torch.randn(7, dtype=torch.float64), "step": torch.tensor(3.0)}
    part = [(group, torch.zeros(5, 3), st, list(st.items())), _item(group, (2, 2), torch.bfloat16)]
    in_use = host_pool.stats().in_use
    chunk = _chunks.new_chunk(part, 1 << 20)
    assert host_pool.stats().in_use == in_use + 1, "the chunk's buffer comes from the host pool"
    try:
        assert [e.offset for e in chunk.entries] == [0, 64, 128, 192, 256] and chunk.nbytes == 320
        assert not chunk.oversized and chunk.params == [part[0][1], part[1][1]]
        assert [(p, n) for p, _, n in chunk.counts] == [(part[0][1], 3), (part[1][1], 2)]
        assert [laid for _, laid, _ in chunk.counts] == [part[0][2], part[1][2]]  # (the dicts laid out)
        assert all(laid is item[2] for (_, laid, _), item in zip(chunk.counts, part))
        for e in chunk.entries:  # (each host view: the destination the engine copies its tensor into)
            host, source = e.host, e.obj
            assert (host.dtype, host.shape, host.stride()) == (source.dtype, source.shape, source.stride())
            assert host.untyped_storage().data_ptr() == chunk.buffer.untyped_storage().data_ptr()
            host.copy_(source)
        again = _chunks.views(chunk.buffer, chunk.entries)
        for v, e in zip(again, chunk.entries):
            assert torch.equal(v, e.obj), "views of the buffer give back what each tensor wrote, nothing overlaps"
    finally:
        _chunks.release([chunk])
    assert all(e.host is None for e in chunk.entries)
    assert host_pool.stats().in_use == in_use, "released: back to the pool"

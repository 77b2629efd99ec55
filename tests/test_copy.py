"""``optimshift._copy``'s staging of host sources in pinned memory, for copies written into live tensors (a host
checkpoint loaded into state on an accelerator). The CPU machines have no pinned memory: a pool that hands out
plain host buffers stands in for the pinned one, and ``pins_host_for`` is told the simulator pins (on a GPU,
``benchmarks/gpu_check.sh`` runs ``tests/test_addresses_cuda.py``'s host-checkpoint load)."""

from __future__ import annotations

import pytest
import torch

import optimshift
from optimshift import _copy, _engine
from optimshift.pool import HostPool

_PINNED: set[int] = set()  # ids of the buffers the test pools hand out as pinned


class _Pool(HostPool):
    """A pool that records what it hands out and gets back: host buffers, taken for pinned ones (``pinned``:
    how many it hands out so before it runs out, as at its pinned limit: pageable memory then)."""

    def __init__(self, pinned: int | None = None) -> None:
        super().__init__()
        self.out: dict[int, torch.Tensor] = {}
        self.asked: list[bool] = []
        self.pinned = pinned

    def acquire(self, nbytes: int, *, pinned: bool, pageable: bool = True) -> torch.Tensor | None:
        self.asked.append(pinned)
        if pinned and not pageable and self.pinned == 0:
            return None
        buf = torch.empty(nbytes, dtype=torch.uint8)
        self.out[id(buf)] = buf
        if pinned and (self.pinned is None or self.pinned > 0):
            _PINNED.add(id(buf))
            self.pinned = None if self.pinned is None else self.pinned - 1
        return buf

    def release(self, buf: torch.Tensor, event=None) -> None:
        del self.out[id(buf)]
        _PINNED.discard(id(buf))


@pytest.fixture
def pinning(sim, monkeypatch):
    """The host is pinned for the simulator, as it is for CUDA, and the test pools' pinned buffers are pinned."""
    monkeypatch.setattr(_copy, "pins_host_for", lambda device: device.type == sim.type)
    monkeypatch.setattr(_copy, "in_pinned_memory", lambda t: id(t) in _PINNED)
    yield sim
    _PINNED.clear()


def test_sources_are_staged_by_dtype_as_views_of_pool_buffers(pinning):
    sources = [torch.randn(3, 4), torch.arange(5, dtype=torch.int64), torch.randn(7), torch.randn(0), torch.tensor(2.0)]
    sources.append(torch.randn(4, 4).t())  # (not contiguous: copied from where it is)
    pool = _Pool()
    staged, buffers = _copy.pinned_sources(sources, pinning, pool)
    assert len(buffers) == 2 and all(pool.asked) and set(map(id, buffers)) == set(pool.out)  # (float32, int64)
    for src, view in zip(sources, staged):
        assert view.shape == src.shape and view.dtype == src.dtype and torch.equal(view, src)
    stays = {3, 5}  # (the empty one and the transposed one are not staged)
    assert all(staged[i] is sources[i] for i in stays)
    bases = {b.data_ptr() for b in buffers}
    assert all(
        any(b <= staged[i].data_ptr() < b + buf.numel() for b, buf in zip(bases, buffers))
        for i in range(len(sources))
        if i not in stays
    )


def test_large_tensors_are_copied_from_where_they_are(pinning):
    """A tensor of SOLO_BYTES or more is copied directly (bound by bandwidth, as the grouped copies make it): no
    copy of it on the host beside the checkpoint's."""
    big = torch.zeros(_copy.SOLO_BYTES // 4)
    small = torch.randn(5)
    pool = _Pool()
    staged, buffers = _copy.pinned_sources([big, small], pinning, pool)
    assert staged[0] is big and staged[1] is not small and torch.equal(staged[1], small)
    assert len(buffers) == 1 and buffers[0].numel() < _copy.SOLO_BYTES


def test_staging_stops_once_the_pool_has_no_pinned_memory_to_give(pinning):
    """Past the pool's pinned limit (or where pinning fails) staging would copy the values once more on the host
    for nothing: the rest is copied from where it is, and no pageable buffer is taken for it."""
    sources = [torch.randn(3), torch.arange(3), torch.randn(2, dtype=torch.float64)]
    pool = _Pool(pinned=1)
    staged, buffers = _copy.pinned_sources(sources, pinning, pool)
    assert len(buffers) == 1 and set(pool.out) == {id(buffers[0])}
    assert sum(s is not t for s, t in zip(staged, sources)) == 1
    assert all(torch.equal(s, t) for s, t in zip(staged, sources))


def test_nothing_is_staged_where_the_host_is_not_pinned_for_the_device(sim):
    sources = [torch.randn(3)]
    staged, buffers = _copy.pinned_sources(sources, sim, _Pool())
    assert staged is sources and buffers == []


def test_a_failure_while_staging_gives_every_buffer_back(pinning, monkeypatch):
    pool = _Pool()
    calls = []
    real = torch.cat

    def cat(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("out of memory")
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "cat", cat)
    with pytest.raises(RuntimeError, match="out of memory"):
        _copy.pinned_sources([torch.randn(3), torch.arange(3)], pinning, pool)
    assert pool.out == {}


def test_a_host_checkpoint_into_device_state_is_written_from_pinned_staging(pinning, monkeypatch):
    """The load's in-place writes from the host read the staged copies, and every buffer is back in the pool once
    the load returned, the values the checkpoint's."""
    from _matrix import Model, bitwise_equal, train

    pool = _Pool()
    monkeypatch.setattr(_engine, "host_pool", pool)
    read = []
    real = _engine._write_in_place

    def spy(pairs):
        read.extend(new for _, news in pairs.values() for new in news)
        return real(pairs)

    monkeypatch.setattr(_engine, "_write_in_place", spy)
    models = [Model([(8, 4), (4,)]).to(pinning) for _ in range(2)]
    opts = [torch.optim.Adam(m.parameters(), foreach=False) for m in models]
    for i, (m, o) in enumerate(zip(models, opts)):
        train(m, o, range(2 + i))
    sd = opts[1].state_dict()
    host = {"state": {i: {k: v.cpu() for k, v in st.items()} for i, st in sd["state"].items()}}
    host["param_groups"] = sd["param_groups"]
    live = [t for st in opts[0].state.values() for t in st.values()]
    optimshift.load_state_dict(opts[0], host)
    assert [t for st in opts[0].state.values() for t in st.values()] == live
    assert pool.asked and pool.out == {}  # (staged, and all given back)
    moments = [t for t in read if t.dim() > 0]
    checkpoint = {id(t) for st in host["state"].values() for t in st.values()}
    assert len(moments) == 4 and not any(id(t) in checkpoint for t in moments)  # (read from the staging)
    assert bitwise_equal(
        [{k: v.cpu() for k, v in st.items()} for st in opts[0].state.values()],
        [{k: v.cpu() for k, v in st.items()} for st in opts[1].state.values()],
    )


def test_a_copy_asked_of_a_device_without_index_is_never_the_tensor_itself(sim):
    """``.to()`` hands a tensor back itself when the target names its device without an index (``sim`` for a tensor
    on ``sim:0``); copy_many's inlined plain-tensor path took that for the copy (6380c12), which a commit would then
    adopt as if it were one."""
    t = torch.ones(3, device=sim)
    (copy,) = _copy.copy_many([(t, torch.device(sim.type))], _copy.BLOCKING, pool=HostPool()).copies
    assert copy is not t and copy.device == t.device and torch.equal(copy.cpu(), t.cpu())


def test_a_failed_cast_says_it_was_a_cast_and_to_which_dtype(sim, monkeypatch):
    """A load with ``cast=`` copies and casts at once: an OOM there got the note of a plain copy, the saved dtype
    its only dtype, as if nothing were cast (float32 state bound for bfloat16 params)."""
    source = [torch.nn.Parameter(torch.randn(3, 2)) for _ in range(2)]
    trained = torch.optim.Adam(source)
    for p in source:
        p.grad = torch.randn_like(p)
    trained.step()
    sd = trained.state_dict()
    saved = {id(t) for st in sd["state"].values() for t in st.values() if t.dim() > 0}
    real = torch.Tensor.to

    def out_of_memory(self, *args, **kwargs):
        if id(self) in saved:
            raise torch.OutOfMemoryError("out of memory (test)")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", out_of_memory)
    opt = torch.optim.Adam([torch.nn.Parameter(torch.randn(3, 2, device=sim, dtype=torch.bfloat16)) for _ in source])
    with pytest.raises(torch.OutOfMemoryError) as info:
        optimshift.load_state_dict(opt, sd, cast="param")
    (note,) = info.value.__notes__
    assert "state key 'exp_avg' ((3, 2), torch.float32) from cpu to sim:0, cast to torch.bfloat16;" in note, note
    assert not opt.state


def test_a_failed_copy_in_a_column_of_plain_tensors_names_its_own_item(monkeypatch):
    """copy_many copies plain tensors all bound from one device to one other by one ``.to`` each in a pass in C
    (_one_pair); a copy that fails there is named by its own index, as the loop names it."""
    tensors = [torch.ones(2) for _ in range(4)]
    real, calls = torch.Tensor.to, []

    def to(self, *args, **kwargs):
        calls.append(self)
        if len(calls) == 3:
            raise RuntimeError("out of memory")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", to)
    with pytest.raises(RuntimeError, match="out of memory") as e:
        _copy.copy_many(
            [(t, torch.device("meta")) for t in tensors],
            _copy.BLOCKING,
            pool=HostPool(),
            describe=lambda i: f"entry {i}",
        )
    assert calls == tensors[:3]
    assert any("while copying entry 2 " in note for note in e.value.__notes__), e.value.__notes__

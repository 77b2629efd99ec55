"""Streamed steps over the whole optimizer matrix (every separable torch.optim class and mode), on the simulated
accelerator.

For each case, with the params on the device and ``chunk_bytes`` small enough for several chunks (some holding
two params, some one):

- streamed from the start (its state is created under streaming), and streamed after K ordinary steps (its
  device state is laid out on the host), then N more steps: params and state bitwise equal to K + N ordinary
  steps with all state on the device;
- between steps every state tensor is on the host; the objects stay the same across steps and across
  ``unstream``; no dtype changes;
- host syncs over the N steps equal the ordinary optimizer's (the write-backs are copy-stream copies);
- after ``unstream`` the placement equals the ordinary optimizer's and ``check`` is clean.
"""

from __future__ import annotations

import pytest
import torch

import optimshift
from _matrix import CASES, Model, bitwise_equal, state_dtypes, state_layout, tensor_ids, train

K, N = 2, 2


def _model(shapes, sim):
    model = Model(shapes)
    model.to(sim)
    return model, [h.weight for h in model.parts]


def _chunk_bytes(ref) -> int:
    """Two params' streamed state per chunk: the matrix's tensors are at most 48 bytes, each padded to 64."""
    per_param = max(
        sum(64 for v in st.values() if isinstance(v, torch.Tensor) and v.device.type != "cpu")
        for st in ref.state.values()
    )
    return 2 * max(per_param, 64)


def _run(cls, kwargs, shapes, sim, *, stream_at, chunk_bytes=64):
    """K + N steps; stream before step ``stream_at`` (None: never). Returns model, optimizer, syncs of the last
    N steps, and the state tensor ids after step K + 1 and at the end."""
    model, params = _model(shapes, sim)
    opt = cls(params, **kwargs)
    handle = None
    if stream_at == 0:
        handle = optimshift.stream(opt, chunk_bytes=chunk_bytes)
    train(model, opt, range(K))
    if stream_at == K:
        dtypes, objects = state_dtypes(opt), tensor_ids(opt)
        handle = optimshift.stream(opt, chunk_bytes=chunk_bytes)
        assert state_dtypes(opt) == dtypes and tensor_ids(opt) == objects
    train(model, opt, range(K, K + 1))
    ids = tensor_ids(opt)
    with optimshift.count_syncs() as syncs:
        train(model, opt, range(K + 1, K + N + 1))
    assert tensor_ids(opt) == ids, "state tensors must keep their objects from step to step"
    return model, opt, syncs, handle


def _cases():
    for name, cls, kwargs, _, shapes in CASES:
        if name != "LBFGS":
            yield pytest.param(cls, kwargs, shapes, id=name)


@pytest.mark.parametrize("cls, kwargs, shapes", list(_cases()))
def test_streamed_steps_are_the_ordinary_steps(sim, cls, kwargs, shapes):
    ref_model, ref, ref_syncs, _ = _run(cls, kwargs, shapes, sim, stream_at=None)
    has_moments = any(v.dim() > 0 for st in ref.state.values() for v in st.values() if isinstance(v, torch.Tensor))
    chunk_bytes = _chunk_bytes(ref)
    for stream_at in (0, K):
        model, opt, syncs, handle = _run(cls, kwargs, shapes, sim, stream_at=stream_at, chunk_bytes=chunk_bytes)
        assert optimshift.is_streamed(opt)
        if has_moments:
            assert handle.chunks == 2, handle  # (two params, then one)
        assert set(state_layout(opt).values()) == {torch.device("cpu")}, "between steps the state is on the host"
        assert optimshift.check(opt).ok, optimshift.check(opt)
        assert syncs.total == ref_syncs.total, f"host syncs {dict(syncs.by_op)} != ordinary {dict(ref_syncs.by_op)}"
        handle.wait()  # reading state tensors directly: the last write-backs must have landed
        if has_moments:
            assert syncs.async_copies > 0, "the write-backs are counted as copy-stream copies"
        for a, b in zip(model.parameters(), ref_model.parameters()):
            assert bitwise_equal(a, b), f"params diverged (streamed from step {stream_at})"
            assert bitwise_equal(dict(opt.state[a]), dict(ref.state[b])), f"state diverged (from step {stream_at})"
        dtypes, objects = state_dtypes(opt), tensor_ids(opt)
        optimshift.unstream(opt)
        assert not optimshift.is_streamed(opt)
        assert state_layout(opt) == state_layout(ref), "unstream places the state like the ordinary optimizer"
        assert state_dtypes(opt) == dtypes and tensor_ids(opt) == objects
        assert optimshift.check(opt).ok
        for a, b in zip(model.parameters(), ref_model.parameters()):
            assert bitwise_equal(dict(opt.state[a]), dict(ref.state[b]))

"""One object per optimizer holds what optimshift knows about it (optimshift._session)."""

import gc
import weakref

import torch

import optimshift
from _matrix import Model, train
from optimshift import _session
from optimshift.testing import deferred_streams


def test_one_session_holds_the_record_the_transfer_in_flight_its_guards_and_the_mode(sim):
    with deferred_streams(progress=0.0):
        model = Model([(3, 2), (4,)]).to(sim)
        opt = torch.optim.Adam(list(model.parameters()), foreach=True)
        train(model, opt, range(1))
        assert _session.of(opt) is None, "nothing remembered before the first operation"
        handle = optimshift.offload(opt, non_blocking=True)
        session = _session.of(opt)
        assert session is not None and session.record is not None
        assert (
            session.pending is handle and len(session.guards) == 4
        )  # (step, state_dict, load_state_dict pre-hooks; the __getstate__ front)
        handle.wait()
        optimshift.reload(opt)
        assert _session.of(opt) is session, "one session for the optimizer's life"
        assert session.record is None and session.pending is None and not session.guards
        with optimshift.streamed(opt):
            assert session.mode is not None and session.mode() is not None
        assert session.mode is None


def test_the_session_goes_with_its_optimizer(sim):
    model = Model([(3, 2)]).to(sim)
    opt = torch.optim.Adam(list(model.parameters()))
    train(model, opt, range(1))
    for _ in range(2):  # (cached plans too: they must not keep the optimizer alive)
        optimshift.offload(opt)
        optimshift.reload(opt)
    optimshift.offload(opt)
    assert _session.of(opt).plans
    session = weakref.ref(_session.of(opt))
    del opt
    gc.collect()
    assert session() is None


def test_an_optimizer_that_cannot_be_weakly_referenced_has_none():
    class Unhashable:
        __slots__ = ()
        __hash__ = None  # type: ignore[assignment]

    assert _session.get(Unhashable()) is None and _session.of(Unhashable()) is None

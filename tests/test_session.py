"""One object per optimizer holds what optimshift knows about it (optimshift._session)."""

import gc
import weakref

import pytest
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


# -- the params rebinds replaced (Session.rebound) ------------------------------------------------------------


def _sgd(n):
    params = [torch.nn.Parameter(torch.randn(3)) for _ in range(n)]
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    return params, opt


def _fresh(params):
    return [torch.nn.Parameter(p.detach().clone()) for p in params]


def test_the_params_rebinds_replaced_stay_bounded_when_the_params_alternate():
    """Two sets of params kept alive, rebound back and forth: one entry per param out of the groups, each naming the
    param in its place now. The map kept an entry for each param back in its own place too (naming itself)."""
    a, opt = _sgd(4)
    b = _fresh(a)
    for i in range(10):
        now, out = (b, a) if i % 2 == 0 else (a, b)
        optimshift.rebind(opt, now)
        rebound = _session.of(opt).rebound
        assert len(rebound) == len(out)
        assert all(rebound.get(p)() is q for p, q in zip(out, now))
        assert all(rebound.get(q) is None or rebound.get(q)() is not q for q in now)


def _profiled_events(fn):
    """How many Python and C calls ``fn()`` makes (sys.setprofile's events)."""
    import sys

    count = [0]

    def counting(frame, event, arg):
        count[0] += 1

    sys.setprofile(counting)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return count[0]


def test_a_rebind_costs_the_same_however_many_earlier_params_are_kept_alive():
    """Each rebind to fresh params, every old set kept alive: its bookkeeping walked the entries of every param any
    earlier rebind replaced (a rebind's cost grew with the rebinds before it), now only those of its own params."""
    params, opt = _sgd(20)
    history = [params]
    counts = []
    for _ in range(12):
        new = _fresh(history[-1])
        counts.append(_profiled_events(lambda: optimshift.rebind(opt, new)))
        history.append(new)
    rebound = _session.of(opt).rebound
    assert all(rebound.get(p)() is q for old in history[:-1] for p, q in zip(old, history[-1]))
    assert counts[-1] <= counts[2] + 20, counts  # (the 20 entries a walk of one earlier set would add alone)


def test_the_params_rebinds_replaced_are_held_weakly():
    """The map holds neither the old params nor those in their places now: each goes with its last reference,
    its entries with it, and the map goes with its optimizer (no cycle)."""
    a, opt = _sgd(3)
    b, c = _fresh(a), _fresh(a)
    optimshift.rebind(opt, b)
    optimshift.rebind(opt, c)
    rebound = _session.of(opt).rebound
    assert len(rebound) == 6 and all(rebound.get(p)() is q for p, q in zip(a, c))
    refs = [weakref.ref(p) for p in (*a, *b)]
    del a, b
    gc.collect()
    assert [r for r in refs if r() is not None] == [] and len(rebound) == 0
    optimshift.rebind(opt, _fresh(c))  # (c out of the groups: held by this test only)
    refs = [weakref.ref(q) for q in c]
    del c
    gc.collect()
    assert [r for r in refs if r() is not None] == [] and len(rebound) == 0
    ref = weakref.ref(rebound)
    del rebound, opt
    assert ref() is None


@pytest.mark.parametrize("seed", range(20))
def test_the_params_rebinds_replaced_follow_every_later_rebind_as_a_walk_of_them_all_did(seed):
    """Against the walk the map replaced (every entry naming a param a rebind replaces renamed to its new param):
    random rebinds of three places among eight params, some places changed outside the session's rebinds (a
    wrapper's rebind over shared groups), swaps included. Each param maps to the same param in its place now; one
    back in its own place has no entry (the walk kept it naming itself)."""
    import random

    rng = random.Random(seed)
    pool = [torch.nn.Parameter(torch.zeros(1)) for _ in range(8)]
    places = rng.sample(pool, 3)
    walked: dict[int, torch.Tensor] = {}
    rebound = _session.Rebound()
    for _ in range(30):
        new = rng.sample(pool, 3)
        renamed = [(p, q) for p, q in zip(places, new) if p is not q]
        if rng.random() < 0.8:
            now = {id(p): q for p, q in renamed}
            walked = {k: now.get(id(q), q) for k, q in walked.items()} | {id(p): q for p, q in renamed}
            rebound.record(renamed)
        places = new
        for p in pool:
            want = walked.get(id(p))
            got = rebound.get(p)
            assert (None if got is None else got()) is (None if want is p else want)

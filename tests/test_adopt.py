"""How a tensor keeps its object across devices (optimshift._adopt), and the fallback where torch allows none."""

import contextlib
import weakref

import pytest
import torch

import optimshift
from _matrix import Model, bitwise_equal, snapshot, train
from optimshift._adopt import mechanism


def test_mechanism_per_pair_of_devices(sim):
    cpu = torch.zeros(3)
    assert mechanism(cpu, torch.ones(3)) == "data"  # same kind of TensorImpl: set_data
    assert mechanism(torch.zeros(3, device=sim), torch.ones(3, device=sim)) == "data"
    assert mechanism(torch.zeros(3), torch.ones(3, device=sim)) == "swap"  # a Python backend: swap_tensors
    assert mechanism(torch.zeros(3), torch.ones(3, device="meta")) == "swap"
    held = torch.zeros(3)
    ref = weakref.ref(held)  # what dynamo keeps once it traced a step over the tensor
    assert mechanism(held, torch.ones(3, device=sim)) == "replace" and ref() is held
    viewed = torch.zeros(3)
    view = viewed[1:]  # another C++ holder of the tensor: swapping would hand it to the other object
    assert mechanism(viewed, torch.ones(3, device=sim)) == "replace" and view.numel() == 2


def test_fake_tensors_are_swapped_not_set_data():
    """A FakeTensor keeps its device in a Python attribute that set_data would not update."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        a, b = torch.zeros(3), torch.zeros(3, device=torch.device("cuda", 0))
        assert mechanism(a, b) == "swap"


def test_where_no_mechanism_applies_the_copy_takes_the_place(sim):
    """The documented fallback: a state tensor someone holds weakly, moved between the host and the simulated
    device, is replaced by its copy; placement and values are as always, the other tensors keep their objects."""
    model = Model([(3, 2), (2,)])
    opt = torch.optim.Adam(model.parameters(), foreach=False)
    train(model, opt, range(2))
    st0, st1 = (opt.state[p] for p in model.parameters())
    held = st0["exp_avg"]
    ref = weakref.ref(held)
    values = snapshot(st0)
    others = {k: st1[k] for k in st1}
    model.to(sim)
    optimshift.move(opt)
    assert st0["exp_avg"] is not held and ref() is held and held.device.type == "cpu"
    assert st0["exp_avg"].device == sim and bitwise_equal(dict(st0), values)
    assert all(st1[k] is others[k] for k in st1), "the rest keep their objects"
    assert optimshift.check(opt).ok


def test_check_says_which_tensors_would_lose_their_object(sim):
    model = Model([(3, 2)]).to(sim)
    opt = torch.optim.Adam(model.parameters(), foreach=False)
    train(model, opt, range(1))
    assert not [f for f in optimshift.check(opt).findings if "weakly referenced" in f.why]
    (st,) = opt.state.values()
    ref = weakref.ref(st["exp_avg"])  # what dynamo holds after tracing a step
    (finding,) = [f for f in optimshift.check(opt).findings if "weakly referenced" in f.why]
    assert finding.severity == "info" and finding.key == "exp_avg" and "1 state tensor on sim" in finding.why
    assert ref() is st["exp_avg"] and optimshift.check(opt).ok  # info only: nothing is misplaced


def test_an_entry_cut_from_a_dropped_buffer_lets_the_buffer_go():
    """A live entry that is a view of a buffer nothing else holds (cut from it, the buffer dropped) took a load's
    copy by ``set_data``, which keeps the view's ``_base``: the whole old buffer stayed alive (on CUDA, device
    memory an offload never freed). It is swapped instead: the same object, viewing nothing."""
    import gc
    import weakref

    import optimshift

    p = torch.nn.Parameter(torch.randn(4, 3))
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    p.grad = torch.randn(4, 3)
    opt.step()
    flat = torch.zeros(1 << 16)
    entry = opt.state[p]["momentum_buffer"] = flat[:12].view(4, 3)
    gone = weakref.ref(flat)
    del flat
    saved = {"state": {0: {"momentum_buffer": torch.ones(4, 3)}}, "param_groups": opt.state_dict()["param_groups"]}
    optimshift.load_state_dict(opt, saved)
    gc.collect()
    assert opt.state[p]["momentum_buffer"] is entry and torch.equal(entry, torch.ones(4, 3))
    assert entry._base is None and gone() is None


def test_a_reused_decision_is_reused_only_where_deciding_again_gives_it(sim):
    """The two statements of "may this pair be swapped": ``decide_all`` (inlined for plain tensors, and
    ``_swappable``) and ``still_valid`` (which a cached plan's commit asks of an earlier commit's decisions).
    Whatever changed since (a weak reference dynamo took, a view someone keeps, a grad requirement), a decision
    still_valid keeps is the one decide_all makes now."""
    from optimshift._adopt import decide_all, still_valid

    changes = {
        "nothing": lambda old, new, keep: None,
        "weakref to the old": lambda old, new, keep: keep.append(weakref.ref(old)),
        "weakref to the new": lambda old, new, keep: keep.append(weakref.ref(new)),
        "a view of the old": lambda old, new, keep: keep.append(old[:1]),
        "a view of the new": lambda old, new, keep: keep.append(new[:1]),
        "the new requires grad": lambda old, new, keep: new.requires_grad_(),
        "the old requires grad": lambda old, new, keep: old.requires_grad_(),
    }
    placements = [("cpu", "cpu"), ("cpu", sim), (sim, "cpu"), ("cpu", "meta"), (sim, sim)]
    changed = 0
    for name, change in changes.items():
        for source, target in placements:
            for view in (False, True):
                base = torch.zeros(4, device=source)
                old = base[1:] if view else base
                if view:
                    del base  # (a view whose base nothing else holds)
                new = torch.ones(old.shape, device=target)
                before = decide_all([(old, new)])
                keep: list[object] = []
                change(old, new, keep)
                now = decide_all([(old, new)])
                changed += now != before
                if still_valid([(old, new)], before):
                    assert now == before, (name, source, target, view, before, now)
    assert changed, "no change made any decision differ: the test would not see a wrong reuse"


def test_a_complex_entry_with_real_views_of_it_keeps_its_object(sim):
    """A complex entry beside views of it in another dtype (``view_as_real``, ``.real``, ``.imag``) kept in state:
    each of those views holds its base twice (a forward view info beside the backward one), so counting one hold
    per view found the base held outside and replaced it on every move to or from the simulator. Every entry keeps
    its object, the views keep sharing its storage, the values stay bitwise; a view held outside still forbids it."""
    p = torch.nn.Parameter(torch.randn(4))
    opt = torch.optim.SGD([p], lr=0.1)
    c = torch.randn(4, dtype=torch.complex64)
    opt.state[p] = {"c": c, "pair": torch.view_as_real(c), "re": c.real, "im": c.imag}
    objects, values, devices = dict(opt.state[p]), snapshot(opt.state[p]), []
    for road in (lambda o: optimshift.move(o, sim), optimshift.offload, optimshift.reload, optimshift.move):
        road(opt)  # (the last: back to the host, where its param is)
        st = opt.state[p]
        assert all(st[k] is objects[k] for k in st)
        assert {st[k].untyped_storage().data_ptr() for k in st} == {c.untyped_storage().data_ptr()}
        assert bitwise_equal(dict(st), values)
        devices.append(c.device.type)
    assert devices == ["sim", "cpu", "sim", "cpu"]
    outside = c.imag  # (not an entry: a swap would leave it on the old storage)
    del opt.state[p]["im"]
    optimshift.move(opt, sim)
    st = opt.state[p]
    assert st["c"] is not c and outside.device.type == "cpu", "a view held outside: the copy takes the place"
    assert st["pair"].untyped_storage().data_ptr() == st["c"].untyped_storage().data_ptr()


def test_a_leaf_entry_that_requires_grad_keeps_its_object(sim):
    """A state entry that is a leaf requiring grad (its copy is one too) was replaced by every move to or from the
    simulator: a swap was refused for any tensor requiring grad. Two leaves that require it swap as any pair does
    (the entry stays a leaf requiring grad, usable by autograd where it is); one holding a grad, or held by a graph
    not yet run backward, is still replaced (its grad and that graph stay with the old object)."""
    p = torch.nn.Parameter(torch.randn(3))
    opt = torch.optim.SGD([p], lr=0.1)
    t = torch.randn(3, requires_grad=True)
    opt.state[p]["t"] = t
    value = t.detach().clone()
    for device in (sim, "cpu", sim):
        optimshift.move(opt, device)
        assert opt.state[p]["t"] is t and t.device.type == torch.device(device).type
        assert t.requires_grad and t.is_leaf and bitwise_equal(t.detach().cpu(), value)
    (t * 2).sum().backward()
    assert t.grad.device == t.device
    optimshift.move(opt, "cpu")  # (it holds a grad)
    held = opt.state[p]["t"]
    assert held is not t and t.grad is not None
    loss = (held * 3).sum()  # (a graph that holds the entry, not yet run backward)
    optimshift.move(opt, sim)
    assert opt.state[p]["t"] is not held
    loss.backward()
    assert torch.equal(held.grad, torch.full((3,), 3.0))


@pytest.mark.parametrize("register", ["register_hook", "register_post_accumulate_grad_hook"])
@pytest.mark.parametrize("removed", [False, True])
def test_a_leaf_entry_given_a_hook_is_replaced_and_every_hook_fires(sim, register, removed):
    """A hook lives in the TensorImpl, which a swap hands to the discarded copy: a swapped entry's hook never fired
    again, and one registered on it later went to its Python dict only (once given a hook, even a removed one,
    torch never registers another in C++), never called. Such an entry is replaced; the old object keeps its hooks."""
    p = torch.nn.Parameter(torch.randn(3))
    opt = torch.optim.SGD([p], lr=0.1)
    t = torch.randn(3, requires_grad=True)
    fired: list[str] = []
    handle = getattr(t, register)(lambda *_: fired.append("old"))
    if removed:
        handle.remove()
    opt.state[p]["t"] = t
    optimshift.move(opt, sim)
    entry = opt.state[p]["t"]
    assert entry is not t and entry.device.type == "sim" and entry.requires_grad and entry.is_leaf
    getattr(entry, register)(lambda *_: fired.append("new"))
    (entry * 2).sum().backward()
    (t * 2).sum().backward()
    assert fired == ["new"] if removed else ["new", "old"]


def test_a_fresh_copy_is_decided_as_any_copy(sim):
    """``decide_all(fresh=True)`` skips what a copy ``copy_many`` just made by ``.to`` cannot be (an inference tensor,
    one requiring grad or held elsewhere): for every kind of old tensor such a copy is made of, it answers as the
    general case; and the batch says ``fresh`` only where its copies are (one pair of devices, outside any mode)."""
    from optimshift._adopt import decide_all
    from optimshift._copy import BLOCKING, copy_many
    from optimshift.pool import host_pool

    def olds(source):
        yield "plain", torch.zeros(4, device=source), None
        base = torch.zeros(4, device=source)
        yield "a view, its base dropped", base[1:], None
        yield "a view, its base held", base[1:], base
        held = torch.zeros(4, device=source)
        yield "weakly referenced", held, weakref.ref(held)
        viewed = torch.zeros(4, device=source)
        yield "viewed outside", viewed, viewed[1:]
        with torch.inference_mode():
            inference = torch.zeros(4, device=source)
        yield "an inference tensor", inference, None

    seen = set()
    for source, target in [("cpu", "meta"), ("cpu", sim), (sim, "cpu"), (sim, "meta"), ("meta", "meta")]:
        for name, old, keep in olds(source):
            batch = copy_many([(old, torch.device(target))], BLOCKING, pool=host_pool)
            pairs = [(old, batch.copies[0])]
            general = decide_all(pairs)
            seen.add(general[0])
            if batch.fresh:
                assert decide_all(pairs, fresh=True) == general, (name, source, target)
                ref = weakref.ref(pairs[0][1])  # (still asked of a fresh copy: cheap, and no mode can make it one)
                assert decide_all(pairs, fresh=True) == decide_all(pairs), (name, source, target)
                del ref
            del keep
    assert seen == {"data", "swap", "replace"}, "every decision is made for some old tensor"
    plain = [(torch.zeros(4), torch.device("meta"))]
    assert copy_many(plain, BLOCKING, pool=host_pool).fresh
    with torch.device("meta"):  # (a torch function mode: .to's answer is the mode's)
        assert not copy_many(plain, BLOCKING, pool=host_pool).fresh
    with torch.inference_mode():
        assert not copy_many(plain, BLOCKING, pool=host_pool).fresh
    grad = [(torch.zeros(4, requires_grad=True), torch.device("meta"))]
    assert not copy_many(grad, BLOCKING, pool=host_pool).fresh
    assert not copy_many(plain + [(torch.zeros(4), sim)], BLOCKING, pool=host_pool).fresh


def test_a_move_between_two_devices_asks_for_its_fresh_copies_what_any_copy_gets(sim, monkeypatch):
    """A move sim:0 -> sim:1 of plain state (``engine.Copies.fresh``) decides with ``fresh``, and its decisions are
    the general case's; an entry requiring grad, or a torch function mode, makes the commit ask without it."""
    from torch.overrides import TorchFunctionMode

    from optimshift import _adopt, _engine

    class Passing(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    calls = []

    def spy(pairs, *, fresh=False):
        calls.append((fresh, _adopt.decide_all(pairs, fresh=fresh), _adopt.decide_all(pairs)))
        return calls[-1][1]

    monkeypatch.setattr(_engine, "decide_all", spy)

    def moved(extra=None, mode=None):
        p = torch.nn.Parameter(torch.randn(3, device=sim))
        opt = torch.optim.SGD([p], lr=0.1, momentum=0.9)
        p.grad = torch.ones_like(p)
        opt.step()
        st = opt.state[p]
        st["cut"] = torch.zeros(8, device=sim)[2:5]  # (its base dropped: a swap)
        st["weak"] = torch.zeros(3, device=sim)
        st["viewed"] = torch.zeros(3, device=sim)
        with torch.inference_mode():
            st["inference"] = torch.zeros(3, device=sim)  # (replaced)
        st.update(extra or {})
        keep = (weakref.ref(st["weak"]), st["viewed"][1:])
        calls.clear()
        with mode or contextlib.nullcontext():
            optimshift.move(opt, torch.device(sim.type, 1))
        del keep
        [(fresh, hows, general)] = calls
        assert hows == general and {"data", "swap", "replace"} <= set(hows)
        return fresh

    assert moved(), "copies one .to pass made are fresh"
    assert not moved({"leaf": torch.zeros(3, device=sim, requires_grad=True)})
    assert not moved(mode=Passing())

"""Caches hold nothing strongly that the optimizer no longer uses (issue 27, item 6).

Each test warms a cache the way a loop does (its plans kept from the second build, reused from the third), lets
the optimizer drop what it held (new params, new state, the optimizer itself), and checks with ``weakref`` that
nothing survives: on a GPU a survivor is the whole model's memory.
"""

from __future__ import annotations

import gc
import weakref

import torch

import optimshift
from _custom_optimizers import Averaged, Counter

O = torch.optim
Parameter = torch.nn.Parameter


def _trained(device, n=3):
    params = [Parameter(torch.randn(4, 3, device=device)) for _ in range(n)]
    opt = O.Adam(params, lr=1e-3)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    return params, opt


def _cycles(opt, sim, n=3):
    for _ in range(n):
        optimshift.offload(opt)
        optimshift.reload(opt)
    for _ in range(n):
        optimshift.move(opt, "cpu")
        optimshift.move(opt, sim)


def _alive(refs):
    gc.collect()
    return [r for r in refs if r() is not None]


def test_cached_plans_let_go_of_params_a_rebind_replaced(sim):
    params, opt = _trained(sim)
    _cycles(opt, sim)
    refs = [weakref.ref(p) for p in params] + [weakref.ref(p.grad) for p in params]
    optimshift.rebind(opt, [Parameter(p.detach().clone()) for p in params])
    del params
    assert not _alive(refs), "a cached plan keeps the old params (or their grads) alive"
    optimshift.offload(opt)  # and the cache still answers for the new params
    optimshift.reload(opt)
    assert all(st["exp_avg"].device == sim for st in opt.state.values())


def test_cached_plans_of_state_keyed_by_the_params_let_go_of_the_params_a_rebind_replaced(sim):
    """State keyed by the params inside an optimizer-wide entry (TRAC's ``state["_trac"][param]``) names its sites
    through the params: the cached plans and the kept addresses' layout kept those paths, params and all, and the
    rebind left the old params as the mappings' keys, so they outlived it. Re-keyed, and kept by id in the caches:
    freed; the cache still answers for the new params."""
    params = [Parameter(torch.randn(4, 3, device=sim)) for _ in range(3)]
    opt = Averaged(params)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    _cycles(opt, sim)
    for _ in range(2):  # (the kept addresses' layout names each site too)
        optimshift.offload(opt, keep_addresses=True)
        optimshift.reload(opt)
    refs = [weakref.ref(p) for p in params] + [weakref.ref(p.grad) for p in params]
    new = [Parameter(p.detach().clone()) for p in params]
    optimshift.rebind(opt, new)
    del params, p
    assert not _alive(refs), "the state or a cached plan keeps the old params (or their grads) alive"
    for _ in range(3):
        optimshift.offload(opt)
        optimshift.reload(opt)
    assert [id(k) for k in opt.state["ema"]] == [id(q) for q in new]
    assert all(opt.state["_trac"][q]["ref"].device == sim for q in new)


def test_the_sides_a_move_remembers_let_go_of_the_params_a_rebind_replaced(sim):
    """A group mapping keyed by the params (``group["masks"][param]``), its tensors taken to the host by a move:
    the session remembered each one's side by its site, the param itself in its path, and so kept the old params
    alive after a rebind. Remembered by the tensor now: freed, and a move back still finds their side."""
    params = [Parameter(torch.ones(3, device=sim)), Parameter(torch.ones(2, device=sim))]
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    opt.param_groups[0]["masks"] = {p: torch.ones(p.shape, device=sim) for p in params}
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    optimshift.move(opt, "cpu")
    refs = [weakref.ref(p) for p in params]
    new = [Parameter(torch.ones(3)), Parameter(torch.ones(2))]
    optimshift.rebind(opt, new)
    del params, p
    assert not _alive(refs), "the session's remembered sides keep the old params alive"
    optimshift.move(opt, sim)
    assert [v.device for v in opt.param_groups[0]["masks"].values()] == [sim, sim]


def test_cached_plans_let_go_of_state_the_optimizer_dropped(sim, tmp_path):
    params, opt = _trained(sim)
    _cycles(opt, sim)
    refs = [weakref.ref(t) for st in opt.state.values() for t in st.values()]
    fresh_params, fresh = _trained(sim)
    optimshift.load_state_dict(opt, fresh.state_dict(), copy=False)  # the live tensors are superseded
    del fresh
    assert not _alive(refs), "a cached plan keeps state tensors the optimizer no longer holds"


def test_an_optimizer_dropped_takes_everything_optimshift_knew_of_it(sim):
    params, opt = _trained(sim)
    _cycles(opt, sim)
    optimshift.check(opt)
    optimshift.stream(opt)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    optimshift.unstream(opt)
    refs = [weakref.ref(opt)] + [weakref.ref(p) for p in params]
    refs += [weakref.ref(t) for st in opt.state.values() for t in st.values()]
    del opt, params, p
    assert not _alive(refs), "a session, a plan or a mode outlives its optimizer"


def test_the_probe_and_load_caches_keep_no_tensor_of_the_user(sim, tmp_path):
    """The probes (torch's classes and third-party ones), the load's checks and the plan caches key on kinds
    (class, flags, ranks, a tensor hyperparameter's device and dtype), never on the user's objects: a tensor
    ``lr``, a checkpoint's tensors, the params and the optimizer all die with the user's last reference."""
    lr = torch.tensor(0.01)
    params = [Parameter(torch.randn(4, 3, device=sim)) for _ in range(2)]
    adam = O.Adam(params, lr=lr, betas=(torch.tensor(0.9), torch.tensor(0.99)))
    custom_params = [Parameter(torch.randn(3, device=sim))]
    custom = Counter(custom_params)
    for opt, ps in ((adam, params), (custom, custom_params)):
        for p in ps:
            p.grad = torch.ones_like(p)
        opt.step()
        optimshift.check(opt)
        _cycles(opt, sim)
        optimshift.save(opt, tmp_path / f"{type(opt).__name__}.pt")
        sd = optimshift.load(tmp_path / f"{type(opt).__name__}.pt")
        optimshift.load_state_dict(opt, sd)
    refs = [weakref.ref(x) for x in (lr, adam, custom, *params, *custom_params)]
    refs += [weakref.ref(t) for o in (adam, custom) for st in o.state.values() for t in st.values()]
    refs += [weakref.ref(t) for st in sd["state"].values() for t in st.values() if isinstance(t, torch.Tensor)]
    del lr, params, adam, custom_params, custom, opt, ps, p, sd
    assert not _alive(refs), "a cache keeps an object of the user's"


def test_a_streamed_optimizer_dropped_frees_its_host_buffers_without_the_collector(sim):
    """``stream()`` installs ``step`` and ``load_state_dict`` on the optimizer; were they methods bound to it, the
    optimizer would sit in a reference cycle and its host buffers (pinned memory on a GPU) stay in use until the
    collector ran. Dropped while streamed, it goes at once, and so do its buffers."""
    from optimshift.pool import host_pool

    params, opt = _trained(sim)
    gc.collect()
    before = host_pool.stats().in_use
    optimshift.stream(opt)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    assert host_pool.stats().in_use > before  # (the state is in the pool's buffers)
    ref = weakref.ref(opt)
    gc.disable()
    try:
        del opt
        assert ref() is None, "a streamed optimizer outlives its last reference (a reference cycle)"
        assert host_pool.stats().in_use == before
    finally:
        gc.enable()


def _classes_of_a_run():
    """Optimizer classes a function defines (a notebook cell, a test, a sweep's factory): a torch subclass with a
    step of its own, a third-party class, and a plain subclass; each used by every road that asks the caches."""

    class Own(O.SGD):
        def step(self, closure=None):
            return super().step(closure)

    class Third(Counter):
        pass

    class Plain(O.Adam):
        pass

    return Own, Third, Plain


def test_the_caches_let_go_of_a_class_defined_at_run_time(sim, tmp_path, caplog):
    """The probe cache, its signatures, the load's checks and the guessed-class warnings held every class they were
    asked about, and so its module globals and closures (a notebook's model), for the life of the process."""
    refs = []
    for cls in _classes_of_a_run():
        params = [Parameter(torch.randn(4, 3, device=sim))]
        opt = cls(params, lr=0.1)
        params[0].grad = torch.ones_like(params[0])
        opt.step()
        optimshift.check(opt)
        _cycles(opt, sim)
        optimshift.save(opt, tmp_path / "opt.pt")
        optimshift.load_state_dict(opt, optimshift.load(tmp_path / "opt.pt"))
        refs.append(weakref.ref(cls))
        del opt, params
    del cls
    assert not _alive(refs), "a cache keeps a class defined at run time"


def test_every_road_lets_go_of_an_optimizer_over_two_devices_with_group_tensors(sim, tmp_path):
    """The placement memos (``policy.Placer``: by the group's and the tensor's id, the sides a move remembers, the
    spans of a group over two devices) are one operation's: after every road that asks them (a move, an offload
    and reload, blocking or not, keeping addresses or not, a load from a state dict or a file, into existing state
    or fresh, a rebind, check and placement), the model dropped takes everything with it."""
    sim1 = torch.device(sim.type, 1)
    path = tmp_path / "opt.pt"
    roads = {
        "move": lambda opt: (optimshift.move(opt, "cpu"), optimshift.move(opt, sim)),
        "offload": lambda opt: (optimshift.offload(opt), optimshift.reload(opt)),
        "non-blocking": lambda opt: (
            optimshift.offload(opt, non_blocking=True),
            optimshift.reload(opt, non_blocking=True),
            optimshift.wait(opt),
        ),
        "keep_addresses": lambda opt: (optimshift.offload(opt, keep_addresses=True), optimshift.reload(opt)),
        "load": lambda opt: optimshift.load_state_dict(opt, opt.state_dict()),
        "load-file": lambda opt: (optimshift.save(opt, path), optimshift.load_state_dict(opt, path)),
        "load-fresh": lambda opt: optimshift.load_state_dict(opt, (opt.state_dict(), opt.state.clear())[0]),
        "rebind": lambda opt: optimshift.rebind(
            opt, [Parameter(p.detach().clone()) for g in opt.param_groups for p in g["params"]]
        ),
        "check": lambda opt: (optimshift.check(opt), optimshift.placement(opt)),
    }
    for name, road in roads.items():
        # (a group on one device with a device lr, whose side a move remembers; one over two devices with host ones)
        params = [Parameter(torch.randn(4, 3, device=sim)), Parameter(torch.randn(3, device=sim1))]
        groups = [
            {"params": [Parameter(torch.randn(2, device=sim))], "lr": torch.tensor(0.01, device=sim)},
            {"params": params, "lr": torch.tensor(0.01), "betas": (torch.tensor(0.9), torch.tensor(0.99))},
        ]
        opt = O.Adam(groups, capturable=True, foreach=True)
        for p in opt.param_groups[0]["params"] + params:
            p.grad = torch.ones_like(p)
        opt.step()
        for _ in range(3):  # (a plan is kept from its second build, reused from the third)
            road(opt)
        if name == "move":  # (back on the device: the side the session remembered for it, by its id)
            assert opt.param_groups[0]["lr"].device == sim
        held = [opt, *(t for g in opt.param_groups for _, t in optimshift._state.group_tensors(g))]
        held += [p for g in opt.param_groups for p in g["params"]]
        refs = [weakref.ref(x) for x in held] + [weakref.ref(t) for st in opt.state.values() for t in st.values()]
        del opt, params, groups, p, held
        assert not _alive(refs), f"{name}: an object of the user's outlives the optimizer"

"""A class torch.optim does not define, with no registered policy (issue 30, item 7): its 0-dim state is placed
where a fresh optimizer of the class keeps it, learned by the probe from a throwaway step of the class itself;
check() reports a scalar that costs syncs a fresh optimizer does not have, with what the probe counted."""

from __future__ import annotations

import gc
import logging
import types
import weakref
from collections import OrderedDict
from collections.abc import MutableMapping

import pytest
import torch

import optimshift
from _custom_optimizers import Averaged, CountedAdam, CountedSGD, Counter, Placed, ScaledByLr, WideCounter, WideScale
from optimshift import _probe, policy


class Net(torch.nn.Module):
    def __init__(self, shapes, device):
        super().__init__()
        self.ps = torch.nn.ParameterList(torch.nn.Parameter(torch.ones(s, device=device)) for s in shapes)


def _trained(cls, device, groups=None, steps=2, shapes=((3,), (2, 2))):
    net = Net(shapes, device)
    opt = cls(groups(list(net.ps)) if groups else list(net.ps))
    for _ in range(steps):
        _step(net, opt)
    return net, opt


def _step(net, opt):
    for i, p in enumerate(net.ps):
        p.grad = torch.full_like(p, 0.5 * (i + 1))
    opt.step()


def _layout(opt):
    return [
        (gi, pi, key, str(value.device))
        for gi, group in enumerate(opt.param_groups)
        for pi, p in enumerate(group["params"])
        for key, value in opt.state[p].items()
    ]


def test_move_keeps_a_custom_host_counter_where_a_fresh_optimizer_does(sim):
    net, opt = _trained(Counter, "cpu")
    net.to(sim)
    optimshift.move(opt, sim)
    fresh_net, fresh = _trained(Counter, sim)
    assert _layout(opt) == _layout(fresh)
    assert {key: str(v.device) for key, v in opt.state[net.ps[0]].items()} == {"count": "cpu", "buf": str(sim)}
    with optimshift.count_syncs() as moved:
        _step(net, opt)
    with optimshift.count_syncs() as fresh_syncs:
        _step(fresh_net, fresh)
    assert moved.total == fresh_syncs.total == 0
    report = optimshift.check(opt)
    assert report.ok and report.findings == []  # probed: no guess to report


def test_a_torch_subclass_with_a_step_of_its_own_is_placed_by_its_own_probe(sim):
    """A torch.optim subclass whose own step keeps a 0-dim host counter and reads it with ``.item()`` (then runs
    SGD's step) was placed by SGD's probe: a move put the counter on the device (a sync per param per step) and
    check() called a fresh optimizer's host counter misplaced. Its own probe decides, SGD's entries stay SGD's,
    and check() prices the counter on the device with what the probe counted."""
    net, opt = _trained(CountedSGD, "cpu", groups=lambda ps: [{"params": ps, "lr": 0.1, "momentum": 0.9}])
    net.to(sim)
    optimshift.move(opt, sim)
    fresh_net, fresh = _trained(CountedSGD, sim, groups=lambda ps: [{"params": ps, "lr": 0.1, "momentum": 0.9}])
    assert _layout(opt) == _layout(fresh)
    assert {k: str(v.device) for k, v in opt.state[net.ps[0]].items()} == {"count": "cpu", "momentum_buffer": str(sim)}
    with optimshift.count_syncs() as moved:
        _step(net, opt)
    with optimshift.count_syncs() as fresh_syncs:
        _step(fresh_net, fresh)
    assert moved.total == fresh_syncs.total == 0
    assert optimshift.check(fresh).findings == [] and optimshift.check(opt).findings == []
    for p in net.ps:
        opt.state[p]["count"] = opt.state[p]["count"].to(sim)  # by hand: what the base's probe decided
    report = optimshift.check(opt)
    assert [(f.severity, f.key, f.expected) for f in report.findings] == [("warning", "count", "cpu")] * 2
    with optimshift.count_syncs() as syncs:
        _step(net, opt)
    assert syncs.total == 2 and report.syncs_per_step == syncs.total  # the probe's count, per param per step


def test_check_reports_a_custom_counter_on_the_device_with_its_sync_cost(sim):
    net, opt = _trained(Counter, sim)
    for p in net.ps:
        opt.state[p]["count"] = opt.state[p]["count"].to(sim)  # by hand: what the old default rule did
    report = optimshift.check(opt)
    assert not report.ok
    assert [(f.severity, f.key, f.expected) for f in report.findings] == [("warning", "count", "cpu")] * 2
    assert all("device-to-host sync" in f.why for f in report.findings)
    with optimshift.count_syncs() as syncs:
        _step(net, opt)
    assert syncs.total == 2  # one .item() per param
    assert report.syncs_per_step == syncs.total  # the probe's count, per param per step


def test_the_probe_counts_the_device_reads_of_each_host_scalar():
    group = {"lr": 0.1, "momentum": 0.9}
    observed = _probe.probe(Counter, group, 1)
    assert observed is not None and observed.state == {"count": False}
    assert dict(observed.reads) == {"count": 1}
    assert _probe.unprobed(Counter, group, 1) is None


def test_a_custom_class_is_placed_per_group_flag_and_param_rank(sim):
    """The probe key (flags by value, param rank) and the Placer's memo (group, rank) hold for a third-party
    class: each entry goes where a fresh one keeps it."""

    def groups(ps):
        return [{"params": ps[:2], "device_counter": False}, {"params": ps[2:], "device_counter": True}]

    shapes = ((3,), (2, 2), (3,))
    net, opt = _trained(Placed, "cpu", groups, shapes=shapes)
    net.to(sim)
    optimshift.move(opt, sim)
    _, fresh = _trained(Placed, sim, groups, shapes=shapes)
    expected = [(0, 0, "count", "cpu"), (0, 1, "count", str(sim)), (1, 0, "count", str(sim))]
    assert _layout(opt) == _layout(fresh) == expected
    assert optimshift.check(opt).ok


def test_a_custom_class_is_probed_once_per_key(monkeypatch):
    """A float's value is not part of the key (an LR scheduler runs no probe again); its class against 0 and 1 is."""
    runs = []
    real = _probe._observe
    monkeypatch.setattr(_probe, "_observe", lambda *a: runs.append(a[1]["lr"]) or real(*a))
    _probe.clear_cache()
    p = torch.nn.Parameter(torch.zeros(3))
    for lr in (0.1, 0.01, 0.5, 0.0):
        group = {"params": [p], "lr": lr, "momentum": 0.9}
        decision = policy.decide(Counter([p]), group, p, "count", torch.zeros(()), torch.device("cuda", 0))
        assert (decision.device.type, decision.source) == ("cpu", "probe")
    assert runs == [0.1, 0.0]


class Converging(torch.optim.Optimizer):
    """Iterates until a device value converges: on the probe's stand-ins (no values) it never would."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    state["count"] = torch.tensor(0.0)
                state["count"] += 1
                while (p.grad * p.grad).sum().item() > 0.1:
                    p.grad.mul_(0.5)


def test_a_probe_step_that_would_never_end_is_stopped(monkeypatch):
    monkeypatch.setattr(_probe, "MAX_READS", 50)
    _probe.clear_cache()
    observed = _probe.probe(Converging, {"lr": 0.1}, 1)
    assert observed is not None and observed.state == {"count": False}
    assert observed.error is not None and "host reads" in observed.error


def test_the_throwaway_is_given_no_mutable_value_of_the_users_group():
    class Configured(torch.optim.Optimizer):
        def __init__(self, params, lr=0.1, config=None, betas=(0.9, 0.99)):
            super().__init__(params, {"lr": lr, "config": config, "betas": betas})

    config = {"warmup": 3}
    built = _probe.built_kwargs(Configured, {"lr": 0.2, "config": config, "betas": [0.8, 0.9], "params": []})
    assert built == {"lr": 0.1, "betas": [0.9, 0.99]}  # (the dict: the constructor's default stands in)


def test_an_unbuildable_custom_class_falls_back_and_says_why(sim, caplog):
    class Needy(Counter):
        def __init__(self, params, num_data, lr=0.1):
            super().__init__(params, lr)

    net = Net(((3,),), "cpu")
    opt = Needy(list(net.ps), num_data=8)
    _step(net, opt)
    net.to(sim)
    with caplog.at_level(logging.WARNING, logger="optimshift"):
        optimshift.move(opt, sim)
    assert opt.state[net.ps[0]]["count"].device == sim  # the default rule: a 0-dim non-'step' follows its param
    (warned,) = [r.getMessage() for r in caplog.records if "Needy" in r.getMessage()]
    assert "could not build Needy" in warned and "num_data" in warned
    report = optimshift.check(opt)
    (info,) = [f for f in report.findings if f.severity == "info"]
    assert "could not build Needy" in info.why and "num_data" in info.why and "register_policy" in info.why


class _OnMeta(torch.optim.Adam):
    pass


@pytest.fixture
def on_meta():
    """A class whose registered policy puts every entry on meta."""
    optimshift.register_policy(_OnMeta, lambda key, value, param, group, device: torch.device("meta"))
    yield _OnMeta
    optimshift.unregister_policy(_OnMeta)


@pytest.mark.parametrize("way", ["move", "load_state_dict", "reload"])
def test_a_policy_that_puts_values_on_meta_is_refused_before_anything_changes(sim, on_meta, way):
    # Before: move() and the others sent every entry to meta, its values gone (move(opt, "meta") is refused).
    params = [torch.nn.Parameter(torch.ones(3, device=sim)) for _ in range(2)]
    opt = on_meta([{"params": params[:1]}, {"params": params[1:]}])
    for p in params:
        p.grad = torch.ones(3, device=sim)
    opt.step()
    sd = opt.state_dict()
    if way == "reload":
        optimshift.offload(opt)
    before = {(i, k): (v, v.device, v.cpu()) for i, p in enumerate(params) for k, v in opt.state[p].items()}
    with pytest.raises(ValueError) as info:
        if way == "move":
            optimshift.move(opt)
        elif way == "load_state_dict":
            optimshift.load_state_dict(opt, sd)
        else:
            optimshift.reload(opt, sim)
    message = str(info.value)
    assert "the policy registered for _OnMeta placed group 0, param 0, state['step'] on meta" in message, message
    assert f"for params bound for {sim}" in message and "nothing was changed" in message
    after = {(i, k): v for i, p in enumerate(params) for k, v in opt.state[p].items()}
    assert after.keys() == before.keys()
    for at, (v, device, values) in before.items():
        assert after[at] is v and v.device == device and torch.equal(v.cpu(), values)


def test_a_policy_may_put_state_on_meta_where_the_params_are(on_meta):
    """Deferred init: params and state on meta, the policy's meta answer loses nothing (there are no values; a host
    step, which holds one, would be lost there: refused, as the built-in rule's meta is: test_offload_guards)."""
    params = [torch.nn.Parameter(torch.ones(3, device="meta"))]
    opt = on_meta(params)
    state = {"exp_avg": torch.zeros(3, device="meta"), "step": torch.tensor(1.0, device="meta")}
    opt.state[params[0]] = dict(state)
    optimshift.move(opt)
    assert all(opt.state[params[0]][key] is value and value.is_meta for key, value in state.items())
    opt.state[params[0]]["step"] = torch.tensor(1.0)
    with pytest.raises(ValueError, match=r"param 0, state\['step'\] \(on cpu\) follows its param, whose device meta"):
        optimshift.move(opt)


def test_a_policy_is_refused_meta_for_real_state_of_params_on_meta_bound_elsewhere(on_meta):
    """Params on meta (deferred init) with real state, moved to the host: the built-in rule puts the state there;
    the policy's meta would lose it. The message names the param by its name."""
    model = torch.nn.Linear(3, 1, bias=False, device="meta")
    opt = on_meta(model.named_parameters())
    (p,) = model.parameters()
    opt.state[p] = {"exp_avg": torch.ones(1, 3), "step": torch.tensor(1.0)}
    with pytest.raises(ValueError) as info:
        optimshift.move(opt, "cpu")
    assert "placed group 0, param 0 (weight), state['exp_avg'] on meta, for params bound for cpu" in str(info.value)
    assert all(v.device.type == "cpu" for v in opt.state[p].values())


def test_a_streamed_first_step_refused_after_it_ran_says_so(sim):
    """The streamed step lays out the state a first step makes once that step ran: a refusal there (a policy's
    meta) says that the step ran, not that nothing changed."""
    optimshift.register_policy(_OnMeta, lambda key, value, param, group, device: torch.device("meta"), separable=True)
    try:
        model = torch.nn.Linear(3, 2).to(sim)
        opt = _OnMeta(model.named_parameters())
        optimshift.stream(opt)
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        before = model.weight.detach().cpu().clone()
        with pytest.raises(ValueError) as info:
            opt.step()
        assert not torch.equal(model.weight.detach().cpu(), before)  # (the step ran)
        (note,) = info.value.__notes__
        assert "_OnMeta.step() has just made for group 0, param 0 (weight); group 0, param 1 (bias)" in note, note
        assert "those params were stepped (updated)" in note
    finally:
        optimshift.unregister_policy(_OnMeta)


class _Indexless(torch.optim.Adam):
    pass


@pytest.mark.parametrize("answer", ["sim", "sim:1", "nonsense", "cpu:0"])
def test_a_policy_answer_without_an_index_names_the_params_device(sim, answer):
    """A policy answering ``'sim'`` for state on ``sim:0``: check() called every entry misplaced (expected ``sim``,
    which no tensor is on) and every move copied them again. The index is the param's; an explicit one is kept,
    and an answer that is no device is refused, naming the class, before anything changes."""
    optimshift.register_policy(_Indexless, lambda key, value, param, group, device: answer if key == "step" else None)
    try:
        p = torch.nn.Parameter(torch.ones(3, device=sim))
        opt = _Indexless([p], capturable=True)
        p.grad = torch.ones(3, device=sim)
        opt.step()
        step = opt.state[p]["step"]
        if answer == "nonsense":
            with pytest.raises(ValueError, match=r"registered for _Indexless, asked where group 0, param 0, "):
                optimshift.move(opt)
            assert opt.state[p]["step"] is step and step.device == sim
            return
        expected = {"sim": sim, "sim:1": torch.device(sim.type, 1), "cpu:0": torch.device("cpu")}[answer]
        assert [f.expected for f in optimshift.check(opt).findings] == ([] if answer == "sim" else [str(expected)])
        optimshift.move(opt)
        assert opt.state[p]["step"] is step and step.device == expected
        assert optimshift.check(opt).ok and not optimshift.check(opt).findings
    finally:
        optimshift.unregister_policy(_Indexless)


def _wide(opt):
    return {k: str(v.device) for k, v in opt.state.items() if isinstance(k, str)}


@pytest.mark.parametrize("cls", [WideCounter, WideScale], ids=lambda c: c.__name__)
def test_optimizer_wide_entries_are_placed_where_a_fresh_optimizer_keeps_them(sim, cls):
    """A one-element tensor under a plain state key was placed by the group-tensor rule (it stayed where it was): a
    TRAC-shaped ``s`` trained on the host stayed there after a move and the next step mixed devices, and check()
    said OK. Placed where a fresh optimizer keeps it (its probe), else with the params; a MADGRAD-shaped host
    counter stays on the host."""
    net, opt = _trained(cls, "cpu")
    net.to(sim)
    optimshift.move(opt, sim)
    fresh_net, fresh = _trained(cls, sim)
    expected = {"k": "cpu"} if cls is WideCounter else {"s": str(sim)}
    assert _wide(opt) == _wide(fresh) == expected
    assert optimshift.check(opt).ok and optimshift.check(fresh).ok
    with optimshift.count_syncs() as syncs:
        _step(net, opt)  # no device mix
    assert syncs.total == 0


def test_an_optimizer_wide_entry_of_a_subclass_stepping_with_torch_s_step_is_placed_by_its_own_probe(sim):
    """A subclass of Adam that steps with Adam's step and keeps a host counter of its own under a plain state key:
    its entries were placed by Adam's probe, which keeps none, so the counter followed the params (check() said a
    fresh one keeps it on the device, move() took it there). A fresh one keeps it on the host."""
    net, opt = _trained(CountedAdam, "cpu")
    net.to(sim)
    optimshift.move(opt, sim)
    fresh_net, fresh = _trained(CountedAdam, sim)
    assert _wide(opt) == _wide(fresh) == {"n": "cpu"}
    assert not optimshift.check(opt).findings and not optimshift.check(fresh).findings


def test_a_third_party_device_lr_stays_where_it_was_given(sim):
    """A tensor lr given on the device to a class torch.optim does not define went to the host on any move (and a
    load): the rule for unknown kernels put a 0-dim group tensor on the host. It stays on its side unless the
    class's probe sees its step read it on the host, as for torch's classes."""
    params = [torch.nn.Parameter(torch.ones(3, device=sim))]
    opt = ScaledByLr(params, lr=torch.tensor(0.1, device=sim))
    params[0].grad = torch.ones(3, device=sim)
    opt.step()
    lr = opt.param_groups[0]["lr"]
    optimshift.move(opt)
    assert opt.param_groups[0]["lr"] is lr and lr.device == sim and optimshift.check(opt).ok
    host = ScaledByLr([torch.nn.Parameter(torch.ones(3, device=sim))], lr=torch.tensor(0.1))
    optimshift.move(host)
    assert host.param_groups[0]["lr"].device.type == "cpu"


def test_optimizer_wide_entries_a_wrapper_added_follow_the_params(sim):
    """TRAC keeps ``state["trac"]`` beside the Adam state it wraps: entries no probe of Adam sees. Its one-element
    ``s`` stayed on the host after a move (the group-tensor rule), the next step mixed devices, and check() said
    OK. It follows the params, as every optimizer-wide tensor no probe places but a 0-dim one (a scalar on the
    host mixes with device tensors), which stays where it is."""
    for way in ("move", "rebind"):
        net, opt = _trained(torch.optim.Adam, "cpu")
        opt.state["trac"] = {"s": torch.zeros(1), "v": torch.zeros(6), "z": torch.zeros(())}
        if way == "move":
            net.to(sim)
            optimshift.move(opt, sim)
        else:  # (rebind asked the group-tensor rule for them: they stayed on the host, check() then said so)
            optimshift.rebind(opt, [torch.nn.Parameter(p.detach().to(sim)) for p in net.ps])
        assert {k: str(v.device) for k, v in opt.state["trac"].items()} == {"s": str(sim), "v": str(sim), "z": "cpu"}
        assert optimshift.check(opt).ok


class _ParamDict(dict):
    pass


class _Ordered(OrderedDict):
    pass


@pytest.mark.parametrize("kind", [dict, OrderedDict, _ParamDict, _Ordered], ids=lambda k: k.__name__)
def test_rebind_re_keys_mappings_keyed_by_the_params_in_optimizer_wide_state(sim, kind):
    """TRAC keeps ``state["_trac"][param]``: a mapping keyed by the params inside an optimizer-wide entry. rebind
    re-keyed ``optimizer.state`` only, so those kept the old params: the next step looked the new ones up and
    failed (KeyError), and the old params stayed alive. Each such mapping is re-keyed, in order, with the same
    values (moved as placed, the same objects), in the same commit."""
    net, opt = _trained(lambda ps: Averaged(ps, kind=kind), "cpu")
    ema = opt.state["ema"]
    values = [ema[p] for p in net.ps]
    refs = [opt.state["_trac"][p]["ref"] for p in net.ps]
    new = [torch.nn.Parameter(p.detach().to(sim)) for p in net.ps]
    optimshift.rebind(opt, new)
    assert opt.state["ema"] is ema and type(ema) is kind
    assert [id(k) for k in ema] == [id(q) for q in new]
    assert all(ema[q] is v and v.device == sim for q, v in zip(new, values))
    assert [k if isinstance(k, str) else id(k) for k in opt.state["_trac"]] == ["s"] + [id(q) for q in new]
    assert all(opt.state["_trac"][q]["ref"] is r and r.device == sim for q, r in zip(new, refs))
    net.ps = torch.nn.ParameterList(new)
    _step(net, opt)  # looks every new param up


def test_rebind_re_keys_a_mapping_whose_values_the_commit_replaced(sim):
    """A value the commit cannot keep as its object (weakly referenced, moving between the host and the simulator,
    which needs a swap) is replaced in its mapping under the key it had: the mapping is re-keyed after that, so the
    replacement lands under the new param (before, the old key would have come back beside the new one)."""
    net, opt = _trained(Averaged, "cpu")
    watched = [weakref.ref(v) for v in opt.state["ema"].values()]  # (blocks the swap: the copy takes its place)
    new = [torch.nn.Parameter(p.detach().to(sim)) for p in net.ps]
    optimshift.rebind(opt, new)
    ema = opt.state["ema"]
    assert [id(k) for k in ema] == [id(q) for q in new]
    assert all(v.device == sim and v is not w() for v, w in zip(ema.values(), watched))
    net.ps = torch.nn.ParameterList(new)
    _step(net, opt)


@pytest.mark.parametrize("how", ["immutable", "own mapping", "both keys"])
def test_rebind_refuses_a_mapping_keyed_by_the_params_it_cannot_re_key(sim, how):
    """A mapping keyed by the params that rebind cannot rename in place without risking a failure part-way (an
    immutable one, a mapping class of its own), or one that already holds a new param beside the old one it
    would become: refused, naming it, before anything changed (the old keys would have stayed)."""
    net, opt = _trained(Averaged, "cpu")
    new = [torch.nn.Parameter(p.detach().to(sim)) for p in net.ps]
    entries = {p: torch.zeros(1) for p in net.ps}
    if how == "both keys":
        entries[new[1]] = torch.ones(1)
    opt.state["extra"] = {"immutable": types.MappingProxyType, "own mapping": OwnMapping, "both keys": dict}[how](
        entries
    )
    before = {k: dict(v) if isinstance(k, torch.Tensor) else v for k, v in opt.state.items()}
    error, reason = {
        "immutable": (TypeError, "is an immutable mappingproxy"),
        "own mapping": (TypeError, "is an OwnMapping"),
        "both keys": (ValueError, "holds entries under both an old param and the new param"),
    }[how]
    with pytest.raises(
        error, match=rf"Averaged: rebind: optimizer.state\['extra'\] is keyed by the params and {reason}"
    ):
        optimshift.rebind(opt, new)
    assert opt.param_groups[0]["params"] == list(net.ps)
    assert list(opt.state) == list(before) and all(opt.state[k] is v or opt.state[k] == v for k, v in before.items())
    assert [id(k) for k in opt.state["ema"]] == [id(p) for p in net.ps]
    assert all(t.device.type == "cpu" for t in optimshift._state.tensors(dict(opt.state)))


class OwnMapping(MutableMapping):
    def __init__(self, items):
        self._items = dict(items)

    def __getitem__(self, key):
        return self._items[key]

    def __setitem__(self, key, value):
        self._items[key] = value

    def __delitem__(self, key):
        del self._items[key]

    def __iter__(self):
        return iter(self._items)

    def __len__(self):
        return len(self._items)


def test_rebind_re_keys_trac(sim, tmp_path):
    """TRAC itself (``trac_optimizer.start_trac``: ``state["_trac"][param]["ref"]``, looked up each step): a step
    after a rebind failed with a KeyError on the new param."""
    trac = pytest.importorskip("trac_optimizer")
    net = Net(((3,), (2, 2)), "cpu")
    opt = trac.start_trac(str(tmp_path / "trac.log"), torch.optim.Adam)(list(net.ps), lr=0.01)
    for _ in range(2):
        _step(net, opt)
    new = [torch.nn.Parameter(p.detach().clone()) for p in net.ps]
    refs = [opt.state["_trac"][p]["ref"] for p in net.ps]
    old = [weakref.ref(p) for p in net.ps]
    optimshift.rebind(opt, new)
    assert all(opt.state["_trac"][q]["ref"] is r for q, r in zip(new, refs))
    net.ps = torch.nn.ParameterList(new)
    _step(net, opt)
    gc.collect()
    assert not [r for r in old if r() is not None], "the old params are still held"

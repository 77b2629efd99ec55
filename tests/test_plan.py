"""plan.py: the errors a plan raises for bad input name the optimizer and the param, and come before anything
changes."""

from __future__ import annotations

import pytest
import torch

import optimshift
from _matrix import bitwise_equal, snapshot, tensor_ids

O = torch.optim


def _adam(named: bool) -> tuple[O.Optimizer, list[torch.nn.Parameter]]:
    model = torch.nn.Linear(3, 2)
    opt = O.Adam(model.named_parameters() if named else model.parameters(), foreach=False)
    params = list(model.parameters())
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    return opt, params


@pytest.mark.parametrize("named", [False, True], ids=["unnamed", "named"])
@pytest.mark.parametrize("operation", ["move", "offload", "check"])
def test_state_that_is_not_a_dict_names_the_optimizer_and_the_param(named, operation):
    """The second param's state is a list: the error names the class (not the first param's name, as the
    param name once overwrote it) and the param, with its name where the group has one; nothing changes."""
    opt, params = _adam(named)
    bad = [torch.zeros(2)]
    opt.state[params[1]] = bad
    ids, values, first = tensor_ids(opt), snapshot(dict(opt.state)), opt.state[params[0]]
    label = "group 0, param 1 (bias)" if named else "group 0, param 1"
    with pytest.raises(TypeError) as raised:
        getattr(optimshift, operation)(opt)
    assert str(raised.value).startswith(f"Adam: state of {label} is a list, expected a dict"), str(raised.value)
    assert "optimizer.state[param]" in str(raised.value)  # the fix
    assert opt.state[params[1]] is bad and opt.state[params[0]] is first
    assert tensor_ids(opt) == ids and bitwise_equal(dict(opt.state), values)


def test_an_errors_type_name_takes_the_article_its_sound_takes(sim):
    """Every "is a {type}" message reads as English (issue 30's small things): "an int", "an OrderedDict"."""
    opt, params = _adam(False)
    opt.state[params[1]] = 3
    with pytest.raises(TypeError, match=r"Adam: state of group 0, param 1 is an int, expected a dict"):
        optimshift.move(opt)
    del opt.state[params[1]]
    with pytest.raises(TypeError, match=r"param 1 is an int, not a tensor"):
        optimshift.rebind(opt, [torch.nn.Parameter(params[0].detach().clone()), 3])


@pytest.mark.parametrize("road", ["move", "offload", "check", "stream", "save"])
def test_state_for_a_param_in_no_group_is_refused_by_every_road_before_anything_changes(sim, road, tmp_path):
    """An entry for a param no group lists can be placed nowhere and saved by no state_dict(): every operation
    refuses it, naming it, before anything changes (stream() took it, then unstream() refused it and the optimizer
    stayed streamed; save raised torch's bare KeyError of an id)."""
    model = torch.nn.Linear(3, 3).to(sim)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 3, device=sim)).sum().backward()
    opt.step()
    stray = torch.nn.Parameter(torch.zeros(3))
    opt.state[stray] = {"exp_avg": torch.zeros(3)}
    before = {id(t): t.device for st in opt.state.values() for t in st.values()}
    call = {
        "move": lambda: optimshift.move(opt, "cpu"),
        "offload": lambda: optimshift.offload(opt),
        "check": lambda: optimshift.check(opt),
        "stream": lambda: optimshift.stream(opt),
        "save": lambda: optimshift.save({"optimizer": opt}, tmp_path / "ckpt.pt"),
    }[road]
    with pytest.raises(ValueError, match=r"Adam: state holds an entry \(keys \['exp_avg'\]\) for a param of shape"):
        call()
    assert {id(t): t.device for st in opt.state.values() for t in st.values()} == before
    assert not optimshift.is_streamed(opt) and not optimshift.is_offloaded(opt)
    assert list(tmp_path.iterdir()) == []


_BROKEN_GROUPS = {
    "a group without params": (lambda groups: groups[0].pop("params"), r"param group 0 has no 'params'"),
    "params that are an int": (
        lambda groups: groups[0].__setitem__("params", 5),
        r"group 0's params are an int, not a list",
    ),
    "params that are a set": (
        lambda groups: groups[0].__setitem__("params", set(groups[0]["params"])),
        r"group 0's params are a set, not a list",
    ),
    "a param that is not a tensor": (
        lambda groups: groups[0]["params"].append(3),
        r"group 0, param 2 is an int, not a tensor",
    ),
    "a group that is not a dict": (lambda groups: groups.append(5), r"param group 1 is an int, not a dict"),
    "groups that are a tuple": (None, r"param_groups is a tuple, not a list"),
}


@pytest.mark.parametrize("broken", list(_BROKEN_GROUPS))
@pytest.mark.parametrize("road", ["move", "move to its params", "offload", "reload", "check", "save", "rebind"])
def test_a_broken_param_group_is_refused_by_every_road_naming_the_group_before_anything_changes(
    sim, road, broken, tmp_path
):
    """A param group that is not a dict holding a list of tensors (as torch's add_param_group makes it): every
    operation names the optimizer and the group (and the param), and changes nothing (a raw KeyError of 'params',
    a TypeError or an AttributeError of an int came from deep inside, the offload's after it began its record)."""
    model = torch.nn.Linear(3, 2).to(sim)
    opt = O.Adam(model.parameters())
    model(torch.randn(2, 3, device=sim)).sum().backward()
    opt.step()
    if road == "reload":
        optimshift.offload(opt)
    ids, values = tensor_ids(opt), snapshot(dict(opt.state))
    kept = opt.param_groups
    groups = [dict(g) for g in kept]
    groups[0]["params"] = list(groups[0]["params"])
    breaking, message = _BROKEN_GROUPS[broken]
    if breaking is not None:
        breaking(groups)
    opt.param_groups = groups if breaking is not None else tuple(groups)
    call = {
        "move": lambda: optimshift.move(opt, "cpu"),
        "move to its params": lambda: optimshift.move(opt),
        "offload": lambda: optimshift.offload(opt, include=("grads",)),
        "reload": lambda: optimshift.reload(opt),
        "check": lambda: optimshift.check(opt),
        "save": lambda: optimshift.save({"optimizer": opt}, tmp_path / "ckpt.pt"),
        "rebind": lambda: optimshift.rebind(opt, [torch.nn.Parameter(p.detach().clone()) for p in model.parameters()]),
    }[road]
    with pytest.raises(TypeError, match=rf"^Adam: {message}.*; nothing was changed$"):
        call()
    opt.param_groups = kept  # (to compare: tensor_ids walks the groups)
    assert tensor_ids(opt) == ids and bitwise_equal(dict(opt.state), values)
    assert optimshift.is_offloaded(opt) == (road == "reload") and all(p.grad is not None for p in model.parameters())
    assert list(tmp_path.iterdir()) == []


class _Watched(list):
    """A group's params that count how often they are walked."""

    walks = 0

    def __iter__(self):
        type(self).walks += 1
        return super().__iter__()


def test_wait_walks_no_param_and_a_group_check_adds_no_key():
    """``wait()``, called once per iteration of an RL loop, asked every group's params (a pass over every param,
    0.3 ms for 15k, 11 ms for 15k groups of one) to check groups it never walks. And the check of the groups, asked
    of all at once, takes nothing by a group's own ``__getitem__``: a defaultdict group without params gains none."""
    opt, params = _adam(False)
    opt.param_groups[0]["params"] = _Watched(params)
    _Watched.walks = 0
    optimshift.wait(opt)
    assert _Watched.walks == 0
    optimshift.check(opt)  # (an operation that walks them asks them)
    assert _Watched.walks > 0
    from collections import defaultdict

    opt, params = _adam(False)
    broken = defaultdict(list, {k: v for k, v in opt.param_groups[0].items() if k != "params"})
    opt.param_groups[0] = broken
    with pytest.raises(TypeError, match=r"param group 0 has no 'params'"):
        optimshift.move(opt)
    assert "params" not in broken


@pytest.mark.parametrize("road", ["move", "offload", "check", "placement", "wait"])
@pytest.mark.parametrize("attribute", ["state", "param_groups"])
def test_an_optimizer_whose_state_or_groups_are_gone_is_named(road, attribute):
    """A torch optimizer whose ``state`` is None (or whose ``param_groups`` was deleted) raised a raw
    AttributeError from inside (check_optimizer asked a duck-typed one only)."""
    opt, params = _adam(False)
    held = getattr(opt, attribute)
    if attribute == "state":
        opt.state = None
    else:
        del opt.param_groups
    with pytest.raises(TypeError, match=rf"^Adam: {attribute} is None, not a (dict|list); nothing was changed$"):
        getattr(optimshift, road)(opt)
    setattr(opt, attribute, held)
    optimshift.check(opt)

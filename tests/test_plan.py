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

"""load_state_dict refuses, before anything changes, what PyTorch accepts and fails on later: state keys left
as text by a JSON round trip, optimizer-wide entries a torch.optim class never has, state a torch.optim step
cannot use, expanded views that would allocate GiBs, and containers nested thousands deep. Errors name the
param, the key and, for a path, the file."""

from __future__ import annotations

import copy
import json

import pytest
import torch

import optimshift
from _crafted import nest_in_place
from _matrix import bitwise_equal

O = torch.optim


def _trained(cls=O.Adam, shapes=((4, 3), (3,)), **kwargs):
    params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    opt = cls(params, **kwargs)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    return opt


def _copied(value):
    if isinstance(value, torch.Tensor):
        return value.clone()
    return {k: _copied(v) for k, v in value.items()} if isinstance(value, dict) else value


def _snapshot(opt):
    return (
        id(opt.state),
        [(id(p), id(st), _copied(st)) for p, st in opt.state.items()],
        [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
    )


def _refused(target, sd, exc, match):
    before = _snapshot(target)
    with pytest.raises(exc, match=match):
        optimshift.load_state_dict(target, sd)
    after = _snapshot(target)
    assert before[0] == after[0] and before[2] == after[2]
    assert [(a, b) for a, b, _ in before[1]] == [(a, b) for a, b, _ in after[1]]
    assert all(bitwise_equal(x, y) for (_, _, x), (_, _, y) in zip(before[1], after[1])), "nothing may change"


# --- item 5: text keys from a JSON round trip -----------------------------------------------------------------


def test_state_keyed_by_text_is_refused_not_dropped():
    sd = _trained(foreach=False).state_dict()
    # What json.loads(json.dumps(...)) does to the keys (tensors kept): "0", "1" while the groups list 0, 1.
    texted = {"state": {str(k): v for k, v in sd["state"].items()}, "param_groups": sd["param_groups"]}
    assert json.loads(json.dumps({str(k): 0 for k in sd["state"]})) == {"0": 0, "1": 0}
    plain = _trained(foreach=False)
    plain.load_state_dict(copy.deepcopy(texted))  # PyTorch: every param's state silently gone
    assert not any(isinstance(k, torch.Tensor) for k in plain.state)
    _refused(
        _trained(foreach=False),
        texted,
        ValueError,
        r"Adam: load_state_dict: state_dict\['state'\] is keyed by text \('0', '1'\) while the param groups "
        r"list the ids 0, 1: it went through JSON .* sd\['state'\] = \{int\(k\): v",
    )


def test_a_torch_optim_class_has_no_optimizer_wide_entries():
    sd = _trained(foreach=False).state_dict()
    sd["state"]["k"] = torch.tensor([3])
    _refused(
        _trained(foreach=False),
        sd,
        ValueError,
        r"state_dict\['state'\] has entries \['k'\] that are no param's id, but torch\.optim\.adam\.Adam keeps "
        r"all of its state per param",
    )


def test_other_classes_keep_their_optimizer_wide_entries():
    class Madgradish(O.SGD):  # MADGRAD's optimizer-wide counter state["k"]
        pass

    src = _trained(Madgradish, lr=0.1, momentum=0.9)
    src.state["k"] = torch.tensor([3])
    target = _trained(Madgradish, lr=0.1, momentum=0.9)
    optimshift.load_state_dict(target, src.state_dict())
    assert torch.equal(target.state["k"], torch.tensor([3]))
    texted = src.state_dict()
    texted["state"] = {(str(k) if not isinstance(k, str) else k): v for k, v in texted["state"].items()}
    _refused(target, texted, ValueError, r"is keyed by text \('0', '1'\)")


# --- item 8: no amplification ------------------------------------------------------------------------------------


def test_an_expanded_step_is_refused_before_any_copy(tmp_path):
    """A few-KB file whose ``step`` is zeros(1).expand(16384, 16384) made load_state_dict allocate 1 GiB."""
    sd = _trained(foreach=False).state_dict()
    sd["state"][0]["step"] = torch.zeros(1).expand(16384, 16384)
    path = tmp_path / "amplify.pt"
    torch.save(sd, path)
    assert path.stat().st_size < 4096
    _refused(
        _trained(foreach=False),
        path,
        ValueError,
        rf"Adam: load_state_dict: {path}: group 0, param 0, state key 'step': expected a 0-dim tensor \(or a "
        rf"number\), got a tensor of shape \(16384, 16384\)",
    )


def test_an_expanded_view_is_refused_for_any_class():
    class Custom(O.Adam):  # its own step: what it keeps is not known, but no state is an expanded view
        def step(self, closure=None):
            return super().step(closure)

    sd = _trained(Custom, foreach=False).state_dict()
    sd["state"][1]["history"] = [torch.zeros(1).expand(4096, 4096)]
    _refused(
        _trained(Custom, foreach=False),
        sd,
        ValueError,
        r"group 0, param 1, state key 'history'\[0\]: a tensor of shape \(4096, 4096\) \(67108864 bytes once "
        r"copied\) is a view of a storage of 4 bytes",
    )
    small = _trained(Custom, foreach=False).state_dict()
    small["state"][1]["history"] = [torch.zeros(1).expand(8)]  # a small broadcast is harmless
    target = _trained(Custom, foreach=False)
    optimshift.load_state_dict(target, small)
    assert torch.equal(target.state[target.param_groups[0]["params"][1]]["history"][0], torch.zeros(8))


@pytest.mark.parametrize(
    "cls, kwargs, key",
    [
        (O.NAdam, {"foreach": False}, "mu_product"),
        (O.ASGD, {"foreach": False}, "eta"),
        (O.Adam, {"foreach": False}, "step"),
    ],
)
def test_scalar_keys_have_one_element(cls, kwargs, key):
    sd = _trained(cls, **kwargs).state_dict()
    sd["state"][0][key] = torch.zeros(4, 3)
    _refused(_trained(cls, **kwargs), sd, ValueError, rf"state key '{key}': expected a 0-dim tensor")


# --- "Also": what a torch.optim step needs ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, exc, match",
    [
        ("abc", TypeError, r"expected a tensor, got str 'abc'"),
        ([1.0], TypeError, r"expected a tensor, got a list of 1"),
        (None, TypeError, r"expected a tensor, got None"),
        (torch.zeros(4, 3).to_sparse(), TypeError, r"expected a dense tensor, got a sparse_coo one"),
        (torch.zeros(4, 3, dtype=torch.int64), TypeError, r"expected a floating-point tensor, got int64"),
    ],
)
def test_a_buffer_a_step_cannot_use_is_refused(value, exc, match):
    sd = _trained(foreach=False).state_dict()
    sd["state"][0]["exp_avg"] = value
    _refused(
        _trained(foreach=False), sd, exc, rf"Adam: load_state_dict: group 0, param 0, state key 'exp_avg': {match}"
    )


def test_a_missing_entry_is_refused():
    sd = _trained(foreach=False, amsgrad=True).state_dict()
    del sd["state"][1]["max_exp_avg_sq"]
    _refused(
        _trained(foreach=False, amsgrad=True),
        sd,
        ValueError,
        r"group 0, param 1: its state has no 'max_exp_avg_sq'; Adam\.step keeps 'exp_avg', 'exp_avg_sq', "
        r"'max_exp_avg_sq', 'step'",
    )


def test_a_subclass_that_steps_like_its_torch_class_is_checked_like_it():
    class Sub(O.Adam):
        pass

    # What Optimizer.__init__ does when a subclass is built before its base ever was: a wrapper of its own.
    Sub.step = Sub.profile_hook_step(O.Adam.step)
    Sub.step.hooked = True
    sd = _trained(Sub, foreach=False).state_dict()
    sd["state"][0]["exp_avg"] = None
    _refused(
        _trained(Sub, foreach=False),
        sd,
        TypeError,
        r"Sub: load_state_dict: group 0, param 0, state key "
        r"'exp_avg': expected a tensor, got None",
    )


def test_eager_classes_need_every_params_state():
    sd = _trained(O.Adagrad).state_dict()
    del sd["state"][1]
    _refused(
        _trained(O.Adagrad),
        sd,
        ValueError,
        r"group 0, param 1: the checkpoint has no state for it, but Adagrad creates every param's state when it "
        r"is built \('step', 'sum'\)",
    )


@pytest.mark.parametrize(
    "key, value, match",
    [
        ("lr", "0.1", r"key 'lr': expected a number \(or a one-element tensor\), got str '0.1'"),
        ("lr", torch.ones(2), r"key 'lr': expected a number .* got a tensor of shape \(2,\)"),
        ("lr", True, r"key 'lr': expected a number"),
        ("betas", 0.9, r"key 'betas': expected a pair of numbers like \(0.9, 0.999\), got a float"),
        ("betas", (0.9, 0.99, 0.9), r"key 'betas': expected a pair of numbers .* got a tuple of 3"),
        ("betas", (0.9, "x"), r"key 'betas': item 1 must be a number, got str 'x'"),
        ("amsgrad", "no", r"key 'amsgrad': expected True or False, got str 'no'"),
    ],
)
def test_hyperparameters_of_the_wrong_type_are_refused(key, value, match):
    sd = _trained(foreach=False).state_dict()
    sd["param_groups"][0][key] = value
    _refused(_trained(foreach=False), sd, TypeError, rf"Adam: load_state_dict: param group 0, {match}")


def test_what_older_pytorch_saved_still_loads():
    """Python-number steps (PyTorch < 1.12), one-element steps (1.12/1.13 capturable), tensor lr, list betas."""
    src = _trained(foreach=False)
    sd = copy.deepcopy(src.state_dict())
    sd["state"][0]["step"] = 1.0
    sd["state"][1]["step"] = torch.tensor([1.0])
    sd["param_groups"][0]["lr"] = torch.tensor(0.001)
    sd["param_groups"][0]["betas"] = [0.9, 0.999]
    target = _trained(foreach=False)
    optimshift.load_state_dict(target, sd)
    states = list(target.state.values())
    assert torch.equal(states[0]["step"], torch.tensor(1.0)) and torch.equal(states[1]["step"], torch.tensor([1.0]))
    assert bitwise_equal(states[0]["exp_avg"], src.state_dict()["state"][0]["exp_avg"])
    target.step()  # and PyTorch's step takes them
    assert states[0]["step"].item() == 2.0 and states[1]["step"].item() == 2.0


# --- deep nesting ----------------------------------------------------------------------------------------------


def _deep(levels):
    value = []
    for _ in range(levels):
        value = [value]
    return value


@pytest.mark.parametrize("where", ["state", "group"])
def test_state_nested_20000_deep_is_a_value_error(where):
    sd = _trained(foreach=False).state_dict()
    if where == "state":
        sd["state"][0]["history"] = _deep(20000)
        match = r"group 0, param 0, state key 'history': nested more than 64 levels deep"
    else:
        sd["param_groups"][0]["schedule"] = _deep(20000)
        match = r"param group 0, key 'schedule': nested more than 64 levels deep"
    _refused(_trained(foreach=False), sd, ValueError, match)


def test_saving_state_nested_20000_deep_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match="nested too deeply to pickle"):
        optimshift.save({"history": _deep(20000)}, tmp_path / "deep.pt")
    assert list(tmp_path.iterdir()) == [], "nothing written, no temporary left"


def test_a_file_nested_20000_deep_names_the_file(tmp_path):
    """A crafted file (torch.save itself cannot write one this deep): load works, load_state_dict refuses."""
    sd = _trained(foreach=False).state_dict()
    sd["state"][0]["history"] = "DEEP-MARKER"
    path = tmp_path / "deep.pt"
    optimshift.save(sd, path)
    levels = 20000
    nest_in_place(path, "DEEP-MARKER", levels)
    loaded = optimshift.load(path)
    depth, v = 0, loaded["state"][0]["history"]
    while v:
        depth, v = depth + 1, v[0]
    assert depth == levels - 1
    _refused(
        _trained(foreach=False),
        path,
        ValueError,
        rf"Adam: load_state_dict: {path}: group 0, param 0, state key 'history': nested more than 64 levels",
    )

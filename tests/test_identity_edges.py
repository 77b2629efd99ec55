"""Where keeping tensor objects needs care: tensors shared between places, tensors the model owns, inference
tensors, and group tensors in a state_dict taken while offloaded (found in review)."""

import copy
import io

import pytest
import torch

import optimshift
from optimshift._adopt import mechanism
from optimshift.pool import host_pool


class Holder(torch.optim.Optimizer):
    """A third-party-like optimizer whose state is whatever the test puts there."""

    def __init__(self, params):
        super().__init__(params, {"lr": 0.1})

    def step(self, closure=None):
        return None


def test_one_live_tensor_given_two_different_copies_takes_neither():
    """LBFGS keeps state['t'] is group['lr'] after its second step; a checkpoint from its first step holds two
    different tensors there. Each place gets the checkpoint's value, as with PyTorch's load."""
    p = torch.nn.Parameter(torch.tensor([1.5, -2.0, 0.7]))  # (fixed: from some random draws one step converges)

    def closure():
        opt.zero_grad()
        loss = (p**2).sum()
        loss.backward()
        return loss

    opt = torch.optim.LBFGS([p], lr=torch.tensor(0.5))
    opt.step(closure)
    opt.step(closure)
    assert opt.state[p]["t"] is opt.param_groups[0]["lr"], "precondition: the live optimizer shares them"
    sd = copy.deepcopy(opt.state_dict())
    sd["state"][0]["t"] = torch.tensor(0.123)
    sd["param_groups"][0]["lr"] = torch.tensor(0.5)
    optimshift.load_state_dict(opt, sd)
    assert opt.param_groups[0]["lr"].item() == 0.5 and opt.state[p]["t"].item() == torch.tensor(0.123).item()


def test_a_copy_also_held_inside_a_container_is_never_swapped_away(sim):
    p = torch.nn.Parameter(torch.randn(3, device=sim))
    opt = Holder([p])
    opt.state[p]["x"] = torch.zeros(3)  # on the host: a swap would be the mechanism to the device
    opt.state[p]["hist"] = [torch.zeros(3)]
    assert mechanism(opt.state[p]["x"], torch.ones(3, device=sim)) == "swap"
    shared = torch.full((3,), 7.0)
    optimshift.load_state_dict(
        opt, {"state": {0: {"x": shared, "hist": [shared]}}, "param_groups": [{"lr": 0.1, "params": [0]}]}
    )
    st = opt.state[p]
    assert st["x"] is st["hist"][0], "the checkpoint shares them: they stay one tensor"
    assert st["x"].device == sim and torch.equal(st["x"].cpu(), shared)


def test_tensors_the_model_owns_are_never_changed_in_place(sim):
    """A frozen param or a param's grad kept in state goes to the host as a copy: the model does not move."""
    p = torch.nn.Parameter(torch.randn(3, device=sim))
    (p * 2).sum().backward()
    frozen = torch.nn.Parameter(torch.randn(3, device=sim), requires_grad=False)
    opt = Holder([p])
    opt.state[p]["prev_grad"] = p.grad
    opt.state[p]["anchor"] = frozen
    optimshift.offload(opt)
    assert p.grad.device == sim and frozen.device == sim
    assert opt.state[p]["anchor"].device.type == "cpu" and opt.state[p]["prev_grad"].device.type == "cpu"
    optimshift.reload(opt)
    assert opt.state[p]["anchor"].device == sim


def test_inference_tensors_are_replaced_not_broken():
    with torch.inference_mode():
        old = torch.zeros(3)
    assert mechanism(old, torch.ones(3)) == "replace"
    assert mechanism(torch.zeros(3), torch.ones(3)) == "data"


def test_a_state_dict_taken_while_offloaded_has_compact_group_tensors(sim):
    host_pool.release_idle()
    params = [torch.nn.Parameter(torch.randn(64, 64, device=sim)) for _ in range(4)]
    opt = torch.optim.Adam(params, lr=torch.tensor(0.01, device=sim), capturable=True)
    for q in params:
        q.grad = torch.ones_like(q)
    opt.step()
    optimshift.offload(opt)
    sd = opt.state_dict()
    lr = sd["param_groups"][0]["lr"]
    assert lr.untyped_storage().nbytes() == lr.element_size(), "the group's tensor owns exactly its bytes"
    assert opt.param_groups[0]["lr"] is not lr, "the live group is untouched"
    buf = io.BytesIO()
    torch.save(sd, buf)
    optimshift.reload(opt)


def _roads(opt, model, sim, road, saved):
    """Every road, under the caller's modes."""
    if road == "offload":
        optimshift.offload(opt)
        optimshift.reload(opt)
    elif road == "move":
        optimshift.move(opt, "cpu")
        optimshift.move(opt, sim)
    elif road == "rebind":
        optimshift.rebind(opt, list(model.parameters()))
    elif road == "load_state_dict":
        optimshift.load_state_dict(opt, saved)
    else:
        optimshift.stream(opt)
        optimshift.unstream(opt)


@pytest.mark.parametrize("road", ["offload", "move", "rebind", "load_state_dict", "stream"])
def test_an_operation_under_inference_mode_leaves_no_inference_tensor(sim, road):
    """Offloading during generation, under ``torch.inference_mode()`` (an RL loop's eval): every copy was an
    inference tensor, which the state took (swapped in, or put in its place), and the next step outside inference
    mode raised ("Inplace update to inference tensor outside InferenceMode"). Copies are made outside it."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2).to(sim)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 3, device=sim)).sum().backward()
    opt.step()
    saved = copy.deepcopy(opt.state_dict())
    ids = [id(t) for st in opt.state.values() for t in st.values()]
    with torch.inference_mode():
        _roads(opt, model, sim, road, saved)
    assert [id(t) for st in opt.state.values() for t in st.values()] == ids
    assert not any(t.is_inference() for st in opt.state.values() for t in st.values())
    model(torch.randn(4, 3, device=sim)).sum().backward()
    opt.step()


def test_entries_keep_their_python_attributes_through_a_swap(sim):
    """Between the host and a Python backend (a swap of the C++ tensors) an entry's own attributes (a tag a framework
    put on it) went to the copy: the same object came back without them."""
    p = torch.nn.Parameter(torch.randn(4, device=sim))
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    p.grad = torch.randn(4, device=sim)
    opt.step()
    entry = opt.state[p]["momentum_buffer"]
    entry.tag = "bucket-0"
    optimshift.offload(opt)
    assert opt.state[p]["momentum_buffer"] is entry and entry.device.type == "cpu" and entry.tag == "bucket-0"
    optimshift.reload(opt)
    assert entry.device == sim and entry.tag == "bucket-0"


def test_a_state_dict_taken_under_inference_mode_while_offloaded_holds_no_inference_tensor(sim):
    """The state_dict() hook of an offloaded optimizer copies each entry out of its pool buffer: under the caller's
    inference mode the copies were inference tensors, and a plain load of that dict made the next step raise."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2).to(sim)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 3, device=sim)).sum().backward()
    opt.step()
    optimshift.offload(opt)
    with torch.inference_mode():
        saved = opt.state_dict()
    assert not any(t.is_inference() for st in saved["state"].values() for t in st.values())


@pytest.mark.parametrize("road", ["offload+reload", "move", "load_state_dict"])
@pytest.mark.parametrize("name, kwargs", [("ASGD", {}), ("Adamax", {"weight_decay": 0.1})])
def test_a_state_tensor_autograd_made_steps_after_every_road(sim, road, name, kwargs):
    """Under ``differentiable=True`` ASGD's ``ax`` (an average of the param) and, with weight decay, Adamax's moments
    are results of autograd. Their copies were made leaves requiring grad, which the next step (in place, grad
    mode on) refused: "a leaf Variable that requires grad is being used in an in-place operation"."""
    cls = getattr(torch.optim, name)

    def trained():
        params = [torch.randn(3, 2, device=sim, requires_grad=True).clone() for _ in range(2)]
        opt = cls(params, differentiable=True, **kwargs)
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
        return opt, params

    opt, params = trained()
    assert any(t.grad_fn is not None for st in opt.state.values() for t in st.values())
    if road == "offload+reload":
        optimshift.reload(optimshift.offload(opt))
    elif road == "move":
        optimshift.move(optimshift.move(opt, "cpu"), sim)
    else:
        sd = opt.state_dict()
        opt, params = trained()
        optimshift.load_state_dict(opt, sd)
    assert not any(t.requires_grad and t.is_leaf for st in opt.state.values() for t in st.values())
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()

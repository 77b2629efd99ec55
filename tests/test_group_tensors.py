"""Tensors a param group holds itself (tensor lr, tensor betas) and tensors shared between a group and state,
on the simulated accelerator: they go exactly where a fresh optimizer keeps them, shared ones stay shared."""

from __future__ import annotations

import copy
import io

import pytest
import torch

import optimshift
from _matrix import bitwise_equal, grad_for

O = torch.optim


def _params(device, shapes=((3, 2), (3,))):
    return [
        torch.nn.Parameter(torch.randn(s, generator=torch.Generator().manual_seed(i)).to(device))
        for i, s in enumerate(shapes)
    ]


def _step(opt, params, k):
    for i, p in enumerate(params):
        p.grad = grad_for(k, i, p.shape).to(p.device)
    with optimshift.count_syncs() as syncs:
        opt.step()
    return syncs.total


def _group_devices(opt):
    out = {}
    for gi, g in enumerate(opt.param_groups):
        for key, value in g.items():
            for i, t in enumerate(value if isinstance(value, tuple) else (value,)):
                if isinstance(t, torch.Tensor):
                    out[(gi, key, i)] = t.device.type
    return out


# The configurations whose capturable step read a device group tensor on the host once optimshift had put it
# there: one sync per param per step, against none for a fresh optimizer (issue 13).
READ_ON_THE_HOST = [
    (O.Adam, {"capturable": True, "foreach": False}),
    (O.AdamW, {"capturable": True, "foreach": False, "amsgrad": True}),
    (O.Adam, {"capturable": True, "foreach": True}),
    (O.Adadelta, {"capturable": True, "foreach": False}),
    (O.RMSprop, {"capturable": True, "foreach": False}),
]


@pytest.mark.parametrize(
    "cls, kwargs",
    READ_ON_THE_HOST,
    ids=lambda v: getattr(v, "__name__", None) or "-".join(k for k, x in v.items() if x),
)
def test_move_keeps_host_group_tensors_where_a_fresh_optimizer_has_them(sim, cls, kwargs):
    tensors = {"lr": torch.tensor(0.01)}
    if cls in (O.Adam, O.AdamW):
        tensors["betas"] = (torch.tensor(0.9), torch.tensor(0.99))
    params = _params(sim)
    opt = cls(params, **tensors, **kwargs)
    fresh_syncs = _step(opt, params, 0)
    optimshift.move(opt)  # already placed right: nothing may change
    assert set(_group_devices(opt).values()) == {"cpu"}
    assert _step(opt, params, 1) == fresh_syncs == 0
    assert optimshift.check(opt).ok


def test_a_group_tensor_the_step_reads_on_the_host_goes_there(sim):
    """Given on the device, capturable Adam's beta2 costs a sync per param per step (addcmul_ takes 1 - beta2 as
    a number): move() puts it on the host. Its lr and beta1 are used as tensors: a device one stays there, as
    a fresh optimizer given them on the device keeps them (CUDA-graph users do that on purpose)."""
    params = _params(sim)
    opt = O.Adam(
        params,
        lr=torch.tensor(0.01, device=sim),
        capturable=True,
        foreach=False,
        betas=(torch.tensor(0.9, device=sim), torch.tensor(0.99, device=sim)),
    )
    assert _step(opt, params, 0) == len(params)
    assert not optimshift.check(opt).ok
    optimshift.move(opt)
    assert _group_devices(opt) == {(0, "lr", 0): "sim", (0, "betas", 0): "sim", (0, "betas", 1): "cpu"}
    assert _step(opt, params, 1) == 0
    assert optimshift.check(opt).ok


# torch's default implementation (foreach=None) over accelerator params is the foreach step, whose reads of a device
# lr are on the device: none costs a sync. The probe's fake param took the single-tensor path there (torch picks
# foreach by the params' type, and a FakeTensor is neither Tensor nor Parameter), which reads lr on the host.
DEFAULT_FOREACH_KEEPS_A_DEVICE_LR = [
    (O.Adagrad, {}),
    (O.Adadelta, {"capturable": True}),
    (O.RMSprop, {"capturable": True}),
]


@pytest.mark.parametrize(
    "cls, kwargs", DEFAULT_FOREACH_KEEPS_A_DEVICE_LR, ids=lambda v: getattr(v, "__name__", None) or "-".join(v)
)
def test_a_device_lr_torch_s_default_step_reads_on_the_device_stays_there(sim, cls, kwargs):
    """check() called such a device lr misplaced (a sync per read, it said, where a step costs none) and move()
    took it to the host, away from where a fresh optimizer given it keeps it (a CUDA-graph user's choice)."""
    params = _params(sim)
    lr = torch.tensor(0.01, device=sim)
    opt = cls(params, lr=lr, **kwargs)
    assert opt.param_groups[0]["foreach"] is None
    assert _step(opt, params, 0) == _step(opt, params, 1) == 0
    assert not optimshift.check(opt).findings
    optimshift.move(opt)
    assert opt.param_groups[0]["lr"] is lr and lr.device == sim
    assert _step(opt, params, 2) == 0


def test_a_device_lr_torch_s_default_step_reads_on_the_host_is_still_reported(sim):
    """SGD's foreach step reads lr on the host too (one sync per step): still found, still moved to the host."""
    params = _params(sim)
    opt = O.SGD(params, lr=torch.tensor(0.01, device=sim))
    assert _step(opt, params, 0) == 1
    assert [(f.key, f.expected) for f in optimshift.check(opt).findings] == [("lr", "cpu")]
    optimshift.move(opt)
    assert opt.param_groups[0]["lr"].device.type == "cpu"
    assert _step(opt, params, 1) == 0


def test_fused_host_lr_stays_on_the_host_and_steps_without_syncs(sim):
    host = _params(torch.device("cpu"))
    opt = O.Adam(host, lr=torch.tensor(0.01), fused=True)
    _step(opt, host, 0)
    for p in host:
        torch.utils.swap_tensors(p, torch.nn.Parameter(p.detach().to(sim)))
    optimshift.move(opt)
    assert opt.param_groups[0]["lr"].device.type == "cpu"
    assert all(st["step"].device == sim for st in opt.state.values())
    assert _step(opt, host, 1) == 0


# --- LBFGS: state['t'] is group['lr'] -----------------------------------------------------------------------------


def _lbfgs(device):
    params = _params(device)
    opt = O.LBFGS(params, lr=torch.tensor(0.5), history_size=3, max_iter=3)
    return params, opt


def _lbfgs_step(opt, params):
    targets = [grad_for(7, i, p.shape).to(p.device) for i, p in enumerate(params)]

    def closure():
        opt.zero_grad()
        loss = sum(((p - t) ** 2).sum() for p, t in zip(params, targets))
        loss.backward()
        return loss

    opt.step(closure)


def _to(params, device):
    for p in params:
        p.grad = None
        torch.utils.swap_tensors(p, torch.nn.Parameter(p.detach().to(device)))


def test_lbfgs_tensor_lr_shared_with_state_moves_as_one_tensor(sim):
    """A fresh LBFGS with a tensor lr holds state['t'] = group['lr'] on the host. move() used to refuse it
    ("one tensor is shared by ... different devices"); it now goes where the group keeps lr, still one tensor."""
    params, opt = _lbfgs(sim)
    still_params, still = _lbfgs(sim)
    for _ in range(2):
        _lbfgs_step(opt, params)
        _lbfgs_step(still, still_params)
    state = opt.state[params[0]]
    assert state["t"] is opt.param_groups[0]["lr"], "precondition: a fresh LBFGS shares the tensor"
    _to(params, torch.device("cpu"))
    optimshift.move(opt)
    _to(params, sim)
    optimshift.move(opt, sim)
    assert state["t"] is opt.param_groups[0]["lr"] and state["t"].device.type == "cpu"
    assert state["d"].device == sim and all(t.device == sim for t in state["old_dirs"])
    assert optimshift.check(opt).ok
    _lbfgs_step(opt, params)
    _lbfgs_step(still, still_params)
    assert all(bitwise_equal(p, q) for p, q in zip(params, still_params))


def test_lbfgs_load_state_dict_keeps_the_shared_lr(sim):
    """optimshift.load_state_dict used to give state['t'] its own copy, on the device."""
    params, opt = _lbfgs(sim)
    for _ in range(2):
        _lbfgs_step(opt, params)
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer, map_location="cpu", weights_only=False)
    assert saved["state"][0]["t"] is saved["param_groups"][0]["lr"], "precondition: the checkpoint shares it"
    new_params, new = _lbfgs(sim)
    for p, q in zip(new_params, params):
        p.data.copy_(q.detach())
    optimshift.load_state_dict(new, saved)
    state = new.state[new_params[0]]
    assert state["t"] is new.param_groups[0]["lr"] and state["t"].device.type == "cpu"
    assert state["t"] is not saved["param_groups"][0]["lr"]  # copy=True: nothing shared with the checkpoint
    assert optimshift.check(new).ok


def test_lbfgs_load_into_its_own_state_keeps_the_shared_lr_object(sim):
    """A rollback into live LBFGS state: its lr (state['t'], the same tensor) took a new object (a copy installed
    in two places was never adopted); the old one takes it back in both places, still one tensor."""
    params, opt = _lbfgs(sim)
    for _ in range(2):
        _lbfgs_step(opt, params)
    saved = copy.deepcopy(opt.state_dict())
    lr = opt.param_groups[0]["lr"]
    for _ in range(2):
        _lbfgs_step(opt, params)
    optimshift.load_state_dict(opt, saved)
    assert opt.param_groups[0]["lr"] is lr and opt.state[params[0]]["t"] is lr
    assert torch.equal(lr, saved["param_groups"][0]["lr"]) and optimshift.check(opt).ok


def test_state_entries_sharing_a_tensor_across_devices_are_still_refused(sim):
    """Only a group's own tensor decides for the state entries holding it; two state entries that belong on
    different devices cannot share one tensor."""
    cpu_p, sim_p = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(3, device=sim))
    opt = O.SGD([cpu_p, sim_p], lr=0.1, momentum=0.9)
    shared = torch.zeros(3)
    opt.state[cpu_p]["momentum_buffer"] = shared
    opt.state[sim_p]["momentum_buffer"] = shared
    with pytest.raises(ValueError, match="one tensor is shared by group 0, param 0.*and group 0, param 1"):
        optimshift.move(opt)
    assert opt.state[sim_p]["momentum_buffer"] is shared and shared.device.type == "cpu"


def test_a_checkpoint_sharing_a_tensor_across_devices_is_refused_like_a_move(sim, tmp_path):
    """A load plans with the planner every operation uses (issue 18): a checkpoint tensor that two state entries
    share, for params on two devices, cannot be placed for both, as a move says; the load is refused before
    anything changes, naming both entries and the file (it used to split it silently)."""
    cpu_p, sim_p = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(3, device=sim))
    source = O.SGD([torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(3))], lr=0.1, momentum=0.9)
    sd = source.state_dict()
    shared = torch.ones(3)
    sd["state"] = {0: {"momentum_buffer": shared}, 1: {"momentum_buffer": shared}}
    opt = O.SGD([cpu_p, sim_p], lr=0.1, momentum=0.9)
    with pytest.raises(
        ValueError,
        match=r"^SGD: load_state_dict: one tensor is shared by group 0, param 0.*and group 0, "
        r"param 1.*it cannot be placed for both",
    ):
        optimshift.load_state_dict(opt, sd)
    assert not opt.state
    path = tmp_path / "shared.pt"
    torch.save(sd, path)
    with pytest.raises(ValueError, match=rf"^SGD: load_state_dict: {path}: one tensor is shared"):
        optimshift.load_state_dict(opt, path)
    optimshift.load_state_dict(opt, sd, device="cpu")  # one device: one tensor, still shared
    assert opt.state[cpu_p]["momentum_buffer"] is opt.state[sim_p]["momentum_buffer"]


@pytest.mark.parametrize("cls, kwargs", [(O.Adam, {"capturable": True, "foreach": True})], ids=["Adam-capturable"])
def test_a_load_puts_a_live_group_tensor_back_on_the_side_a_move_took_it_from(sim, cls, kwargs):
    """A move to the host and back remembers where a device lr was given (the session); a load writes the
    checkpoint's lr into that same tensor, which goes back to its side, whatever side the checkpoint's is on."""
    params, opt = _device_lr_optimizer(sim, cls, kwargs)
    optimshift.move(opt, "cpu")  # the lr given on the device goes to the host: the session remembers the device
    for p in params:
        p.data = p.data.to(sim)
    live = opt.param_groups[0]["lr"]
    saved = cls(_params("cpu"), lr=torch.tensor(0.02), **kwargs)  # a host lr in the checkpoint
    optimshift.load_state_dict(opt, saved.state_dict())
    assert opt.param_groups[0]["lr"] is live and live.device == sim and live.item() == pytest.approx(0.02)
    assert not optimshift.check(opt).findings


ADAM_ON_DEVICE = [(cls, {flag: True}) for cls in (O.Adam, O.AdamW) for flag in ("fused", "capturable")]


def _scheduled(device, cls, kwargs, lr, steps=1):
    """Two groups sharing one ``lr``, a scheduler (an ``initial_lr`` in each), ``steps`` steps."""
    params = _params(device)
    opt = cls([{"params": params[:1]}, {"params": params[1:]}], lr=lr, **kwargs)
    torch.optim.lr_scheduler.StepLR(opt, 1)
    for k in range(steps):
        _step(opt, params, k)
    return params, opt


def _lr(kind, device, value=0.01):
    """An lr of ``kind``: a tensor on ``device`` ("device"), a tensor on the host ("host"), a float ("float")."""
    return {"device": lambda: torch.tensor(value, device=device), "host": lambda: torch.tensor(value)}.get(
        kind, lambda: value
    )()


def _roads(saved, path):
    """Every road a saved optimizer's state dict reaches a load by: from memory, from the file (as torch.load reads
    it, as a framework's resume reads it onto the host: Lightning's, Accelerate's map_location='cpu'), its path."""
    return {
        "memory": saved.state_dict,
        "torch.load": lambda: torch.load(path, weights_only=True),  # (no map_location: on the device)
        "map_location": lambda: torch.load(path, map_location="cpu", weights_only=True),
        "optimshift.load": lambda: optimshift.load(path),
        "path": lambda: path,
    }


def _loaded_on_every_road(sim, tmp_path, cls, kwargs, live_lr, saved_lr, steps):
    """Where lr and initial_lr of both groups are after a load of the saved optimizer by each road, the lr the live
    optimizer was given kept (the same object) where it was a tensor; every load checked and stepped."""
    saved = _scheduled(sim, cls, kwargs, _lr(saved_lr, sim, 0.02), 1)[1]
    path = tmp_path / "opt.pt"
    optimshift.save(saved, path)
    where = {}
    for road, sd in _roads(saved, path).items():
        params, opt = _scheduled(sim, cls, kwargs, _lr(live_lr, sim), steps)
        live = opt.param_groups[0]["lr"]
        optimshift.load_state_dict(opt, sd())
        groups = opt.param_groups
        where[road] = [str(getattr(g[k], "device", "float")) for g in groups for k in ("lr", "initial_lr")]
        if live_lr != "float":
            assert groups[0]["lr"] is groups[1]["lr"] is live and float(live) == pytest.approx(0.02), road
        _step(opt, params, 1)
        assert not [(f.param, f.key, f.why) for f in optimshift.check(opt).findings if f.severity != "info"], road
    return where


@pytest.mark.parametrize("into", ["fresh", "existing"])
@pytest.mark.parametrize("lr", ["device", "host", "float"])
@pytest.mark.parametrize("cls, kwargs", ADAM_ON_DEVICE, ids=lambda v: getattr(v, "__name__", None) or "-".join(v))
def test_a_load_places_group_tensors_alike_on_every_road(sim, tmp_path, cls, kwargs, lr, into):
    """A device lr saved: a load read onto the host (map_location, optimshift.load, a path) put it there, the live
    lr it keeps, the group sharing it and the scheduler's initial_lr, where the same load from memory keeps it on
    the device (a captured step reads it at its address); a host lr and a float stay as they are."""
    where = _loaded_on_every_road(sim, tmp_path, cls, kwargs, lr, lr, int(into == "existing"))
    side = {"device": str(sim), "host": "cpu", "float": "float"}[lr]
    assert where == dict.fromkeys(where, [side] * 4)


@pytest.mark.parametrize("live, saved", [("device", "host"), ("host", "device"), ("float", "device")])
def test_a_load_keeps_a_live_group_tensor_on_its_side(sim, tmp_path, live, saved):
    """The load writes the checkpoint's lr (and initial_lr) into the live tensor, which stays on the side it was
    given on, whatever side the checkpoint's is on; a float lr keeps none: the loaded one goes where the file saved
    it, else stays where it is."""
    where = _loaded_on_every_road(sim, tmp_path, O.Adam, {"capturable": True}, live, saved, 1)
    side = {"device": str(sim), "host": "cpu"}
    read_to_the_host = ("map_location", "optimshift.load")
    expected = {
        road: side[live if live != "float" else "host" if road in read_to_the_host else saved] for road in where
    }
    assert where == {road: [at] * 4 for road, at in expected.items()}


@pytest.mark.parametrize("live, saved", [("cpu", "sim"), ("sim", "cpu")])
def test_a_load_leaves_a_group_tensor_a_state_entry_views_where_it_is(sim, tmp_path, live, saved):
    """LBFGS's ``state['t']`` is a view of a ``(1,)`` tensor lr, and stays on its own side: a load that put the lr on
    the live one's side (or where the file saved it) refused the checkpoint (one storage on two devices); the lr
    stays where it is, as the view does, on every road."""

    def lbfgs(side, steps):
        params = _params(sim, shapes=((4,),))
        opt = O.LBFGS(params, lr=torch.full((1,), 0.5, device=sim if side == "sim" else "cpu"))
        for _ in range(steps):
            opt.step(lambda: (opt.zero_grad(), (params[0] * params[0]).sum().backward(), params[0].square().sum())[2])
        return params, opt

    saved_opt = lbfgs(saved, 3)[1]
    path = tmp_path / "opt.pt"
    optimshift.save(saved_opt, path)
    for road, sd in _roads(saved_opt, path).items():
        params, opt = lbfgs(live, 0)
        optimshift.load_state_dict(opt, sd())
        lr, t = opt.param_groups[0]["lr"], opt.state[params[0]]["t"]
        assert lr.device == t.device and lr.untyped_storage().data_ptr() == t.untyped_storage().data_ptr(), road
        opt.step(lambda: (opt.zero_grad(), (params[0] * params[0]).sum().backward(), params[0].square().sum())[2])


# -- group tensors follow params that moved (issue 17, item 5) ----------------------------------------------

FOLLOW = [
    (O.Adam, {"capturable": True, "foreach": True}),
    (O.AdamW, {"capturable": True, "foreach": False}),
    (O.RAdam, {"capturable": True, "foreach": True}),
    (O.NAdam, {"capturable": True, "foreach": True}),
]


def _device_lr_optimizer(device, cls, kwargs):
    params = _params(device)
    opt = cls(params, lr=torch.tensor(0.01, device=device), **kwargs)
    for k in range(2):
        _step(opt, params, k)
    return params, opt


def _fresh_lr_device(device, cls, kwargs):
    """Where a fresh optimizer over params on ``device``, given its lr there, holds lr after a step."""
    params, opt = _device_lr_optimizer(device, cls, kwargs)
    return opt.param_groups[0]["lr"].device


@pytest.mark.parametrize("cls, kwargs", FOLLOW, ids=lambda v: getattr(v, "__name__", None) or "-".join(v))
def test_a_device_lr_follows_params_that_moved_while_offloaded(sim, cls, kwargs):
    sim1 = torch.device(sim.type, 1)
    params, opt = _device_lr_optimizer(sim, cls, kwargs)
    ref_params, ref = _device_lr_optimizer(sim, cls, kwargs)
    optimshift.offload(opt)
    for p in params:
        p.data = p.data.to(sim1)  # the model moved while its optimizer state was on the host
    optimshift.reload(opt)
    assert opt.param_groups[0]["lr"].device == _fresh_lr_device(sim1, cls, kwargs) == sim1
    assert not optimshift.check(opt).findings
    for p in ref_params:
        p.data = p.data.to(sim1)
    optimshift.move(ref)
    for k in range(2, 4):
        _step(opt, params, k)  # no device mix
        _step(ref, ref_params, k)
    for a, b in zip(params, ref_params):
        assert bitwise_equal(a, b)


@pytest.mark.parametrize("cls, kwargs", FOLLOW, ids=lambda v: getattr(v, "__name__", None) or "-".join(v))
def test_a_device_lr_moved_to_the_host_and_back_is_on_the_device_again(sim, cls, kwargs):
    params, opt = _device_lr_optimizer(sim, cls, kwargs)
    lr = opt.param_groups[0]["lr"]
    optimshift.move(opt, "cpu")
    assert lr.device.type == "cpu"
    for p in params:
        p.data = p.data.to(sim)
    # (check sees it too: with the params on the device, the lr given there belongs there)
    assert [f.key for f in optimshift.check(opt).findings if f.param == "group 0"] == ["lr"]
    optimshift.move(opt, sim)
    assert opt.param_groups[0]["lr"] is lr and lr.device == _fresh_lr_device(sim, cls, kwargs) == sim
    assert not optimshift.check(opt).findings
    _step(opt, params, 2)


@pytest.mark.parametrize("cls, kwargs", FOLLOW[:1], ids=lambda v: getattr(v, "__name__", None) or "-".join(v))
def test_a_rebind_after_a_move_to_the_host_puts_a_device_lr_back_as_a_move_does(sim, cls, kwargs):
    """A device lr a move took to the host: a move back put it on the device again, a rebind to the params there
    left it on the host (it asked the policy without the side the session remembers), and check() called it an
    error. Both ask the Placer the same way now; a rebind to the host remembers the side, as a move does."""
    params, opt = _device_lr_optimizer(sim, cls, kwargs)
    lr = opt.param_groups[0]["lr"]
    optimshift.move(opt, "cpu")
    assert lr.device.type == "cpu"
    optimshift.rebind(opt, params)
    assert opt.param_groups[0]["lr"] is lr and lr.device == sim and not optimshift.check(opt).findings
    host = [torch.nn.Parameter(p.detach().cpu()) for p in params]
    optimshift.rebind(opt, host)  # (the rebind takes it to the host: the side is remembered)
    assert lr.device.type == "cpu"
    optimshift.rebind(opt, params)
    assert lr.device == sim and not optimshift.check(opt).findings
    _step(opt, params, 2)


def test_a_host_lr_stays_on_the_host(sim):
    """The side is remembered, not invented: an lr given on the host stays there through the same moves."""
    params = _params(sim)
    opt = O.Adam(params, lr=torch.tensor(0.01), capturable=True, foreach=True)
    _step(opt, params, 0)
    optimshift.move(opt, "cpu")
    optimshift.move(opt, sim)
    assert opt.param_groups[0]["lr"].device.type == "cpu"
    optimshift.offload(opt)
    optimshift.reload(opt, sim)
    assert opt.param_groups[0]["lr"].device.type == "cpu"


@pytest.mark.parametrize("away", ["move", "offload"])
@pytest.mark.parametrize("cls, kwargs", FOLLOW, ids=lambda v: getattr(v, "__name__", None) or "-".join(v))
def test_a_group_added_on_the_host_sharing_a_device_lr_moves_back_with_it(sim, cls, kwargs, away):
    """A device lr a move (or an offload) took to the host, then a group added (add_param_group fills it from the
    defaults: that very tensor), then a move back: group 0's lr went to its remembered side, the new group's (the
    same tensor, at a site with no side remembered) stayed on the host, and the move refused the one tensor for two
    devices (ValueError): the state could not be moved back. The one tensor goes to the side remembered for it."""
    params, opt = _device_lr_optimizer(sim, cls, kwargs)
    lr = opt.param_groups[0]["lr"]
    if away == "move":
        optimshift.move(opt, "cpu")
    else:
        optimshift.offload(opt)
    extra = torch.nn.Parameter(torch.randn(3, device=sim))
    opt.add_param_group({"params": [extra]})
    assert opt.param_groups[1]["lr"] is lr and lr.device.type == "cpu"
    optimshift.move(opt, sim)
    assert opt.param_groups[1]["lr"] is opt.param_groups[0]["lr"] is lr
    assert lr.device == _fresh_lr_device(sim, cls, kwargs) == sim
    assert not optimshift.check(opt).findings
    _step(opt, [*params, extra], 2)


@pytest.mark.parametrize("how", ["move", "reload-to"])
@pytest.mark.parametrize("cls, kwargs", FOLLOW, ids=lambda v: getattr(v, "__name__", None) or "-".join(v))
def test_an_offloaded_device_lr_moved_back_is_on_the_device_again(sim, cls, kwargs, how):
    """An offload takes a device lr to the host as a move to the host does, and a move (or ``reload(opt, device)``,
    the RL frameworks' move-to-device) of the offloaded optimizer put everything back but that lr, left on the
    host (the session remembered the side a move took it from, not an offload's); check() found nothing."""
    params, opt = _device_lr_optimizer(sim, cls, kwargs)
    lr = opt.param_groups[0]["lr"]
    optimshift.offload(opt)
    assert lr.device.type == "cpu"
    if how == "move":
        optimshift.move(opt)
    else:
        optimshift.reload(opt, sim)
    assert opt.param_groups[0]["lr"] is lr and lr.device == _fresh_lr_device(sim, cls, kwargs) == sim
    assert not optimshift.check(opt).findings
    _step(opt, params, 2)


@pytest.mark.parametrize("cls, kwargs", FOLLOW, ids=lambda v: getattr(v, "__name__", None) or "-".join(v))
def test_an_offloaded_device_lr_is_judged_where_reload_puts_it(sim, cls, kwargs):
    """check() of an offloaded optimizer judges a group tensor from the side reload() puts it on: no finding
    before, during or after (it warned that the host lr it waits on belonged there)."""
    params, opt = _device_lr_optimizer(sim, cls, kwargs)
    assert not optimshift.check(opt).findings
    optimshift.offload(opt)
    assert opt.param_groups[0]["lr"].device.type == "cpu"
    assert [f.severity for f in optimshift.check(opt).findings] == ["info"]  # (only: offloaded on purpose)
    optimshift.reload(opt)
    assert opt.param_groups[0]["lr"].device == sim and not optimshift.check(opt).findings


@pytest.mark.parametrize("cls, kwargs", FOLLOW, ids=lambda v: getattr(v, "__name__", None) or "-".join(v))
def test_a_group_added_while_offloaded_sharing_the_lr_comes_back_with_it(sim, cls, kwargs):
    """torch's add_param_group fills a new group's lr from the defaults: the very tensor group 0 holds. Added
    while offloaded, reload() put group 0's where it was and the new group's by where it waited (the host), and
    refused the one tensor for two devices: the optimizer stayed offloaded, step() refused."""
    params, opt = _device_lr_optimizer(sim, cls, kwargs)
    extra = torch.nn.Parameter(torch.randn(3, device=sim))
    optimshift.offload(opt)
    opt.add_param_group({"params": [extra]})
    assert opt.param_groups[1]["lr"] is opt.param_groups[0]["lr"]
    assert [f.severity for f in optimshift.check(opt).findings] == ["info"]
    optimshift.reload(opt)
    assert opt.param_groups[1]["lr"] is opt.param_groups[0]["lr"]
    assert opt.param_groups[0]["lr"].device == _fresh_lr_device(sim, cls, kwargs)
    assert not optimshift.check(opt).findings
    _step(opt, [*params, extra], 2)


@pytest.mark.parametrize("cls, kwargs", FOLLOW, ids=lambda v: getattr(v, "__name__", None) or "-".join(v))
def test_a_shared_lr_follows_its_groups_params_that_moved_while_offloaded(sim, cls, kwargs):
    """The same, with group 0's params moved while offloaded: the one lr goes where group 0's goes (its params'
    new device), for the new group too (it went to its recorded device: two places for one tensor)."""
    sim1 = torch.device(sim.type, 1)
    params, opt = _device_lr_optimizer(sim, cls, kwargs)
    optimshift.offload(opt)
    for p in params:
        p.data = p.data.to(sim1)
    extra = torch.nn.Parameter(torch.randn(3, device=sim1))
    opt.add_param_group({"params": [extra]})
    assert [f.severity for f in optimshift.check(opt).findings] == ["info"]
    optimshift.reload(opt)
    assert opt.param_groups[1]["lr"] is opt.param_groups[0]["lr"]
    assert opt.param_groups[0]["lr"].device == _fresh_lr_device(sim1, cls, kwargs) == sim1
    assert not optimshift.check(opt).findings
    _step(opt, [*params, extra], 2)


# --- the sides remembered for group tensors, across offload/reload cycles (the session review's cases) -------


def _with_grads(opt):
    for g in opt.param_groups:
        for p in g["params"]:
            p.grad = torch.ones_like(p)
    return opt


def test_a_device_lr_the_policy_put_on_the_host_stays_there_across_offload_reload(sim):
    """Non-capturable Adam reads lr on the host: move(opt) takes a device lr there and remembers where it came
    from; an offload/reload cycle puts everything back where it was, the lr on the host (it went to the device:
    a sync per step)."""
    a = torch.nn.Parameter(torch.ones(3, device=sim))
    opt = _with_grads(O.Adam([a], lr=torch.tensor(0.01, device=sim), foreach=False))
    opt.step()
    optimshift.move(opt)
    lr = opt.param_groups[0]["lr"]
    assert lr.device.type == "cpu" and not optimshift.check(opt).findings
    optimshift.offload(opt)
    optimshift.reload(opt)
    assert lr.device.type == "cpu" and not optimshift.check(opt).findings


@pytest.mark.parametrize("params_to_host", [False, True])
def test_offload_reload_of_an_optimizer_moved_to_the_host_leaves_its_lr_on_the_host(sim, params_to_host):
    a = torch.nn.Parameter(torch.ones(3, device=sim))
    opt = _with_grads(O.Adam([a], lr=torch.tensor(0.01, device=sim), capturable=True, foreach=True))
    opt.step()
    lr = opt.param_groups[0]["lr"]
    if params_to_host:
        a.grad = None
        torch.nn.ParameterList([a]).to("cpu")
    optimshift.move(opt, "cpu")
    before = [(k, t.device) for k, t in opt.state[a].items()]
    assert lr.device.type == "cpu" and opt.state[a]["exp_avg"].device.type == "cpu"
    optimshift.offload(opt)
    optimshift.reload(opt)
    assert [(k, t.device) for k, t in opt.state[a].items()] == before
    assert lr.device.type == "cpu"


def _device_and_host_lr(sim):
    """Group 0: a device lr (capturable Adam keeps it there); group 1: a lr given on the host."""
    a = torch.nn.Parameter(torch.ones(3, device=sim))
    b = torch.nn.Parameter(torch.ones(2, device=sim))
    groups = [{"params": [a], "lr": torch.tensor(0.01, device=sim)}, {"params": [b], "lr": torch.tensor(0.02)}]
    opt = _with_grads(O.Adam(groups, capturable=True, foreach=True))
    opt.step()
    return a, opt


def test_a_side_remembered_for_a_popped_group_is_not_another_groups(sim):
    """The side an offload remembers for group 0's device lr belongs to that tensor: once the group is popped
    while offloaded, the group now at index 0 (its lr given on the host) keeps its lr on the host, through
    check(), a move and an offload/reload cycle."""
    a, opt = _device_and_host_lr(sim)
    host_lr = opt.param_groups[1]["lr"]
    optimshift.offload(opt)
    opt.param_groups.pop(0)
    del opt.state[a]
    optimshift.reload(opt)
    assert host_lr.device.type == "cpu" and not optimshift.check(opt).findings
    optimshift.offload(opt)
    optimshift.reload(opt)
    assert host_lr.device.type == "cpu"
    optimshift.move(opt, sim)
    assert host_lr.device.type == "cpu" and not optimshift.check(opt).findings


def _device_lrs(sim, devices):
    """One group per device in ``devices``, each with a device lr (capturable Adam keeps it there), one step."""
    params = [torch.nn.Parameter(torch.ones(i + 2, device=d)) for i, d in enumerate(devices)]
    groups = [
        {"params": [p], "lr": torch.tensor(0.01 * (i + 1), device=d)} for i, (p, d) in enumerate(zip(params, devices))
    ]
    opt = _with_grads(O.Adam(groups, capturable=True, foreach=False))
    opt.step()
    return params, opt


@pytest.mark.parametrize("shift", ["pop", "insert"])
@pytest.mark.parametrize("away", ["move", "offload"])
def test_a_side_follows_its_tensor_when_groups_shift(sim, away, shift):
    """A device lr taken to the host, then an earlier group popped (or one inserted before it): the move back
    puts it on the device it came from, wherever its group sits now (the side was looked up by its old index)."""
    sim1 = torch.device(sim.type, 1)
    params, opt = _device_lrs(sim, [sim, sim1] if shift == "pop" else [sim1])
    b = params[-1]
    lr_b = opt.param_groups[-1]["lr"]
    if away == "move":
        optimshift.move(opt, "cpu")
        torch.nn.ParameterList([b]).to(sim1)
    else:
        optimshift.offload(opt)
    if shift == "pop":
        opt.param_groups.pop(0)
        del opt.state[params[0]]
    else:
        c = torch.nn.Parameter(torch.ones(2, device=sim1))
        opt.param_groups.insert(0, {**opt.param_groups[0], "params": [c], "lr": 0.1})
    optimshift.move(opt)
    assert opt.param_groups[-1]["lr"] is lr_b and lr_b.device == sim1
    assert not optimshift.check(opt).findings


def test_a_side_is_forgotten_once_no_group_holds_its_tensor(sim):
    """The session holds the tensor a side was remembered for (its id names it only while it lives), and lets it
    go at the next operation once the user replaced it: a lr given on the host then stays there."""
    import weakref

    from optimshift import _session

    (a,), opt = _device_lrs(sim, [sim])
    optimshift.move(opt, "cpu")
    taken = weakref.ref(opt.param_groups[0]["lr"])
    opt.param_groups[0]["lr"] = torch.tensor(0.02)  # given on the host: a fresh optimizer keeps it there
    torch.nn.ParameterList([a]).to(sim)
    optimshift.move(opt)
    assert opt.param_groups[0]["lr"].device.type == "cpu" and not optimshift.check(opt).findings
    assert taken() is None and not _session.get(opt).group_sides


@pytest.mark.parametrize("back", ["reload", "reload-to", "move"])
def test_a_host_lr_given_while_offloaded_stays_on_the_host_on_every_way_back(sim, back):
    """A new lr given on the host while offloaded (the one the offload took is gone): every way back leaves it
    where it was given (reload() put it on the device the record names for that site)."""
    (a,), opt = _device_lrs(sim, [sim])
    optimshift.offload(opt)
    opt.param_groups[0]["lr"] = torch.tensor(0.005)
    {
        "reload": lambda: optimshift.reload(opt),
        "reload-to": lambda: optimshift.reload(opt, sim),
        "move": lambda: optimshift.move(opt),
    }[back]()
    assert opt.param_groups[0]["lr"].device.type == "cpu" and not optimshift.check(opt).findings
    assert opt.state[a]["exp_avg"].device == sim


@pytest.mark.parametrize("back", ["reload", "move"])
def test_lrs_swapped_between_groups_while_offloaded_go_back_to_their_sides(sim, back):
    """The offload took group 0's device lr; group 1's was given on the host; the two are swapped while offloaded.
    Every way back puts the taken one on the device (the offload record keeps it by the tensor, whatever site it
    sits at: reload() kept it on the host by the record of its new site) and the given one on the host."""
    a, opt = _device_and_host_lr(sim)
    optimshift.offload(opt)
    g0, g1 = opt.param_groups
    taken, given = g0["lr"], g1["lr"]
    g0["lr"], g1["lr"] = given, taken
    getattr(optimshift, back)(opt)
    assert given.device.type == "cpu" and taken.device == sim and not optimshift.check(opt).findings


def test_a_taken_lr_given_to_another_group_while_offloaded_reloads(sim):
    """Group 1 (its lr given on the host) is given group 0's device lr while offloaded: one tensor for both, which
    the reload puts where the offload took it from (it refused it as bound for the device and the host, and so did
    check(); the optimizer stayed offloaded)."""
    a, opt = _device_and_host_lr(sim)
    optimshift.offload(opt)
    opt.param_groups[1]["lr"] = opt.param_groups[0]["lr"]
    assert optimshift.check(opt) is not None
    optimshift.reload(opt)
    assert not optimshift.is_offloaded(opt) and opt.param_groups[1]["lr"].device == sim
    assert not optimshift.check(opt).findings


def test_a_device_lr_given_while_offloaded_stays_on_the_device_on_reload(sim):
    """The offload took a host lr (its record: the host); a new lr given on the device while offloaded stays
    there on reload() (it went to the host by its site's record, and check() then called it an error)."""
    a = torch.nn.Parameter(torch.ones(3, device=sim))
    opt = _with_grads(O.Adam([a], lr=torch.tensor(0.01), capturable=True, foreach=False))
    opt.step()
    optimshift.offload(opt)
    opt.param_groups[0]["lr"] = given = torch.tensor(0.005, device=sim)
    optimshift.reload(opt)
    assert given.device == sim and not optimshift.check(opt).findings


class _Ema(O.SGD):
    """An optimizer-wide ``state["ema"] = {param: tensor}``, each made on its param's device."""

    def __init__(self, params):
        super().__init__(params, lr=0.1)

    @torch.no_grad()
    def step(self, closure=None):
        super().step()
        params = [p for g in self.param_groups for p in g["params"]]
        if "ema" not in self.state:
            self.state["ema"] = {p: p.detach().clone() for p in params}
        for p in params:
            self.state["ema"][p].lerp_(p, 0.1)


def test_reload_puts_an_optimizer_wide_device_entry_back_where_it_was(sim):
    """An optimizer-wide entry on the second device is no group tensor: the reload puts it back where it was
    (a rule for group tensors given while offloaded once took it to the first group's device)."""
    sim1 = torch.device(sim.type, 1)
    params = [torch.nn.Parameter(torch.ones(3, device=sim)), torch.nn.Parameter(torch.ones(3, device=sim1))]
    opt = _with_grads(_Ema(params))
    opt.step()
    optimshift.offload(opt)
    optimshift.reload(opt)
    assert [t.device for t in opt.state["ema"].values()] == [sim, sim1]
    opt.step()


def test_stream_lets_go_of_a_replaced_lr_whose_side_was_remembered(sim):
    """A device lr a move took to the host, then replaced by a float: stream() lets the session's hold on it go
    (it kept it alive through every streamed step, until unstream())."""
    import gc
    import weakref

    a = torch.nn.Parameter(torch.ones(3, device=sim))
    opt = _with_grads(O.Adam([{"params": [a], "lr": torch.tensor(0.01, device=sim)}], capturable=True))
    opt.step()
    optimshift.move(opt, "cpu")
    taken = weakref.ref(opt.param_groups[0]["lr"])
    opt.param_groups[0]["lr"] = 0.01
    torch.nn.ParameterList([a]).to(sim)
    optimshift.stream(opt)
    try:
        gc.collect()
        assert taken() is None
    finally:
        optimshift.unstream(opt)


def test_a_host_lr_given_at_a_taken_site_stays_on_the_host_after_a_second_offload(sim):
    """The first offload took group 0's device lr; a lr given on the host at that site meanwhile; a second offload
    takes nothing from a device there, and the reload leaves the given lr on the host (it was recorded as taken,
    by the site's first offload)."""
    a, opt = _device_and_host_lr(sim)
    optimshift.offload(opt)
    opt.param_groups[0]["lr"] = given = torch.tensor(0.03)
    optimshift.offload(opt)
    optimshift.reload(opt)
    assert given.device.type == "cpu" and not optimshift.check(opt).findings


def test_a_device_lr_given_at_a_host_site_goes_back_after_a_second_offload(sim):
    """A device lr given meanwhile at a site whose first offload found a host lr: the second offload takes it from
    the device, and the reload puts it back there (it stayed on the host, which check() called an error)."""
    a, opt = _device_and_host_lr(sim)
    optimshift.offload(opt)
    opt.param_groups[1]["lr"] = given = torch.tensor(0.03, device=sim)
    optimshift.offload(opt)
    optimshift.reload(opt)
    assert given.device == sim and not optimshift.check(opt).findings


@pytest.mark.parametrize("moved", [0, 1])
def test_reload_refuses_a_taken_lr_shared_by_groups_whose_params_moved_apart(sim, moved):
    """One device lr two groups share (add_param_group), one group's params moved to the second device while
    offloaded: the reload refuses the one tensor for two devices before anything changes, as move() and check()
    do (it put the lr with the last group and the next step mixed devices)."""
    sim1 = torch.device(sim.type, 1)
    a = torch.nn.Parameter(torch.ones(3, device=sim))
    b = torch.nn.Parameter(torch.ones(2, device=sim))
    opt = O.Adam([a], lr=torch.tensor(0.01, device=sim), capturable=True, foreach=False)
    opt.add_param_group({"params": [b]})
    _with_grads(opt).step()
    optimshift.offload(opt)
    torch.nn.ParameterList([(a, b)[moved]]).to(sim1)
    with pytest.raises(ValueError, match="cannot be placed for both"):
        optimshift.reload(opt)
    assert optimshift.is_offloaded(opt)


@pytest.mark.parametrize("how", ["add_param_group", "given"])
def test_a_reload_after_a_move_to_the_host_and_a_group_given_its_lr_meanwhile(sim, how):
    """move(opt, 'cpu') took the device lr to the host; an offload found it there; a group added (the same tensor
    lr, from the defaults) or given that lr while offloaded: the reload keeps the one tensor on the host with the
    state (it sent the new site by the remembered side and refused one tensor for two devices), and a move then
    brings it all to the device."""
    a = torch.nn.Parameter(torch.ones(3, device=sim))
    if how == "given":
        b = torch.nn.Parameter(torch.ones(2, device=sim))
        groups = [{"params": [b], "lr": 0.01}, {"params": [a], "lr": torch.tensor(0.02, device=sim)}]
        opt = _with_grads(O.Adam(groups, capturable=True))
    else:
        opt = _with_grads(O.Adam([a], lr=torch.tensor(0.02, device=sim), capturable=True))
    opt.step()
    optimshift.move(opt, "cpu")
    optimshift.offload(opt)
    if how == "given":
        opt.param_groups[0]["lr"] = opt.param_groups[1]["lr"]
    else:
        opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(4, device=sim))]})
    optimshift.reload(opt)
    assert not optimshift.is_offloaded(opt) and {g["lr"].device.type for g in opt.param_groups} == {"cpu"}
    optimshift.move(opt)
    assert {g["lr"].device for g in opt.param_groups} == {sim} and optimshift.check(opt).ok


@pytest.mark.parametrize("back", ["reload", "move"])
def test_lrs_swapped_between_groups_on_two_devices_go_to_their_groups_devices(sim, back):
    """Both lrs taken by the offload, swapped between groups whose params are on different devices: each goes to
    its new group's device, as a fresh optimizer given it there keeps it (reload() put each on the device it was
    taken from, the other group's, and the next step mixed devices)."""
    sim1 = torch.device(sim.type, 1)
    (a, b), opt = _device_lrs(sim, [sim, sim1])
    optimshift.offload(opt)
    g0, g1 = opt.param_groups
    g0["lr"], g1["lr"] = g1["lr"], g0["lr"]
    getattr(optimshift, back)(opt)
    assert [g["lr"].device for g in opt.param_groups] == [sim, sim1]
    _with_grads(opt).step()


@pytest.mark.parametrize("capturable", [False, True], ids=["switched-on", "switched-off"])
def test_a_groups_tensors_go_where_its_flags_switched_while_offloaded_keep_them(sim, capturable):
    """A device lr, capturable switched while offloaded: the reload places it as a fresh optimizer with the new flag
    keeps a lr given on the device (non-capturable Adam reads it on the host, capturable on the device), as it
    places the param's state (it put the lr back where it was, and check() called it misplaced)."""
    a = torch.nn.Parameter(torch.ones(3, device=sim))
    opt = _with_grads(O.Adam([a], lr=torch.tensor(0.01, device=sim), capturable=capturable, foreach=False))
    opt.step()
    optimshift.move(opt)  # (non-capturable: the lr to the host, its side remembered)
    lr = opt.param_groups[0]["lr"]
    optimshift.offload(opt)
    opt.param_groups[0]["capturable"] = not capturable
    optimshift.reload(opt)
    assert lr.device.type == ("cpu" if capturable else sim.type) and not optimshift.check(opt).findings
    _with_grads(opt).step()
    optimshift.move(opt)
    assert lr.device.type == ("cpu" if capturable else sim.type)


def test_a_lr_a_move_took_to_the_host_goes_to_the_device_with_params_brought_back_while_offloaded(sim):
    """move(opt, 'cpu') with the model took the device lr to the host; the offload found it there; the model came
    back while offloaded: the reload puts the lr on the device, by the side the session remembers, as move() does
    (it kept it on the host, by its site's record, and check() called it misplaced)."""
    a = torch.nn.Parameter(torch.ones(3, device=sim))
    opt = _with_grads(O.Adam([a], lr=torch.tensor(0.01, device=sim), capturable=True, foreach=False))
    opt.step()
    torch.nn.ParameterList([a]).to("cpu")
    optimshift.move(opt, "cpu")
    optimshift.offload(opt)
    torch.nn.ParameterList([a]).to(sim)
    optimshift.reload(opt)
    assert opt.param_groups[0]["lr"].device == sim and not optimshift.check(opt).findings
    _with_grads(opt).step()


@pytest.mark.parametrize("kind", [tuple, list])
@pytest.mark.parametrize("fresh", [True, False], ids=["fresh", "existing"])
def test_a_load_keeps_each_tensor_of_tensor_betas_as_it_keeps_a_tensor_lr(sim, kind, fresh):
    """A group's tensor lr keeps its object across a load (the live one adopts the loaded value: a captured or
    compiled step that reads it stays valid); each tensor of its tensor betas was a new object, in a new tuple.
    Now each live one adopts its loaded value too, placed as the load places it, in the container's kind."""

    def adam(beta1: float) -> tuple[list[torch.nn.Parameter], torch.optim.Optimizer]:
        params = [torch.nn.Parameter(torch.randn(3, device=sim)) for _ in range(2)]
        betas = (torch.tensor(beta1, device=sim), torch.tensor(0.999, device=sim))
        opt = torch.optim.Adam(params, lr=torch.tensor(0.01, device=sim), betas=betas, capturable=True, foreach=True)
        opt.param_groups[0]["betas"] = kind(betas)  # (Adam makes them a tuple; a user may set a list)
        if not fresh:
            for p in params:
                p.grad = torch.ones_like(p)
            opt.step()
        return params, opt

    _, saved_from = adam(0.8)
    for p in saved_from.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    saved_from.step()
    saved = copy.deepcopy(saved_from.state_dict())
    _, opt = adam(0.5)
    live = list(opt.param_groups[0]["betas"])
    optimshift.load_state_dict(opt, saved)
    betas = opt.param_groups[0]["betas"]
    assert type(betas) is kind and all(b is old for b, old in zip(betas, live))
    assert [float(b.cpu()) for b in betas] == [float(b.cpu()) for b in saved["param_groups"][0]["betas"]]
    assert optimshift.check(opt).ok
    for p in opt.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    opt.step()


def test_a_loaded_tensor_betas_holding_one_tensor_twice_stays_one_tensor(sim):
    """A checkpoint's betas holding one tensor twice load as one copy: two live tensors both took it (the second
    took what the first left, the live beta1, as its beta2). Now neither does, the copy is installed in both."""
    params = [torch.nn.Parameter(torch.randn(3, device=sim))]
    saved_beta = torch.tensor(0.8, device=sim)
    saved_from = torch.optim.Adam(params, betas=(saved_beta, saved_beta), capturable=True, foreach=True)
    saved = copy.deepcopy(saved_from.state_dict())
    betas = (torch.tensor(0.5, device=sim), torch.tensor(0.999, device=sim))
    opt = torch.optim.Adam(params, betas=betas, capturable=True, foreach=True)
    optimshift.load_state_dict(opt, saved)
    loaded = opt.param_groups[0]["betas"]
    assert loaded[0] is loaded[1] and float(loaded[1].cpu()) == float(saved_beta.cpu())
    assert float(betas[1].cpu()) == pytest.approx(0.999) and optimshift.check(opt).ok


def test_placing_a_group_s_tensors_walks_its_params_once_not_once_per_tensor(sim):
    """A group's own tensors are placed for its params' device (the host where they span several): each group
    tensor walked every param twice (``params_device``, and the probe's lookup of the first param's rank), so a
    plan over 10k params and a tensor ``lr`` and ``betas`` cost three walks of them. One walk per operation now."""

    class Walked(list):
        seen = 0

        def __iter__(self):
            for p in super().__iter__():
                Walked.seen += 1
                yield p

    def seen_by_a_move(**kwargs):
        params = [torch.nn.Parameter(torch.randn(4, device=sim)) for _ in range(50)]
        opt = O.Adam(params, lr=torch.tensor(0.01), foreach=False, **kwargs)
        opt.param_groups[0]["params"] = Walked(opt.param_groups[0]["params"])
        Walked.seen = 0
        optimshift.move(opt)
        assert all(t.is_cpu for t in (opt.param_groups[0]["lr"], *opt.param_groups[0]["betas"]) if torch.is_tensor(t))
        return Walked.seen

    assert seen_by_a_move(betas=(torch.tensor(0.9), torch.tensor(0.99))) - seen_by_a_move() < 50


@pytest.mark.parametrize("road", ["a param moved while offloaded", "offloaded as it was"])
def test_a_reload_puts_the_lr_of_a_group_over_two_devices_where_a_move_does(sim, road):
    """A group's params on sim:0 and sim:1, its tensor ``lr`` on sim:0: a step raises mixing devices, and a move
    (and check) put the lr on the host, where it serves both. A reload placed it by the group's first param
    (``group_device``), back on sim:0: the roads disagreed, and the next step raised."""
    sim1 = torch.device(sim.type, 1)
    params = _params(sim)
    opt = O.RAdam(params, lr=torch.tensor(0.01, device=sim))
    if road == "offloaded as it was":
        params[1].data = params[1].data.to(sim1)  # (no step before: it raises mixing devices)
    else:
        _step(opt, params, 0)
    lr = opt.param_groups[0]["lr"]
    optimshift.offload(opt)
    if road == "a param moved while offloaded":
        params[1].data = params[1].data.to(sim1)
    optimshift.reload(opt)
    assert opt.param_groups[0]["lr"] is lr and lr.device.type == "cpu" and optimshift.check(opt).ok
    _step(opt, params, 1)


def test_a_rebind_onto_params_over_two_devices_puts_a_device_lr_where_a_move_does(sim):
    """A rebind onto new params on the host and the sim placed the group's tensor ``lr`` by the first new param's
    device alone (the sim): the next step raised mixing devices, and check() said so. A move puts it on the host,
    where it serves both; a rebind does too."""
    opt = O.RAdam(_params(sim), lr=torch.tensor(0.01, device=sim))
    lr = opt.param_groups[0]["lr"]
    new = [torch.nn.Parameter(torch.randn(3, 2, device=sim)), torch.nn.Parameter(torch.randn(3))]
    optimshift.rebind(opt, new)
    assert opt.param_groups[0]["lr"] is lr and lr.device.type == "cpu" and optimshift.check(opt).ok
    _step(opt, new, 0)


@pytest.mark.parametrize("kwargs", [{"foreach": False}, {"foreach": True}, {"capturable": True, "foreach": False}])
@pytest.mark.parametrize("lr_shape", [(), (1,)], ids=["0-dim", "one-element"])
def test_check_does_not_say_rprop_reads_its_lr_each_step(sim, kwargs, lr_shape):
    """Rprop reads its lr only where it makes a param's state (``step_size``): on the device that costs a sync per
    param in its first step and none after. check() said it read it on the host "each step" (with 0 syncs per step
    beside it, capturable; or as a state scalar's warning, or 'a fresh Rprop keeps it on cpu', where the probe
    could not count the reads)."""
    params = _params(sim)
    opt = O.Rprop(params, lr=torch.full(lr_shape, 0.01, device=sim), **kwargs)
    assert _step(opt, params, 0) > 0 and _step(opt, params, 1) == _step(opt, params, 2) == 0
    (finding,) = optimshift.check(opt).findings
    assert (finding.key, finding.expected) == ("lr", "cpu") and finding.syncs_per_step in (0, None)
    assert "each step" not in finding.why and "Rprop reads this on the host" in finding.why


def test_check_does_not_say_a_group_of_no_params_reads_its_lr_where_it_makes_state(sim):
    """A device lr given to the constructor is shared by every group, one of them empty (a no-decay group with no
    param): its cost there is 0, and check() said SGD reads it "where it makes a param's state" (Rprop's wording)."""
    params = _params(sim)
    opt = O.SGD([{"params": []}, {"params": params}], lr=torch.tensor(0.01, device=sim))
    assert _step(opt, params, 0) == _step(opt, params, 1) == 1
    empty, used = optimshift.check(opt).findings
    assert (empty.param, empty.syncs_per_step, used.param, used.syncs_per_step) == ("group 0", 0, "group 1", 1)
    assert "param's state" not in empty.why and "SGD reads this on the host:" in empty.why
    assert "SGD reads this on the host each step" in used.why


def test_a_group_tensor_the_step_refuses_on_the_host_stays_on_the_device(sim):
    """Adafactor's one-element beta2_decay steps on the device (with the params) and raises on the host. The probe
    counted the device reads of a step that ran further than the host one, which had failed: check() said it
    belongs on the host, and move() put it there, after which step() raised."""
    params = _params(sim)
    beta2_decay = torch.full((1,), -0.8, device=sim)
    opt = O.Adafactor(params, beta2_decay=beta2_decay, foreach=False)
    _step(opt, params, 0)
    assert not optimshift.check(opt).findings
    optimshift.move(opt)
    assert opt.param_groups[0]["beta2_decay"] is beta2_decay and beta2_decay.device == sim
    _step(opt, params, 1)


@pytest.mark.parametrize(
    "cls, kwargs, given, where",
    [
        (O.NAdam, {"momentum_decay": "0d"}, "sim", "sim:0 (a probe step did; on cpu it runs)"),
        (O.NAdam, {"betas": "0d"}, "sim", "sim:0 (a probe step did; on cpu it runs)"),
        (O.Adafactor, {"beta2_decay": "1"}, "cpu", "cpu (a probe step did; on sim:0 it runs)"),
        (O.Adadelta, {"rho": "1"}, "sim", "either device"),
        (O.RMSprop, {"alpha": "1"}, "sim", "either device"),
    ],
    ids=["NAdam-momentum_decay", "NAdam-betas", "Adafactor-beta2_decay", "Adadelta-rho", "RMSprop-alpha"],
)
def test_check_calls_a_group_tensor_the_step_raises_with_an_error(sim, cls, kwargs, given, where):
    """NAdam's single-tensor step raises with a 0-dim device momentum_decay or betas[0] and runs with it on the host:
    check() called it a sync per read (a warning) though its probe had seen the step raise; it is an error, as on
    the host a one-element beta2_decay the step takes only on the device is, and a (1,) rho or alpha no step takes."""
    device = sim if given == "sim" else torch.device("cpu")
    key, kind = next(iter(kwargs.items()))
    value = torch.full(() if kind == "0d" else (1,), -0.8 if key == "beta2_decay" else 0.9, device=device)
    params = _params(sim)
    opt = cls(params, **{key: (value, 0.999) if key == "betas" else value}, foreach=False)
    (finding,) = optimshift.check(opt).findings
    assert (finding.severity, finding.why) == ("error", f"{cls.__name__}'s step() raises with it on {where}")
    with pytest.raises((RuntimeError, TypeError)):  # (the finding is right: here step() raises)
        _step(opt, params, 0)


def test_check_does_not_call_a_group_tensor_a_cpu_only_build_cannot_probe_an_error(sim):
    """Fused AdamW's probe with a device weight_decay fails in a CPU-only build's missing CUDA backend: no refusal
    of the class (on the device its step runs, reading it on the host), so its finding stays a sync warning."""
    params = _params(sim)
    opt = O.AdamW(params, weight_decay=torch.tensor(0.01, device=sim), fused=True)
    _step(opt, params, 0)
    (finding,) = optimshift.check(opt).findings
    assert finding.severity == "warning" and "reads this on the host" in finding.why


class _OnLrsStream(torch.optim.Optimizer):
    """Plain SGD that asks ``torch.cuda`` for a CUDA ``lr``'s stream first (on any other device it does not)."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            lr = group["lr"]
            if isinstance(lr, torch.Tensor) and lr.is_cuda:
                torch.cuda.current_stream(lr.device)
            for p in group["params"]:
                if p.grad is not None:
                    p.sub_(p.grad * lr)


def test_check_does_not_call_a_torch_cuda_call_a_cpu_only_build_refuses_in_the_probe_an_error(sim):
    """The probe's step over a fake cuda:0 lr reaches torch.cuda, which a CPU-only build refuses ('Torch not compiled
    with CUDA enabled'): the build's refusal, not the class's, whose step runs with the tensor on the device."""
    params = _params(sim)
    opt = _OnLrsStream(params, lr=torch.tensor(0.1, device=sim))
    assert not [f.why for f in optimshift.check(opt).findings if f.severity == "error"]
    _step(opt, params, 0)


@pytest.mark.parametrize("road", ["move", "offload-reload", "host-and-back", "trained on the host"])
@pytest.mark.parametrize(
    "cls, flags, key",
    [
        (O.AdamW, {"foreach": False}, "weight_decay"),  # (its decay, behind a truth read the probe answered false)
        (O.Adafactor, {"foreach": False}, "weight_decay"),
        (O.LBFGS, {}, "tolerance_grad"),  # (the probe's device step stops at a CPU-only build's missing backend)
        (O.LBFGS, {}, "tolerance_change"),
        (O.Adafactor, {"foreach": True}, "d"),  # (a foreach op, which fake tensors do not check for devices)
        (O.Adafactor, {"foreach": True}, "beta2_decay"),
    ],
)
def test_a_one_element_group_tensor_the_step_takes_only_on_the_device_stays_there(sim, cls, flags, key, road):
    """A (1,) device hyperparameter these steps compute with beside the params runs on the device (reading it there)
    and raises on the host: the probe saw its device reads but not the host step raise, so move() and reload took it
    to the host (or left it there after the params moved), where step() raised, and check() found nothing."""
    value = {"weight_decay": 0.01, "tolerance_grad": 1e-7, "tolerance_change": 1e-9, "d": 1.0, "beta2_decay": -0.8}[key]
    params = _params("cpu" if road == "trained on the host" else sim)
    tensor = torch.full((1,), value, device=params[0].device)
    opt = cls(params, **{key: tensor}, **flags)
    step = (lambda k: _lbfgs_step(opt, params)) if cls is O.LBFGS else (lambda k: _step(opt, params, k))
    step(0)
    if road == "move":
        optimshift.move(opt)
    elif road == "offload-reload":
        optimshift.reload(optimshift.offload(opt))
    elif road == "host-and-back":
        optimshift.move(optimshift.move(opt, "cpu"), sim)
    else:
        _to(params, sim)
        optimshift.move(opt)
    assert opt.param_groups[0][key] is tensor and tensor.device == sim
    step(1)
    assert not optimshift.check(opt).findings


def test_one_element_betas_the_step_takes_only_together_on_the_device_go_there(sim):
    """Adamax's capturable single-tensor step raises with either (1,) beta on the host and runs with both on the
    device: the probe, moving one at a time, saw each refused either way and gave no verdict, so move() left betas
    given on the host there (step() raised) and check() found nothing. Both go to the device, and check() says why."""
    params = _params(sim)
    betas = (torch.full((1,), 0.9), torch.full((1,), 0.999))
    opt = O.Adamax(params, betas=betas, foreach=False, capturable=True)
    assert [f.severity for f in optimshift.check(opt).findings] == ["error", "error"]
    with pytest.raises(RuntimeError, match="same device"):  # (the findings are right: here step() raises)
        _step(opt, params, 0)
    optimshift.move(opt)
    assert all(b.device == sim for b in opt.param_groups[0]["betas"])
    _step(opt, params, 1)
    assert not optimshift.check(opt).findings


def test_a_0_dim_tensor_read_after_where_the_host_step_refuses_a_one_element_one_is_still_judged(sim):
    """foreach Adafactor's host step stops at a (1,) ``beta2_decay`` on the host (NEEDS_DEVICE), before it reads
    ``d``: the others' reads are compared with it on the device, so a 0-dim ``d`` on sim still goes to the host."""
    params = _params(sim)
    beta2_decay = torch.full((1,), -0.8, device=sim)
    opt = O.Adafactor(params, foreach=True, beta2_decay=beta2_decay, d=torch.tensor(1.0, device=sim))
    _step(opt, params, 0)
    assert [(f.key, f.expected) for f in optimshift.check(opt).findings] == [("d", "cpu")]
    optimshift.move(opt)
    assert opt.param_groups[0]["d"].device.type == "cpu" and opt.param_groups[0]["beta2_decay"] is beta2_decay
    _step(opt, params, 1)
    assert not optimshift.check(opt).findings


@pytest.mark.parametrize(
    "cls, kwargs, key",
    [
        (O.Adam, {"foreach": True, "eps": "1"}, "eps"),  # (a foreach op takes a 0-dim scalar tensor only)
        (O.Adam, {"fused": True, "eps": "1"}, "eps"),  # (the fused kernel takes a number)
        (O.AdamW, {"foreach": True, "weight_decay": "1"}, "weight_decay"),  # (behind `if weight_decay != 0`)
        (O.Adamax, {"foreach": False, "betas": "1"}, "betas"),  # (betas[1] raises first on the host)
        (O.NAdam, {"foreach": True, "betas": "0d"}, "betas"),
    ],
    ids=["Adam-foreach-eps", "Adam-fused-eps", "AdamW-foreach-weight_decay", "Adamax-betas", "NAdam-foreach-betas"],
)
@pytest.mark.parametrize("given", ["cpu", "sim"])
def test_a_group_tensor_the_step_raises_with_on_either_device_is_known(sim, cls, kwargs, key, given):
    """A (1,) eps, weight_decay or beta, or foreach NAdam's 0-dim betas, raises the step wherever it is (its kind,
    not its side): the probe's steps raised alike with it on the host and on the device, so it said nothing
    (policy.group_raises empty) and check() was silent. Now it says either device; here step() raises."""
    device = sim if given == "sim" else torch.device("cpu")
    flags = {k: v for k, v in kwargs.items() if k != key}
    shape = () if kwargs[key] == "0d" else (1,)
    value = {"eps": 1e-8, "weight_decay": 0.01}.get(key)
    given_value = (
        tuple(torch.full(shape, b, device=device) for b in (0.9, 0.999))
        if key == "betas"
        else torch.full(shape, value, device=device)
    )
    params = _params(sim)
    opt = cls(params, **{key: given_value}, **flags)
    group = opt.param_groups[0]
    tensors = group[key] if key == "betas" else (group[key],)
    found = [optimshift.policy.group_raises(cls, group, key, t) for t in tensors]
    assert {"host", "device"} in found
    assert "either device" in " ".join(f.why for f in optimshift.check(opt).findings if f.severity == "error")
    with pytest.raises((RuntimeError, TypeError)):  # (it is right: here step() raises)
        _step(opt, params, 0)


@pytest.mark.parametrize(
    "cls, key", [(O.AdamW, "weight_decay"), (O.Adam, "weight_decay"), (O.SGD, "weight_decay"), (O.RMSprop, "momentum")]
)
@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("given", ["cpu", "sim"])
def test_a_one_element_zero_behind_a_branch_it_skips_is_no_error(sim, cls, key, foreach, given):
    """A ``(1,)`` weight_decay (momentum) of 0: the step's ``if weight_decay != 0`` skips the branch that raises with
    a nonzero one, and the step runs. check() called it an error (the probe asks that branch with truth reads true,
    by the tensor's kind, not its value); it is read now, and 0.01 on the host still is one."""
    device = sim if given == "sim" else torch.device("cpu")
    for value, raises in ((0.0, False), (0.01, True))[: 2 if given == "cpu" else 1]:
        params = _params(sim)
        opt = cls(params, **{key: torch.full((1,), value, device=device)}, foreach=foreach)
        errors = [f.why for f in optimshift.check(opt).findings if f.severity == "error"]
        assert bool(errors) == raises, (value, errors)
        if raises:
            with pytest.raises((RuntimeError, TypeError)):
                _step(opt, params, 0)
        else:
            _step(opt, params, 0)


@pytest.mark.parametrize("given", ["cpu", "sim"])
def test_a_raise_of_the_probe_s_contradicting_truth_reads_is_no_error(sim, given):
    """Fused SGD's ``momentum == 0`` and its group's ``momentum != 0``, both read false by the probe, disagree: an
    IndexError on either side, which check() called an error of a 0-dim tensor momentum, though the step runs. A raise
    is the tensor's now only where it holds with truth reads true as well."""
    device = sim if given == "sim" else torch.device("cpu")
    params = _params(sim)
    opt = O.SGD(params, momentum=torch.tensor(0.9, device=device), fused=True)
    group = opt.param_groups[0]
    assert not optimshift.policy.group_raises(O.SGD, group, "momentum", group["momentum"])
    assert not [f.why for f in optimshift.check(opt).findings if f.severity == "error"]
    _step(opt, params, 0)
    _step(opt, params, 1)


class _DecayUnlessZero(torch.optim.Optimizer):
    """A third-party SGD that skips its weight decay by ``if weight_decay == 0`` (not ``!= 0``, as Adamax's foreach
    step reads it too): the branch a nonzero value takes is the one the probe's false truth reads take."""

    def __init__(self, params, lr=0.1, weight_decay=0.0):
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                wd = group["weight_decay"]
                p.add_(p.grad if wd == 0 else p.grad.add(p, alpha=wd), alpha=-group["lr"])


@pytest.mark.parametrize("given", ["cpu", "sim"])
def test_a_raise_a_nonzero_one_element_value_takes_is_an_error(sim, given):
    """A ``(1,)`` weight_decay of 0.01 under ``if weight_decay == 0``: the step's else branch raises (alpha takes no
    tensor) on either device. The probe sees that raise with truth reads false only, which a confirmation with them
    true (meant for fused SGD's 0-dim momentum) dropped: check() said nothing."""
    device = sim if given == "sim" else torch.device("cpu")
    params = _params(sim)
    opt = _DecayUnlessZero(params, weight_decay=torch.full((1,), 0.01, device=device))
    assert [f.key for f in optimshift.check(opt).findings if f.severity == "error"] == ["weight_decay"]
    with pytest.raises(TypeError):
        _step(opt, params, 0)


@pytest.mark.parametrize("cls", [O.Adam, O.NAdam, O.RMSprop])
def test_a_0_dim_eps_a_fake_step_cannot_read_is_no_error(sim, cls):
    """A foreach step reads a 0-dim eps as a number in C++, which a fake tensor cannot answer (the probe's steps
    stop there on either side alike): no refusal of the class, whose step runs with it."""
    params = _params(sim)
    opt = cls(params, eps=torch.tensor(1e-8), foreach=True)
    group = opt.param_groups[0]
    assert not optimshift.policy.group_raises(cls, group, "eps", group["eps"])
    _step(opt, params, 0)


@pytest.mark.parametrize("key", ["weight_decay", "lambd", "alpha"])
@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("given", ["cpu", "sim"])
def test_an_asgd_one_element_hyperparameter_the_step_raises_with_is_an_error(sim, key, foreach, given):
    """ASGD makes ``eta`` with ``torch.as_tensor(lr, device=p.device)``, which the probe's fake step could not run
    in a CPU-only build (a constant lifted onto the fake device): every probe step failed there alike, so check() said
    nothing of a ``(1,)`` weight_decay, lambd or alpha, with which step() raises on either device."""
    device = sim if given == "sim" else torch.device("cpu")
    params = _params(sim)
    opt = O.ASGD(params, **{key: torch.full((1,), 0.5, device=device)}, foreach=foreach)
    errors = [(f.key, f.why) for f in optimshift.check(opt).findings if f.severity == "error"]
    assert errors == [(key, "ASGD's step() raises with it on either device")]
    with pytest.raises((RuntimeError, TypeError)):  # (it is right: here step() raises)
        _step(opt, params, 0)


@pytest.mark.parametrize("foreach", [False, True, None], ids=["single", "foreach", "default"])
@pytest.mark.parametrize("given", ["cpu", "sim"])
def test_a_one_element_sgd_momentum_first_computed_with_in_a_second_step_is_judged(sim, foreach, given):
    """SGD's first step clones the grad into its momentum buffer; only the next computes with ``momentum``. A (1,) one
    on the host raises there (beside the device buffer; a foreach op takes no (1,) scalar on either device), which the
    probe's one step never saw: check() said nothing, or that it belongs on the host, where move() took it."""
    device = sim if given == "sim" else torch.device("cpu")
    params = _params(sim)
    momentum = torch.full((1,), 0.9, device=device)
    opt = O.SGD(params, momentum=momentum, foreach=foreach)
    errors = [(f.key, f.why) for f in optimshift.check(opt).findings if f.severity == "error"]
    if foreach is False:  # (the single-tensor step runs with it on the device, reading it there)
        assert errors == (
            []
            if given == "sim"
            else [("momentum", "SGD's step() raises with it on cpu (a probe step did; on sim:0 it runs)")]
        )
        optimshift.move(opt)
        assert opt.param_groups[0]["momentum"] is momentum and momentum.device == sim
        _step(opt, params, 0)
        _step(opt, params, 1)
        assert not optimshift.check(opt).findings
        return
    assert errors == [("momentum", "SGD's step() raises with it on either device")]
    _step(opt, params, 0)
    with pytest.raises(RuntimeError, match="0 dim"):  # (it is right: here the second step raises)
        _step(opt, params, 1)


@pytest.mark.parametrize("given", ["cpu", "sim"])
def test_a_0_dim_beta2_of_radam_s_capturable_foreach_step_is_an_error_on_either_device(sim, given):
    """RAdam's capturable foreach step hands ``_foreach_addcmul_`` ``1 - beta2``, a 0-dim tensor it takes on neither
    device. The probe's fake step stopped before, where a fake ``_foreach_add_`` reads its 0-dim ``rho_inf`` (a real
    kernel takes it as a tensor): check() said nothing, or only that beta2 on the device costs syncs."""
    device = sim if given == "sim" else torch.device("cpu")
    params = _params(sim)
    betas = (torch.tensor(0.9, device=device), torch.tensor(0.999, device=device))
    opt = O.RAdam(params, betas=betas, foreach=True, capturable=True)
    errors = [(f.key, f.why) for f in optimshift.check(opt).findings if f.severity == "error"]
    assert errors == [("betas[1]", "RAdam's step() raises with it on either device")]
    with pytest.raises(RuntimeError, match="scalar"):  # (it is right: here step() raises)
        _step(opt, params, 0)


@pytest.mark.parametrize("foreach", [False, True], ids=["single", "foreach"])
@pytest.mark.parametrize("given", ["cpu", "sim"])
@pytest.mark.parametrize("path", [("etas", 0), ("etas", 1), ("step_sizes", 0), ("step_sizes", 1)], ids=str)
def test_rprop_s_one_element_etas_and_step_sizes_are_judged_past_its_masked_fills(sim, foreach, given, path):
    """Non-capturable Rprop fills its signs by a mask (``sign[sign.gt(0)] = etaplus``), which fake tensors cannot
    run: the probe's steps stopped there, before ``clamp_`` refuses a ``(1,)`` step size on either side and
    ``sign.eq(etaminus)`` a ``(1,)`` etaminus on the host: check() said nothing, and move() left that one there."""
    key, index = path
    device = sim if given == "sim" else torch.device("cpu")
    params = _params(sim)
    value = list(O.Rprop([torch.zeros(1)]).defaults[key])
    value[index] = torch.full((1,), float(value[index]), device=device)
    opt = O.Rprop(params, **{key: tuple(value)}, foreach=foreach)
    errors = [(f.key, f.why) for f in optimshift.check(opt).findings if f.severity == "error"]
    name = f"{key}[{index}]"
    if key == "step_sizes":
        assert errors == [(name, "Rprop's step() raises with it on either device")]
        with pytest.raises(TypeError, match="clamp_"):  # (it is right: here step() raises)
            _step(opt, params, 0)
    elif path == ("etas", 0) and given == "cpu":
        assert errors == [(name, "Rprop's step() raises with it on cpu (a probe step did; on sim:0 it runs)")]
        with pytest.raises(RuntimeError, match="same device"):  # (it is right: here step() raises)
            _step(O.Rprop(params, **{key: tuple(value)}, foreach=foreach), params, 0)
        optimshift.move(opt)  # (where it runs: on the device)
        assert opt.param_groups[0][key][index] is value[index] and value[index].device == sim
    else:
        assert errors == []
    if key == "etas":
        _step(opt, params, 0)
        _step(opt, params, 1)
        costly = path == ("etas", 1) and given == "sim"  # (filled by index_put_: see the test below)
        assert [f.key for f in optimshift.check(opt).findings] == ([name] if costly else [])


@pytest.mark.parametrize("foreach", [False, True], ids=["single", "foreach"])
@pytest.mark.parametrize("index, shape", [(0, ()), (1, ()), (1, (1,))], ids=["etas0-0dim", "etas1-0dim", "etas1-1"])
def test_a_device_eta_of_non_capturable_rprop_is_priced_and_moved_to_the_host(sim, foreach, index, shape):
    """``sign[sign.gt(0)] = etaplus``: ATen fills from a one-element host value (``masked_fill_``) and writes a
    device one by ``index_put_``, whose mask's ``nonzero`` syncs (on CUDA; the simulator's count_syncs cannot tell it
    from a number): check() called such a device eta ok, and move() kept it there. One sync per param a step."""
    params = _params(sim)

    def etas():
        given = [0.5, 1.2]
        return (*given[:index], torch.full(shape, given[index], device=sim), *given[index + 1 :])

    opt = O.Rprop(params, etas=etas(), foreach=foreach)
    eta = opt.param_groups[0]["etas"][index]
    found = [(f.severity, f.key, f.syncs_per_step) for f in optimshift.check(opt).findings]
    assert found == [("warning", f"etas[{index}]", len(params))]
    optimshift.move(opt)
    assert opt.param_groups[0]["etas"][index] is eta and eta.device.type == "cpu"
    _step(opt, params, 0)
    assert not optimshift.check(opt).findings
    capturable = O.Rprop(_params(sim), etas=etas(), foreach=foreach, capturable=True)  # (torch.where: no sync)
    optimshift.move(capturable)
    assert capturable.param_groups[0]["etas"][index].device == sim and not optimshift.check(capturable).findings


@pytest.mark.parametrize("foreach", [False, True], ids=["single", "foreach"])
def test_a_0_dim_device_step_size_of_non_capturable_rprop_is_priced(sim, foreach):
    """``clamp_`` reads a 0-dim step size as a number: on the device a sync each step, which check() missed where
    the probe's non-capturable step stopped at its masked fills."""
    params = _params(sim)
    opt = O.Rprop(params, step_sizes=(1e-6, torch.tensor(50.0, device=sim)), foreach=foreach)
    found = [(f.severity, f.key) for f in optimshift.check(opt).findings]
    assert found == [("warning", "step_sizes[1]")]
    assert _step(opt, params, 0) > 0 and _step(opt, params, 1) > 0  # (it is right: each step syncs)


# 0-dim group tensors a real step reads on the host where the probe's first fake step did not: through a foreach
# op's binding, which takes a 0-dim tensor as a number (``_foreach_add_(.., eps)``: its ``.item()``), or only
# from the second step on (SGD's dampening): check() called them ok on the device, each step syncing there.
READ_BY_A_BINDING_OR_LATER = [
    *[(cls, "eps", {"foreach": True}) for cls in (O.Adam, O.AdamW, O.Adamax, O.NAdam, O.RAdam, O.RMSprop)],
    (O.Adagrad, "eps", {"foreach": True}),
    (O.Adadelta, "eps", {"foreach": True}),
    (O.Adam, "eps", {"foreach": True, "capturable": True}),
    (O.NAdam, "momentum_decay", {"foreach": True, "capturable": True}),
    (O.SGD, "dampening", {"foreach": False, "momentum": 0.9}),
    (O.SGD, "dampening", {"foreach": True, "momentum": 0.9}),
]


@pytest.mark.parametrize(
    "cls, key, kwargs",
    READ_BY_A_BINDING_OR_LATER,
    ids=lambda v: getattr(v, "__name__", None) or (v if isinstance(v, str) else "-".join(k for k, x in v.items() if x)),
)
def test_a_0_dim_device_tensor_read_by_a_binding_or_a_later_step_is_priced_at_its_syncs(sim, cls, key, kwargs):
    """check() prices such a tensor on the device at the syncs a step makes more with it than with a float there,
    and says nothing of it on the host (where reading it costs none)."""

    def stepped(value):
        params = _params(sim)
        opt = cls(params, **{key: value}, **kwargs)
        findings = optimshift.check(opt).findings
        return findings, [_step(opt, params, k) for k in range(3)]

    _, plain = stepped(0.1)
    on_host, host_syncs = stepped(torch.tensor(0.1))
    found, device_syncs = stepped(torch.tensor(0.1, device=sim))
    extra = device_syncs[-1] - plain[-1]
    assert extra > 0 and host_syncs == plain and not on_host
    assert [(f.severity, f.key, f.expected, f.syncs_per_step) for f in found] == [("warning", key, "cpu", extra)]

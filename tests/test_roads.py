"""The differential matrix: every road an optimizer's state can take to a device leaves it where a fresh optimizer
keeps it (issue 27).

Configurations: every torch.optim class in every mode of the shared matrix (``_matrix.CASES``: foreach, fused,
capturable, amsgrad, maximize...) x the kind of its hyperparameters (floats, a 0-dim tensor ``lr``, a one-element
tensor ``lr``, tensor ``betas``) x its two param groups on one device or on two. Roads:

- ``move`` after the params moved (``device=None``);
- ``offload`` + ``reload``;
- ``reload`` after the params moved while offloaded;
- ``rebind`` onto new params on the device;
- ``load_state_dict`` from a state dict, from a file through ``optimshift.load``, and into existing state;
- a ``stream``/``unstream`` round trip (the classes that stream).

Pass: every entry, param state and group tensors alike, is where the fresh optimizer built on the device keeps it
after a step; ``check()`` finds nothing; the next step costs the fresh optimizer's host syncs.

The roads decide placement through one function (``policy.Placer``, the memoizing front of ``policy.decide``);
before it, a one-element tensor ``lr`` went to the device on ``move``, ``reload`` after a param move, every load
and the stream round trip, while ``offload``/``reload`` and ``rebind`` kept it on the host, and ``check()``
disagreed with both (the road names of a failure are in its message).
"""

from __future__ import annotations

import pytest
import torch

import optimshift
from _matrix import CASES, ON_DEVICE

O = torch.optim
Parameter = torch.nn.Parameter

# which torch.optim classes take betas
_BETAS = {"Adam", "AdamW", "Adamax", "NAdam", "RAdam"}
HYPERS = ("float", "lr0d", "lr1", "betas")
LAYOUTS = ("one", "two")
SHAPES = [[(4, 3), (3,)], [(2, 3)]]  # two param groups
SHAPES_2D = [[(4, 3), (2, 3)], [(3, 3)]]


def _hyper(cls, kwargs, hyper):
    kw = dict(kwargs)
    if hyper == "lr0d":
        kw["lr"] = torch.tensor(0.01)
    elif hyper == "lr1":
        kw["lr"] = torch.full((1,), 0.01)
    elif hyper == "betas":
        if cls.__name__ not in _BETAS:
            return None
        kw["betas"] = (torch.tensor(0.9), torch.tensor(0.99))
    return kw


def _devices(sim, layout, on_device):
    """(source devices, target devices) per group: the source is the host, or, for classes that step only on an
    accelerator, the simulated device 1 (so every road crosses devices)."""
    d0, d1 = torch.device(sim.type, 0), torch.device(sim.type, 1)
    dst = [d0, d0] if layout == "one" else [d0, d1]
    src = [d1, d1] if on_device else [torch.device("cpu")] * 2
    if on_device and layout == "two":
        src = [d1, d0]
    return src, dst


def _params(shapes, devices, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [[Parameter(torch.randn(s, generator=g).to(d)) for s in group] for group, d in zip(shapes, devices)]


def _build(cls, kw, params):
    if cls is O.LBFGS:  # (one param group only, on one device: it flattens every grad into one vector)
        return cls([p for ps in params for p in ps], **kw)
    groups = [{"params": ps} for ps in params]
    groups[1] = dict(groups[1], **({"lr": kw["lr"].clone()} if isinstance(kw.get("lr"), torch.Tensor) else {}))
    return cls(groups, **kw)


def _step(opt, k):
    params = [p for g in opt.param_groups for p in g["params"]]
    for i, p in enumerate(params):
        g = torch.Generator().manual_seed(100 * k + i)
        p.grad = torch.randn(p.shape, generator=g).to(p.device)
    if isinstance(opt, O.LBFGS):
        opt.step(lambda: sum((p.detach() ** 2).sum().to("cpu") for p in params))
    else:
        opt.step()


def _layout(opt):
    out = {}
    for gi, group in enumerate(opt.param_groups):
        for pi, p in enumerate(group["params"]):
            for path, t in optimshift._state.leaves(opt.state.get(p, {})):
                out[("state", gi, pi, path)] = t.device
        for path, t in optimshift._state.leaves({k: v for k, v in group.items() if k not in ("params",)}):
            out[("group", gi, path)] = t.device
    return out


def _move_params(opt, devices):
    for group, d in zip(opt.param_groups, devices):
        for p in group["params"]:
            p.grad = None
            torch.utils.swap_tensors(p, Parameter(p.detach().to(d)))


def _trained(cls, kw, shapes, devices, steps=1):
    opt = _build(cls, kw, _params(shapes, devices))
    for k in range(steps):
        _step(opt, k)
    return opt


def _road(name, cls, kw, shapes, src, dst, tmp_path):
    """The optimizer after road ``name``, its state last on ``dst``."""
    if name == "move":
        opt = _trained(cls, kw, shapes, src)
        _move_params(opt, dst)
        return optimshift.move(opt)
    if name == "offload+reload":
        opt = _trained(cls, kw, shapes, dst)
        optimshift.offload(opt)
        return optimshift.reload(opt)
    if name == "reload-moved":
        opt = _trained(cls, kw, shapes, src)
        optimshift.offload(opt)
        _move_params(opt, dst)
        return optimshift.reload(opt)
    if name == "rebind":
        opt = _trained(cls, kw, shapes, src)
        new = [Parameter(p.detach().to(d)) for g, d in zip(opt.param_groups, dst) for p in g["params"]]
        return optimshift.rebind(opt, new)
    if name.startswith("load"):
        sd = _trained(cls, kw, shapes, src).state_dict()
        if name == "load-file":
            optimshift.save(sd, tmp_path / "opt.pt")
            sd = optimshift.load(tmp_path / "opt.pt")
        opt = _build(cls, kw, _params(shapes, dst, seed=1))
        if name == "load-existing":
            _step(opt, 7)
        return optimshift.load_state_dict(opt, sd)
    assert name == "stream"
    opt = _trained(cls, kw, shapes, dst)
    optimshift.stream(opt)
    _step(opt, 1)
    return optimshift.unstream(opt)


ROADS = ("move", "offload+reload", "reload-moved", "rebind", "load", "load-file", "load-existing", "stream")


def _configs():
    for name, cls, kwargs, directions, _ in CASES:
        for hyper in HYPERS:
            for layout in LAYOUTS:
                yield pytest.param(cls, kwargs, directions == ON_DEVICE, hyper, layout, id=f"{name}-{hyper}-{layout}")


def _findings(opt):
    return [f for f in optimshift.check(opt).findings if f.severity != "info"]


@pytest.mark.parametrize("cls, kwargs, on_device, hyper, layout", list(_configs()))
def test_every_road_places_like_a_fresh_optimizer(sim, tmp_path, cls, kwargs, on_device, hyper, layout):
    kw = _hyper(cls, kwargs, hyper)
    if kw is None:
        pytest.skip(f"{cls.__name__} takes no betas")
    if cls is O.LBFGS and layout == "two":
        pytest.skip("LBFGS holds one param group, on one device")
    shapes = SHAPES_2D if cls is O.Muon else SHAPES
    src, dst = _devices(sim, layout, on_device)
    try:
        fresh = _trained(cls, kw, shapes, dst)
    except (RuntimeError, ValueError, TypeError) as e:  # a combination torch itself refuses
        pytest.skip(f"torch refuses {cls.__name__}({kw}): {e}")
    want = _layout(fresh)
    with optimshift.count_syncs() as counted:
        _step(fresh, 1)
    fresh_syncs = counted.total
    # (entries a fresh optimizer holds on either side, by their values: LBFGS's `t`; the syncs compare them)
    table = optimshift.policy._TABLE.get(cls.__name__, {})
    either = {k for k, rule in table.items() if rule == optimshift.policy._EITHER}
    wrong = {}
    for road in ROADS:
        if road == "stream" and (not optimshift.policy.separable(cls)[0] or layout == "two"):
            continue  # (LBFGS steps all params at once; a streamed step's lane is one device's)
        opt = _road(road, cls, kw, shapes, src, dst, tmp_path)
        got = _layout(opt)
        findings = _findings(opt)
        with optimshift.count_syncs() as counted:
            _step(opt, 1)
        misplaced = {
            k: (str(v), str(want.get(k))) for k, v in got.items() if want.get(k) != v and k[-1][0][1] not in either
        }
        if got.keys() != want.keys():
            misplaced["keys"] = (sorted(map(str, got.keys() ^ want.keys())), "")
        if misplaced or findings or counted.total > fresh_syncs:
            wrong[road] = (misplaced, [(f.param, f.key, f.why) for f in findings], counted.total, fresh_syncs)
    assert not wrong, f"roads that disagree with a fresh optimizer: {wrong}"


@pytest.mark.parametrize("cls, kwargs, on_device, hyper, layout", [c for c in _configs() if "two" in c.id])
def test_the_placer_answers_as_decide_for_every_entry(sim, cls, kwargs, on_device, hyper, layout):
    """The memo in front of the rule is only a memo: every entry ``policy.Placer`` places (through
    ``build_plan``, its per-param memo key included), ``policy.decide`` places alike when asked directly."""
    kw = _hyper(cls, kwargs, hyper)
    if kw is None or cls is O.LBFGS:
        pytest.skip("no such configuration")
    # (two params of one rank in a group: the memo serves both)
    shapes = (
        [[(4, 3), (2, 3), (3, 3)], [(3, 3)]]
        if cls is O.Muon
        else [[(4, 3), (3,), (2, 3), (5,), (1,), (6,), (7,)], [(2, 3)]]
    )
    _, dst = _devices(sim, layout, on_device)
    try:
        opt = _trained(cls, kw, shapes, dst)
    except (RuntimeError, ValueError, TypeError) as e:
        pytest.skip(f"torch refuses {cls.__name__}({kw}): {e}")
    from optimshift._plan import build_plan, policy_target

    # (a one-element, a two-element and a 0-dim step among the params of one rank in one group, under one key,
    # and a bf16 0-dim and one-element one beside float32 ones: placed apart by the rule, so the memo must tell
    # them apart; only planned here, never stepped)
    for group in opt.param_groups:
        seen: dict[int, int] = {}
        for p in group["params"]:
            st, k = opt.state.get(p, {}), seen.setdefault(p.dim(), 0)
            seen[p.dim()] += 1
            if isinstance(st.get("step"), torch.Tensor) and st["step"].dim() == 0:
                if k < 2:
                    st["step"] = st["step"].reshape(1).expand(k + 1).clone()
                elif k in (3, 4):
                    st["step"] = st["step"].to(torch.bfloat16).reshape((1,) * (k - 3))
    for device in (None, torch.device("cpu"), torch.device(sim.type, 1)):
        plan = build_plan(opt, policy_target(opt, device))
        for tr in plan.transfers:
            gi, pi, path = tr.ident
            group = opt.param_groups[gi]
            where = device or (tr.param.device if tr.param is not None else group["params"][0].device)
            direct = optimshift.policy.decide(opt, group, tr.param, path[0][1], tr.tensor, where)
            assert (tr.target, tr.source) == (direct.device, direct.source), (tr.site, device)

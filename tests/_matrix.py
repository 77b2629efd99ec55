"""The optimizer matrix shared by the tests: every torch.optim class in every mode it supports."""

from __future__ import annotations

import torch

O = torch.optim
ALL = ("h2d", "d2h", "d0d1", "split", "follow")
ON_DEVICE = ("d0d1",)  # capturable cannot step on a CPU: only device-to-device directions

SHAPES = [(4, 3), (3,), (2, 3)]
SHAPES_2D = [(4, 3), (2, 3), (3, 3)]

# (id, class, kwargs, directions, shapes)
CASES = [
    ("Adam", O.Adam, {"foreach": False}, ALL, SHAPES),
    ("Adam-foreach", O.Adam, {"foreach": True}, ALL, SHAPES),
    ("Adam-fused", O.Adam, {"fused": True}, ALL, SHAPES),
    ("Adam-capturable", O.Adam, {"capturable": True, "foreach": False}, ON_DEVICE, SHAPES),
    ("Adam-capturable-foreach", O.Adam, {"capturable": True, "foreach": True}, ON_DEVICE, SHAPES),
    ("Adam-amsgrad-maximize", O.Adam, {"amsgrad": True, "maximize": True, "foreach": False}, ALL, SHAPES),
    ("AdamW", O.AdamW, {"foreach": False}, ALL, SHAPES),
    ("AdamW-foreach-amsgrad", O.AdamW, {"foreach": True, "amsgrad": True}, ALL, SHAPES),
    ("AdamW-fused", O.AdamW, {"fused": True}, ALL, SHAPES),
    ("AdamW-capturable", O.AdamW, {"capturable": True}, ON_DEVICE, SHAPES),
    ("SGD-momentum", O.SGD, {"momentum": 0.9, "foreach": False}, ALL, SHAPES),
    ("SGD-nesterov-foreach", O.SGD, {"momentum": 0.9, "nesterov": True, "foreach": True}, ALL, SHAPES),
    ("SGD-fused", O.SGD, {"momentum": 0.9, "fused": True}, ALL, SHAPES),
    ("Adagrad", O.Adagrad, {"foreach": False}, ALL, SHAPES),
    ("Adagrad-foreach", O.Adagrad, {"foreach": True}, ALL, SHAPES),
    ("Adagrad-fused", O.Adagrad, {"fused": True}, ALL, SHAPES),
    ("Adadelta", O.Adadelta, {"foreach": False}, ALL, SHAPES),
    ("Adadelta-foreach-maximize", O.Adadelta, {"foreach": True, "maximize": True}, ALL, SHAPES),
    ("Adadelta-capturable", O.Adadelta, {"capturable": True}, ON_DEVICE, SHAPES),
    ("Adamax", O.Adamax, {"foreach": False}, ALL, SHAPES),
    ("Adamax-foreach", O.Adamax, {"foreach": True}, ALL, SHAPES),
    ("Adamax-capturable", O.Adamax, {"capturable": True}, ON_DEVICE, SHAPES),
    ("ASGD", O.ASGD, {"foreach": False}, ALL, SHAPES),
    ("ASGD-foreach", O.ASGD, {"foreach": True}, ALL, SHAPES),
    ("ASGD-capturable", O.ASGD, {"capturable": True}, ON_DEVICE, SHAPES),
    ("NAdam", O.NAdam, {"foreach": False}, ALL, SHAPES),
    (
        "NAdam-foreach-decoupled",
        O.NAdam,
        {"foreach": True, "decoupled_weight_decay": True, "weight_decay": 0.1},
        ALL,
        SHAPES,
    ),
    ("NAdam-capturable", O.NAdam, {"capturable": True}, ON_DEVICE, SHAPES),
    ("RAdam", O.RAdam, {"foreach": False}, ALL, SHAPES),
    (
        "RAdam-foreach-decoupled",
        O.RAdam,
        {"foreach": True, "decoupled_weight_decay": True, "weight_decay": 0.1},
        ALL,
        SHAPES,
    ),
    ("RAdam-capturable", O.RAdam, {"capturable": True}, ON_DEVICE, SHAPES),
    ("RMSprop-centered", O.RMSprop, {"centered": True, "momentum": 0.9, "foreach": False}, ALL, SHAPES),
    ("RMSprop-foreach", O.RMSprop, {"foreach": True}, ALL, SHAPES),
    ("RMSprop-capturable", O.RMSprop, {"capturable": True, "centered": True, "momentum": 0.5}, ON_DEVICE, SHAPES),
    ("Rprop", O.Rprop, {"foreach": False}, ALL, SHAPES),
    ("Rprop-foreach-maximize", O.Rprop, {"foreach": True, "maximize": True}, ALL, SHAPES),
    ("Rprop-capturable", O.Rprop, {"capturable": True}, ON_DEVICE, SHAPES),
    ("Adafactor", O.Adafactor, {"foreach": False}, ALL, SHAPES),
    ("Adafactor-foreach", O.Adafactor, {"foreach": True}, ALL, SHAPES),
    ("Muon", O.Muon, {}, ALL, SHAPES_2D),
    # LBFGS flattens all grads into one tensor: it cannot hold params on two devices at once (no "split").
    ("LBFGS", O.LBFGS, {"history_size": 3, "max_iter": 2}, ("h2d", "d2h", "d0d1", "follow"), SHAPES),
]


def grad_for(step: int, index: int, shape) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + index)
    return torch.randn(shape, generator=g)


class Holder(torch.nn.Module):
    def __init__(self, shape, seed):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.weight = torch.nn.Parameter(torch.randn(shape, generator=g))


class Delegating:
    """A wrapper that delegates to the optimizer it holds, as Accelerate's and Lightning's do (its own object,
    the inner optimizer's param_groups and state)."""

    def __init__(self, optimizer):
        self.optimizer = optimizer

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state


class Model(torch.nn.Module):
    """One sub-module per param, so that a test can move some of them (params split over devices)."""

    def __init__(self, shapes):
        super().__init__()
        self.parts = torch.nn.ModuleList(Holder(s, i) for i, s in enumerate(shapes))


def train(model: Model, opt: torch.optim.Optimizer, steps: range) -> None:
    params = [h.weight for h in model.parts]
    for step in steps:
        if isinstance(opt, O.LBFGS):

            def closure():
                opt.zero_grad()
                loss = sum(
                    ((p - grad_for(0, i, p.shape).to(p.device)) ** 2).sum().to("cpu") for i, p in enumerate(params)
                )
                loss.backward()
                return loss

            opt.step(closure)
        else:
            for i, p in enumerate(params):
                p.grad = grad_for(step, i, p.shape).to(p.device, p.dtype)  # (the param's dtype: a double one)
            opt.step()


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor, on the host: for bitwise comparisons (NaN == NaN, -0.0 != 0.0)."""
    return t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)


def bitwise_equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))
        )
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(bitwise_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(bitwise_equal(a[k], b[k]) for k in a)
    return a == b or (a != a and b != b)


def state_layout(opt):
    """{(param index, key): device} for every tensor entry (nested ones by index too)."""
    out = {}
    params = [p for g in opt.param_groups for p in g["params"]]
    for i, p in enumerate(params):
        for k, v in opt.state.get(p, {}).items():
            if isinstance(v, torch.Tensor):
                out[(i, k)] = v.device
            elif isinstance(v, (list, tuple)):
                for j, x in enumerate(v):
                    if isinstance(x, torch.Tensor):
                        out[(i, k, j)] = x.device
    return out


def state_dtypes(opt):
    params = [p for g in opt.param_groups for p in g["params"]]
    return {
        (i, k): v.dtype
        for i, p in enumerate(params)
        for k, v in opt.state.get(p, {}).items()
        if isinstance(v, torch.Tensor)
    }


def tensor_ids(opt) -> dict:
    """{where: id(tensor)} for every tensor the optimizer holds (state, nested containers, param groups)."""
    from optimshift._state import leaves

    out = {}
    params = [p for g in opt.param_groups for p in g["params"]]
    for i, p in enumerate(params):
        for path, t in leaves(opt.state.get(p, {})):
            out[("state", i, path)] = id(t)
    for gi, group in enumerate(opt.param_groups):
        for path, t in leaves({k: v for k, v in group.items() if k not in ("params", "param_names")}):
            out[("group", gi, path)] = id(t)
    return out


def snapshot(value):
    """A copy of ``value`` with every tensor cloned (containers rebuilt), for before/after comparisons of state
    whose tensor objects are kept (and so change in place)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: snapshot(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(snapshot(v) for v in value)
    return value


def as_it_is(opt) -> dict:
    """What a failed operation must leave as it found it: each tensor's object, device and values (state, groups,
    grads), the optimizer's own attributes (fronts) and hooks, in order, and what optimshift records of it."""
    from optimshift import _session

    params = [p for g in opt.param_groups for p in g["params"]]
    session = _session.of(opt)  # (none yet: as an empty one)
    mode = None if session is None or session.mode is None else session.mode()
    return {
        "ids": tensor_ids(opt),
        "layout": state_layout(opt),
        "values": snapshot([dict(opt.state.get(p, {})) for p in params] + list(opt.param_groups)),
        "grads": [None if p.grad is None else (id(p.grad), p.grad.device, p.grad.detach().clone()) for p in params],
        "attributes": {k: id(v) for k, v in vars(opt).items()},
        "hooks": {k: list(v.items()) for k, v in vars(opt).items() if k.endswith("_hooks") and isinstance(v, dict)},
        "record": [
            id(None if session is None else session.record),
            id(None if session is None else session.pending),
            [] if session is None else list(map(id, session.guards)),
            id(mode),
            0 if session is None else session.offloaded_in,
        ],
    }


def assert_as_it_was(opt, before: dict) -> None:
    now = as_it_is(opt)
    for key, value in before.items():
        assert bitwise_equal(now[key], value), f"{key} changed: {value} -> {now[key]}"

"""State in any container keeps its type, identity where mutable, and bitwise values through a move."""

import collections
import dataclasses

import torch

import optimshift
from _matrix import bitwise_equal

Pair = collections.namedtuple("Pair", "left right")


@dataclasses.dataclass(frozen=True)
class Frozen:
    scale: torch.Tensor
    name: str


@dataclasses.dataclass
class Mutable:
    buf: torch.Tensor
    count: int = 0


class Projector:
    """What GaLore-style optimizers keep in state: an object holding tensors in attributes."""

    def __init__(self, rank):
        self.ortho = torch.randn(4, rank)
        self.rank = rank
        self.history = [torch.randn(2), None]


class Slotted:
    __slots__ = ("matrix", "tag")

    def __init__(self):
        self.matrix = torch.randn(2, 2)
        self.tag = "slots"


class Exotic(torch.optim.Optimizer):
    """A third-party optimizer whose state holds every kind of container."""

    def __init__(self, params):
        super().__init__(params, {"lr": 0.1})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                st = self.state[p]
                if not st:
                    st["step"] = torch.tensor(0.0)
                    st["pair"] = Pair(torch.zeros_like(p), torch.ones(()))
                    st["window"] = collections.deque([torch.zeros_like(p)], maxlen=3)
                    st["frozen"] = Frozen(torch.tensor(2.0, dtype=torch.float64), "f")
                    st["mutable"] = Mutable(torch.zeros_like(p))
                    st["projector"] = Projector(2)
                    st["slotted"] = Slotted()
                    st["nested"] = {
                        "a": [torch.arange(3), ("text", 7, None)],
                        "b": {"c": torch.ones(2, dtype=torch.bfloat16)},
                    }
                    st["label"] = "adam-like"
                    st["count"] = 0
                    st["lr_hist"] = (0.1, 0.2)
                    st["none"] = None
                st["step"] += 1
                st["window"].append(p.grad.clone())
                st["mutable"].buf.add_(p.grad)
                st["count"] += 1
                p.add_(st["mutable"].buf, alpha=-group["lr"])


def _make(sim):
    params = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(3))]
    opt = Exotic(params)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
    return params, opt


def _snapshot(opt):
    import copy

    return {i: copy.deepcopy(st) for i, st in enumerate(opt.state.values())}


def test_every_container_round_trips_with_types_identity_and_bits(sim):
    params, opt = _make(sim)
    before = _snapshot(opt)
    st = opt.state[params[0]]
    ids = {k: id(st[k]) for k in ("window", "mutable", "projector", "slotted", "nested")}
    inner_list = st["nested"]["a"]
    optimshift.move(opt, sim)
    st = opt.state[params[0]]
    assert st["pair"].left.device == sim and type(st["pair"]) is Pair
    assert st["window"][0].device == sim and st["window"].maxlen == 3
    assert (
        type(st["frozen"]) is Frozen and st["frozen"].scale.device == sim and st["frozen"].scale.dtype == torch.float64
    )
    assert st["mutable"].buf.device == sim and st["projector"].ortho.device == sim
    assert st["projector"].history[0].device == sim and st["projector"].history[1] is None
    assert st["slotted"].matrix.device == sim and st["slotted"].tag == "slots"
    assert st["nested"]["a"][0].device == sim and st["nested"]["a"][1] == ("text", 7, None)
    assert st["nested"]["b"]["c"].dtype == torch.bfloat16
    assert st["label"] == "adam-like" and st["count"] == 2 and st["lr_hist"] == (0.1, 0.2) and st["none"] is None
    assert st["step"].device.type == "cpu", "default rule: a 0-dim step stays on the host"
    # Mutable containers and objects keep their identity: code holding them sees the moved tensors.
    assert {k: id(st[k]) for k in ids} == ids and st["nested"]["a"] is inner_list
    for p in params:
        p.data = p.data  # params stay on the host; move them to the device as a user would
    optimshift.move(opt, "cpu")
    after = _snapshot(opt)
    for i in before:
        for key in before[i]:
            a, b = before[i][key], after[i][key]
            assert type(a) is type(b), key
            assert _flat_equal(a, b), key


def _flat_equal(a, b):
    from optimshift._state import leaves

    la, lb = list(leaves(a)), list(leaves(b))
    return [p for p, _ in la] == [p for p, _ in lb] and all(bitwise_equal(x, y) for (_, x), (_, y) in zip(la, lb))


def test_aliased_tensor_is_copied_once_and_stays_aliased(sim):
    p = torch.nn.Parameter(torch.randn(3))
    opt = torch.optim.SGD([p], lr=0.1)
    t = torch.randn(3)
    opt.state[p]["a"] = t
    opt.state[p]["b"] = [t, (t,)]
    optimshift.move(opt, sim)
    st = opt.state[p]
    assert st["a"] is st["b"][0] is st["b"][1][0] and st["a"].device == sim


def test_optimizer_wide_entries_under_plain_keys(sim):
    """MADGRAD-style state: optimizer.state["k"] next to the per-param dicts (PyTorch's state_dict keeps them)."""
    p = torch.nn.Parameter(torch.randn(3))
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    p.grad = torch.ones(3)
    opt.step()
    opt.state["k"] = torch.tensor(3)  # a 0-dim counter: read on the host
    opt.state["total"] = 7
    opt.state["buffers"] = {"mean": torch.zeros(3)}
    p2 = torch.nn.Parameter(p.detach().to(sim))
    optimshift.rebind(opt, [p2])
    assert opt.state["k"].device.type == "cpu" and opt.state["total"] == 7
    assert opt.state["buffers"]["mean"].device == sim and opt.state[p2]["momentum_buffer"].device == sim
    rows = {(r.param, r.key) for r in optimshift.placement(opt)}
    assert ("optimizer-wide", "k") in rows and ("optimizer-wide", "buffers['mean']") in rows
    assert optimshift.check(opt).ok


def test_state_nested_20000_deep_is_walked_without_recursion(sim):
    """The one walker is iterative: move, check and placement handle a hostile 20,000-level nesting."""
    p = torch.nn.Parameter(torch.zeros(2, device=sim))
    opt = torch.optim.SGD([p], lr=0.1)
    deep: list = [torch.ones(2)]  # on the host: it must follow its param
    for _ in range(20_000):
        deep = [deep]
    opt.state[p]["deep"] = deep
    optimshift.move(opt)
    inner = opt.state[p]["deep"]
    for _ in range(20_000):
        inner = inner[0]
    assert inner[0].device == sim
    assert len(optimshift.placement(opt)) == 1 and optimshift.check(opt).ok

"""The uniform load (``checkpoint/_uniform.py``): a checkpoint whose every param's state is what its class's step
creates loads in one pass, checked in C, and ends exactly as the general staging ends it (same placement, dtypes,
values, objects, storages, errors); anything else takes the general path.

Each test loads one checkpoint into two equal optimizers, once as it is and once with the uniform path switched off
(``TensorGuards`` None), and compares everything an optimizer holds afterwards, then one more step."""

from __future__ import annotations

import copy

import pytest
import torch

import optimshift
from _matrix import CASES, Model, bits, train
from optimshift.checkpoint import _staging, _uniform

O = torch.optim
K = 2


@pytest.fixture
def taken(monkeypatch):
    """Whether each load of the test took the uniform path."""
    calls: list[bool] = []
    real = _staging.build_uniform

    def spy(*args, **kwargs):
        try:
            out = real(*args, **kwargs)
        except BaseException:
            calls.append("raised")
            raise
        calls.append(out is not None)
        return out

    monkeypatch.setattr(_staging, "build_uniform", spy)
    return calls


def _trained(cls, kwargs, shapes, device="cpu", steps=K):
    model = Model(shapes)
    model.to(device)
    opt = cls([h.weight for h in model.parts], **kwargs)
    train(model, opt, range(steps))
    return model, opt


def _live(opt):
    """{(param index, key): (id, data_ptr)} of every tensor entry."""
    params = [p for g in opt.param_groups for p in g["params"]]
    return {
        (i, k): (id(v), v.data_ptr())
        for i, p in enumerate(params)
        for k, v in opt.state.get(p, {}).items()
        if isinstance(v, torch.Tensor)
    }


def _facts(opt, before, sd):
    """Everything a load decides, comparable across two optimizers: per param, each entry's key (in order), class,
    dtype, device, bits, and whether it is the live object it was, on its storage, or the checkpoint's own tensor;
    the groups but their params."""
    params = [p for g in opt.param_groups for p in g["params"]]
    saved = {id(t) for st in sd["state"].values() for t in st.values() if isinstance(t, torch.Tensor)}
    rows = []
    for i, p in enumerate(params):
        st = opt.state.get(p)
        if st is None:
            rows.append(None)
            continue
        row = []
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                was = before.get((i, k))
                kept = was is not None and id(v) == was[0]
                row.append(
                    (
                        k,
                        type(v),
                        v.dtype,
                        v.device,
                        tuple(v.stride()),
                        bits(v.detach()).cpu(),
                        kept,
                        kept and v.data_ptr() == was[1],
                        id(v) in saved,
                    )
                )
            else:
                row.append((k, v))
        rows.append(row)
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return rows, groups


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b or (a != a and b != b)


def _load(make, sd, monkeypatch, *, uniform, **kwargs):
    """(outcome, model, optimizer) of one load into a new ``make()``: the facts, or the error's type and text."""
    model, opt = make()
    if kwargs.get("copy") is False:  # (the optimizer then holds the checkpoint's tensors: each load its own)
        sd = copy.deepcopy(sd)
    before = _live(opt)
    with monkeypatch.context() as m:
        if not uniform:
            m.setattr(_uniform, "TensorGuards", None)
        try:
            optimshift.load_state_dict(opt, sd, **kwargs)
        except Exception as e:  # (compared: both paths must raise alike)
            return (type(e), str(e), getattr(e, "__notes__", None)), model, opt
    return _facts(opt, before, sd), model, opt


def _both(make, sd, monkeypatch, **kwargs):
    """Load ``sd`` both ways; assert every fact agrees, then that one more step agrees too. Returns the uniform
    load's outcome."""
    got, m1, o1 = _load(make, sd, monkeypatch, uniform=True, **kwargs)
    want, m2, o2 = _load(make, sd, monkeypatch, uniform=False, **kwargs)
    assert _same(got, want)
    if not isinstance(got[0], type):
        train(m1, o1, range(K, K + 1))
        train(m2, o2, range(K, K + 1))
        assert _same(_facts(o1, {}, {"state": {}}), _facts(o2, {}, {"state": {}}))
        assert all(torch.equal(bits(a.detach()), bits(b.detach())) for a, b in zip(m1.parameters(), m2.parameters()))
    return got


# Classes whose state after a step is every key its step creates, each a plain tensor of the param's shape or
# 0-dim: the checkpoints the uniform path is for. (Adafactor keeps row and column factors, LBFGS containers.)
_GENERAL = {"Adafactor", "Adafactor-foreach", "LBFGS"}


def _host_cases():
    for name, cls, kwargs, _directions, shapes in CASES:
        if not kwargs.get("capturable"):  # capturable cannot step on a CPU
            yield pytest.param(name, cls, kwargs, shapes, id=name)


@pytest.mark.parametrize("into", ["fresh", "existing state"])
@pytest.mark.parametrize("name, cls, kwargs, shapes", list(_host_cases()))
def test_every_class_loads_as_the_general_path_loads_it(monkeypatch, taken, name, cls, kwargs, shapes, into):
    _, source = _trained(cls, kwargs, shapes, steps=K + 1)
    sd = source.state_dict()

    def make():
        if into == "fresh":
            model = Model(shapes)
            return model, cls([h.weight for h in model.parts], **kwargs)
        return _trained(cls, kwargs, shapes)

    _both(make, sd, monkeypatch)
    assert taken[0] is (name not in _GENERAL)


@pytest.mark.parametrize("how", ["copy=False", "device='cpu'"])
def test_options_load_as_the_general_path_loads_them(monkeypatch, taken, how):
    _, source = _trained(O.AdamW, {"foreach": False}, [(4, 3), (3,)], steps=K + 1)
    kwargs = {"copy": False} if how == "copy=False" else {"device": "cpu"}
    got = _both(
        lambda: _trained(O.AdamW, {"foreach": False}, [(4, 3), (3,)]), source.state_dict(), monkeypatch, **kwargs
    )
    assert taken[0] is True
    installed_as_saved = [entry[-1] for row in got[0] for entry in row]
    assert all(installed_as_saved) is (how == "copy=False")


@pytest.mark.parametrize("into", ["fresh", "existing state"])
def test_copy_false_onto_an_accelerator_moves_what_belongs_there_as_the_general_path(monkeypatch, taken, sim, into):
    """``copy=False`` installs the checkpoint's own tensors only where they belong: a host checkpoint onto the
    simulator has its moments moved there, as the general path (and torch) does. (Found by review: the uniform
    path installed them on the host, and the next step failed on mixed devices.)"""
    shapes = [(4, 3), (3,)]
    _, source = _trained(O.Adam, {"foreach": False}, shapes, steps=K + 1)

    def make():
        if into == "fresh":
            model = Model(shapes).to(sim)
            return model, O.Adam([h.weight for h in model.parts], foreach=False)
        return _trained(O.Adam, {"foreach": False}, shapes, device=sim)

    got = _both(make, source.state_dict(), monkeypatch, copy=False)
    devices = {(entry[0], entry[3].type) for row in got[0] for entry in row}
    assert devices == {("step", "cpu"), ("exp_avg", sim.type), ("exp_avg_sq", sim.type)}


def test_every_column_copied_alike_is_all_empty_or_none(monkeypatch, sim):
    """The uniform load's columns go to ``copy_many(columns=...)`` each all empty tensors or none (what a column
    promises): an empty param beside others, first or not, onto the simulator. (Found by review: a batch keyed by
    devices and dtype alone mixed the empty param's columns with the others', and an empty first tensor sent the
    whole batch one tensor at a time.)"""
    from optimshift import _copy

    columns: list[list[bool]] = []
    real = _copy.copy_many

    def spy(items, *args, **kwargs):
        columns.extend([t.numel() == 0 for t in tensors] for tensors, _ in kwargs.get("columns", ()))
        return real(items, *args, **kwargs)

    monkeypatch.setattr(_copy, "copy_many", spy)
    monkeypatch.setattr("optimshift._engine.copy_many", spy)
    for shapes in ([(0, 3), (4, 3), (3,)], [(4, 3), (0, 3), (3,)]):
        _, source = _trained(O.Adam, {"foreach": False}, shapes, steps=K + 1)
        model = Model(shapes).to(sim)
        columns.clear()
        optimshift.load_state_dict(O.Adam([h.weight for h in model.parts], foreach=False), source.state_dict())
        assert sum(map(len, columns)) == 9 and all(len(set(column)) == 1 for column in columns), columns


def test_existing_state_takes_the_values_in_place(monkeypatch, taken):
    """Same objects, same storage, the checkpoint's bits, nothing shared with it."""
    _, source = _trained(O.Adam, {"foreach": False}, [(4, 3), (3,)], steps=K + 1)
    got = _both(lambda: _trained(O.Adam, {"foreach": False}, [(4, 3), (3,)]), source.state_dict(), monkeypatch)
    assert taken[0] is True
    entries = [entry for row in got[0] for entry in row]
    assert entries and all(kept and same_storage and not saved for *_, kept, same_storage, saved in entries)


@pytest.mark.parametrize("into", ["fresh", "existing state"])
@pytest.mark.parametrize(
    "kwargs", [{"foreach": False}, {"capturable": True, "foreach": False}], ids=["Adam", "capturable"]
)
def test_on_the_simulated_accelerator(monkeypatch, taken, sim, kwargs, into):
    """Placement by the plan: a capturable Adam keeps ``step`` on the device, a plain one on the host."""
    shapes = [(4, 3), (3,)]
    _, source = _trained(O.Adam, kwargs, shapes, device=sim, steps=K + 1)
    sd = source.state_dict()

    def make():
        if into == "fresh":
            model = Model(shapes).to(sim)
            return model, O.Adam([h.weight for h in model.parts], **kwargs)
        return _trained(O.Adam, kwargs, shapes, device=sim)

    got = _both(make, sd, monkeypatch)
    assert taken[0] is True
    steps = {entry[3].type for row in got[0] for entry in row if entry[0] == "step"}
    assert steps == ({sim.type} if kwargs.get("capturable") else {"cpu"})


def _adam_sd(shapes=((3, 3), (3,), (3,))):
    _, source = _trained(O.Adam, {"foreach": False}, list(shapes), steps=K + 1)
    return source.state_dict()


def _edit(what):
    """A checkpoint of a trained Adam, edited: each edit is one thing the uniform path leaves to the general one."""
    sd = _adam_sd()
    st0, st1 = sd["state"][0], sd["state"][1]
    if what == "a wrong shape":
        st1["exp_avg"] = torch.zeros(5)
    elif what == "float64 moments":
        st0["exp_avg"], st0["exp_avg_sq"] = st0["exp_avg"].double(), st0["exp_avg_sq"].double()
    elif what == "a step of shape (1,)":
        st1["step"] = st1["step"].reshape(1)
    elif what == "another key order":
        # (param 2 is of param 1's kind, which holds its entries in the class's order)
        st2 = sd["state"][2]
        sd["state"][2] = {"exp_avg": st2["exp_avg"], "step": st2["step"], "exp_avg_sq": st2["exp_avg_sq"]}
    elif what == "views of one storage":
        # (no base tensor kept alive by a view: the two are all that uses the storage)
        flat = torch.cat([st0["exp_avg"].flatten(), st0["exp_avg_sq"].flatten()]).untyped_storage()
        st0["exp_avg"] = torch.tensor([]).set_(flat, 0, (3, 3), (3, 1))
        st0["exp_avg_sq"] = torch.tensor([]).set_(flat, 9, (3, 3), (3, 1))
    elif what == "one tensor twice":
        st1["exp_avg_sq"] = st1["exp_avg"]
    elif what == "a tensor lr":
        sd["param_groups"][0]["lr"] = torch.tensor(0.01)
    elif what == "a transposed moment":
        st0["exp_avg"] = st0["exp_avg"].t().contiguous().t()
    elif what == "a moment requiring grad":
        st0["exp_avg"] = st0["exp_avg"].clone().requires_grad_()
    elif what == "an extra key":
        st1["extra"] = torch.zeros(3)
    elif what == "a missing key":
        del st1["exp_avg_sq"]
    elif what == "an integer moment":
        st0["exp_avg"] = st0["exp_avg"].to(torch.int32)
    elif what == "a 0-dim moment of a 1-dim param":
        st1["exp_avg"] = st1["exp_avg"][0]
    elif what == "a param without state":
        del sd["state"][1]
    elif what == "two moments' dtypes swapped with their order":
        # (param 2 holds param 1's dtypes entry by entry, but under the other keys: its bfloat16 exp_avg is refused)
        st1["exp_avg_sq"] = st1["exp_avg_sq"].to(torch.bfloat16)
        st2 = sd["state"][2]
        sd["state"][2] = {"step": st2["step"], "exp_avg_sq": st2["exp_avg_sq"], "exp_avg": st2["exp_avg"].bfloat16()}
    elif what == "a tensor inside a group entry":
        sd["param_groups"][0]["extra"] = {"scale": torch.tensor(0.5), "more": [[torch.tensor(0.25)]]}
    return sd


_EDITS = [
    "a wrong shape",
    "float64 moments",
    "a step of shape (1,)",
    "another key order",
    "views of one storage",
    "one tensor twice",
    "a tensor lr",
    "a transposed moment",
    "a moment requiring grad",
    "an extra key",
    "a missing key",
    "an integer moment",
    "a 0-dim moment of a 1-dim param",
    "two moments' dtypes swapped with their order",
    "a tensor inside a group entry",
]


@pytest.mark.parametrize("into", ["fresh", "existing state"])
@pytest.mark.parametrize("what", _EDITS)
def test_anything_else_takes_the_general_path(monkeypatch, taken, what, into):
    """Each edit fails the uniform path's checks, and the load (or its error) is the general path's."""
    sd = _edit(what)

    def make():
        if into == "fresh":
            model = Model([(3, 3), (3,), (3,)])
            return model, O.Adam([h.weight for h in model.parts], foreach=False)
        return _trained(O.Adam, {"foreach": False}, [(3, 3), (3,), (3,)])

    got = _both(make, sd, monkeypatch)
    assert taken[0] is False
    if what == "a tensor inside a group entry":  # (copied, as PyTorch deep-copies the groups)
        (group,) = got[1]
        assert group["extra"]["scale"] is not sd["param_groups"][0]["extra"]["scale"]
        assert group["extra"]["more"][0][0] is not sd["param_groups"][0]["extra"]["more"][0][0]


def _lanes(monkeypatch):
    """Whether each uniform load's (first) group was checked at once (``_whole_group``) or left to the loop."""
    calls: list[bool] = []
    real = _uniform._whole_group

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        calls.append(out)
        return out

    monkeypatch.setattr(_uniform, "_whole_group", spy)
    return calls


_ROWS = [
    "another shape last",
    "kinds in turn",
    "a double param among them",
    "a param without state",
    "another key order",
]


@pytest.mark.parametrize("into", ["fresh", "existing state"])
@pytest.mark.parametrize("what", ["one kind", *_ROWS])
def test_a_group_of_one_layout_is_checked_at_once_else_row_by_row(monkeypatch, taken, what, into):
    """Every param of its group with state of its own kind (keys in the kind's order), every kind's entries of one
    layout (one kind, or a real model's shapes in turn): the group's rows are checked at once; anything else row by
    row (a double param, whose entries make a layout of their own: each row in its layout's place; a row in another
    key order, which goes to the general path); all load as the general path loads."""
    shapes = [(4,)] * 5 + [(2,) if what == "another shape last" else (4,)]
    if what in ("kinds in turn", "a double param among them"):
        shapes = [(4,), (2,), (3, 2), (4,), (2,), (3, 2)]

    def trained(steps):
        model = Model(shapes)
        if what == "a double param among them":
            model.parts[2].weight.data = model.parts[2].weight.data.double()
        opt = O.Adam([h.weight for h in model.parts], foreach=False)
        train(model, opt, range(steps))
        return model, opt

    lanes = _lanes(monkeypatch)

    def make():
        model, opt = trained(K)
        if into == "fresh":
            opt.state.clear()
        return model, opt

    sd = trained(K + 1)[1].state_dict()
    if what == "a param without state":
        del sd["state"][5]
    elif what == "another key order":
        sd["state"][5] = {k: sd["state"][5][k] for k in ("exp_avg", "step", "exp_avg_sq")}
    _both(make, sd, monkeypatch)
    assert taken[0] is (what != "another key order")  # (a row in another order than its kind's: the general path)
    assert lanes[0] is (what in ("one kind", "another shape last", "kinds in turn"))


@pytest.mark.parametrize("into", ["fresh", "existing state"])
@pytest.mark.parametrize("other", ["shape", "dtype"])
def test_a_param_of_another_kind_under_rows_of_the_first_kind_fails_as_the_general_path_fails(
    monkeypatch, taken, into, other
):
    """Every checkpoint row of the group's first kind, but the last param of another shape or dtype: the group is
    not checked at once (the last param's kind refuses its row), and the load fails as the general path fails,
    naming param 5."""
    lanes = _lanes(monkeypatch)

    def make():
        model, opt = _trained(O.Adam, {"foreach": False}, [(4,)] * 5 + [(2,) if other == "shape" else (4,)])
        if other == "dtype":
            last = opt.param_groups[0]["params"][-1]
            opt.state.pop(last, None)
            last.data = last.data.double()
        if into == "fresh":
            opt.state.clear()
        return model, opt

    sd = _trained(O.Adam, {"foreach": False}, [(4,)] * 6, steps=K + 1)[1].state_dict()
    got = _both(make, sd, monkeypatch)
    assert lanes[0] is False
    assert issubclass(got[0], ValueError) and "param 5" in got[1]


@pytest.mark.parametrize("groups", ["one group", "two groups"])
def test_rows_of_no_entries_load_as_the_general_path_loads_them(monkeypatch, taken, groups):
    """A checkpoint row ``{}`` (left by an access to ``opt.state[p]``; torch installs it as it is): the general
    path loads it. (The uniform path installed no state for such params, or stopped with a bare StopIteration
    beside another layout.)"""

    def make(steps=K):
        model = Model([(4,)] * 4)
        ps = [h.weight for h in model.parts]
        if groups == "one group":
            opt = O.SGD(ps, lr=0.1, foreach=False)
        else:
            opt = O.SGD([{"params": ps[:2], "momentum": 0.9}, {"params": ps[2:]}], lr=0.1, foreach=False)
        train(model, opt, range(steps))
        return model, opt

    sd = make(K + 1)[1].state_dict()
    sd["state"].update({i: {} for i in range(4 if groups == "one group" else 2, 4)})
    if groups == "one group":
        sd["state"].update({i: {} for i in range(4)})
    got = _both(make, sd, monkeypatch)
    assert taken[0] is False
    assert [row for row in got[0][2 if groups == "two groups" else 0 :]] == [[]] * (2 if groups == "two groups" else 4)


def test_a_param_without_state_is_uniform(monkeypatch, taken):
    """A param a lazy class never stepped has no state: it is skipped, as the general path skips it."""
    _both(
        lambda: _trained(O.Adam, {"foreach": False}, [(3, 3), (3,), (3,)]), _edit("a param without state"), monkeypatch
    )
    assert taken[0] is True


def test_under_the_callers_inference_mode_the_load_runs_outside_it(monkeypatch, taken):
    """Inference mode hides the dispatch keys that tell inference tensors apart; a load runs outside the caller's
    (``engine.operation``), so it is uniform there too, and nothing it installs is an inference tensor. A
    checkpoint made of inference tensors is not uniform (the general path clones them)."""
    sd = _adam_sd()
    model, opt = _trained(O.Adam, {"foreach": False}, [(3, 3), (3,), (3,)])
    with torch.inference_mode():
        optimshift.load_state_dict(opt, sd)
    assert taken == [True]
    assert not any(t.is_inference() for st in opt.state.values() for t in st.values())
    with torch.inference_mode():
        made_there = {k: {n: t.clone() for n, t in st.items()} for k, st in sd["state"].items()}
    optimshift.load_state_dict(opt, {"state": made_there, "param_groups": sd["param_groups"]})
    assert taken == [True, False]
    assert not any(t.is_inference() for st in opt.state.values() for t in st.values())


@pytest.mark.parametrize(
    "live",
    [
        "an inference tensor",
        "a view held elsewhere",
        "a float step",
        "a param's grad",
        "one tensor twice",
        "its group's tensor lr",
        "another key order",
    ],
)
@pytest.mark.parametrize("shapes", [((3, 3), (3,), (3,)), ((3,), (3,), (3,))], ids=["two kinds", "one kind"])
def test_live_tensors_that_cannot_take_values_in_place(monkeypatch, taken, live, shapes):
    """The live tensors of a uniform checkpoint are judged one by one as the general path judges them: those that
    cannot be written in place get a copy, adopted into the live object. (The group's rows are checked at once,
    :func:`_uniform._whole_group`, which leaves live state under another key order, or not of its kind, to the loop
    row by row.)"""
    sd = _adam_sd(shapes)
    keep = []
    lanes = _lanes(monkeypatch)

    def make():
        model, opt = _trained(O.Adam, {"foreach": False}, list(shapes))
        p0, p1, _ = (h.weight for h in model.parts)
        if live == "an inference tensor":
            with torch.inference_mode():
                opt.state[p0]["exp_avg"] = opt.state[p0]["exp_avg"].clone()
        elif live == "a view held elsewhere":
            keep.append(opt.state[p0]["exp_avg"][0])
        elif live == "a float step":
            opt.state[p1]["step"] = float(opt.state[p1]["step"])
        elif live == "a param's grad":
            p1.grad = opt.state[p1]["exp_avg"]
        elif live == "one tensor twice":
            opt.state[p1]["exp_avg_sq"] = opt.state[p1]["exp_avg"]
        elif live == "its group's tensor lr":  # (LBFGS's state['t'] is its tensor lr: never written in place)
            opt.param_groups[0]["lr"] = torch.tensor(0.001)
            opt.state[p1]["step"] = opt.param_groups[0]["lr"]
        elif live == "another key order":  # (each live tensor takes the values saved under its own key)
            opt.state[p1] = {k: opt.state[p1][k] for k in ("exp_avg_sq", "step", "exp_avg")}
        return model, opt

    got = _both(make, sd, monkeypatch)
    assert taken[0] is True
    # (at once, but where the live state is not the checkpoint's keys in order, or an entry is no tensor, or not of
    # its kind, or one tensor is there twice, which TensorGuards refuses)
    at_once = live not in (
        "another key order",
        "a float step",
        "an inference tensor",
        "one tensor twice",
    )
    assert lanes[0] is at_once
    written = [entry[7] for row in got[0] for entry in row]
    if live == "another key order":
        assert all(written)
        return
    assert not all(written)
    if live != "one tensor twice":
        assert any(written)  # (the others still take their values in place)


def test_an_inference_checkpoint_into_inference_state_takes_the_general_path(monkeypatch, taken):
    """Inference tensors (a checkpoint read, and a state built, under inference mode) cannot be written outside it:
    the general path copies them, whatever their dispatch keys say to the guard."""
    sd = _adam_sd()
    with torch.inference_mode():
        sd["state"] = {i: {k: v.clone() for k, v in st.items()} for i, st in sd["state"].items()}

    def make():
        model, opt = _trained(O.Adam, {"foreach": False}, [(3, 3), (3,), (3,)])
        with torch.inference_mode():
            for p in list(opt.state):
                opt.state[p] = {k: v.clone() for k, v in opt.state[p].items()}
        return model, opt

    got = _both(make, sd, monkeypatch)
    assert taken[0] is False
    assert not any(entry[7] for row in got[0] for entry in row)  # (no live tensor written in place)


def _out_of_memory_at(monkeypatch, method, sd, n):
    """``torch.Tensor.<method>`` runs out of memory on its ``n``-th call on one of ``sd``'s state tensors (the
    load's copies of them)."""
    saved = {id(t) for st in sd["state"].values() for t in st.values()}
    real, calls = getattr(torch.Tensor, method), []

    def failing(self, *args, **kwargs):
        if id(self) in saved:
            calls.append(1)
            if len(calls) == n:
                raise torch.OutOfMemoryError("out of memory (test)")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, method, failing)


def test_an_oom_on_a_copy_names_the_entry_and_changes_nothing(monkeypatch, taken):
    sd = _adam_sd()
    sd["param_groups"][0]["lr"] = 0.5
    model = Model([(3, 3), (3,), (3,)])
    opt = O.Adam([h.weight for h in model.parts], foreach=False)
    _out_of_memory_at(monkeypatch, "clone", sd, 5)
    with pytest.raises(torch.OutOfMemoryError) as info:
        optimshift.load_state_dict(opt, sd)
    assert taken == ["raised"]  # (in the uniform path)
    assert len(opt.state) == 0 and opt.param_groups[0]["lr"] == 0.001
    (note,) = info.value.__notes__
    assert "while copying Adam: load_state_dict: " in note and "param 1" in note and "'exp_avg'" in note
    assert note.endswith("the optimizer was left unchanged")


def test_a_copied_optimizer_state_dict_loads_uniformly_into_its_twin(monkeypatch, taken):
    """The common resume: ``copy.deepcopy`` of ``state_dict()`` (what torch.save and torch.load give back)."""
    _, source = _trained(O.AdamW, {"foreach": True}, [(4, 3), (3,), (2, 3)], steps=K + 1)
    sd = copy.deepcopy(source.state_dict())
    _both(lambda: _trained(O.AdamW, {"foreach": True}, [(4, 3), (3,), (2, 3)]), sd, monkeypatch)
    assert taken[0] is True


@pytest.mark.parametrize("shapes", [[(4,)] * 4, [(4, 3), (3,), (3,)]], ids=["one kind", "two kinds"])
def test_its_own_state_dict_loads_into_it_as_the_general_path_loads_it(monkeypatch, taken, shapes):
    """``load_state_dict(opt, opt.state_dict())``: every live tensor is the checkpoint's own, so none takes the
    values in place (the state dict would keep holding it): each gets a copy, adopted into the live object."""
    outcomes = []
    lanes = _lanes(monkeypatch)
    for uniform in (True, False):
        _, opt = _trained(O.Adam, {"foreach": False}, shapes)
        sd = opt.state_dict()
        before = _live(opt)
        with monkeypatch.context() as m:
            if not uniform:
                m.setattr(_uniform, "TensorGuards", None)
            optimshift.load_state_dict(opt, sd)
        outcomes.append(_facts(opt, before, sd))
    assert taken == [True, False]  # (the uniform load, then the general one)
    assert lanes == [True]  # (at once, its live tensors checked apart from the sd's)
    assert _same(outcomes[0], outcomes[1])
    kept = [entry[6:] for row in outcomes[0][0] for entry in row]
    # (the live object, which the state dict holds too, as torch's state_dict() does, on a new storage)
    assert kept and all(k == (True, False, True) for k in kept)


_SHAPES = [(4, 3), (3,), (3,), (3,), (2, 2), (3,)]


def _grouped(cls, kwargs, steps=K, stateless=()):
    """Three groups over _SHAPES' params (two, three and one of them, other lrs), trained; the params listed in
    ``stateless`` (by index) then lose their state."""
    model = Model(_SHAPES)
    ps = [h.weight for h in model.parts]
    opt = cls([{"params": ps[:2]}, {"params": ps[2:5], "lr": 0.02}, {"params": ps[5:], "lr": 0.003}], **kwargs)
    train(model, opt, range(steps))
    for i in stateless:
        del opt.state[ps[i]]
    return model, opt


@pytest.mark.parametrize(
    "into", ["fresh", "existing state", "one group without live state", "one param without live state"]
)
@pytest.mark.parametrize("cls, kwargs", [(O.Adam, {"foreach": False}), (O.ASGD, {}), (O.SGD, {"momentum": 0.9})])
def test_several_groups_load_as_the_general_path_loads_them(monkeypatch, taken, cls, kwargs, into):
    """Entries of every group in one pass, paired with their live tensors group by group, some groups or params
    with live state and some without."""
    _, source = _grouped(cls, kwargs, steps=K + 1)
    sd = source.state_dict()

    def make():
        if into == "fresh":
            model = Model(_SHAPES)
            ps = [h.weight for h in model.parts]
            return model, cls([{"params": ps[:2]}, {"params": ps[2:5], "lr": 0.02}, {"params": ps[5:]}], **kwargs)
        stateless = {"one group without live state": (2, 3, 4), "one param without live state": (3,)}.get(into, ())
        return _grouped(cls, kwargs, stateless=stateless)

    got = _both(make, sd, monkeypatch)
    assert taken[0] is True
    written = [entry[7] for row in got[0] for entry in row]
    if into == "fresh":
        assert not any(written)
    else:  # (the params with live state take the values in place, the others get copies)
        assert any(written) and all(written) is (into == "existing state")


@pytest.mark.parametrize("where", ["set on the instance", "patched into the class"])
@pytest.mark.parametrize("uniform", [True, False], ids=["uniform", "general"])
def test_a_setstate_of_its_own_is_handed_the_loaded_values(monkeypatch, uniform, where):
    """Live tensors take the loaded values in place only after a torch.optim class's own ``__setstate__``, which
    fixes up non-tensor entries only; another (set on the instance, or a wrapper patched into the class) may read
    the state it is handed: as with ``torch.optim``'s own ``load_state_dict``, it reads the checkpoint's values
    (copies, adopted afterwards)."""
    sd = _adam_sd()
    model, opt = _trained(O.Adam, {"foreach": False}, [(3, 3), (3,), (3,)])
    live = [st["exp_avg"] for st in opt.state.values()]
    seen = []
    real = O.Adam.__setstate__

    def own(self, state):
        if self is opt:  # (not the probe's throwaway optimizers)
            seen.append([st["exp_avg"].clone() for st in state["state"].values()])
        real(self, state)

    if where == "set on the instance":
        opt.__setstate__ = own.__get__(opt)
    else:
        monkeypatch.setattr(O.Adam, "__setstate__", own)
    if not uniform:
        monkeypatch.setattr(_uniform, "TensorGuards", None)
    optimshift.load_state_dict(opt, sd)
    want = [st["exp_avg"] for st in sd["state"].values()]
    assert len(seen) == 1 and all(torch.equal(a, b) for a, b in zip(seen[0], want))
    assert all(st["exp_avg"] is t for st, t in zip(opt.state.values(), live))  # (still the same objects)


def _device_cases():
    for name, cls, kwargs, _directions, shapes in CASES:
        if name not in _GENERAL and not kwargs.get("capturable"):
            yield pytest.param(name, cls, kwargs, shapes, id=name)


@pytest.mark.parametrize("into", ["fresh", "existing state"])
@pytest.mark.parametrize("name, cls, kwargs, shapes", list(_device_cases()))
def test_a_host_checkpoint_onto_a_device_loads_uniformly_as_the_general_path_loads_it(
    monkeypatch, taken, sim, name, cls, kwargs, shapes, into
):
    """The common resume (issue 27): a checkpoint on the host (what ``optimshift.load`` maps to) into an optimizer
    whose params are on an accelerator. Its entries are copied to the device with the others, in one engine batch,
    by the uniform path (it used to leave every such load to the general path)."""
    _, source = _trained(cls, kwargs, shapes, steps=K + 1)
    sd = source.state_dict()

    def make():
        if into == "fresh":
            model = Model(shapes)
            model.to(sim)
            return model, cls([h.weight for h in model.parts], **kwargs)
        return _trained(cls, kwargs, shapes, device=sim)

    _both(make, sd, monkeypatch)
    assert taken[0] is True


def test_a_host_checkpoint_onto_meta_loads_uniformly(taken):
    """The speed goal's case: 16k params on ``meta`` in the benchmark; the path taken is what this shows."""
    _, source = _trained(O.Adam, {"foreach": False}, [(4, 3), (3,)], steps=K + 1)
    params = [torch.nn.Parameter(torch.empty(s, device="meta")) for s in [(4, 3), (3,)]]
    opt = O.Adam(params, foreach=False)
    optimshift.load_state_dict(opt, source.state_dict())
    assert taken == [True]
    assert [{k: v.device.type for k, v in opt.state[p].items()} for p in params] == [
        {"step": "cpu", "exp_avg": "meta", "exp_avg_sq": "meta"}
    ] * 2


def test_a_host_checkpoint_into_live_device_state_is_written_in_place_by_both_paths(monkeypatch, taken):
    """Into existing state on an accelerator (``meta`` here: its live tensors are nobody else's, as on CUDA), the
    uniform path and the general one both write every entry in place: the host ``step`` from the host, the device
    moments from the host checkpoint (staged in pinned memory where the host is pinned for the device: see
    ``tests/test_copy.py``). The uniform path once did this alone, one pageable copy each, while the general path
    copied the moments to the device and adopted the copies (the state's memory twice on the device)."""
    from optimshift import _engine as engine

    _, source = _trained(O.Adam, {"foreach": False}, [(4, 3), (3,), (2, 3)], steps=K + 1)
    sd = source.state_dict()
    written = []
    real = engine._write_in_place

    def spy(pairs):
        written.append(
            sorted((str(old.device), str(new.device)) for olds, news in pairs.values() for old, new in zip(olds, news))
        )
        return real(pairs)

    monkeypatch.setattr(engine, "_write_in_place", spy)
    for uniform in (True, False):
        params = [torch.nn.Parameter(torch.empty(s, device="meta")) for s in [(4, 3), (3,), (2, 3)]]
        live = O.Adam(params, foreach=False)
        for p in params:
            p.grad = torch.zeros_like(p)
        live.step()
        with monkeypatch.context() as m:
            if not uniform:
                m.setattr(_uniform, "TensorGuards", None)
            optimshift.load_state_dict(live, sd)
        assert [{k: v.device.type for k, v in live.state[p].items()} for p in params] == [
            {"step": "cpu", "exp_avg": "meta", "exp_avg_sq": "meta"}
        ] * 3
    assert taken == [True, False]
    assert written[0] == written[1] == [("cpu", "cpu")] * 3 + [("meta", "cpu")] * 6


def _mixed(device="cpu", steps=K, capturable=False):
    """An Adam over two groups, the second amsgrad (and, on an accelerator, capturable: its ``step`` on the
    device), trained: two layouts (two key sets; two places for ``step``)."""
    model = Model([(4, 3), (3,), (2, 3), (3,)])
    model.to(device)
    ps = [h.weight for h in model.parts]
    second = {"params": ps[2:], "amsgrad": True, "capturable": capturable}
    opt = O.Adam([{"params": ps[:2]}, second], foreach=False)
    train(model, opt, range(steps))
    return model, opt


@pytest.mark.parametrize("into", ["fresh", "existing state"])
@pytest.mark.parametrize("where", ["cpu", "sim"])
def test_entries_of_several_layouts_load_as_the_general_path_loads_them(monkeypatch, taken, sim, where, into):
    """Kinds whose entries differ in keys or places are copied in layouts of their own (the moving columns of one
    source, dtype and target in one batch), then put back row by row in the checkpoint's order: a host checkpoint
    on the host and onto an accelerator, fresh and into existing state."""
    device = sim if where == "sim" else "cpu"
    capturable = where == "sim"
    _, source = _mixed(steps=K + 1)
    sd = source.state_dict()

    def make():
        if into == "fresh":
            model, _ = _mixed()
            model.to(device)
            ps = [h.weight for h in model.parts]
            second = {"params": ps[2:], "amsgrad": True, "capturable": capturable}
            return model, O.Adam([{"params": ps[:2]}, second], foreach=False)
        return _mixed(device, capturable=capturable)

    got = _both(make, sd, monkeypatch)
    assert taken[0] is True
    rows = [{entry[0]: entry[3].type for entry in row} for row in got[0]]
    assert ["max_exp_avg_sq" in row for row in rows] == [False, False, True, True]
    steps = ["cpu", "cpu", "sim", "sim"] if capturable else ["cpu"] * 4
    assert [row["step"] for row in rows] == steps


def test_an_oom_on_a_move_names_the_entry_and_changes_nothing(monkeypatch, taken):
    """A host checkpoint onto ``meta``: the moving columns are copied in one batch (every ``exp_avg``, then every
    ``exp_avg_sq``); the fourth copy runs out of memory, and the note names param 1's ``exp_avg_sq``."""
    _, source = _trained(O.Adam, {"foreach": False}, [(4, 3), (3,)], steps=K + 1)
    sd = source.state_dict()
    params = [torch.nn.Parameter(torch.empty(s, device="meta")) for s in [(4, 3), (3,)]]
    opt = O.Adam(params, foreach=False)
    _out_of_memory_at(monkeypatch, "to", sd, 4)
    with pytest.raises(torch.OutOfMemoryError) as info:
        optimshift.load_state_dict(opt, sd)
    assert taken == ["raised"]  # (in the uniform path)
    assert len(opt.state) == 0
    (note,) = info.value.__notes__
    assert "Adam: load_state_dict: group 0, param 1, state key 'exp_avg_sq' ((3,)" in note and "to meta" in note
    assert note.endswith("the optimizer was left unchanged")


@pytest.mark.parametrize("into", ["fresh", "existing state"])
def test_an_empty_param_beside_others_onto_a_device_loads_as_the_general_path_loads_it(monkeypatch, taken, sim, into):
    """A param with no elements (a zero-width layer) among others: its entries are a layout of their own (a
    column of one batch is all empty or none), copied to the device as the general path copies them."""
    shapes = [(4, 3), (0, 3), (3,)]
    _, source = _trained(O.Adam, {"foreach": False}, shapes, steps=K + 1)
    sd = source.state_dict()

    def make():
        if into == "fresh":
            model = Model(shapes).to(sim)
            return model, O.Adam([h.weight for h in model.parts], foreach=False)
        return _trained(O.Adam, {"foreach": False}, shapes, device=sim)

    _both(make, sd, monkeypatch)
    assert taken[0] is True


def test_a_ctrl_c_while_the_columns_copies_are_decided_names_an_entry_and_changes_nothing(monkeypatch, taken, sim):
    """A Ctrl-C delivered as ``copy_many`` decides how a moving column is copied, after a column copied in one pass
    (each ``step``, cloned where it stays): the note read the item of a column copied in one pass, which has none,
    and the interrupt became ``TypeError: Value after * must be an iterable, not NoneType``. It is the interrupt,
    naming the entry it landed on, nothing installed."""
    import os
    import signal

    from optimshift import _copy

    _, source = _trained(O.Adam, {"foreach": False}, [(4, 3), (3,)], steps=K + 1)
    model = Model([(4, 3), (3,)]).to(sim)
    opt = O.Adam([h.weight for h in model.parts], foreach=False)
    real = _copy.pins_host_for

    def interrupted(device):
        if device.type == sim.type:
            os.kill(os.getpid(), signal.SIGINT)  # (delivered as it returns, in copy_many's decisions)
        return real(device)

    monkeypatch.setattr(_copy, "pins_host_for", interrupted)
    with pytest.raises(KeyboardInterrupt) as info:
        optimshift.load_state_dict(opt, source.state_dict())
    assert taken == ["raised"]  # (in the uniform path)
    assert len(opt.state) == 0
    (note,) = info.value.__notes__
    assert "Adam: load_state_dict: group 0, param 0, state key 'exp_avg' ((4, 3)" in note and f"to {sim}" in note
    assert note.endswith("the optimizer was left unchanged")

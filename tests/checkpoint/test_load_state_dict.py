"""``optimshift.load_state_dict``: equal to ``optimizer.load_state_dict`` where PyTorch is right, and right
where it is not (strings, namedtuples, dtypes, NAdam's ``mu_product``, flags, aliasing, quadratic time);
validation before any change; hooks and ``__setstate__`` fix-ups as in PyTorch."""

from __future__ import annotations

import collections
import contextlib
import copy
import functools
import gc
import io

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import optimshift
from _matrix import CASES, Model, bitwise_equal, state_dtypes, state_layout, train

K, M = 2, 2
O = torch.optim


def _trained(cls, kwargs, shapes, device="cpu", steps=K):
    model = Model(shapes)
    model.to(device)
    opt = cls([h.weight for h in model.parts], **kwargs)
    train(model, opt, range(steps))
    return model, opt


def _twin(model, cls, kwargs, device=None):
    """A model with the same param values (on ``device``) and a new optimizer over it."""
    twin = copy.deepcopy(model)
    if device is not None:
        twin.to(device)
    return twin, cls([h.weight for h in twin.parts], **kwargs)


def _host(value):
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu")
    if isinstance(value, dict):
        return {k: _host(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_host(v) for v in value)
    return value


def _state(opt):
    return [_host(dict(opt.state[p])) for g in opt.param_groups for p in g["params"] if p in opt.state]


def _groups(opt):
    return [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]


def _fingerprint(opt):
    """Identity of everything an aborted load could have touched."""
    return (
        id(opt.state),
        id(opt.param_groups),
        [(id(p), id(st), [(k, id(v)) for k, v in st.items()]) for p, st in opt.state.items()],
        [
            (id(g), {k: v for k, v in g.items() if k != "params"}, [id(p) for p in g["params"]])
            for g in opt.param_groups
        ],
    )


# --- equivalence where PyTorch is right ---------------------------------------------------------------------


def _host_cases():
    for name, cls, kwargs, _directions, shapes in CASES:
        if not kwargs.get("capturable"):  # capturable cannot step on a CPU
            yield pytest.param(cls, kwargs, shapes, id=name)


@pytest.mark.parametrize("cls, kwargs, shapes", list(_host_cases()))
def test_equivalent_to_pytorch_on_host(cls, kwargs, shapes):
    model, opt = _trained(cls, kwargs, shapes)
    sd = opt.state_dict()
    theirs_model, theirs = _twin(model, cls, kwargs)
    ours_model, ours = _twin(model, cls, kwargs)
    theirs.load_state_dict(sd)
    optimshift.load_state_dict(ours, sd)
    assert state_layout(ours) == state_layout(theirs)
    assert state_dtypes(ours) == state_dtypes(theirs)
    assert bitwise_equal(_state(ours), _state(theirs))
    assert _groups(ours) == _groups(theirs)
    train(theirs_model, theirs, range(K, K + M))
    train(ours_model, ours, range(K, K + M))
    for a, b in zip(ours_model.parameters(), theirs_model.parameters()):
        assert bitwise_equal(a, b)


# Host -> device, where PyTorch moves a host scalar onto the device (it casts every non-`step` tensor there, and
# keeps a `step` wherever it was saved): the only classes of the matrix where it differs from a fresh optimizer.
PYTORCH_MISPLACES_H2D = {
    "NAdam": {"mu_product"},
    "NAdam-foreach-decoupled": {"mu_product"},
    "ASGD": {"step"},
    "ASGD-foreach": {"step"},
}


def _sim_cases():
    for name, cls, kwargs, _directions, shapes in CASES:
        if not kwargs.get("capturable"):
            yield pytest.param(name, cls, kwargs, shapes, id=name)


@pytest.mark.parametrize("name, cls, kwargs, shapes", list(_sim_cases()))
def test_host_to_device_against_pytorch(sim, name, cls, kwargs, shapes):
    model, opt = _trained(cls, kwargs, shapes)
    sd = opt.state_dict()
    _, theirs = _twin(model, cls, kwargs, sim)
    _, ours = _twin(model, cls, kwargs, sim)
    fresh_model, fresh = _twin(Model(shapes), cls, kwargs, sim)
    train(fresh_model, fresh, range(1))
    theirs.load_state_dict(sd)
    optimshift.load_state_dict(ours, sd)
    assert state_layout(ours) == state_layout(fresh)
    assert bitwise_equal(_state(ours), _state(theirs))
    differs = {key[1] for key, dev in state_layout(theirs).items() if state_layout(ours)[key] != dev}
    assert differs == PYTORCH_MISPLACES_H2D.get(name, set())


# --- where PyTorch is wrong: one test each -------------------------------------------------------------------


def _sgd(value_key=None, value=None):
    p = torch.nn.Parameter(torch.randn(3))
    opt = O.SGD([p], lr=0.1, momentum=0.9)
    p.grad = torch.ones(3)
    opt.step()
    sd = opt.state_dict()
    if value_key is not None:
        sd["state"][0][value_key] = value
    return sd


def test_string_in_state_is_kept():
    sd = _sgd("note", "warmup done")
    theirs = O.SGD([torch.nn.Parameter(torch.randn(3))], lr=0.1, momentum=0.9)
    theirs.load_state_dict(sd)
    assert list(theirs.state.values())[0]["note"].startswith("<generator object")  # PyTorch mangles it
    ours = O.SGD([torch.nn.Parameter(torch.randn(3))], lr=0.1, momentum=0.9)
    optimshift.load_state_dict(ours, sd)
    assert list(ours.state.values())[0]["note"] == "warmup done"


Pair = collections.namedtuple("Pair", "buf count")


def test_namedtuple_in_state_is_rebuilt(sim):
    sd = _sgd("pair", Pair(torch.arange(3.0), 7))
    theirs = O.SGD([torch.nn.Parameter(torch.randn(3))], lr=0.1, momentum=0.9)
    with pytest.raises(TypeError):
        theirs.load_state_dict(sd)  # PyTorch rebuilds it as type(value)(generator)
    p = torch.nn.Parameter(torch.randn(3, device=sim))
    ours = O.SGD([p], lr=0.1, momentum=0.9)
    optimshift.load_state_dict(ours, sd)
    pair = ours.state[p]["pair"]
    assert type(pair) is Pair and pair.count == 7 and pair.buf.device == sim
    assert bitwise_equal(pair.buf, torch.arange(3.0))
    assert pair.buf is not sd["state"][0]["pair"].buf


def test_dtype_is_kept_unless_cast_param():
    # fp32 optimizer state for bf16 params (mixed precision keeps the momentum in fp32): SGD steps with it.
    p = torch.nn.Parameter(torch.randn(4, 3))
    opt = O.SGD([p], lr=0.1, momentum=0.9, foreach=False)
    p.grad = torch.randn(4, 3)
    opt.step()
    sd = opt.state_dict()
    sd["state"][0]["momentum_buffer"] = sd["state"][0]["momentum_buffer"] + 1e-3  # bits that bf16 cannot hold

    def bf16():
        return O.SGD([torch.nn.Parameter(torch.randn(4, 3, dtype=torch.bfloat16))], lr=0.1, momentum=0.9, foreach=False)

    theirs, ours, cast = bf16(), bf16(), bf16()
    theirs.load_state_dict(sd)
    optimshift.load_state_dict(ours, sd)
    optimshift.load_state_dict(cast, sd, cast="param")
    saved = sd["state"][0]["momentum_buffer"]
    assert list(theirs.state.values())[0]["momentum_buffer"].dtype == torch.bfloat16  # PyTorch casts: values lost
    got = list(ours.state.values())[0]["momentum_buffer"]
    assert got.dtype == torch.float32 and bitwise_equal(got, saved)
    assert bitwise_equal(_state(cast), _state(theirs))  # cast="param" is PyTorch's behaviour, bit for bit
    q = ours.param_groups[0]["params"][0]
    q.grad = torch.ones_like(q)
    ours.step()  # kept because the step accepts it
    assert got.dtype == torch.float32


def _fp64_adam_checkpoint(cls=O.Adam, **kwargs):
    p = torch.nn.Parameter(torch.randn(4, 3, dtype=torch.float64))
    opt = cls([p], **kwargs)
    p.grad = torch.randn(4, 3, dtype=torch.float64)
    opt.step()
    return opt.state_dict()


@pytest.mark.parametrize(
    "kwargs", [{"foreach": False}, {"foreach": True}, {"fused": True}], ids=["single", "foreach", "fused"]
)
def test_a_dtype_the_step_would_reject_fails_the_load_before_anything_changes(kwargs):
    """float64 moments kept (cast=None) for float32 params: Adam's next step() would raise (lerp_ wants the
    moments in the grad's dtype). The load fails first, naming the key and both dtypes and the fix."""
    sd = _fp64_adam_checkpoint(**kwargs)
    p = torch.nn.Parameter(torch.randn(4, 3))
    opt = O.Adam([p], **kwargs)
    p.grad = torch.randn(4, 3)
    opt.step()
    before = {k: v.clone() for k, v in opt.state[p].items()}
    objects = dict(opt.state[p])
    groups = opt.param_groups
    with pytest.raises(ValueError) as raised:
        optimshift.load_state_dict(opt, sd)
    message = str(raised.value)
    assert "group 0, param 0" in message and "'exp_avg'" in message
    assert "float64" in message and "float32" in message and "cast='param'" in message
    assert opt.param_groups is groups and all(opt.state[p][k] is v for k, v in objects.items())
    assert bitwise_equal(dict(opt.state[p]), before)
    optimshift.load_state_dict(opt, sd, cast="param")  # the suggested fix loads, and the optimizer steps
    assert opt.state[p]["exp_avg"].dtype == torch.float32
    opt.step()


@pytest.mark.parametrize("kwargs", [{"foreach": False}, {"foreach": True}], ids=["single", "foreach"])
def test_a_complex_dtype_the_step_would_reject_fails_the_load_and_check_finds_it(kwargs):
    """Adam steps complex params: complex64 moments under complex128 params fail its step, as float64 ones under
    float32 params do. The load refused the real case only (the host trial skipped complex params): it took the
    complex one, and the next step() raised; check() of an optimizer torch loaded so said nothing. PyTorch's cast
    leaves a complex param's state as saved, so the message does not offer cast='param'."""
    torch.manual_seed(0)
    src = [torch.nn.Parameter(torch.randn(4, 3, dtype=torch.complex64))]
    source = O.Adam(src, **kwargs)
    src[0].grad = torch.randn_like(src[0])
    source.step()
    sd = source.state_dict()
    p = torch.nn.Parameter(torch.randn(4, 3, dtype=torch.complex128))
    opt = O.Adam([p], **kwargs)
    p.grad = torch.randn_like(p)
    opt.step()
    before = {k: v.clone() for k, v in opt.state[p].items()}
    objects = dict(opt.state[p])
    with pytest.raises(ValueError) as raised:
        optimshift.load_state_dict(opt, sd)
    message = str(raised.value)
    assert "group 0, param 0" in message and "'exp_avg'" in message
    assert "complex64" in message and "complex128" in message and "cast the checkpoint's entries" in message
    assert all(opt.state[p][k] is v for k, v in objects.items()) and bitwise_equal(dict(opt.state[p]), before)
    theirs = O.Adam([torch.nn.Parameter(p.detach().clone())], **kwargs)
    theirs.load_state_dict(sd)  # (torch takes it; its next step raises)
    findings = [f for f in optimshift.check(theirs).findings if f.severity == "error"]
    assert {f.key for f in findings} >= {"exp_avg"} and "cast='param'" not in findings[0].why
    # SGD's step takes complex128 momentum for complex64 params: kept as saved
    sgd_src = [torch.nn.Parameter(torch.randn(4, dtype=torch.complex128))]
    sgd = O.SGD(sgd_src, lr=0.1, momentum=0.9)
    sgd_src[0].grad = torch.randn_like(sgd_src[0])
    sgd.step()
    q = torch.nn.Parameter(torch.randn(4, dtype=torch.complex64))
    ours = O.SGD([q], lr=0.1, momentum=0.9)
    optimshift.load_state_dict(ours, sgd.state_dict())
    assert ours.state[q]["momentum_buffer"].dtype == torch.complex128
    q.grad = torch.randn_like(q)
    ours.step()


def test_a_dtype_the_step_accepts_is_kept():
    """SGD's step takes float64 momentum for float32 params (in-place ops cast into the param): kept as saved."""
    sd = _fp64_adam_checkpoint(O.SGD, lr=0.1, momentum=0.9)
    p = torch.nn.Parameter(torch.randn(4, 3))
    opt = O.SGD([p], lr=0.1, momentum=0.9)
    optimshift.load_state_dict(opt, sd)
    assert opt.state[p]["momentum_buffer"].dtype == torch.float64
    p.grad = torch.randn(4, 3)
    opt.step()


def test_a_cast_load_onto_meta_keeps_the_saved_dtype_of_a_scalar_it_keeps_on_the_host():
    """cast='param' onto bf16 params on meta: NAdam's ``mu_product`` stays on the host with its values, as a fresh
    optimizer keeps it, float32 as saved. PyTorch casts it only as its load sends it to the param (on meta, where
    its value is lost); cast on the host to bf16, it would be refused there beside the params once on an accelerator
    under the foreach step. (meta is a host device elsewhere, ``_devices.HOSTS``, but not the host here.)"""
    p = torch.nn.Parameter(torch.randn(3, 2, dtype=torch.bfloat16))
    saved = O.NAdam([p])
    p.grad = torch.randn_like(p)
    saved.step()
    sd = saved.state_dict()
    q = torch.nn.Parameter(torch.empty(3, 2, dtype=torch.bfloat16, device="meta"))
    opt = optimshift.load_state_dict(O.NAdam([q]), sd, cast="param")
    mu = opt.state[q]["mu_product"]
    assert (mu.device.type, mu.dtype) == ("cpu", torch.float32) and bitwise_equal(mu, sd["state"][0]["mu_product"])
    assert opt.state[q]["exp_avg"].dtype == torch.bfloat16 and opt.state[q]["exp_avg"].is_meta


def test_nadam_mu_product_stays_on_host(sim):
    model, opt = _trained(O.NAdam, {"foreach": False}, [(4, 3), (3,)])
    sd = opt.state_dict()
    theirs_model, theirs = _twin(model, O.NAdam, {"foreach": False}, sim)
    ours_model, ours = _twin(model, O.NAdam, {"foreach": False}, sim)
    theirs.load_state_dict(sd)
    optimshift.load_state_dict(ours, sd)
    assert all(st["mu_product"].device == sim for st in theirs.state.values())
    assert all(st["mu_product"].device.type == "cpu" for st in ours.state.values())
    with optimshift.count_syncs() as theirs_syncs:
        train(theirs_model, theirs, range(K, K + 1))
    with optimshift.count_syncs() as ours_syncs:
        train(ours_model, ours, range(K, K + 1))
    assert ours_syncs.total == 0
    assert theirs_syncs.total == 2 * 2  # 2 host syncs per param per step, 2 params
    for a, b in zip(ours_model.parameters(), theirs_model.parameters()):
        assert bitwise_equal(a, b)


def test_live_flags_are_kept(sim):
    """A checkpoint made with capturable=True on the device, resumed on a CPU."""
    p = torch.nn.Parameter(torch.randn(4, 3, device=sim))
    src = O.Adam([p], capturable=True, foreach=False, lr=0.01)
    p.grad = torch.randn(4, 3, device=sim)
    src.step()
    sd = src.state_dict()

    def cpu_adam():
        q = torch.nn.Parameter(p.detach().to("cpu"))
        q.grad = torch.randn(4, 3)
        return O.Adam([q], foreach=False, lr=0.5)

    theirs = cpu_adam()
    theirs.load_state_dict(sd)
    assert theirs.param_groups[0]["capturable"] is True  # PyTorch adopts the checkpoint's flags...
    with pytest.raises((RuntimeError, AssertionError), match="capturable=True"):
        theirs.step()  # ...and the CPU cannot run them
    ours = cpu_adam()
    optimshift.load_state_dict(ours, sd)
    group = ours.param_groups[0]
    assert group["capturable"] is False and group["lr"] == 0.01  # live flags, checkpoint hyperparameters
    assert optimshift.check(ours).ok
    ours.step()
    as_saved = cpu_adam()
    optimshift.load_state_dict(as_saved, sd, flags="checkpoint")
    assert _groups(as_saved) == _groups(theirs)


def test_never_aliases_the_callers_tensors():
    model, opt = _trained(O.Adam, {"foreach": False}, [(4, 3)])
    sd = opt.state_dict()
    saved = [t for st in sd["state"].values() for t in st.values()]
    before = [t.clone() for t in saved]
    theirs_model, theirs = _twin(model, O.Adam, {"foreach": False})
    theirs.load_state_dict(sd)
    assert any(t is s for st in theirs.state.values() for t in st.values() for s in saved)  # PyTorch aliases
    ours_model, ours = _twin(model, O.Adam, {"foreach": False})
    optimshift.load_state_dict(ours, sd)
    held = [t for st in ours.state.values() for t in st.values()]
    assert not any(t.untyped_storage().data_ptr() == s.untyped_storage().data_ptr() for t in held for s in saved)
    train(ours_model, ours, range(K, K + 1))
    assert all(bitwise_equal(a, b) for a, b in zip(saved, before)), "stepping must not write into the caller's dict"
    shared_model, shared = _twin(model, O.Adam, {"foreach": False})
    optimshift.load_state_dict(shared, sd, copy=False)
    assert [t for st in shared.state.values() for t in st.values()] == saved  # copy=False: PyTorch's aliasing


class CountingId(int):
    """A param id that counts equality comparisons: PyTorch's load scans the param groups with ``in`` once per
    state tensor; a linear load looks ids up by hash (and identity) instead."""

    comparisons = 0

    def __eq__(self, other):
        CountingId.comparisons += 1
        return int.__eq__(self, other)

    __hash__ = int.__hash__


def _counting_state_dict(n):
    params = [torch.nn.Parameter(torch.randn(2)) for _ in range(n)]
    opt = O.Adam(params, foreach=False)
    for p in params:
        p.grad = torch.ones(2)
    opt.step()
    sd = opt.state_dict()
    ids = {i: CountingId(i) for i in sd["state"]}
    sd["state"] = {ids[i]: st for i, st in sd["state"].items()}
    for g in sd["param_groups"]:
        g["params"] = [ids[i] for i in g["params"]]
    return params, sd


def _comparisons(load, n):
    params, sd = _counting_state_dict(n)
    opt = O.Adam([torch.nn.Parameter(p.detach().clone()) for p in params], foreach=False)
    CountingId.comparisons = 0
    load(opt, sd)
    return CountingId.comparisons


@pytest.mark.parametrize("sharing", ["one tensor", "one tensor and views of one storage"])
def test_what_the_checkpoint_shares_stays_shared(sharing):
    """One tensor held by two entries of the checkpoint loads as one copy held by both; tensors that share a
    storage (views of one buffer) load as views of one copied storage. Neither is the caller's."""
    model, opt = _trained(O.SGD, {"lr": 0.1, "momentum": 0.9}, [(4, 3), (4, 3), (4, 3)])
    sd = opt.state_dict()
    one = torch.arange(12.0).reshape(4, 3)
    sd["state"][0]["momentum_buffer"] = sd["state"][1]["momentum_buffer"] = one
    if sharing != "one tensor":
        # (as torch.load makes them: two tensors on one storage, no base; nothing else uses it)
        storage = torch.arange(24.0).untyped_storage()
        sd["state"][2]["momentum_buffer"] = torch.empty(0).set_(storage, 0, (4, 3), (3, 1))
        sd["state"][2]["extra"] = torch.empty(0).set_(storage, 12, (4, 3), (3, 1))
        source = storage.data_ptr()
        del storage
    _, new = _twin(model, O.SGD, {"lr": 0.1, "momentum": 0.9})
    optimshift.load_state_dict(new, sd)
    a, b, c = (new.state[p] for p in new.param_groups[0]["params"])
    assert a["momentum_buffer"] is b["momentum_buffer"] and a["momentum_buffer"] is not one
    assert torch.equal(a["momentum_buffer"], one)
    if sharing != "one tensor":
        storage = c["momentum_buffer"].untyped_storage()
        assert c["extra"].untyped_storage().data_ptr() == storage.data_ptr() != source
        assert torch.equal(c["extra"], torch.arange(12.0, 24.0).view(4, 3))


def _two_trained_adams():
    """An optimizer with state, and the state dict of another over params of the same shapes (other values)."""
    model, opt = _trained(O.Adam, {"foreach": False}, [(3, 3), (3, 3)])
    _, other = _trained(O.Adam, {"foreach": False}, [(3, 3), (3, 3)], steps=K + 1)
    return model, opt, other.state_dict()


def test_existing_state_takes_the_values_in_place():
    """Loading into state that already fits (same device, dtype, shape, contiguous, nothing else on its storage)
    copies the values into the live tensors: same objects, same storage (a CUDA graph's addresses stay valid),
    no copy made first; values bitwise the checkpoint's, which shares nothing with the optimizer."""
    model, opt, sd = _two_trained_adams()
    live = [(t, t.data_ptr()) for st in opt.state.values() for t in st.values()]
    saved = [t for st in sd["state"].values() for t in st.values()]
    optimshift.load_state_dict(opt, sd)
    now = [t for st in opt.state.values() for t in st.values()]
    assert all(t is old and t.data_ptr() == ptr for t, (old, ptr) in zip(now, live))
    assert all(bitwise_equal(t, s) and t.data_ptr() != s.data_ptr() for t, s in zip(now, saved))
    train(model, opt, range(K + 1, K + 2))
    assert optimshift.check(opt).ok


@pytest.mark.parametrize("made_by", ["torch.save", "copy.deepcopy"])
def test_state_saved_before_still_takes_the_values_in_place(made_by):
    """``torch.save`` (and ``deepcopy``) of the live state makes each tensor's Python storage object, which torch
    keeps alive with the storage and which nobody holds: the live tensors still take the values in place. Before,
    that object counted as a second user of the storage, and every load after a checkpoint was saved allocated
    the whole state again (twice the state's memory on the device) and adopted the copies."""
    model, opt, sd = _two_trained_adams()
    if made_by == "torch.save":
        torch.save(opt.state_dict(), io.BytesIO())
    else:
        copy.deepcopy(opt.state_dict())
    gc.collect()  # (an older torch keeps the storage objects torch.save made in a cycle until a collection)
    live = [(t, t.data_ptr()) for st in opt.state.values() for t in st.values()]
    optimshift.load_state_dict(opt, sd)
    now = [t for st in opt.state.values() for t in st.values()]
    assert all(t is old and t.data_ptr() == ptr for t, (old, ptr) in zip(now, live))
    saved = [t for st in sd["state"].values() for t in st.values()]
    assert all(bitwise_equal(t, s) for t, s in zip(now, saved))


def test_a_storage_object_someone_holds_keeps_its_tensor_from_being_written_in_place():
    """A user who holds a live tensor's storage object reads through it: that tensor takes a copy instead (the
    adoption), and the storage object keeps the old values; the others are written in place."""
    model, opt, sd = _two_trained_adams()
    first = opt.state[opt.param_groups[0]["params"][0]]["exp_avg"]
    other = opt.state[opt.param_groups[0]["params"][1]]["exp_avg"]
    held, before = first.untyped_storage(), first.clone()
    ptrs = first.data_ptr(), other.data_ptr()
    optimshift.load_state_dict(opt, sd)
    assert opt.state[opt.param_groups[0]["params"][0]]["exp_avg"] is first and first.data_ptr() != ptrs[0]
    assert other.data_ptr() == ptrs[1]
    assert bitwise_equal(torch.tensor([], dtype=first.dtype).set_(held).view_as(before), before)
    assert bitwise_equal(first, sd["state"][0]["exp_avg"])


def _adams_of_two_dtypes(device, steps):
    """A trained Adam over two params, the second (and its state) in float64."""
    model, opt = _trained(O.Adam, {"foreach": False}, [(3, 3), (2, 5)], device=device, steps=steps)
    p = model.parts[1].weight
    model.parts[1].double()
    opt.state[p] = {k: v.double() if k != "step" else v for k, v in opt.state[p].items()}
    return model, opt


@pytest.mark.parametrize("where", ["host", "host and accelerator"])
def test_existing_state_of_two_dtypes_and_devices_takes_the_values(sim, where):
    """State of two dtypes (one param in float64), on the host or on two devices (Adam's host ``step`` beside
    moments on the accelerator): every live tensor keeps its object and takes the checkpoint's values (the
    in-place copies are batched per device); on the host, in place (same storage); and the optimizer then steps
    as the one the checkpoint came from."""
    device = "cpu" if where == "host" else sim
    model, opt = _adams_of_two_dtypes(device, K)
    other_model, other = _adams_of_two_dtypes(device, K + 1)
    live = [(t, t.data_ptr()) for st in opt.state.values() for t in st.values()]
    assert len({t.dtype for t, _ in live}) == 2
    assert {t.device.type for t, _ in live} == ({"cpu"} if where == "host" else {"cpu", sim.type})
    optimshift.load_state_dict(opt, other.state_dict())
    now = [t for st in opt.state.values() for t in st.values()]
    assert all(t is old for t, (old, _) in zip(now, live))
    # (the simulator's backend keeps its own reference to each storage: not the sole user, so adopted instead)
    assert all(t.data_ptr() == ptr for t, (_, ptr) in zip(now, live) if t.device.type == "cpu")
    assert bitwise_equal(_state(opt), _state(other))
    other_model.load_state_dict(model.state_dict())
    for o in (opt, other):
        for p in o.param_groups[0]["params"]:
            p.grad = torch.full_like(p, 0.5)
        o.step()
    assert bitwise_equal(_state(opt), _state(other))


def _complex_adam(steps):
    torch.manual_seed(steps)
    p = torch.nn.Parameter(torch.randn(4, dtype=torch.cfloat))
    opt = O.Adam([p], foreach=False)
    for _ in range(steps):
        p.grad = torch.randn_like(p)
        opt.step()
    return p, opt


@pytest.mark.parametrize("failure", ["the batched copy is refused", "a conjugate view's temporary runs out"])
def test_in_place_copies_complete_when_the_batched_copy_fails(monkeypatch, failure):
    """The in-place copies run after __setstate__ (nothing may fail there): when the batched foreach copy fails
    (on CUDA it refuses some dtypes, uint32; for a conjugate view it first allocates a resolved temporary, which
    can run out of memory), each pair is copied one by one and the load completes, in place. Found by review:
    the failure left the checkpoint's groups over the old state values."""
    p, opt = _complex_adam(2)
    _, other = _complex_adam(3)
    sd = other.state_dict()
    want = {k: v.clone() for k, v in sd["state"][0].items()}
    sd["param_groups"][0]["lr"] = 0.5
    live = {k: (v, v.data_ptr()) for k, v in opt.state[p].items()}
    armed = []
    if failure == "the batched copy is refused":

        def refuse(*args, **kwargs):
            raise RuntimeError("\"foreach_tensor_copy\" not implemented for 'UInt32'")

        monkeypatch.setattr(torch, "_foreach_copy_", refuse)
        mode = contextlib.nullcontext()
    else:
        sd["state"][0]["exp_avg"] = want["exp_avg"].conj_physical().conj()  # the same values, a conjugate view

        class OutOfMemoryAfterSetstate(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if armed and func is torch.ops.aten.clone.default:
                    raise torch.OutOfMemoryError("simulated: out of memory")
                return func(*args, **(kwargs or {}))

        # (armed by the batched copy itself, which runs after __setstate__: a __setstate__ patched into the class
        # would keep the live tensors from taking the values in place at all)
        batched = torch._foreach_copy_

        def armed_batched_copy(*args, **kwargs):
            armed.append(True)
            return batched(*args, **kwargs)

        monkeypatch.setattr(torch, "_foreach_copy_", armed_batched_copy)
        mode = OutOfMemoryAfterSetstate()
    with mode:
        optimshift.load_state_dict(opt, sd)
    assert failure == "the batched copy is refused" or armed, "precondition: the failure was armed"
    assert opt.param_groups[0]["lr"] == 0.5
    for k, (old, ptr) in live.items():
        assert opt.state[p][k] is old and old.data_ptr() == ptr
    assert bitwise_equal(dict(opt.state[p]), want)


@pytest.mark.parametrize("how", ["params permuted", "keys swapped"])
def test_a_state_dict_made_of_live_tensors_loads_its_values(how):
    """A state dict whose tensors are the optimizer's own live tensors, at other places (its own state_dict()
    with the params permuted, or two entries swapped): each place gets the values the state dict holds for it.
    Found by review: written in place one by one, a later copy read a live tensor an earlier one had
    overwritten."""
    ps = [torch.nn.Parameter(torch.randn(3)) for _ in range(2)]
    opt = O.Adam(ps, foreach=False)
    for _ in range(2):
        for p in ps:
            p.grad = torch.randn(3)
        opt.step()
    sd = opt.state_dict()
    if how == "params permuted":
        sd["state"] = {0: sd["state"][1], 1: sd["state"][0]}
    else:
        st = sd["state"][0]
        sd["state"][0] = {**st, "exp_avg": st["exp_avg_sq"], "exp_avg_sq": st["exp_avg"]}
    want = {i: {k: v.clone() for k, v in st.items()} for i, st in sd["state"].items()}
    objects = [id(v) for st in opt.state.values() for v in st.values()]
    optimshift.load_state_dict(opt, sd)
    for i, p in enumerate(ps):
        assert bitwise_equal(dict(opt.state[p]), want[i])
    assert [id(v) for st in opt.state.values() for v in st.values()] == objects


def test_lbfgs_live_t_that_is_its_tensor_lr_takes_the_checkpoints_t():
    """LBFGS's live state['t'] is its group's tensor lr; the checkpoint's t is not its lr. The loaded t holds the
    checkpoint's t and the loaded lr its lr, two tensors as in the checkpoint. Found by review: t was written in
    place, then the group's adoption gave the same object lr's value."""

    def lbfgs(steps):
        p = torch.nn.Parameter(torch.randn(4))
        opt = O.LBFGS([p], lr=torch.tensor(0.5), max_iter=1)

        def closure():
            opt.zero_grad()
            loss = (p**2).sum()
            loss.backward()
            return loss

        for _ in range(steps):
            opt.step(closure)
        return p, opt

    p, opt = lbfgs(3)
    assert opt.state[p]["t"] is opt.param_groups[0]["lr"], "precondition: the live t is the lr"
    _, other = lbfgs(1)
    sd = other.state_dict()
    assert sd["state"][0]["t"] is not sd["param_groups"][0]["lr"], "precondition: the checkpoint's are two"
    t, lr = sd["state"][0]["t"].clone(), sd["param_groups"][0]["lr"].clone()
    optimshift.load_state_dict(opt, sd)
    assert bitwise_equal(opt.state[p]["t"], t) and bitwise_equal(opt.param_groups[0]["lr"], lr)
    assert opt.state[p]["t"] is not opt.param_groups[0]["lr"]


@pytest.mark.parametrize("held", ["a view of it", "one tensor in two places"])
def test_live_state_used_elsewhere_is_not_written_in_place(held):
    """A live tensor something else reads (a view a user keeps) keeps its object but gets new storage (the
    adoption): the view keeps the old values. One that sits in two places, given two values, is written by
    neither: each place gets its own copy."""
    model, opt, sd = _two_trained_adams()
    first, second = (opt.state[p] for p in opt.param_groups[0]["params"])
    old = first["exp_avg"]
    if held == "one tensor in two places":
        second["exp_avg"] = old
    before, ptr = old.clone(), old.data_ptr()
    view = old[0] if held == "a view of it" else None
    optimshift.load_state_dict(opt, sd)
    first, second = (opt.state[p] for p in opt.param_groups[0]["params"])  # (the loaded state's own dicts)
    assert bitwise_equal(first["exp_avg"], sd["state"][0]["exp_avg"])
    assert bitwise_equal(second["exp_avg"], sd["state"][1]["exp_avg"])
    if held == "a view of it":
        assert first["exp_avg"] is old and old.data_ptr() != ptr and bitwise_equal(view, before[0])
    else:
        assert first["exp_avg"] is not second["exp_avg"] and bitwise_equal(old, before)


def test_the_copies_a_load_made_are_listed_once_and_only_for_live_tensors(monkeypatch):
    """Live tensors that cannot take the values in place (a view of each is held) adopt the copies made: their ids
    are listed once per load, not once per live tensor (quadratic), and not at all for a fresh optimizer."""
    from optimshift.checkpoint import _staging

    calls = []
    made_ids = _staging.Staging.made_ids
    monkeypatch.setattr(_staging.Staging, "made_ids", lambda self: calls.append(1) or made_ids(self))
    model, opt, sd = _two_trained_adams()
    live = [st["exp_avg"] for st in opt.state.values()]
    views, before = [t[0] for t in live], [t[0].clone() for t in live]
    optimshift.load_state_dict(opt, sd)
    assert len(calls) == 1 and all(st["exp_avg"] is t for st, t in zip(opt.state.values(), live))
    assert all(bitwise_equal(v, b) for v, b in zip(views, before))  # (the adoption: new storage, the views the old)
    _, fresh = _twin(model, O.Adam, {"foreach": False})
    optimshift.load_state_dict(fresh, sd)
    assert len(calls) == 1


def test_linear_time_no_group_scans():
    pytorch = [_comparisons(lambda o, sd: o.load_state_dict(sd), n) for n in (100, 200)]
    assert pytorch[1] > 3.5 * pytorch[0] > 3.5 * 100 * 100 / 2  # quadratic: one scan per state tensor
    ours = [_comparisons(optimshift.load_state_dict, n) for n in (100, 200)]
    assert ours[1] <= 2 * 200, f"{ours} equality comparisons: not linear"


class _OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def test_linear_time_ops_per_tensor(sim):
    counts = []
    for n in (20, 40, 60):
        params = [torch.nn.Parameter(torch.randn(3)) for _ in range(n)]
        opt = O.Adam(params, foreach=False)
        for p in params:
            p.grad = torch.ones(3)
        opt.step()
        sd = opt.state_dict()
        target = O.Adam([torch.nn.Parameter(p.detach().to(sim)) for p in params], foreach=False)
        optimshift.load_state_dict(target, sd)  # warm (probes, caches)
        with _OpCounter() as counter:
            optimshift.load_state_dict(target, sd)
        counts.append(counter.ops)
    per_20 = counts[1] - counts[0]
    assert counts[2] - counts[1] == per_20, counts  # each 20 more params cost the same number of ops: linear
    assert per_20 <= 20 * 3 * 3, counts  # at most 3 ops per state tensor (Adam: 3 per param)


# --- placement options ---------------------------------------------------------------------------------------


def test_device_argument_places_for_that_device(sim):
    model, opt = _trained(O.Adam, {"foreach": False}, [(4, 3), (3,)])
    sd = opt.state_dict()
    twin, ours = _twin(model, O.Adam, {"foreach": False})  # params still on the host
    optimshift.load_state_dict(ours, sd, device=sim)
    for st in ours.state.values():
        assert st["exp_avg"].device == sim and st["step"].device.type == "cpu"
    twin.to(sim)
    assert optimshift.check(ours).ok
    fresh_model, fresh = _twin(Model([(4, 3), (3,)]), O.Adam, {"foreach": False}, sim)
    train(fresh_model, fresh, range(1))
    assert state_layout(ours) == state_layout(fresh)


def test_fused_checkpoint_into_foreach_on_device(sim):
    model, opt = _trained(O.AdamW, {"fused": True}, [(4, 3)], device=sim)
    sd = opt.state_dict()
    assert next(iter(sd["state"].values()))["step"].device == sim
    _, ours = _twin(model, O.AdamW, {"foreach": True})
    optimshift.load_state_dict(ours, sd)
    assert ours.param_groups[0]["fused"] is None and ours.param_groups[0]["foreach"] is True
    assert all(st["step"].device.type == "cpu" for st in ours.state.values())


# --- validation before any change -----------------------------------------------------------------------------


def _adam(shapes=((4, 3), (3,)), groups=1):
    params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    if groups == 2:
        opt = O.Adam([{"params": params[:1]}, {"params": params[1:], "lr": 0.1}], foreach=False)
    else:
        opt = O.Adam(params, foreach=False)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    return opt


@pytest.mark.parametrize(
    "mutate, exc, match",
    [
        (
            lambda sd: sd["param_groups"].append({"params": []}),
            ValueError,
            r"Adam: load_state_dict: the checkpoint has 3 param groups, the optimizer has 2",
        ),
        (
            lambda sd: sd["param_groups"][1]["params"].append(9),
            ValueError,
            r"param group 1 has 2 params in the checkpoint and 1 in the optimizer",
        ),
        (
            lambda sd: sd["state"][1].__setitem__("exp_avg", torch.zeros(4)),
            ValueError,
            r"group 1, param 0, state key 'exp_avg': the checkpoint's tensor has shape \(4,\), "
            r"the param has shape \(3,\)",
        ),
        (
            lambda sd: sd["state"][0].__setitem__("exp_avg_sq", torch.zeros(3, 4)),
            ValueError,
            r"group 0, param 0, state key 'exp_avg_sq': .* shape \(3, 4\), the param has shape \(4, 3\)",
        ),
        (
            lambda sd: sd["state"].__setitem__(7, {"exp_avg": torch.zeros(1)}),
            ValueError,
            r"entries for param ids \[7\] that no param group lists",
        ),
        (
            lambda sd: sd["param_groups"][1].__setitem__("params", [0]),
            ValueError,
            r"lists param id 0 twice \(group 0, param 0 and group 1, param 0\)",
        ),
        (
            lambda sd: sd["state"].__setitem__(1, [torch.zeros(3)]),
            TypeError,
            r"group 1, param 0: its state is a list, expected a dict",
        ),
        (lambda sd: sd.pop("param_groups"), ValueError, r"state_dict has no 'param_groups' entry"),
        (
            lambda sd: sd["state"][0].__setitem__("exp_avg", torch.zeros(4, 3, device="meta")),
            ValueError,
            r"group 0, param 0, state key 'exp_avg': a meta tensor has no values to load",
        ),
    ],
)
def test_bad_state_dict_is_refused_before_any_change(mutate, exc, match):
    source = _adam(groups=2)
    sd = copy.deepcopy(source.state_dict())
    mutate(sd)
    target = _adam(groups=2)
    before = _fingerprint(target)
    with pytest.raises(exc, match=match):
        optimshift.load_state_dict(target, sd)
    assert _fingerprint(target) == before


def test_wrong_class_is_refused(tmp_path):
    optimshift.save(_adam(), tmp_path / "adam.pt")
    sgd = O.SGD([torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(3))], lr=0.1, momentum=0.9)
    before = _fingerprint(sgd)
    with pytest.raises(
        ValueError,
        match=r"SGD: load_state_dict: the checkpoint was saved from a "
        r"torch\.optim\.adam\.Adam, not a torch\.optim\.sgd\.SGD",
    ):
        optimshift.load_state_dict(sgd, optimshift.load(tmp_path / "adam.pt"))
    assert _fingerprint(sgd) == before
    with pytest.raises(ValueError, match=r"Load it into an Adam, or pass"):  # the article its sound takes
        optimshift.load_state_dict(sgd, optimshift.load(tmp_path / "adam.pt"))
    optimshift.save(sgd, tmp_path / "sgd.pt")
    with pytest.raises(ValueError, match=r"saved from a torch\.optim\.sgd\.SGD, not a torch\.optim\.adam\.Adam; "):
        optimshift.load_state_dict(_adam(), tmp_path / "sgd.pt")


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        ({"flags": "mine"}, ValueError, "flags must be 'live' or 'checkpoint'"),
        ({"cast": "bf16"}, ValueError, "cast must be None or 'param'"),
        ({"copy": "yes"}, TypeError, "copy must be a bool"),
        ({"device": "cuda:7"}, ValueError, "cuda:7 is not available"),
    ],
)
def test_bad_arguments(kwargs, exc, match):
    target = _adam()
    before = _fingerprint(target)
    with pytest.raises(exc, match=match):
        optimshift.load_state_dict(target, _adam().state_dict(), **kwargs)
    assert _fingerprint(target) == before


def test_setstate_failure_rolls_back():
    class Fussy(O.Adam):
        def __setstate__(self, state):  # a class fix-up that fails after Adam's has changed the optimizer
            super().__setstate__(state)
            raise KeyError("step")

    sd = _adam().state_dict()
    target = Fussy([torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(3))], foreach=False)
    before = _fingerprint(target)
    with pytest.raises(
        ValueError,
        match=r"Fussy.__setstate__ rejected the loaded state \(KeyError: 'step'\); "
        r"the optimizer is unchanged",
    ):
        optimshift.load_state_dict(target, sd)
    assert _fingerprint(target) == before


@pytest.mark.parametrize("site", ["copy_tensor", "Tensor.clone"])
def test_copy_failure_midway_changes_nothing(monkeypatch, site):
    """An OOM on the 5th copy (one by one, or in the loop that clones same-place tensors) changes nothing, and
    the error says which entry it hit."""
    from optimshift import _copy

    shapes = ((4, 3), (3,), (2,), (5,))
    source = _adam(shapes).state_dict()
    calls = []

    def failing(real):
        def wrapper(*args, **kwargs):
            calls.append(1)
            if len(calls) == 5:
                raise torch.OutOfMemoryError("simulated OOM")
            return real(*args, **kwargs)

        return wrapper

    if site == "copy_tensor":  # (the engine's general copy: what run makes one by one)
        monkeypatch.setattr(_copy, "copy_tensor", failing(_copy.copy_tensor))
        for st in source["state"].values():  # (copied one by one: tensors that require grad)
            for key in ("exp_avg", "exp_avg_sq"):
                st[key] = st[key].detach().requires_grad_(True)
    else:
        monkeypatch.setattr(torch.Tensor, "clone", failing(torch.Tensor.clone))
    # (a fresh optimizer for the clones: live tensors that fit take the values in place, with no copy)
    target = _adam(shapes) if site == "copy_tensor" else O.Adam([torch.nn.Parameter(torch.randn(s)) for s in shapes])
    before = _fingerprint(target)
    with pytest.raises(torch.OutOfMemoryError) as caught:
        optimshift.load_state_dict(target, source)
    assert len(calls) == 5
    assert any("the optimizer was left unchanged" in n and "state key" in n for n in caught.value.__notes__)
    assert _fingerprint(target) == before


def test_optimizer_that_overrides_load_state_dict_is_refused():
    class Custom(O.Adam):
        def load_state_dict(self, state_dict):  # custom logic optimshift cannot reproduce
            super().load_state_dict(state_dict)

    target = Custom([torch.nn.Parameter(torch.randn(3))])
    with pytest.raises(TypeError, match=r"Custom overrides load_state_dict .* optimshift\.move\(optimizer\)"):
        optimshift.load_state_dict(target, O.Adam([torch.nn.Parameter(torch.randn(3))]).state_dict())


def test_pytorch_optimizer_base_class_is_accepted():
    """pytorch_optimizer's BaseOptimizer overrides load_state_dict only to restore the dtypes PyTorch casts
    away, which optimshift keeps anyway: it is on the list of equivalent overrides."""
    po = pytest.importorskip("pytorch_optimizer")
    params = [torch.nn.Parameter(torch.randn(4, 3))]
    source = po.Lion(params, lr=1e-3)
    params[0].grad = torch.randn(4, 3)
    source.step()
    target = po.Lion([torch.nn.Parameter(torch.randn(4, 3))], lr=1e-2)
    optimshift.load_state_dict(target, source.state_dict())
    assert bitwise_equal(_state(target), _state(source)) and target.param_groups[0]["lr"] == 1e-3


def test_delegating_wrapper_loads_into_the_wrapped_optimizer():
    class Wrapper:  # the shape of Accelerate's AcceleratedOptimizer / Lightning's LightningOptimizer
        def __init__(self, optimizer):
            self.optimizer = optimizer

        param_groups = property(lambda self: self.optimizer.param_groups)
        state = property(lambda self: self.optimizer.state)

    source = _adam()
    inner = _adam()
    wrapper = Wrapper(inner)
    assert optimshift.load_state_dict(wrapper, source.state_dict()) is wrapper
    assert bitwise_equal(_state(inner), _state(source))


def test_ambiguous_checkpoint_names_the_candidates():
    a, b = _adam().state_dict(), _adam().state_dict()
    with pytest.raises(ValueError, match=r"holds 2 optimizer states \(\['gen'\], \['disc'\]\); pass the one"):
        optimshift.load_state_dict(_adam(), {"gen": a, "disc": b})


# --- hooks and __setstate__ fix-ups, as in PyTorch --------------------------------------------------------------


def test_hooks_run_as_in_pytorch():
    calls = {}

    def run(load):
        target = _adam()
        seen = []

        def pre(opt, sd):
            seen.append(("pre", opt is target, sorted(sd)))
            sd = dict(sd)
            sd["param_groups"] = [dict(g, lr=0.123) for g in sd["param_groups"]]
            return sd

        def post(opt):
            seen.append(("post", opt is target, opt.param_groups[0]["lr"]))

        target.register_load_state_dict_pre_hook(pre)
        target.register_load_state_dict_post_hook(post)
        load(target, _adam().state_dict())
        return seen

    calls["theirs"] = run(lambda o, sd: o.load_state_dict(sd))
    calls["ours"] = run(optimshift.load_state_dict)
    assert calls["ours"] == calls["theirs"] == [("pre", True, ["param_groups", "state"]), ("post", True, 0.123)]


@pytest.mark.parametrize("cls, kwargs", [(O.Adam, {"fused": True}), (O.Adam, {}), (O.NAdam, {}), (O.Adagrad, {})])
def test_setstate_fixups_for_old_checkpoints(cls, kwargs):
    """A checkpoint from before tensor steps (torch < 1.12): `step` (and NAdam's mu_product) are floats."""
    model, opt = _trained(cls, {**kwargs}, [(4, 3)])
    sd = copy.deepcopy(opt.state_dict())
    for st in sd["state"].values():
        st["step"] = float(st["step"])
        if "mu_product" in st:
            st["mu_product"] = float(st["mu_product"])
    _, theirs = _twin(model, cls, kwargs)
    _, ours = _twin(model, cls, kwargs)
    theirs.load_state_dict(sd)
    optimshift.load_state_dict(ours, sd)
    assert state_layout(ours) == state_layout(theirs)
    assert state_dtypes(ours) == state_dtypes(theirs)
    assert bitwise_equal(_state(ours), _state(theirs))


def test_param_names_follow_pytorch():
    params = [torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(2))]
    named = O.SGD([("a", params[0]), ("b", params[1])], lr=0.1)
    plain_sd = O.SGD([torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(2))], lr=0.2).state_dict()
    optimshift.load_state_dict(named, plain_sd)
    assert named.param_groups[0]["param_names"] == ["a", "b"] and named.param_groups[0]["lr"] == 0.2
    with pytest.raises(ValueError, match=r"group 0, param 1 \(b\), state key 'momentum_buffer': .* shape \(3,\)"):
        source = O.SGD([torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(3))], lr=0.1, momentum=0.9)
        for p in source.param_groups[0]["params"]:
            p.grad = torch.ones(3)
        source.step()
        optimshift.load_state_dict(named, source.state_dict())


def test_sparse_state_loads_as_it_was_saved():
    """A sparse CSR entry (a third-party optimizer's mask) loads as it was saved, next to dense ones: the
    overexpanded-view check asks only strided tensors about their strides (sparse CSR has none)."""

    class Holder(O.Optimizer):
        def __init__(self, params):
            super().__init__(params, {"lr": 0.1})

        def step(self, closure=None):
            pass

    p = torch.nn.Parameter(torch.zeros(3, 3))
    src = Holder([p])
    src.state[p]["csr"] = torch.eye(3).to_sparse_csr()
    src.state[p]["m"] = torch.ones(3, 3)
    dst = Holder([torch.nn.Parameter(torch.zeros(3, 3))])
    optimshift.load_state_dict(dst, src.state_dict())
    st = next(iter(dst.state.values()))
    assert st["csr"].layout == torch.sparse_csr and torch.equal(st["csr"].to_dense(), torch.eye(3))
    assert st["csr"] is not src.state[p]["csr"] and torch.equal(st["m"], torch.ones(3, 3))


class _Int8Moments(torch.optim.Adam):
    """Keeps its first moment as int8 between steps (as 8-bit optimizers do), around Adam's own step, wrapped with
    ``functools.wraps`` (which copies Adam's step's ``__wrapped__`` and ``hooked`` marks)."""

    @functools.wraps(torch.optim.Adam.step)
    def step(self, closure=None):
        for st in self.state.values():
            if st["exp_avg"].dtype == torch.int8:
                st["exp_avg"] = st["exp_avg"].float() / 100
        loss = super().step(closure)
        for st in self.state.values():
            st["exp_avg"] = (st["exp_avg"] * 100).round().to(torch.int8)
        return loss


def test_a_step_wrapped_with_functools_wraps_is_its_own_for_the_load_as_for_the_policy():
    """One ``same_step`` (policy's): a subclass whose step wraps Adam's keeps state of its own kind, so the load
    checks only what any subclass's state is checked for (it used to apply Adam's checks and refuse int8)."""
    assert optimshift.policy.separable(_Int8Moments) == (False, "overrides step")
    params = [torch.nn.Parameter(torch.randn(3))]
    src = _Int8Moments(params)
    params[0].grad = torch.ones(3)
    src.step()
    dst = _Int8Moments([torch.nn.Parameter(torch.randn(3))])
    optimshift.load_state_dict(dst, src.state_dict())
    (state,) = dst.state.values()
    assert state["exp_avg"].dtype == torch.int8 and torch.equal(state["exp_avg"], src.state[params[0]]["exp_avg"])
    dst.param_groups[0]["params"][0].grad = torch.ones(3)
    dst.step()


def test_an_interrupt_during_the_in_place_copies_waits_for_the_load_to_finish(monkeypatch):
    """Ctrl-C while live tensors take the loaded values one by one (the per-tensor fallback after the foreach copy
    refused) used to leave some of them written and the rest old; now the commit runs to its end, then the
    interrupt is raised."""
    import os
    import signal

    def trained(seed):
        torch.manual_seed(seed)
        params = [torch.nn.Parameter(torch.randn(3)) for _ in range(6)]
        opt = torch.optim.Adam(params, foreach=False)
        for p in params:
            p.grad = torch.randn(3)
        opt.step()
        return params, opt

    _, source = trained(0)
    params, live = trained(1)
    before = {id(t) for st in live.state.values() for t in st.values()}

    def refuse(*args, **kwargs):
        raise RuntimeError("no foreach kernel for this dtype")

    real_copy = torch.Tensor.copy_
    calls = []

    def copy_then_interrupt(self, src, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGINT)  # delivered at the next bytecode boundary: inside the loop
        return real_copy(self, src, *args, **kwargs)

    monkeypatch.setattr(torch, "_foreach_copy_", refuse)
    monkeypatch.setattr(torch.Tensor, "copy_", copy_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        optimshift.load_state_dict(live, source.state_dict())
    monkeypatch.undo()
    assert len(calls) == 18  # every pair was written
    assert {id(t) for st in live.state.values() for t in st.values()} == before  # in place: the same objects
    for p, q in zip(source.param_groups[0]["params"], params):
        assert all(torch.equal(live.state[q][k], source.state[p][k]) for k in ("step", "exp_avg", "exp_avg_sq"))


def _host_copy(sd):
    return {"state": _host(sd["state"]), "param_groups": copy.deepcopy(sd["param_groups"])}


@pytest.mark.parametrize("uniform", [True, False], ids=["uniform", "general"])
@pytest.mark.parametrize("seed", [None, 0, 1, 2])
def test_a_host_checkpoint_is_written_into_live_device_state_in_place(sim, monkeypatch, uniform, seed):
    """Resuming from a host checkpoint into state that lives on an accelerator writes the values into the live
    tensors: same objects, same storages (a CUDA graph's addresses stay valid), and no second copy of the state
    on the device. Before, each entry was copied to the device and the copy adopted: the state's memory twice on
    the device during the load, and new addresses after it. Under every ``deferred_streams`` schedule (``None``:
    none), the values are there when the load returns, and the optimizer then steps as the checkpoint's."""
    from optimshift.testing import deferred_streams, simulated_memory_allocated

    if not uniform:
        monkeypatch.setattr(optimshift.checkpoint._staging, "build_uniform", lambda *a: None)
    shapes = [(64, 64), (64, 64), (64,)]
    model, opt = _trained(O.Adam, {"foreach": False}, shapes, device=sim)
    other_model, other = _trained(O.Adam, {"foreach": False}, shapes, device=sim, steps=K + 1)
    host = _host_copy(other.state_dict())
    live = [(t, t.data_ptr(), t.device) for st in opt.state.values() for t in st.values()]
    assert {d.type for _, _, d in live} == {"cpu", sim.type}  # (Adam's step on the host, the moments on sim)
    at_commit = []
    real = optimshift._engine.commit

    def commit(*args, **kwargs):  # (every copy is made by then: the load's peak)
        at_commit.append(simulated_memory_allocated(0))
        return real(*args, **kwargs)

    monkeypatch.setattr(optimshift._engine, "commit", commit)
    with deferred_streams(seed, progress=0.0) if seed is not None else contextlib.nullcontext():
        before = simulated_memory_allocated(0)
        optimshift.load_state_dict(opt, host)
        now = [t for st in opt.state.values() for t in st.values()]
        assert all(t is old and t.data_ptr() == ptr for t, (old, ptr, _) in zip(now, live))
        assert at_commit and max(at_commit) <= before and simulated_memory_allocated(0) <= before
        assert bitwise_equal(_state(opt), _state(other))
    other_model.load_state_dict(model.state_dict())
    for o in (opt, other):
        for p in o.param_groups[0]["params"]:
            p.grad = torch.full_like(p, 0.5)
        o.step()
    assert bitwise_equal(_state(opt), _state(other))


@pytest.mark.parametrize("uniform", [True, False], ids=["uniform", "general"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_device_checkpoint_written_into_host_state_is_there_when_the_load_returns(sim, monkeypatch, uniform, seed):
    """A checkpoint on the accelerator loaded into state on the host is written in place there; the copies into
    host memory are never queued, even beside a source in pinned memory (the checkpoint's host ``step``, taken
    for pinned here), on a side stream under every ``deferred_streams`` schedule. A first version queued them
    then and returned before they ran (found by review)."""
    from optimshift.testing import deferred_streams

    if not uniform:
        monkeypatch.setattr(optimshift.checkpoint._staging, "build_uniform", lambda *a: None)
    shapes = [(64, 64), (64,)]
    _, opt = _trained(O.Adam, {"foreach": False}, shapes)
    _, other = _trained(O.Adam, {"foreach": False}, shapes, device=sim, steps=K + 1)
    sd = other.state_dict()
    sd = {
        "state": {i: {k: v.clone() for k, v in st.items()} for i, st in sd["state"].items()},
        "param_groups": sd["param_groups"],
    }
    steps = {id(st["step"]) for st in sd["state"].values()}
    monkeypatch.setattr(optimshift._engine, "in_pinned_memory", lambda t: id(t) in steps)
    live = [(t, t.data_ptr()) for st in opt.state.values() for t in st.values()]
    backend = getattr(torch, sim.type)
    backend.synchronize()  # (the checkpoint's clones, made on the default stream, done before the side stream reads)
    with deferred_streams(seed, progress=0.0):
        with backend.stream(backend.Stream(sim)):
            optimshift.load_state_dict(opt, sd)
        assert [(t, t.data_ptr()) for st in opt.state.values() for t in st.values()] == live
        assert bitwise_equal(_state(opt), _state(other))


def test_a_resume_that_casts_as_torch_would_runs_the_pre_hooks_once():
    """A framework's resume (``load_as_torch_would``) of an fp32 checkpoint into bf16 params casts as PyTorch does;
    its load_state_dict pre-hooks run once, as PyTorch's (a first version loaded twice, running them twice: a hook
    that scales the state scaled it twice; found by review)."""
    from optimshift.checkpoint._resume import load_as_torch_would

    _, source = _trained(O.Adam, {"foreach": False}, [(3, 3)])
    sd = source.state_dict()
    params = [torch.nn.Parameter(torch.zeros(3, 3, dtype=torch.bfloat16))]
    opt = O.Adam(params, foreach=False)
    ran = []
    opt.register_load_state_dict_pre_hook(lambda o, state: ran.append(1))
    load_as_torch_would(opt, sd)
    assert ran == [1] and opt.state[params[0]]["exp_avg"].dtype == torch.bfloat16
    with pytest.raises(optimshift.checkpoint._staging.CastNeeded):  # (the plain load refuses, as documented)
        optimshift.load_state_dict(O.Adam(params, foreach=False), sd)


def test_a_load_into_a_broken_optimizer_or_with_a_bad_device_names_the_optimizer_first():
    """A live param group without "params" raised a raw KeyError from inside the load (every other operation names
    the group: ``check_optimizer``), a live state that is not a dict an AttributeError, and ``device=5.0`` a
    TypeError that named no optimizer and no call; nothing changes."""
    opt = _adam()
    sd = copy.deepcopy(opt.state_dict())
    before = copy.deepcopy([dict(st) for st in opt.state.values()])
    with pytest.raises(TypeError, match=r"^Adam: load_state_dict: device must be a torch.device, .*got 5.0$"):
        optimshift.load_state_dict(opt, sd, device=5.0)
    state, group = opt.state, opt.param_groups[0]
    opt.param_groups[0] = {k: v for k, v in group.items() if k != "params"}
    with pytest.raises(TypeError, match=r"^Adam: param group 0 has no 'params' .*; nothing was changed$"):
        optimshift.load_state_dict(opt, sd)
    opt.param_groups[0], opt.state = group, None
    with pytest.raises(TypeError, match=r"^Adam: state is None, not a dict; nothing was changed$"):
        optimshift.load_state_dict(opt, sd)
    opt.state = state
    assert bitwise_equal([dict(st) for st in opt.state.values()], before)

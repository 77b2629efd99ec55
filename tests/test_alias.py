"""State tensors that share a storage still share it after move, offload/reload and load_state_dict: the storage
is copied once and each tensor is rebuilt as a view of the copy at the same offset, size and stride."""

import io

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import optimshift
from _matrix import Model, bitwise_equal, snapshot, tensor_ids
from _schedules import SCHEDULES
from optimshift._adopt import decide_all
from optimshift.testing import deferred_streams

SHAPES = [(3, 2), (4,), (2, 5)]


class FlatMomentum(torch.optim.Optimizer):
    """Momentum SGD over one flat buffer: ``state[first param]["flat"]`` holds every param's momentum and each
    param's ``state[p]["momentum"]`` is a view of its slice (2-D params also keep a transposed view, strides
    (1, n)). The step updates the flat buffer in one op and reads the views: if they stop sharing its storage,
    the params silently stop moving with the momentum."""

    def __init__(self, params, lr=0.1, beta=0.9):
        super().__init__(params, {"lr": lr, "beta": beta})

    @torch.no_grad()
    def step(self, closure=None):
        group = self.param_groups[0]
        params = [p for g in self.param_groups for p in g["params"]]
        first = self.state[params[0]]
        if "flat" not in first:
            flat = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
            first["flat"] = flat
            offset = 0
            for p in params:
                view = flat[offset : offset + p.numel()].view_as(p)
                self.state[p]["momentum"] = view
                if p.dim() == 2:
                    self.state[p]["transposed"] = view.t()
                offset += p.numel()
        flat = first["flat"]
        flat.mul_(group["beta"]).add_(torch.cat([p.grad.reshape(-1) for p in params]))
        for p in params:
            p.add_(self.state[p]["momentum"], alpha=-group["lr"])


def _grads(model, step):
    for i, p in enumerate(model.parameters()):
        g = torch.Generator().manual_seed(100 * step + i)
        p.grad = torch.randn(p.shape, generator=g).to(p.device)


def _train(model, opt, steps):
    for step in steps:
        _grads(model, step)
        opt.step()


def _trained(device, steps=2):
    model = Model(SHAPES).to(device)
    opt = FlatMomentum(model.parameters())
    _train(model, opt, range(steps))
    return model, opt


def _entries(opt):
    params = [p for g in opt.param_groups for p in g["params"]]
    return [((i, k), v) for i, p in enumerate(params) for k, v in opt.state[p].items()]


def layout(opt):
    """{(param index, key): (storage number, storage offset, shape, stride, dtype, device)}: storages numbered
    by first appearance, so two layouts are equal only if the same entries share one storage."""
    numbers, out = {}, {}
    for where, t in _entries(opt):
        n = numbers.setdefault(t.untyped_storage().data_ptr(), len(numbers))
        out[where] = (n, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t.device)
    return out


def assert_views_of_the_flat_buffer(opt, before_layout, before_values, before_ids):
    """One storage for all entries, at the offsets and strides they had, bitwise the values, the same objects,
    and an in-place update of the flat buffer shows through every view."""
    now = layout(opt)
    assert {n for n, *_ in now.values()} == {0}, "every entry views one storage"
    assert {w: v[1:5] for w, v in now.items()} == {w: v[1:5] for w, v in before_layout.items()}
    assert tensor_ids(opt) == before_ids, "the same tensor objects"
    for (where, t), before in zip(_entries(opt), before_values):
        assert bitwise_equal(t, before), where
    flat = opt.state[next(iter(opt.state))]["flat"]
    saved = flat.clone()
    expected = [(where, t.detach().cpu() + 1) for where, t in _entries(opt) if where[1] != "flat"]
    flat.add_(1)
    for where, value in expected:
        got = dict(_entries(opt))[where]
        assert torch.equal(got.cpu(), value), f"{where} shows the flat buffer's update"
    flat.copy_(saved)  # ((x + 1) - 1 is not always x)


def _snapshot(opt):
    return layout(opt), [snapshot(t) for _, t in _entries(opt)], tensor_ids(opt)


def _same_params(model, reference):
    for a, b in zip(model.parameters(), reference.parameters()):
        assert bitwise_equal(a, b)


def test_move_to_the_device_and_back_keeps_the_views_of_the_flat_buffer(sim):
    """Fails on the copy-each-tensor engine: after the move each view has its own storage."""
    model, opt = _trained("cpu")
    reference, ref = _trained("cpu")
    before = _snapshot(opt)
    model.to(sim)
    optimshift.move(opt)
    assert all(t.device == sim for _, t in _entries(opt))
    assert_views_of_the_flat_buffer(opt, {w: v[:5] + (sim,) for w, v in before[0].items()}, *before[1:])
    _train(model, opt, range(2, 4))
    _train(reference, ref, range(2, 4))
    _same_params(model, reference)  # the step's update of the flat buffer reached the params through the views
    before = _snapshot(opt)
    model.to("cpu")
    optimshift.move(opt)
    assert_views_of_the_flat_buffer(opt, {w: v[:5] + (torch.device("cpu"),) for w, v in before[0].items()}, *before[1:])


def test_offload_and_reload_keep_the_views_of_the_flat_buffer(sim):
    model, opt = _trained(sim)
    reference, ref = _trained(sim)
    before = _snapshot(opt)
    optimshift.offload(opt)
    host = {w: v[:5] + (torch.device("cpu"),) for w, v in before[0].items()}
    assert_views_of_the_flat_buffer(opt, host, *before[1:])  # on the host too
    optimshift.reload(opt)
    assert_views_of_the_flat_buffer(opt, *before)
    _train(model, opt, range(2, 4))
    _train(reference, ref, range(2, 4))
    _same_params(model, reference)
    before = _snapshot(opt)
    with optimshift.offloaded(opt):  # a second cycle (objects that adopted rebuilt views once)
        pass
    assert_views_of_the_flat_buffer(opt, *before)


@pytest.mark.parametrize("seed, progress", SCHEDULES)
def test_non_blocking_offload_and_reload_keep_the_views(sim, seed, progress):
    reference, ref = _trained(sim)  # (the blocking reference first: its syncs would order the copies under test)
    _train(reference, ref, range(2, 4))
    with deferred_streams(seed=seed, progress=progress):
        model, opt = _trained(sim)
        before = _snapshot(opt)
        handle = optimshift.offload(opt, non_blocking=True)
        assert not (progress == 0.0 and handle.done()), "the offload is in flight"
        handle.wait()
        assert_views_of_the_flat_buffer(
            opt, {w: v[:5] + (torch.device("cpu"),) for w, v in before[0].items()}, *before[1:]
        )
        handle = optimshift.reload(opt, non_blocking=True)
        assert not (progress == 0.0 and handle.done()), "the reload is in flight"
        _train(model, opt, range(2, 3))  # no wait: the step pre-hook orders the step after the copies
        assert handle.done()
        _train(model, opt, range(3, 4))
    _same_params(model, reference)
    assert layout(opt) == layout(ref)


class _CrossDeviceBytes(TorchDispatchMode):
    """Bytes copied between devices (every copy, grouped or not, goes through one of these ops)."""

    def __init__(self):
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is torch.ops.aten.copy_.default and args[0].device != args[1].device:
            self.total += args[1].numel() * args[1].element_size()
        elif func is torch.ops.aten._to_copy.default and out.device != args[0].device:
            self.total += out.numel() * out.element_size()
        elif func is torch.ops.aten._foreach_copy_.default:
            self.total += sum(s.numel() * s.element_size() for d, s in zip(args[0], args[1]) if d.device != s.device)
        return out


def test_each_shared_storage_is_copied_once(sim):
    """The flat buffer and its views are its bytes once each way (tensor by tensor: twice)."""
    model, opt = _trained(sim)
    flat = opt.state[next(iter(opt.state))]["flat"]
    nbytes = flat.untyped_storage().nbytes()
    with _CrossDeviceBytes() as offload_bytes:
        optimshift.offload(opt)
    with _CrossDeviceBytes() as reload_bytes:
        optimshift.reload(opt)
    assert (offload_bytes.total, reload_bytes.total) == (nbytes, nbytes)


def test_load_state_dict_into_a_fresh_optimizer_and_into_existing_state(sim):
    source_model, source = _trained(sim)
    reference, ref = _trained(sim)
    # fresh: no state yet
    model = Model(SHAPES).to(sim)
    fresh = FlatMomentum(model.parameters())
    optimshift.load_state_dict(fresh, source.state_dict())
    assert layout(fresh) == layout(source)
    assert all(a is not b for (_, a), (_, b) in zip(_entries(fresh), _entries(source))), "copies, not aliases"
    # into existing state: its objects stay, views of one storage
    model2, existing = _trained(sim, steps=1)
    before_ids = tensor_ids(existing)
    optimshift.load_state_dict(existing, source.state_dict())
    assert_views_of_the_flat_buffer(existing, layout(source), [snapshot(t) for _, t in _entries(source)], before_ids)
    _train(reference, ref, range(2, 4))
    for m, o in ((model, fresh), (model2, existing)):
        m.load_state_dict(source_model.state_dict())
        _train(m, o, range(2, 4))
        _same_params(m, reference)  # the loaded views still carry the step's update of the flat buffer


def test_load_state_dict_from_a_file_keeps_what_torch_load_shares(sim):
    _, source = _trained(sim)
    buf = io.BytesIO()
    torch.save(source.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf, weights_only=True)  # torch.load rebuilds the sharing (on sim)
    model = Model(SHAPES)
    opt = FlatMomentum(model.parameters())
    _train(model, opt, range(1))
    before_ids = tensor_ids(opt)
    optimshift.load_state_dict(opt, sd)
    expected = {w: v[:5] + (torch.device("cpu"),) for w, v in layout(source).items()}
    assert_views_of_the_flat_buffer(opt, expected, [snapshot(t) for _, t in _entries(source)], before_ids)


def test_entries_that_share_a_storage_but_belong_on_two_devices_are_refused(sim):
    model, opt = _trained("cpu")
    before = _snapshot(opt)
    model.parts[1].to(sim)  # param 1's entries would follow it; the flat buffer stays with param 0
    with pytest.raises(ValueError) as info:
        optimshift.move(opt)
    message = str(info.value)
    assert message.startswith("FlatMomentum: ") and "share one storage" in message
    assert "param 0, state['flat']" in message and "param 1, state['momentum']" in message, message
    assert "cpu and sim:0" in message
    assert_views_of_the_flat_buffer(opt, *before)  # nothing changed


def test_entries_that_view_a_param_get_their_own_copies_as_before(sim):
    """A storage a param also uses is not the optimizer's to copy whole: its entries are copied one by one (their
    own bytes, not the param's) and the param stays where it is (the rule for params kept in state)."""
    p = torch.nn.Parameter(torch.arange(10.0, device=sim))
    opt = FlatMomentum([p])
    opt.state[p]["head"] = p.detach()[:2]
    opt.state[p]["tail"] = p.detach()[6:]
    storage = p.untyped_storage().data_ptr()
    with _CrossDeviceBytes() as copied:
        optimshift.offload(opt)
    assert copied.total == 6 * 4, "the entries' bytes, not the param's storage"
    assert p.device == sim and p.untyped_storage().data_ptr() == storage
    with _CrossDeviceBytes() as copied:
        optimshift.reload(opt)
    assert copied.total == 6 * 4
    assert p.untyped_storage().data_ptr() == storage
    assert opt.state[p]["tail"].untyped_storage().data_ptr() != storage
    assert torch.equal(opt.state[p]["tail"].cpu(), torch.arange(6.0, 10.0))


def test_a_base_whose_views_adopt_copies_too_keeps_its_object():
    flat = torch.arange(6.0)
    view = flat[2:5]
    new_flat = torch.zeros(6)
    new_view = torch.zeros(3)
    # (CPU to CPU: set_data applies; ask as if only a swap could exchange them, as for CPU <-> sim)
    assert decide_all([(flat, new_flat.to("meta")), (view, new_view.to("meta"))]) == ["swap", "swap"]
    assert decide_all([(flat, new_flat.to("meta"))]) == ["replace"], "its view stays: the base is replaced"


def test_a_state_dict_taken_while_offloaded_keeps_the_sharing(sim):
    """Offloaded tensors that are views into the host pool get compact copies in state_dict(); a storage of
    the optimizer's own (the flat buffer's host copy) is kept, so a checkpoint saved while offloaded shares too."""
    _, opt = _trained(sim)
    optimshift.offload(opt)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    optimshift.reload(opt)
    buf.seek(0)
    sd = torch.load(buf, weights_only=True)
    storages = {t.untyped_storage().data_ptr() for st in sd["state"].values() for t in st.values()}
    assert len(storages) == 1, "the flat buffer and its views, saved as one storage"
    model = Model(SHAPES).to(sim)
    fresh = FlatMomentum(model.parameters())
    optimshift.load_state_dict(fresh, sd)
    assert layout(fresh) == layout(opt)


def test_load_state_dict_with_a_cast_casts_the_storage_once(sim):
    """cast="param": the flat buffer and its views are cast as one storage (bf16 params, fp32 checkpoint)."""
    _, source = _trained(sim)
    model = Model(SHAPES).to(sim).to(torch.bfloat16)
    opt = FlatMomentum(model.parameters())
    optimshift.load_state_dict(opt, source.state_dict(), cast="param")
    expected = {w: v[:4] + (torch.bfloat16, sim) for w, v in layout(source).items()}
    assert layout(opt) == expected
    for (where, t), (_, s) in zip(_entries(opt), _entries(source)):
        assert bitwise_equal(t, s.to(torch.bfloat16)), where


def test_load_state_dict_refuses_a_shared_storage_loaded_onto_two_devices(sim):
    _, source = _trained("cpu")
    model = Model(SHAPES)
    model.parts[2].to(sim)
    opt = FlatMomentum(model.parameters())
    with pytest.raises(ValueError) as info:
        optimshift.load_state_dict(opt, source.state_dict())
    message = str(info.value)
    assert message.startswith("FlatMomentum: load_state_dict: ") and "share one storage" in message, message
    assert "param 0, state key 'flat'" in message and "param 2, state key 'momentum'" in message, message
    assert not opt.state, "nothing was loaded"


def test_a_shared_storage_refused_from_a_file_names_the_file(sim, tmp_path):
    """The refusal comes from the engine's copy (one rule for every load's copies), and names the file loaded."""
    _, source = _trained("cpu")
    path = tmp_path / "optim.pt"
    optimshift.save(source, path)
    model = Model(SHAPES)
    model.parts[2].to(sim)
    opt = FlatMomentum(model.parameters())
    with pytest.raises(ValueError) as info:
        optimshift.load_state_dict(opt, path)
    message = str(info.value)
    assert message.startswith(f"FlatMomentum: load_state_dict: {path}: ") and "share one storage" in message, message
    assert not opt.state, "nothing was loaded"


def test_an_error_copying_a_shared_storage_names_the_entry_and_the_file(sim, tmp_path, monkeypatch):
    """An OOM while the engine copies a flat buffer and its views as one storage: the note names the entry and
    the file, and nothing is loaded."""
    from optimshift import _alias

    _, source = _trained("cpu")
    path = tmp_path / "optim.pt"
    optimshift.save(source, path)
    opt = FlatMomentum(Model(SHAPES).to(sim).parameters())

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("simulated OOM")

    monkeypatch.setattr(_alias, "copy_storage", out_of_memory)
    with pytest.raises(torch.OutOfMemoryError) as info:
        optimshift.load_state_dict(opt, path)
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert f"while copying FlatMomentum: load_state_dict: {path}: group 0, param 0, state key" in notes, notes
    assert "the optimizer was left unchanged" in notes
    assert not opt.state, "nothing was loaded"


_DTENSOR_SCRIPT = """
import torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate
import optimshift
from optimshift.testing import simulated_accelerator
sim = simulated_accelerator()
mesh = init_device_mesh("cpu", (2,))
p = torch.nn.Parameter(DTensor.from_local(torch.zeros(10), mesh, [Replicate()], run_check=False).to(sim))
class Holder(torch.optim.Optimizer):
    def __init__(self, params):
        super().__init__(params, {"lr": 0.1})
    def step(self, closure=None):
        pass
opt = Holder([p])
flat = torch.zeros_like(p)
flat._local_tensor.copy_(torch.arange(10.0))
opt.state[p]["flat"], opt.state[p]["view"] = flat, flat[2:6]
out = []
def shared():
    st = opt.state[p]
    a, b = st["flat"].to_local(), st["view"].to_local()
    return (type(st["view"]).__name__, str(a.device), a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr(),
            b.storage_offset(), st["view"].placements == (Replicate(),), tuple(st["view"].shape), b.tolist())
optimshift.offload(opt)
out.append(shared())
optimshift.reload(opt)
out.append(shared())
opt.state[p]["flat"]._local_tensor.add_(1)
out.append(opt.state[p]["view"].to_local().tolist())
dist.destroy_process_group()
print(repr(out))
"""


def test_dtensor_state_shares_its_local_shards_storage(tmp_path):
    """DTensor state: the local shards' storage is copied once and each DTensor rebuilt around a view of it
    (same placements and global shape). A fake process group in a subprocess: no collective runs."""
    import ast
    import subprocess
    import sys

    script = tmp_path / "dtensor_alias.py"
    script.write_text(_DTENSOR_SCRIPT)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    offloaded, reloaded, updated = ast.literal_eval(done.stdout.strip().splitlines()[-1])
    assert offloaded == ("DTensor", "cpu", True, 2, True, (4,), [2.0, 3.0, 4.0, 5.0])
    assert reloaded == ("DTensor", "sim:0", True, 2, True, (4,), [2.0, 3.0, 4.0, 5.0])
    assert updated == [3.0, 4.0, 5.0, 6.0], "the flat shard's update shows through the view"


def test_the_set_data_path_keeps_the_sharing_and_the_objects():
    """CPU <-> CUDA copies are adopted by set_data (a view by a swap: set_data would keep its ``_base``, the old
    storage): the old objects take views of the new storage. Shown host to host, where set_data applies too (the
    path a CUDA move takes)."""
    from optimshift import _alias
    from optimshift import _engine as engine
    from optimshift._adopt import mechanism

    flat = torch.arange(12.0)
    olds = [flat, flat[:6].view(2, 3), flat[:6].view(2, 3).t(), flat[6:]]
    (group,) = _alias.shared(olds)
    news = _alias.copy_storage([olds[i] for i in group], torch.device("cpu"), lambda src, d: src.clone())
    assert [mechanism(o, n) for o, n in zip(olds, news)] == ["data", "swap", "swap", "swap"]
    ids = [id(t) for t in olds]
    old_storage, new_storage = flat.untyped_storage().data_ptr(), news[0].untyped_storage().data_ptr()
    layout_before = [(t.storage_offset(), t.shape, t.stride()) for t in olds]
    replaced, apply, _ = engine.adoptions(list(zip(olds, news)))
    assert replaced == []
    apply()
    assert [id(t) for t in olds] == ids
    assert {t.untyped_storage().data_ptr() for t in olds} == {new_storage} != {old_storage}
    assert [(t.storage_offset(), t.shape, t.stride()) for t in olds] == layout_before
    assert all(t._base is None for t in olds)
    olds[0].add_(1)
    assert torch.equal(olds[2], torch.arange(1.0, 7.0).view(2, 3).t()) and torch.equal(olds[3], torch.arange(7.0, 13.0))


@pytest.mark.cuda
def test_on_cuda_offload_to_pinned_memory_and_back_keeps_the_views():
    cuda = torch.device("cuda", 0)
    model, opt = _trained("cpu")
    reference, ref = _trained("cpu")
    for m, o in ((model, opt), (reference, ref)):
        m.to(cuda)
        optimshift.move(o)
    before = _snapshot(opt)
    optimshift.offload(opt)  # pinned host memory: the state came from CUDA
    host = {w: v[:5] + (torch.device("cpu"),) for w, v in before[0].items()}
    assert_views_of_the_flat_buffer(opt, host, *before[1:])
    assert all(t.is_pinned() for _, t in _entries(opt))
    optimshift.reload(opt, non_blocking=True).wait()
    assert_views_of_the_flat_buffer(opt, *before)
    _train(model, opt, range(2, 4))
    _train(reference, ref, range(2, 4))
    for a, b in zip(model.parameters(), reference.parameters()):
        assert bitwise_equal(a, b)


def test_stream_refuses_entries_that_share_a_storage(sim):
    """Streaming gives each entry its own place in a chunk: entries that share a storage are refused by the engine's
    sharing rule (the one for every operation: ``engine.run`` with destinations of their own), before anything
    changes."""
    model = Model([(4,), (2,)]).to(sim)
    opt = torch.optim.Adam(model.parameters(), foreach=False)
    _train(model, opt, range(1))
    flat = torch.zeros(6, device=sim)
    p0, p1 = model.parameters()
    flat[:4].copy_(opt.state[p0]["exp_avg"])
    flat[4:].copy_(opt.state[p1]["exp_avg"])
    opt.state[p0]["exp_avg"], opt.state[p1]["exp_avg"] = flat[:4], flat[4:]
    opt.state[p0]["flat"] = flat  # (the buffer is the optimizer's: a storage something else uses is not its own)
    del flat
    before = _snapshot(opt)
    with pytest.raises(ValueError) as info:
        optimshift.stream(opt)
    message = str(info.value)
    assert "group 0, param 0, state['exp_avg']" in message and "group 0, param 0, state['flat']" in message
    assert "share one storage" in message and "place of their own" in message, message
    assert layout(opt) == before[0] and tensor_ids(opt) == before[2]
    _train(model, opt, range(1, 2))  # still the ordinary step


def _cut_state(device, base_held):
    """SGD state cut from a flat buffer the optimizer does not keep: ``m``, its transpose ``mt`` (the same bytes),
    and ``n``, the buffer's other half; the buffer dropped, or held outside (a module's buffer)."""
    p = torch.nn.Parameter(torch.randn(4, 3, device=device))
    opt = torch.optim.SGD([p], lr=0.1)
    flat = torch.arange(24.0, device=device)
    st = opt.state[p]
    st["m"] = flat[:12].view(4, 3)
    st["mt"] = st["m"].t()
    st["n"] = flat[12:].view(4, 3)
    return opt, st, (flat if base_held else None)


def _ways(opt, sim, way):
    if way == "move":
        optimshift.move(opt, "cpu")
        optimshift.move(opt, sim)
    elif way == "offload":
        optimshift.offload(opt)
        optimshift.reload(opt)
    else:
        optimshift.offload(opt, keep_addresses=True)
        optimshift.reload(opt)


@pytest.mark.parametrize("way", ["move", "offload", "keep_addresses"])
@pytest.mark.parametrize("base_held", [False, True])
def test_entries_that_overlap_keep_sharing_whoever_else_holds_their_storage(sim, way, base_held):
    """Entries whose bytes overlap (a view of a flat buffer and its transpose) on a storage something else uses too
    (the buffer, dropped but still every view's ``_base``, or held outside): each was copied apart, and an update
    through one stopped showing through the other (a silent divergence). They are copied together, as the span
    of bytes they cover; an entry that overlaps none gets its own copy, and a base held outside stays as it was."""
    opt, st, base = _cut_state(sim, base_held)
    ids, values = tensor_ids(opt), {k: v.cpu().clone() for k, v in st.items()}
    _ways(opt, sim, way)
    assert tensor_ids(opt) == ids and all(torch.equal(st[k].cpu(), v) for k, v in values.items())
    assert st["m"].untyped_storage().data_ptr() == st["mt"].untyped_storage().data_ptr()
    assert st["m"].untyped_storage().nbytes() == 12 * 4, "the span the two cover, not the buffer"
    st["m"].add_(1)
    assert torch.equal(st["mt"].t().cpu(), values["m"] + 1)
    assert torch.equal(st["n"].cpu(), values["n"])
    if base is not None:
        assert base.device == sim and torch.equal(base.cpu(), torch.arange(24.0)), "the base held outside is its own"


def test_a_storage_only_state_uses_is_copied_as_the_span_its_entries_cover(sim):
    """A storage nothing else uses is copied as the bytes its entries cover (from the 256-byte boundary below the
    first: each keeps its alignment), not its tail nobody reads."""
    p = torch.nn.Parameter(torch.randn(4, device=sim))
    opt = torch.optim.SGD([p], lr=0.1)
    flat = torch.arange(1024.0, device=sim)
    opt.state[p].update(a=flat[2:6], b=flat[4:10])
    del flat
    with _CrossDeviceBytes() as copied:
        optimshift.offload(opt)
    assert copied.total == 10 * 4  # (elements 0 to 10: a starts 8 bytes past a 256-byte boundary)
    optimshift.reload(opt)
    a, b = opt.state[p]["a"], opt.state[p]["b"]
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() and b.storage_offset() == 4
    assert torch.equal(b.cpu(), torch.arange(4.0, 10.0))


def test_stream_refuses_entries_that_overlap_on_a_storage_something_else_uses(sim):
    """Streaming keeps each entry apart: overlapping entries whose storage something else uses (their dropped base)
    went through, each its own window, and an update through one no longer showed through the other. Refused
    by the engine's sharing rule, before anything changes."""
    model = Model([(4, 3)]).to(sim)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _train(model, opt, range(1))
    (p,) = model.parameters()
    flat = torch.zeros(24, device=sim)
    opt.state[p]["extra"] = flat[:12].view(4, 3)
    opt.state[p]["extra_t"] = opt.state[p]["extra"].t()
    del flat
    ids = tensor_ids(opt)
    with pytest.raises(ValueError, match="share one storage"):
        optimshift.stream(opt)
    assert tensor_ids(opt) == ids


@pytest.mark.parametrize("way", ["move", "offload"])
def test_entries_whose_intervals_interleave_but_share_no_byte_are_copied_apart(sim, way):
    """Two columns of a dropped matrix (each strided over the whole buffer) and moments packed by ``unbind(-1)``:
    their byte intervals overlap, no byte is shared. Grouped by interval they were copied as the whole buffer (16
    MiB held for 16 KiB of state) and stream() refused them; grouped by shared bytes, each is its own. An empty
    view shares nothing either."""
    p = torch.nn.Parameter(torch.randn(2048, device=sim))
    opt = torch.optim.SGD([p], lr=0.1)
    big = torch.zeros(2048, 2048, device=sim)
    st = opt.state[p]
    st["c0"], st["c1"] = big[:, 0], big[:, 1]
    st["m"], st["v"] = torch.zeros(2048, 2, device=sim).unbind(-1)
    st["empty"] = st["c0"][5:5]
    del big
    if way == "move":
        optimshift.move(opt, "cpu")
    else:
        optimshift.offload(opt)
        optimshift.reload(opt)
    assert {k: v.untyped_storage().nbytes() for k, v in st.items() if k != "empty"} == {
        k: 2048 * 4 for k in ("c0", "c1", "m", "v")
    }
    assert len({v.untyped_storage().data_ptr() for k, v in st.items() if k != "empty"}) == 4


def test_a_view_with_attributes_of_its_own_keeps_them():
    """A view adopts its copy by a swap (set_data would keep its ``_base``), but not one with attributes of its own,
    which a swap hands to the copy (a tag a framework put on it)."""
    p = torch.nn.Parameter(torch.randn(4))
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    p.grad = torch.randn(4)
    opt.step()
    entry = opt.state[p]["momentum_buffer"] = torch.zeros(8)[:4]
    entry.tag = "bucket-0"
    optimshift.load_state_dict(
        opt, {"state": {0: {"momentum_buffer": torch.ones(4)}}, "param_groups": opt.state_dict()["param_groups"]}
    )
    assert opt.state[p]["momentum_buffer"] is entry and entry.tag == "bucket-0" and torch.equal(entry, torch.ones(4))


def test_load_state_dict_refuses_a_shared_storage_cast_into_two_dtypes():
    """cast='param' onto params of two dtypes would cast a flat buffer's views apart: the engine's one sharing rule
    (devices and dtypes) refuses it, naming both entries and both dtypes (a first version named the cast one's
    only: "cpu and bfloat16 on cpu"), before anything is loaded."""
    _, source = _trained("cpu")
    model = Model(SHAPES)
    model.parts[2].to(torch.bfloat16)
    opt = FlatMomentum(model.parameters())
    with pytest.raises(ValueError) as info:
        optimshift.load_state_dict(opt, source.state_dict(), cast="param")
    message = str(info.value)
    assert message.startswith("FlatMomentum: load_state_dict: ") and "share one storage" in message, message
    assert "in different dtypes" in message, message
    # (each member's dtype: the one kept as saved too, which the cast one is refused beside)
    assert "(float32 on cpu and float32 cast to bfloat16 on cpu)" in message, message
    assert not opt.state, "nothing was loaded"


def test_located_asks_each_tensor_s_device_and_storage_once_and_a_sparse_one_has_no_storage():
    """``_alias.located`` (engine.run's one walk): a tensor's device and storage key, the views of one storage keyed
    alike; a sparse tensor among plain ones (no storage) is asked one by one and has no key, and ``shared`` given
    the keys still groups the overlapping views."""
    from optimshift import _alias

    base = torch.zeros(6)
    tensors = [base[:4], torch.zeros(2).to_sparse(), base[2:], torch.zeros(1, device="meta")]
    devices, keys = _alias.located(tensors)
    assert devices == [torch.device("cpu"), torch.device("cpu"), torch.device("cpu"), torch.device("meta")]
    assert keys[0] == keys[2] == _alias.storage_of(base) and keys[1] is None and keys[3] not in (None, keys[0])
    assert _alias.shared(tensors, keys) == _alias.shared(tensors) == [[0, 2]]


def test_run_asks_once_whether_fake_mode_is_on_for_the_storages_of_what_moves(monkeypatch):
    """``engine.run`` hands ``shared`` the keys ``located`` read (None each under FakeTensorMode), which asks nothing
    again: a second ask (an import and a C call) was ~1.3 us of a 15-tensor run's ~36, the cached-plan cycle's."""
    from optimshift import _alias, _engine
    from optimshift._plan import build_plan

    params = [torch.nn.Parameter(torch.ones(2)) for _ in range(3)]
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    for p in params:
        p.grad = torch.ones(2)
    opt.step()
    meta = torch.device("meta")
    plan = build_plan(opt, lambda ident, param, group, key, tensor: (meta, "test"))
    asked = []
    real = _alias._fake_mode_active
    monkeypatch.setattr(_alias, "_fake_mode_active", lambda: asked.append(True) or real())
    copies = _engine.run(plan)
    assert [c.device for c in copies.batch.copies] == [meta] * 3, "every buffer moves"
    assert len(asked) == 1, f"asked {len(asked)} times whether FakeTensorMode is on"

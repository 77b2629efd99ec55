"""Resume fidelity over the whole optimizer matrix, on the simulated accelerator, through real files.

Train K steps on the source placement, ``optimshift.save`` the optimizer, ``optimshift.load`` the file,
``optimshift.load_state_dict`` it into an optimizer over the same param values on the target, continue M
steps. Directions: host->device, device->host, device 0->1, fused->non-fused (device), capturable->CPU.

- params after the M steps are bitwise equal to the run that never stopped (same flags) or, when the flags
  change, to a run on the target that loaded the same state with PyTorch (flags set to the live ones);
- placement equals a fresh optimizer's on the target, and so do the host syncs per step (``count_syncs``);
- dtypes are as saved, values bitwise equal to the saved ones right after the load.

Device-sourced files are read back with ``map_location=None`` (restored where saved, as on a GPU machine): the
hard case, where every scalar saved on the device must come back to the host when a fresh optimizer keeps it
there.
"""

from __future__ import annotations

import pytest
import torch

import optimshift
from _matrix import CASES, Model, bitwise_equal, state_dtypes, state_layout, train

K, M = 2, 2
IMPL = ("fused", "capturable", "foreach")


def _place(model, device):
    model.zero_grad(set_to_none=True)
    model.to(device)


def _directions():
    for name, cls, kwargs, _directions, shapes in CASES:
        todo = []
        if kwargs.get("capturable"):
            todo += ["d0d1", "capturable-cpu"]
        else:
            todo += ["h2d", "d2h", "d0d1"]
        if kwargs.get("fused"):
            todo.append("fused-nonfused")
        for direction in todo:
            yield pytest.param(cls, kwargs, shapes, direction, id=f"{name}-{direction}")


def _setup(direction, sim, kwargs):
    cpu, d0, d1 = torch.device("cpu"), torch.device(sim.type, 0), torch.device(sim.type, 1)
    live = dict(kwargs)
    if direction == "capturable-cpu":
        live["capturable"] = False
    if direction == "fused-nonfused":
        live.pop("fused")
        live["foreach"] = False
    src, dst = {
        "h2d": (cpu, d0),
        "d2h": (d0, cpu),
        "d0d1": (d0, d1),
        "fused-nonfused": (d0, d0),
        "capturable-cpu": (d0, cpu),
    }[direction]
    return src, dst, live


def _state_values(opt):
    params = [p for g in opt.param_groups for p in g["params"]]
    return [{k: v for k, v in opt.state[p].items()} for p in params if p in opt.state]


def _optimizer(cls, model, kwargs):
    return cls([h.weight for h in model.parts], **kwargs)


@pytest.mark.parametrize("cls, kwargs, shapes, direction", list(_directions()))
def test_resume(sim, tmp_path, cls, kwargs, shapes, direction):
    src, dst, live = _setup(direction, sim, kwargs)
    flags_change = live != kwargs

    # The source run: K steps, saved, then (as the never-stopped reference) M more.
    source = Model(shapes)
    _place(source, src)
    opt = _optimizer(cls, source, kwargs)
    train(source, opt, range(K))
    path = tmp_path / "optimizer.pt"
    optimshift.save(opt, path)
    trained = [h.weight.detach().to("cpu", copy=True) for h in source.parts]
    saved_values = [
        {k: (v.to("cpu", copy=True) if isinstance(v, torch.Tensor) else v) for k, v in st.items()}
        for st in _state_values(opt)
    ]
    saved_dtypes = state_dtypes(opt)
    train(source, opt, range(K, K + M))

    def target_model():
        model = Model(shapes)
        _place(model, dst)
        with torch.no_grad():
            for h, w in zip(model.parts, trained):
                h.weight.copy_(w)
        return model

    # Ours: load the file (device files restored where they were saved) into an optimizer on the target.
    model = target_model()
    ours = _optimizer(cls, model, live)
    loaded = optimshift.load(path, map_location="cpu" if src.type == "cpu" else None)
    assert optimshift.load_state_dict(ours, loaded) is ours
    assert state_dtypes(ours) == saved_dtypes, "a load must not change a dtype"
    assert bitwise_equal(
        [{k: (v.to("cpu") if isinstance(v, torch.Tensor) else v) for k, v in st.items()} for st in _state_values(ours)],
        saved_values,
    )
    for g in ours.param_groups:
        for flag in IMPL:
            if flag in live:
                assert g[flag] == live[flag], "flags='live' keeps the live optimizer's implementation flags"
    layout = state_layout(ours)
    with optimshift.count_syncs() as syncs:
        train(model, ours, range(K, K + M))

    # A fresh optimizer on the target with the live flags: where it keeps its state, and what a step costs.
    fresh_model = target_model()
    fresh = _optimizer(cls, fresh_model, live)
    train(fresh_model, fresh, range(K))
    fresh_layout = state_layout(fresh)
    with optimshift.count_syncs() as fresh_syncs:
        train(fresh_model, fresh, range(K, K + M))

    assert layout == fresh_layout, "placement after the load must equal a fresh optimizer's on the target"
    assert syncs.total == fresh_syncs.total, f"host syncs after the load {syncs.total} != fresh {fresh_syncs.total}"
    assert optimshift.check(ours).ok

    if flags_change:
        # PyTorch where it is right: the state read onto the host (so a non-fused `step` is where a fresh
        # optimizer keeps it) and the checkpoint's groups given the live flags.
        ref_model = target_model()
        ref = _optimizer(cls, ref_model, live)
        sd = optimshift.load(path, map_location="cpu")
        for g in sd["param_groups"]:
            for flag in IMPL:
                g.pop(flag, None)
            g.update({k: v for k, v in live.items() if k in IMPL})
        ref.load_state_dict(sd)
        train(ref_model, ref, range(K, K + M))
        reference = ref_model
    else:
        reference = source
    for a, b in zip(model.parameters(), reference.parameters()):
        assert bitwise_equal(a, b), "params after the resume diverged from the reference run"


_DTENSOR_SAME_DEVICE_LOAD = """
import torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
import optimshift
mesh = init_device_mesh("cpu", (1,))
p = torch.nn.Parameter(distribute_tensor(torch.randn(4, 3), mesh, [Shard(0)]))
opt = torch.optim.Adam([p])
p.grad = distribute_tensor(torch.randn(4, 3), mesh, [Shard(0)])
opt.step()
sd = opt.state_dict()
saved = sd["state"][0]["exp_avg"].to_local().clone()
fresh = torch.optim.Adam([p])
optimshift.load_state_dict(fresh, sd)
st = fresh.state[p]
base = lambda t: t.to_local().untyped_storage().data_ptr()
shared = base(st["exp_avg"]) == base(sd["state"][0]["exp_avg"])
fresh.step()
print(repr((type(st["exp_avg"]).__name__, shared, torch.equal(sd["state"][0]["exp_avg"].to_local(), saved))))
dist.destroy_process_group()
"""


def test_a_dtensor_checkpoint_loaded_where_it_is_is_copied(tmp_path):
    """DTensor state loaded onto the device its shards are on is a copy (``copy=True``: the optimizer never
    shares a tensor with the state dict), so a step leaves the checkpoint as it was. (Found by review: the one
    copy of a tensor, taking the shard's fast path, gave the shard itself where it already was.) A fake process
    group in a subprocess: no collective runs."""
    import ast
    import subprocess
    import sys

    script = tmp_path / "dtensor_same_device_load.py"
    script.write_text(_DTENSOR_SAME_DEVICE_LOAD)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    kind, shared, unchanged = ast.literal_eval(done.stdout.strip().splitlines()[-1])
    assert kind == "DTensor" and not shared and unchanged


class _Fixing(torch.optim.Adam):
    """A class whose ``__setstate__`` fix-up replaces a tensor entry (a recast, a rescale)."""

    def __setstate__(self, state):
        super().__setstate__(state)
        for s in self.state.values():
            if "exp_avg" in s:
                s["exp_avg"] = s["exp_avg"] * 2


def test_a_setstate_fix_up_that_replaces_an_entry_is_kept_as_torch_keeps_it():
    """Into existing state whose live tensor cannot take the values in place (a view outside shares its
    storage), the load adopts its copy into the live tensor only where ``__setstate__`` left the copy: a fix-up
    that replaced the entry keeps its value, as in torch. (Found by review: the commit put the old object back
    with the checkpoint's values, undoing the fix-up.)"""

    def trained():
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(5))
        opt = _Fixing([p])
        p.grad = torch.randn(5)
        opt.step()
        return p, opt

    _, source = trained()
    sd = source.state_dict()
    checkpoint = sd["state"][0]["exp_avg"].clone()
    q, reference = trained()
    reference.load_state_dict(sd)
    r, live = trained()
    view = live.state[r]["exp_avg"][:]  # (shares the live tensor's storage: no write in place)
    optimshift.load_state_dict(live, sd)
    assert torch.equal(reference.state[q]["exp_avg"], checkpoint * 2)
    assert torch.equal(live.state[r]["exp_avg"], checkpoint * 2)
    assert torch.equal(live.state[r]["exp_avg_sq"], sd["state"][0]["exp_avg_sq"])
    del view

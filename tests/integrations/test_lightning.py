"""optimshift.integrations.lightning against the real Lightning: Trainer (CPU and the simulated accelerator),
the strategy's own setup/load_optimizer_state_dict/teardown, Fabric, and the offload-during-eval callback.

Every placement is compared with a fresh optimizer of the same class and flags over params placed like the
live ones, after one step. Each Lightning bug gets a test that shows it unpatched and fixed patched.
"""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import pytest
import torch
from _integrations_support import (
    bitwise_same,
    count_step_syncs,
    devices,
    fresh_layout,
    layout,
    snapshot,
    step_with_grads,
)

import optimshift

pl = pytest.importorskip("lightning.pytorch")
from lightning.fabric import Fabric  # noqa: E402
from lightning.pytorch.strategies import SingleDeviceStrategy  # noqa: E402

import optimshift.integrations.lightning as osl  # noqa: E402
from optimshift.testing import deferred_streams  # noqa: E402
from optimshift.testing.lightning import fabric_strategy  # noqa: E402
from optimshift.testing.lightning import strategy as lightning_strategy  # noqa: E402

O = torch.optim
# What the simulated accelerator (like CUDA) raises when a step mixes devices or feeds a host tensor to a fused kernel.
MIXED = r"found at least two devices|fused kernels reject CPU"

# id -> (class name, kwargs). All run on the host (for the checkpoint) and on the simulated device.
CONFIGS = {
    "Adam": ("Adam", {"foreach": False}),
    "Adam-fused": ("Adam", {"fused": True}),
    "AdamW-foreach-amsgrad": ("AdamW", {"foreach": True, "amsgrad": True}),
    "NAdam": ("NAdam", {}),
    "RAdam": ("RAdam", {}),
    "Adagrad-fused": ("Adagrad", {"fused": True}),
    "ASGD": ("ASGD", {}),
    "SGD-momentum": ("SGD", {"momentum": 0.9}),
}


class Tiny(pl.LightningModule):
    """Two linear layers; the optimizer is chosen by name (or handed in already built, with state)."""

    def __init__(self, opt_name: str = "Adam", opt_kwargs: dict | None = None, fail_validation_at: int = -1):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
        self.opt_name, self.opt_kwargs = opt_name, dict(opt_kwargs or {})
        self.prebuilt: torch.optim.Optimizer | None = None
        self.fail_validation_at = fail_validation_at
        self.validations = 0

    def make_optimizer(self, params):
        return getattr(O, self.opt_name)(params, **self.opt_kwargs)

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return (self.net(x) ** 2).mean()

    def validation_step(self, batch, batch_idx):
        self.validations += 1
        if self.validations == self.fail_validation_at:
            raise RuntimeError("validation failed on purpose")
        (x,) = batch
        self.net(x)

    def configure_optimizers(self):
        return self.prebuilt if self.prebuilt is not None else self.make_optimizer(self.parameters())


def _data(n: int = 16) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(1)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(n, 4, generator=g)), batch_size=4)


def _trainer(device: torch.device, max_steps: int, callbacks=(), strategy=None, **kwargs) -> pl.Trainer:
    options = dict(
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=list(callbacks),
    )
    options.update(kwargs)
    if strategy is not None:
        return pl.Trainer(strategy=strategy, **options)
    if device.type == "cpu":
        return pl.Trainer(accelerator="cpu", devices=1, **options)
    return pl.Trainer(strategy=lightning_strategy(device), **options)


class Probe(pl.Callback):
    """Records the optimizer's placement, the fresh reference and a value snapshot when training starts,
    and a snapshot when it ends (before the strategy's teardown)."""

    def on_train_start(self, trainer, pl_module):
        opt = trainer.optimizers[0]
        self.layout = layout(opt)
        self.fresh = fresh_layout(pl_module.make_optimizer, list(pl_module.parameters()))
        self.values = snapshot(opt)
        self.check_ok = optimshift.check(opt).ok
        self.lr = opt.param_groups[0]["lr"]
        self.lr_device = getattr(self.lr, "device", None)

    def on_train_end(self, trainer, pl_module):
        self.values_at_end = snapshot(trainer.optimizers[0])


def _checkpoint_state(path: Path) -> dict:
    """The optimizer state saved in a Lightning checkpoint, keyed like :func:`snapshot`."""
    saved = torch.load(path, map_location="cpu", weights_only=False)["optimizer_states"][0]
    index = {i: (gi, pi) for gi, g in enumerate(saved["param_groups"]) for pi, i in enumerate(g["params"])}
    return {(*index[i], k): v for i, entry in saved["state"].items() for k, v in entry.items()}


def _host_checkpoint(tmp_path: Path, name: str, kwargs: dict, steps: int = 3) -> Path:
    module = Tiny(name, kwargs)
    trainer = _trainer(torch.device("cpu"), steps)
    trainer.fit(module, _data())
    path = tmp_path / "host.ckpt"
    trainer.save_checkpoint(path)
    return path


# --- Trainer: fit, checkpoint, resume ---------------------------------------------------------------------


def test_trainer_fit_checkpoint_resume_on_cpu(tmp_path, lightning_patch):
    lightning_patch(True)
    path = _host_checkpoint(tmp_path, "Adam", {})
    module, probe = Tiny("Adam"), Probe()
    trainer = _trainer(torch.device("cpu"), 6, [probe])
    trainer.fit(module, _data(), ckpt_path=path)
    assert probe.layout == probe.fresh
    assert probe.check_ok
    assert bitwise_same(probe.values, _checkpoint_state(path)), "restoring must not change a value"
    assert devices(trainer.optimizers[0]) == {"cpu"}
    assert trainer.global_step == 6


@pytest.mark.parametrize("config", list(CONFIGS))
def test_trainer_resumes_host_checkpoint_on_device(sim, tmp_path, lightning_patch, config):
    """The seed's scenario through a real Trainer: train on the host, checkpoint, fit(ckpt_path=...) on the
    (simulated) accelerator. Placement at on_train_start equals a fresh optimizer's; teardown leaves nothing."""
    lightning_patch(True)
    name, kwargs = CONFIGS[config]
    path = _host_checkpoint(tmp_path, name, kwargs)
    module, probe = Tiny(name, kwargs), Probe()
    trainer = _trainer(sim, 5, [probe])
    trainer.fit(module, _data(), ckpt_path=path)
    assert any(row[2] == str(sim) for row in probe.layout), "the state must have moved to the device"
    assert probe.layout == probe.fresh
    assert probe.check_ok
    assert bitwise_same(probe.values, _checkpoint_state(path))
    opt = trainer.optimizers[0]
    assert devices(opt) == {"cpu"}, "teardown must leave no optimizer tensor on the accelerator"
    assert bitwise_same(snapshot(opt), probe.values_at_end), "teardown must not change a value"


def test_restore_unpatched_puts_host_scalars_on_device(sim, tmp_path, lightning_patch):
    """Lightning's bug on restore: every tensor but ``step`` goes to the root device, so NAdam's host-side
    ``mu_product`` lands on the accelerator (read on the host every step)."""
    path = _host_checkpoint(tmp_path, "NAdam", {})
    for patched in (False, True):
        lightning_patch(patched)
        module, probe = Tiny("NAdam"), Probe()
        _trainer(sim, 4, [probe]).fit(module, _data(), ckpt_path=path)
        mu = {row[2] for row in probe.layout if row[1] == "mu_product"}
        if patched:
            assert probe.layout == probe.fresh and mu == {"cpu"}
        else:
            assert mu == {str(sim)} and probe.layout != probe.fresh


def test_setup_moves_existing_fused_state_with_its_step(sim, lightning_patch):
    """Lightning's bug in strategy setup: a CPU-fused optimizer that already has state keeps a host ``step``
    when moved to the accelerator, and the fused kernel rejects it."""

    def module_with_trained_optimizer():
        module = Tiny("Adam", {"fused": True})
        opt = module.make_optimizer(module.parameters())
        for seed in range(2):
            step_with_grads(list(module.parameters()), opt, seed)
        opt.zero_grad()
        module.prebuilt = opt
        return module

    lightning_patch(False)
    with pytest.raises(RuntimeError, match=MIXED):
        _trainer(sim, 3).fit(module_with_trained_optimizer(), _data())

    lightning_patch(True)
    module, probe = module_with_trained_optimizer(), Probe()
    before = snapshot(module.prebuilt)
    trainer = _trainer(sim, 3, [probe])
    trainer.fit(module, _data())
    assert probe.layout == probe.fresh
    assert bitwise_same(probe.values, before)
    assert devices(trainer.optimizers[0]) == {"cpu"}


@pytest.mark.parametrize("flag", ["fused", "capturable"])
def test_teardown_leaves_nothing_on_device(sim, tmp_path, lightning_patch, flag):
    """Lightning's bug at teardown: a fused or capturable ``step`` stays on the accelerator. Patched, every
    tensor is on the host, bitwise unchanged, and a checkpoint saved afterwards resumes on the device."""
    lightning_patch(False)
    trainer = _trainer(sim, 2)
    trainer.fit(Tiny("Adam", {flag: True}), _data())
    left = {row[1] for row in layout(trainer.optimizers[0]) if row[2] == str(sim)}
    assert left == {"step"}, "unpatched Lightning leaves exactly the step tensors on the device"

    lightning_patch(True)
    probe = Probe()
    trainer = _trainer(sim, 2, [probe])
    trainer.fit(Tiny("Adam", {flag: True}), _data())
    assert devices(trainer.optimizers[0]) == {"cpu"}
    assert bitwise_same(snapshot(trainer.optimizers[0]), probe.values_at_end)

    path = tmp_path / "device.ckpt"
    trainer.save_checkpoint(path)
    resumed = Probe()
    _trainer(sim, 4, [resumed]).fit(Tiny("Adam", {flag: True}), _data(), ckpt_path=path)
    assert resumed.layout == resumed.fresh
    assert bitwise_same(resumed.values, _checkpoint_state(path))


class DeviceLrTiny(Tiny):
    """Fused Adam given its lr on the params' device (a CUDA-graph user's), the lr it was given kept."""

    def make_optimizer(self, params):
        params = list(params)
        return O.Adam(params, lr=torch.tensor(0.01, device=params[0].device), fused=True)

    def configure_optimizers(self):
        self.given = super().configure_optimizers()
        return self.given


def test_a_resume_keeps_a_device_lr_the_object_it_is(sim, tmp_path, lightning_patch):
    """``fit(ckpt_path=...)`` reads the checkpoint onto the host: the resume wrote the saved lr into the device lr
    and took that tensor to the host; it stays on the device (a captured step reads it at its address)."""
    lightning_patch(True)
    first = _trainer(sim, 2)
    first.fit(DeviceLrTiny(), _data())
    path = tmp_path / "device_lr.ckpt"
    first.save_checkpoint(path)
    module, probe = DeviceLrTiny(), Probe()
    _trainer(sim, 3, [probe]).fit(module, _data(), ckpt_path=path)
    assert probe.lr is module.given.param_groups[0]["lr"] and probe.lr_device == sim
    assert probe.check_ok


class TwoDeviceStrategy(SingleDeviceStrategy):
    """Root device sim:0, but the model's last layer lives on sim:1 (manual model parallelism)."""

    def model_to_device(self) -> None:
        net = self.model.net
        net[0].to(torch.device(self.root_device.type, 0))
        net[1].to(torch.device(self.root_device.type, 1))


class TwoDeviceTiny(Tiny):
    def training_step(self, batch, batch_idx):
        (x,) = batch
        hidden = self.net[0](x.to(self.net[0].weight.device))
        return (self.net[1](hidden.to(self.net[1].weight.device)) ** 2).mean().to(self.net[0].weight.device)


@pytest.mark.parametrize("config", ["Adam", "Adam-fused"])
def test_trainer_params_on_two_devices(sim, tmp_path, lightning_patch, config):
    """Lightning's bug with params on several devices: every state tensor goes to the one root device.
    Patched, each param's state follows that param (sim:0 and sim:1), through setup, restore and teardown."""
    name, kwargs = CONFIGS[config]
    path = _host_checkpoint(tmp_path, name, kwargs)
    strategy = lambda: lightning_strategy(sim, TwoDeviceStrategy)  # noqa: E731
    with torch.autograd.set_multithreading_enabled(False):  # backward through sim:1 (see simulated_accelerator)
        lightning_patch(False)
        with pytest.raises(RuntimeError, match="sim:0 and sim:1|sim:1 and sim:0|must be on the same device"):
            _trainer(sim, 5, strategy=strategy()).fit(TwoDeviceTiny(name, kwargs), _data(), ckpt_path=path)

        lightning_patch(True)
        module, probe = TwoDeviceTiny(name, kwargs), Probe()
        trainer = _trainer(sim, 5, [probe], strategy=strategy())
        trainer.fit(module, _data(), ckpt_path=path)
    assert {row[2] for row in probe.layout} >= {"sim:0", "sim:1"}
    assert probe.layout == probe.fresh
    assert bitwise_same(probe.values, _checkpoint_state(path))
    assert devices(trainer.optimizers[0]) == {"cpu"}


# --- the strategy's own methods, called directly --------------------------------------------------------


def _host_state(name: str, kwargs: dict, shapes) -> dict:
    params = [
        torch.nn.Parameter(torch.randn(s, generator=torch.Generator().manual_seed(i))) for i, s in enumerate(shapes)
    ]
    opt = getattr(O, name)(params, **kwargs)
    for seed in range(3):
        step_with_grads(params, opt, seed)
    return opt.state_dict()


@pytest.mark.parametrize("config", ["NAdam", "ASGD", "Adam-fused"])
def test_strategy_load_optimizer_state_dict_and_teardown(sim, lightning_patch, config):
    """``load_optimizer_state_dict`` then ``teardown`` on a strategy whose root device is the simulated one,
    params split over sim:0 and sim:1: placement and host syncs per step equal a fresh optimizer's."""
    name, kwargs = CONFIGS[config]
    shapes = [(3, 4), (3,), (2, 3)]
    saved = _host_state(name, kwargs, shapes)
    where = [torch.device(sim.type, 0), torch.device(sim.type, 0), torch.device(sim.type, 1)]
    make = lambda ps: getattr(O, name)(ps, **kwargs)  # noqa: E731

    def restored(patched: bool):
        lightning_patch(patched)
        params = [torch.nn.Parameter(torch.zeros(s, device=d)) for s, d in zip(shapes, where)]
        opt = make(params)
        strategy = lightning_strategy(sim)
        strategy.optimizers = [opt]
        strategy.load_optimizer_state_dict({"optimizer_states": [saved]})
        return strategy, params, opt

    fresh_params = [torch.nn.Parameter(torch.zeros(s, device=d)) for s, d in zip(shapes, where)]
    fresh = make(fresh_params)
    step_with_grads(fresh_params, fresh, seed=0)
    fresh_syncs = count_step_syncs(fresh_params, fresh, seed=1)

    _, _, buggy = restored(False)
    assert layout(buggy) != layout(fresh), "unpatched Lightning misplaces this optimizer's state"

    strategy, params, opt = restored(True)
    assert layout(opt) == layout(fresh)
    assert bitwise_same(snapshot(opt), {(0, i, k): v for i, e in saved["state"].items() for k, v in e.items()})
    assert count_step_syncs(params, opt, seed=1) == fresh_syncs
    values = snapshot(opt)
    strategy.teardown()
    assert devices(opt) == {"cpu"}
    assert bitwise_same(snapshot(opt), values)


def test_nadam_restore_costs_syncs_only_unpatched(sim, lightning_patch):
    """Measured cost of the restore bug: NAdam's device ``mu_product`` is read on the host each step."""
    shapes = [(3, 4), (3,)]
    saved = _host_state("NAdam", {}, shapes)
    counts = {}
    for patched in (False, True):
        lightning_patch(patched)
        params = [torch.nn.Parameter(torch.zeros(s, device=sim)) for s in shapes]
        opt = O.NAdam(params)
        strategy = lightning_strategy(sim)
        strategy.optimizers = [opt]
        strategy.load_optimizer_state_dict({"optimizer_states": [saved]})
        counts[patched] = count_step_syncs(params, opt, seed=5)
    fresh_params = [torch.nn.Parameter(torch.zeros(s, device=sim)) for s in shapes]
    fresh = O.NAdam(fresh_params)
    step_with_grads(fresh_params, fresh, seed=0)
    assert counts[True] == count_step_syncs(fresh_params, fresh, seed=5) == 0
    assert counts[False] >= len(shapes), f"unpatched restore should sync on every param, got {counts[False]}"


# --- Fabric -------------------------------------------------------------------------------------------------


def _trained(name: str, kwargs: dict, steps: int = 2):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = getattr(O, name)(model.parameters(), **kwargs)
    for seed in range(steps):
        step_with_grads(list(model.parameters()), opt, seed)
    return model, opt


@pytest.mark.parametrize("config", ["Adam", "Adam-fused", "NAdam"])
def test_fabric_setup_places_existing_state(sim, lightning_patch, config):
    """Fabric's gap: ``setup`` moves the model but leaves the optimizer's state where it was."""
    name, kwargs = CONFIGS[config]
    lightning_patch(False)
    model, opt = _trained(name, kwargs)
    _, fabric_opt = Fabric(strategy=fabric_strategy(sim)).setup(model, opt)
    assert devices(opt) == {"cpu"}, "unpatched Fabric leaves the state on the host"
    with pytest.raises(RuntimeError, match=MIXED):
        step_with_grads(list(model.parameters()), fabric_opt, seed=3)

    lightning_patch(True)
    model, opt = _trained(name, kwargs)
    before = snapshot(opt)
    _, fabric_opt = Fabric(strategy=fabric_strategy(sim)).setup(model, opt)
    params = list(model.parameters())
    assert layout(opt) == fresh_layout(lambda ps: getattr(O, name)(ps, **kwargs), params)
    assert bitwise_same(snapshot(opt), before)
    fresh_params = [torch.nn.Parameter(torch.zeros(p.shape, device=sim)) for p in params]
    fresh = getattr(O, name)(fresh_params, **kwargs)
    step_with_grads(fresh_params, fresh, seed=0)
    assert count_step_syncs(params, fabric_opt, seed=3) == count_step_syncs(fresh_params, fresh, seed=3)


@pytest.mark.parametrize("raw", [False, True], ids=["load", "load_raw"])
@pytest.mark.parametrize("config", ["NAdam", "Adam-fused"])
def test_fabric_load_host_checkpoint_on_device(sim, tmp_path, lightning_patch, config, raw):
    name, kwargs = CONFIGS[config]
    model, opt = _trained(name, kwargs, steps=3)
    host = Fabric(accelerator="cpu", devices=1)
    path = tmp_path / ("raw.pt" if raw else "fabric.ckpt")
    if raw:
        torch.save(opt.state_dict(), path)
    else:
        host.save(path, {"model": model, "optimizer": opt})
    saved = snapshot(opt)

    def load(patched: bool):
        lightning_patch(patched)
        model, opt = _trained(name, kwargs, steps=0)
        fabric = Fabric(strategy=fabric_strategy(sim))
        model, fabric_opt = fabric.setup(model, opt)
        if raw:
            fabric.load_raw(path, fabric_opt)
        else:
            fabric.load(path, {"model": model, "optimizer": fabric_opt})
        return opt, list(model.parameters())

    opt, params = load(True)
    reference = fresh_layout(lambda ps: getattr(O, name)(ps, **kwargs), params)
    assert layout(opt) == reference
    assert bitwise_same(snapshot(opt), saved)
    buggy, _ = load(False)
    if name == "NAdam":  # PyTorch's load_state_dict casts mu_product onto the device; Fabric keeps it there
        assert layout(buggy) != reference


@pytest.mark.parametrize("raw", [False, True], ids=["load", "load_raw"])
def test_a_fabric_bf16_load_keeps_a_host_scalar_as_a_fresh_optimizer_holds_it(sim, tmp_path, lightning_patch, raw):
    """``Fabric(precision="bf16-true").load`` of a host fp32 NAdam checkpoint loads as ``fit(ckpt_path=...)`` does
    (optimshift's load, with torch's cast where the step needs it): ``mu_product`` keeps its saved float32 on the
    host, as a fresh NAdam holds it. It went through torch's load, which cast it to bf16 on the device, where the
    patch's placement left it (the foreach step refuses a bf16 host scalar): 2 host syncs a param a step, and
    its value rounded to bf16. A scalar cast so by a user's own ``load_state_dict`` follows its param (test_check)."""
    lightning_patch(True)
    model, opt = _trained("NAdam", {}, steps=3)
    path = tmp_path / ("raw.pt" if raw else "fabric.ckpt")
    if raw:
        torch.save(opt.state_dict(), path)
    else:
        Fabric(accelerator="cpu", devices=1).save(path, {"model": model, "optimizer": opt})
    saved = {k: v for k, v in snapshot(opt).items() if k[2] == "mu_product"}
    model, opt = _trained("NAdam", {}, steps=0)
    fabric = Fabric(strategy=fabric_strategy(sim), precision="bf16-true")
    model, fabric_opt = fabric.setup(model, opt)
    if raw:
        fabric.load_raw(path, fabric_opt)
    else:
        fabric.load(path, {"model": model, "optimizer": fabric_opt})
    assert "load_state_dict" not in vars(opt)  # (the load's own, for the strategy's call only)
    params = list(model.parameters())
    reference = fresh_layout(lambda ps: O.NAdam(ps), params)
    assert layout(opt) == reference and optimshift.check(opt).ok
    assert {(row[2], row[3]) for row in layout(opt) if row[1] == "mu_product"} == {("cpu", "float32")}
    assert bitwise_same({k: v for k, v in snapshot(opt).items() if k[2] == "mu_product"}, saved)
    fresh_params = [torch.nn.Parameter(torch.zeros(p.shape, dtype=p.dtype, device=p.device)) for p in params]
    fresh = O.NAdam(fresh_params)
    step_with_grads(fresh_params, fresh, seed=0)
    assert count_step_syncs(params, fabric_opt, seed=3) == count_step_syncs(fresh_params, fresh, seed=3) == 0


# --- the offload-during-eval callback ---------------------------------------------------------------------


class EvalProbe(pl.Callback):
    def __init__(self):
        self.during_eval: list[set] = []
        self.train_layouts: list = []

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        opt = trainer.optimizers[0]
        grads = {str(p.grad.device) for p in pl_module.parameters() if p.grad is not None}
        self.during_eval.append((devices(opt), optimshift.is_offloaded(opt), grads))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.train_layouts.append(layout(trainer.optimizers[0]))


def _fit_with_validation(device, callbacks, module):
    # Validation after the 3rd of 4 batches while gradients accumulate over 2: it finds the gradients of an
    # unfinished accumulation on the device, which must come back intact.
    trainer = _trainer(
        device,
        6,
        callbacks,
        limit_val_batches=1,
        val_check_interval=3,
        num_sanity_val_steps=1,
        accumulate_grad_batches=2,
    )
    trainer.fit(module, _data(), _data(4))
    return trainer


@pytest.mark.parametrize("include", [(), ("grads",), "grads"], ids=["state", "state+grads", "state+grads as a string"])
@pytest.mark.parametrize("config", ["Adam-fused", "NAdam"])
def test_offload_during_eval(sim, lightning_patch, config, include):
    """State (and with include=("grads",) the gradients) is off the device during every validation loop,
    back exactly where it was for training, and the run is bitwise identical to one without the callback."""
    lightning_patch(True)
    name, kwargs = CONFIGS[config]
    probe, module, plain_module = EvalProbe(), Tiny(name, kwargs), Tiny(name, kwargs)
    offloading = _fit_with_validation(sim, [osl.OffloadOptimizerDuringEval(include=include), probe], module)
    plain = _fit_with_validation(sim, [], plain_module)

    with_state = [d for d in probe.during_eval if d[0]]
    assert len(with_state) >= 2, "validation ran after training steps"
    assert all(d[:2] == ({"cpu"}, True) for d in with_state), "offloaded during validation"
    grads_seen = {frozenset(d[2]) for d in with_state}
    assert grads_seen == ({frozenset()} if include else {frozenset({str(sim)})}), "grads leave only if asked"
    layouts = [lay for lay in probe.train_layouts if lay]  # once the first step created the state
    first = layouts[0]
    assert len(layouts) >= 8 and any(row[2] == str(sim) for row in first)
    assert all(lay == first for lay in layouts), "reloaded exactly where it was"
    assert first == fresh_layout(lambda ps: getattr(O, name)(ps, **kwargs), [p.to(sim) for p in module.parameters()])
    assert bitwise_same(snapshot(offloading.optimizers[0]), snapshot(plain.optimizers[0]))
    for a, b in zip(module.parameters(), plain_module.parameters()):
        assert torch.equal(a, b)


def test_offload_during_eval_when_validation_fails(sim, lightning_patch):
    lightning_patch(True)
    module = Tiny("Adam", {"fused": True}, fail_validation_at=2)
    trainer = _trainer(sim, 6, [osl.OffloadOptimizerDuringEval()], limit_val_batches=1, val_check_interval=2)
    with pytest.raises(RuntimeError, match="validation failed on purpose"):
        trainer.fit(module, _data(), _data(4))
    opt = trainer.optimizers[0]
    assert not optimshift.is_offloaded(opt)
    assert devices(opt) == {"cpu"}


def test_offload_callback_rejects_bad_arguments():
    with pytest.raises(TypeError, match="pin_memory"):
        osl.OffloadOptimizerDuringEval(pin_memory="yes")
    assert osl.OffloadOptimizerDuringEval(include="grads").include == ("grads",)  # (one name, as offload takes it)


# --- patch mechanics ----------------------------------------------------------------------------------------

_IMPORT = re.compile(r"from\s+([\w.]+utilities\.optimizer)\s+import\s+([^\n]+)")


def _modules_binding_helpers() -> list[tuple[str, str, str]]:
    """(module, source module, helper name) for every module of the installed Lightning packages that imports
    one of the helpers by name, found by reading their sources."""
    found = []
    for top in ("lightning", "pytorch_lightning", "lightning_fabric"):
        try:
            package = __import__(top)
        except ImportError:
            continue
        root = Path(package.__file__).parent
        for file in root.rglob("*.py"):
            for source, names in _IMPORT.findall(file.read_text(encoding="utf-8")):
                for helper in ("_optimizer_to_device", "_optimizers_to_device"):
                    if re.search(rf"\b{helper}\b", names):
                        module = ".".join((top, *file.relative_to(root).with_suffix("").parts))
                        found.append((module, source, helper))
    return found


def test_patch_swaps_every_binding_and_unpatch_restores(lightning_patch):
    import importlib

    bindings = _modules_binding_helpers()
    assert len(bindings) >= 10, "the installed Lightning imports the helpers in its strategies"
    modules = {}
    for module, source, helper in bindings:
        try:
            modules[module] = importlib.import_module(module)
        except ImportError:  # a strategy whose optional dependency is missing cannot be imported, nor used
            continue
        assert getattr(modules[module], helper) is getattr(importlib.import_module(source), helper)
    assert "lightning.pytorch.strategies.strategy" in modules and len(modules) >= 10
    for source in {source for _, source, _ in bindings}:  # the helpers' own modules are patched too
        modules[source] = importlib.import_module(source)
        bindings += [(source, source, h) for h in ("_optimizer_to_device", "_optimizers_to_device")]
    originals = {(m, h): getattr(modules[m], h) for m, _, h in bindings if m in modules}
    fabric_setup = Fabric.__dict__["setup"]

    lightning_patch(True)
    assert osl.is_patched()
    patched = {(m, h): getattr(modules[m], h) for m, h in originals}
    assert all(patched[k] is not originals[k] for k in originals)
    assert Fabric.__dict__["setup"] is not fabric_setup
    osl.patch()  # idempotent
    assert {(m, h): getattr(modules[m], h) for m, h in originals} == patched

    # A module imported after patch() binds the replacement; unpatch() gives it the original back.
    late = types.ModuleType("late_lightning_user")
    sys.modules[late.__name__] = late
    try:
        exec("from lightning.fabric.utilities.optimizer import _optimizer_to_device as move_state", late.__dict__)
        assert late.move_state is patched[("lightning.pytorch.strategies.strategy", "_optimizer_to_device")]
        osl.unpatch()
        assert late.move_state is originals[("lightning.pytorch.strategies.strategy", "_optimizer_to_device")]
    finally:
        del sys.modules[late.__name__]
    assert not osl.is_patched()
    assert all(getattr(modules[m], h) is originals[(m, h)] for m, h in originals)
    assert Fabric.__dict__["setup"] is fabric_setup
    osl.unpatch()  # idempotent


class _ListState:
    """A custom optimizer Lightning supports whose state is a list per param."""

    def __init__(self):
        self.p = torch.nn.Parameter(torch.zeros(2))
        self.param_groups = [{"params": [self.p]}]
        self.state = {self.p: [torch.ones(2)]}

    def moved(self):
        return self.state[self.p][0]


class _StrayParam(torch.optim.SGD):
    """An optimizer whose state holds a param that no group holds (optimshift cannot tell where it goes)."""

    def __init__(self):
        self.p = torch.nn.Parameter(torch.zeros(2))
        super().__init__([self.p], lr=0.1, momentum=0.9)
        self.state[self.p]["momentum_buffer"] = torch.ones(2)
        self.state[torch.nn.Parameter(torch.zeros(3))] = {"momentum_buffer": torch.ones(3)}

    def moved(self):
        return self.state[self.p]["momentum_buffer"]


@pytest.mark.parametrize("make", [_ListState, _StrayParam], ids=["list-state", "stray-param"])
def test_patched_helper_leaves_unplaceable_optimizers_to_lightning(sim, lightning_patch, make):
    """Optimizers optimshift refuses to place are still moved by Lightning's own code, as before the patch."""
    from lightning.pytorch.strategies import strategy as strategy_module

    lightning_patch(True)
    custom = make()
    with pytest.raises((TypeError, ValueError)):
        optimshift.move(custom, sim)
    strategy_module._optimizer_to_device(custom, sim)
    assert custom.moved().device == sim


def _two_groups(sim) -> tuple[torch.optim.SGD, torch.Tensor]:
    """SGD over two params in two groups, momentum for each: removing group 1 leaves state for a param in no group."""
    p, q = (torch.nn.Parameter(torch.zeros(n, device=sim)) for n in (2, 3))
    opt = torch.optim.SGD([{"params": [p]}, {"params": [q]}], lr=0.1, momentum=0.9)
    for t in (p, q):
        opt.state[t]["momentum_buffer"] = torch.ones_like(t)
    return opt, p


@pytest.mark.parametrize("held", ["offloaded", "streamed"])
def test_an_optimizer_optimshift_holds_is_not_handed_to_lightnings_loop(sim, lightning_patch, held):
    """Its state became one optimshift cannot place (a group removed while offloaded or streamed): Lightning's loop
    moved it to the device, leaving the offload recorded (step() refused) or the streamed state off the host."""
    lightning_patch(True)
    from lightning.pytorch.strategies import strategy as strategy_module

    opt, p = _two_groups(sim)
    with deferred_streams(seed=0, progress=0.0):
        if held == "offloaded":
            optimshift.offload(opt, non_blocking=True)
        else:
            optimshift.stream(opt)
        del opt.param_groups[1]
        if held == "offloaded":
            with pytest.raises(ValueError, match="in no param group"):
                strategy_module._optimizer_to_device(opt, sim)
            assert optimshift.is_offloaded(opt)
        else:
            strategy_module._optimizer_to_device(opt, sim)  # (its state stays on the host: the step streams it)
            assert optimshift.is_streamed(opt)
        optimshift.wait(opt)
    assert opt.state[p]["momentum_buffer"].device.type == "cpu"


def test_an_optimizer_wide_entry_is_placed_by_optimshift(sim, lightning_patch):
    """MADGRAD's ``state["k"]`` (under a plain key): once left to Lightning's loop, which put it on the device
    (1 host sync per step); optimshift keeps it where a fresh MADGRAD does, on the host."""
    madgrad = pytest.importorskip("pytorch_optimizer").MADGRAD
    from lightning.pytorch.strategies import strategy as strategy_module

    lightning_patch(True)
    params = [torch.nn.Parameter(torch.randn(3, device=sim))]
    opt = madgrad(params, lr=0.01)
    step_with_grads(params, opt, seed=0)
    strategy_module._optimizer_to_device(opt, "cpu")
    strategy_module._optimizer_to_device(opt, sim)
    assert opt.state["k"].device.type == "cpu" and opt.state[params[0]]["s"].device == sim
    assert count_step_syncs(params, opt, seed=1) == 0


@pytest.mark.parametrize("copies", ["in flight", "complete"])
def test_an_optimizer_with_a_reload_in_flight_is_lightnings_once_the_copies_are_complete(sim, lightning_patch, copies):
    """A group removed while a non-blocking reload's copies run (its state then one optimshift cannot place):
    optimshift's ValueError while they ran, Lightning's loop once they were done (a timing's answer); Lightning's
    loop, after the copies, either way."""
    lightning_patch(True)
    from lightning.pytorch.strategies import strategy as strategy_module

    opt, p = _two_groups(sim)
    with deferred_streams(seed=0, progress=0.0):
        optimshift.offload(opt)
        optimshift.reload(opt, non_blocking=True)
        del opt.param_groups[1]
        if copies == "complete":
            torch.sim.synchronize(0)
        strategy_module._optimizer_to_device(opt, "cpu")  # Lightning's own loop: every state tensor .to("cpu")
    buf = opt.state[p]["momentum_buffer"]
    assert buf.device.type == "cpu" and torch.equal(buf, torch.ones(2))


def test_patch_leaves_a_users_own_alias_of_the_helper_alone(lightning_patch):
    import types

    from lightning.fabric.utilities import optimizer as fo

    mine = types.ModuleType("users_training_script")
    mine.keep = fo._optimizer_to_device
    sys.modules[mine.__name__] = mine
    try:
        original = mine.keep
        lightning_patch(True)
        assert mine.keep is original and fo._optimizer_to_device is not original
    finally:
        del sys.modules[mine.__name__]


@pytest.mark.parametrize("patched", [False, True])
def test_restore_keeps_fp32_state_and_strings_when_patched(sim, lightning_patch, patched):
    """fit(ckpt_path=...) restores through Strategy.load_optimizer_state_dict: PyTorch's load casts fp32 state
    to bf16 params and mangles a string in state; patched, it is optimshift.load_state_dict, which keeps SGD's
    fp32 momentum (its step takes it with bf16 params)."""
    lightning_patch(patched)
    params = [torch.nn.Parameter(torch.zeros(2, 3, device=sim, dtype=torch.bfloat16))]
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    group = {k: v for k, v in opt.param_groups[0].items() if k != "params"}
    saved = {
        "state": {0: {"momentum_buffer": torch.full((2, 3), 0.1), "note": "warm"}},
        "param_groups": [{**group, "params": [0]}],
    }
    strategy = lightning_strategy(sim)
    strategy.optimizers = [opt]
    strategy.load_optimizer_state_dict({"optimizer_states": [saved]})
    state = opt.state[params[0]]
    assert state["momentum_buffer"].device == sim
    if patched:
        assert state["momentum_buffer"].dtype == torch.float32 and state["note"] == "warm"
        assert torch.equal(state["momentum_buffer"].cpu(), torch.full((2, 3), 0.1))
    else:
        assert state["momentum_buffer"].dtype == torch.bfloat16 and state["note"] != "warm"


@pytest.mark.parametrize("patched", [False, True])
def test_restore_casts_where_the_step_would_refuse_the_saved_dtype(sim, lightning_patch, patched):
    """An fp32 Adam checkpoint restored into bf16 params (``Trainer(precision="bf16-true")``): PyTorch's load
    casts it and the resume runs unpatched; patched, the load keeps dtypes only where the step takes them, and
    casts as PyTorch does here (it refused the resume: a ``cast`` Lightning's caller cannot pass; found by a
    new-user hunt)."""
    lightning_patch(patched)
    source = torch.nn.Parameter(torch.zeros(2, 3))
    saved_opt = torch.optim.Adam([source], foreach=False)
    source.grad = torch.ones_like(source)
    saved_opt.step()
    params = [torch.nn.Parameter(torch.zeros(2, 3, device=sim, dtype=torch.bfloat16))]
    opt = torch.optim.Adam(params, foreach=False)
    strategy = lightning_strategy(sim)
    strategy.optimizers = [opt]
    strategy.load_optimizer_state_dict({"optimizer_states": [saved_opt.state_dict()]})
    state = opt.state[params[0]]
    assert state["exp_avg"].dtype == torch.bfloat16 and state["exp_avg"].device == sim
    if patched:
        assert optimshift.check(opt).ok
    params[0].grad = torch.ones_like(params[0])
    opt.step()


def test_a_bf16_resume_keeps_a_host_scalar_in_the_dtype_its_step_takes_there(sim, tmp_path, lightning_patch):
    """A host fp32 NAdam checkpoint resumed with ``Trainer(precision="bf16-true")`` on the accelerator: the restore
    casts as PyTorch does (fp32 moments, bf16 params), which casts ``mu_product`` to bf16 too, then kept it on the
    host, where the foreach step refuses a bf16 scalar beside device params (unpatched, torch's load leaves it on
    the device and the run goes on). It keeps its saved float32, where and as a fresh NAdam holds it."""
    lightning_patch(True)
    path = _host_checkpoint(tmp_path, "NAdam", {})
    module, probe = Tiny("NAdam"), Probe()
    _trainer(sim, 5, [probe], precision="bf16-true").fit(module, _data(), ckpt_path=path)
    assert probe.layout == probe.fresh and probe.check_ok
    assert {(row[1], row[2], row[3]) for row in probe.layout if row[1] == "mu_product"} == {
        ("mu_product", "cpu", "float32")
    }
    saved = _checkpoint_state(path)
    mu = {k: v for k, v in saved.items() if k[2] == "mu_product"}
    assert bitwise_same({k: v for k, v in probe.values.items() if k[2] == "mu_product"}, mu)


def test_a_reload_of_the_patched_integration_keeps_its_patch():
    """``importlib.reload`` of the integration while Lightning is patched: the reloaded module knows the patch in
    effect (it reported Lightning unpatched, patched it twice over, and its ``unpatch()`` could not restore
    Lightning's own helper). In a process of its own: a reload redefines the module's classes for everyone."""
    import subprocess
    import sys

    script = """
import importlib
import lightning.fabric.utilities.optimizer as helpers
import optimshift.integrations.lightning as osl
osl.unpatch()
original = helpers._optimizer_to_device
osl.patch()
patched = helpers._optimizer_to_device
importlib.reload(osl)
osl.patch()
again = helpers._optimizer_to_device is patched
known = osl.is_patched()
osl.unpatch()
print(known, again, helpers._optimizer_to_device is original, osl.is_patched())
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "True", "True", "False"], done.stdout


def test_a_restore_optimshift_refuses_but_torch_takes_is_lightnings(sim, lightning_patch):
    """An Adam given an optimizer-wide entry by hand (``state["k"]``, no torch.optim class keeps one): torch's load
    keeps it and the restore runs; optimshift's load refuses it, so the restore is Lightning's, as before 580e5f5
    (which let such an optimizer through to optimshift's load, and the restore raised)."""
    lightning_patch(True)
    params = [torch.nn.Parameter(torch.zeros(3, device=sim))]
    opt = torch.optim.Adam(params, foreach=False)
    step_with_grads(params, opt, seed=0)
    opt.state["k"] = torch.tensor(1.0)
    saved = opt.state_dict()
    strategy = lightning_strategy(sim)
    strategy.optimizers = [opt]
    strategy.load_optimizer_state_dict({"optimizer_states": [saved]})
    assert torch.equal(opt.state["k"], torch.tensor(1.0)) and opt.state[params[0]]["exp_avg"].device == sim
    step_with_grads(params, opt, seed=1)


def test_a_restore_of_an_optimizer_wide_entry_its_class_keeps_is_optimshifts(sim, lightning_patch, monkeypatch):
    """MADGRAD's ``k`` (its class keeps it): the restore is optimshift's load, which keeps ``k`` on the host."""
    madgrad = pytest.importorskip("pytorch_optimizer").MADGRAD
    from optimshift.checkpoint import _resume

    lightning_patch(True)
    params = [torch.nn.Parameter(torch.zeros(3, device=sim))]
    opt = madgrad(params, lr=0.01)
    step_with_grads(params, opt, seed=0)
    saved = opt.state_dict()
    loads, original = [], _resume.load_as_torch_would
    monkeypatch.setattr(_resume, "load_as_torch_would", lambda o, sd: loads.append(o) or original(o, sd))
    strategy = lightning_strategy(sim)
    strategy.optimizers = [opt]
    strategy.load_optimizer_state_dict({"optimizer_states": [saved]})
    assert loads == [opt] and opt.state["k"].device.type == "cpu" and opt.state[params[0]]["s"].device == sim


def test_a_fabric_load_optimshift_refuses_but_torch_takes_is_torchs(sim, tmp_path, lightning_patch):
    """``Fabric.load_raw`` of an Adam checkpoint with a hand-added ``state["k"]`` into a fresh Adam: torch's load
    keeps ``k``; optimshift's refuses it (no torch.optim class keeps one), so that load is torch's."""
    lightning_patch(True)
    model, opt = _trained("Adam", {}, steps=1)
    opt.state["k"] = torch.tensor(1.0)
    path = tmp_path / "raw.pt"
    torch.save(opt.state_dict(), path)
    model, opt = _trained("Adam", {}, steps=0)
    fabric = Fabric(strategy=fabric_strategy(sim))
    model, fabric_opt = fabric.setup(model, opt)
    fabric.load_raw(path, fabric_opt)
    assert torch.equal(opt.state["k"].cpu(), torch.tensor(1.0)) and "load_state_dict" not in vars(opt)
    step_with_grads(list(model.parameters()), opt, seed=1)

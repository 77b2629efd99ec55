"""optimshift.testing's recipes for frameworks: a Lightning Trainer and Fabric on the simulated device in one
line, and Accelerate (with the Transformers Trainer on top) through ``on_device``."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

import optimshift


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's and Accelerate's notes about CPU-only runs
        yield


def test_lightning_trainer_runs_on_the_simulated_device(sim):
    pl = pytest.importorskip("lightning.pytorch")
    import optimshift.testing.lightning as ostl

    seen = []

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(3, 2)

        def training_step(self, batch, batch_idx):
            (x,) = batch
            seen.append((x.device, self.layer.weight.device))
            return self.layer(x).sum()

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters())

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 3)), batch_size=4)
    module = Module()
    trainer = pl.Trainer(
        strategy=ostl.strategy(),
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, data)
    assert seen == [(sim, sim)] * 2
    assert trainer.strategy.root_device == sim and isinstance(trainer.accelerator, ostl.SimAccelerator)
    placed = {r.device for r in optimshift.placement(trainer.optimizers[0])}
    assert placed == {"cpu"}  # Lightning's teardown puts the state back on the host


def test_sim_accelerator_devices(sim):
    pytest.importorskip("lightning.pytorch")
    import optimshift.testing.lightning as ostl

    acc = ostl.SimAccelerator
    assert acc.parse_devices(2) == [0, 1] and acc.parse_devices("0,1") == [0, 1] and acc.parse_devices([1]) == [1]
    assert acc.parse_devices("auto") == [0, 1] and acc.auto_device_count() == 2
    assert acc.parse_devices(-1) == acc.parse_devices("-1") == [0, 1]  # (-1: every device, as for CUDA; was none)
    assert acc.get_parallel_devices([0, 1]) == [torch.device("sim", 0), torch.device("sim", 1)]
    assert ostl.strategy("sim:1").root_device == torch.device("sim", 1)
    with pytest.raises(ValueError, match="expected a simulated device"):
        ostl.strategy("cpu")


def test_fabric_runs_on_the_simulated_device(sim):
    pytest.importorskip("lightning.fabric")
    from lightning.fabric import Fabric

    import optimshift.testing.lightning as ostl

    fabric = Fabric(strategy=ostl.fabric_strategy())
    layer = torch.nn.Linear(3, 2)
    model, opt = fabric.setup(layer, torch.optim.SGD(layer.parameters(), lr=0.1, momentum=0.9))
    assert fabric.device == sim and next(model.parameters()).device == sim
    model(torch.randn(4, 3, device=sim)).sum().backward()
    opt.step()
    assert {r.device for r in optimshift.placement(opt.optimizer)} == {str(sim)}


def test_accelerate_on_device_and_back(sim, monkeypatch):
    pytest.importorskip("accelerate")
    from accelerate import Accelerator

    from optimshift.testing.accelerate import on_device

    monkeypatch.setenv("ACCELERATE_TORCH_DEVICE", "cpu")
    with on_device() as device:
        assert device == sim and os.environ["ACCELERATE_TORCH_DEVICE"] == "sim:0"
        accelerator = Accelerator()
        assert accelerator.device == sim
        model, opt = accelerator.prepare(torch.nn.Linear(3, 2), torch.optim.Adam(torch.nn.Linear(3, 2).parameters()))
        assert next(model.parameters()).device == sim
    assert os.environ["ACCELERATE_TORCH_DEVICE"] == "cpu"
    with on_device("cpu"):
        assert Accelerator().device == torch.device("cpu")
    monkeypatch.delenv("ACCELERATE_TORCH_DEVICE")
    with on_device(1):
        assert Accelerator().device == torch.device("sim", 1)
    assert "ACCELERATE_TORCH_DEVICE" not in os.environ

"""The Hugging Face Transformers ``Trainer`` resuming from a checkpoint the way it does on several devices, on the
simulated accelerator: with ``optimshift.integrations.accelerate.patch()`` every ``step`` stays on the host (no
host syncs in the optimizer step), without it torch's ``load_state_dict`` leaves them on the device.

``Trainer._load_optimizer_and_scheduler`` loads ``optimizer.pt`` with ``map_location=args.device`` when
``args.world_size > 1``, then calls the ``AcceleratedOptimizer``'s ``load_state_dict``. One process here plays
one rank of such a run: ``world_size`` reads 2 while the Trainer loads its checkpoint. A tiny BERT is built
from a config: nothing is downloaded.
"""

from __future__ import annotations

import os

import pytest
import torch
from _integrations_support import layout

import optimshift

transformers = pytest.importorskip("transformers")

import optimshift.integrations.accelerate as osa  # noqa: E402
from optimshift.testing.accelerate import on_device  # noqa: E402

STEPS = 2  # saved after STEPS, resumed for STEPS more


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


class _Data(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> dict:
        g = torch.Generator().manual_seed(i)
        return {"input_ids": torch.randint(0, 64, (8,), generator=g), "labels": torch.tensor(i % 2)}


def _model(seed: int):
    config = transformers.BertConfig(
        vocab_size=64,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=16,
        num_labels=2,
    )
    torch.manual_seed(seed)
    return transformers.BertForSequenceClassification(config)


class _Args(transformers.TrainingArguments):
    """Arguments whose ``world_size`` can be made to read as a multi-device run's."""

    ranks = 1

    @property
    def world_size(self) -> int:
        return self.ranks


class _MultiDeviceResume(transformers.Trainer):
    """Loads its checkpoint as one rank of a two-device run does (``map_location=args.device``)."""

    map_locations: list = []

    def _load_optimizer_and_scheduler(self, checkpoint):
        real_load = torch.load

        def load(f, *args, **kwargs):
            if str(f).endswith("optimizer.pt"):
                self.map_locations.append(kwargs.get("map_location"))
            return real_load(f, *args, **kwargs)

        self.args.ranks, torch.load = 2, load
        try:
            super()._load_optimizer_and_scheduler(checkpoint)
        finally:
            self.args.ranks, torch.load = 1, real_load


class _StepSyncs(transformers.TrainerCallback):
    """Host syncs of each optimizer step."""

    def __init__(self) -> None:
        self.counts: list[int] = []

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self._counting = optimshift.count_syncs()
        self._syncs = self._counting.__enter__()

    def on_optimizer_step(self, args, state, control, **kwargs):
        self._counting.__exit__(None, None, None)
        self.counts.append(self._syncs.total)


def _args(output_dir, steps: int) -> _Args:
    return _Args(
        output_dir=str(output_dir),
        max_steps=steps,
        save_steps=STEPS,
        per_device_train_batch_size=4,
        optim="adamw_torch",
        report_to="none",
        dataloader_pin_memory=False,
        disable_tqdm=True,
        logging_strategy="no",
        seed=0,
    )


def _resumed(tmp_path, patched: bool):
    """Train STEPS on the simulated device and checkpoint, then resume in a new Trainer for STEPS more."""
    out = tmp_path / ("patched" if patched else "unpatched")
    with on_device() as device:
        transformers.Trainer(model=_model(0), args=_args(out, STEPS), train_dataset=_Data()).train()
    checkpoint = out / f"checkpoint-{STEPS}"
    assert checkpoint.is_dir()
    (osa.patch if patched else osa.unpatch)()
    try:
        with on_device() as device:
            syncs = _StepSyncs()
            trainer = _MultiDeviceResume(
                model=_model(1), args=_args(out, 2 * STEPS), train_dataset=_Data(), callbacks=[syncs]
            )
            trainer.map_locations = []
            trainer.train(resume_from_checkpoint=str(checkpoint))
    finally:
        osa.unpatch()
    assert trainer.map_locations == [device], "the Trainer took its multi-device load path"
    return device, trainer, syncs.counts, checkpoint


@pytest.mark.slow
def test_trainer_multi_device_resume_keeps_step_on_the_host(tmp_path):
    device, trainer, counts, checkpoint = _resumed(tmp_path, patched=True)
    optimizer = trainer.optimizer.optimizer
    rows = layout(optimizer)
    assert {row[2] for row in rows if row[1] == "step"} == {"cpu"}
    assert {row[2] for row in rows if row[1] != "step"} == {str(device)}
    assert counts == [0] * STEPS, "a fresh AdamW on the device syncs 0 times per step"

    # The same resume without the patch: every step left on the device, host syncs in every step.
    device, trainer, unpatched_counts, _ = _resumed(tmp_path, patched=False)
    rows = layout(trainer.optimizer.optimizer)
    assert {row[2] for row in rows if row[1] == "step"} == {str(device)}
    params = len(list(trainer.model.parameters()))
    assert len(unpatched_counts) == STEPS and all(n >= params for n in unpatched_counts), unpatched_counts


@pytest.mark.slow
def test_inspect_reads_the_trainer_checkpoint(tmp_path, capsys):
    from optimshift.cli import main

    with on_device():
        transformers.Trainer(model=_model(0), args=_args(tmp_path, STEPS), train_dataset=_Data()).train()
        assert main(["inspect", os.path.join(tmp_path, f"checkpoint-{STEPS}")]) == 0
    out = capsys.readouterr().out
    assert "(Hugging Face Trainer checkpoint folder; global step 2" in out
    assert "optimizer.pt  (" in out and "exp_avg     25     sim:0 ×25" in out
    assert "the Trainer resumes this file with torch.load(map_location=its device)" in out

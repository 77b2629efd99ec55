"""Hugging Face Trainer ``checkpoint-N/`` and Accelerate ``save_state`` folders, and the optimizer files inside them,
recognised by file names only (nothing is loaded)."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import Any

# (pattern, role); the first match names a file's role.
_ROLES = [
    (r"optimizer(_\d+)?\.(pt|bin)", "optimizer"),
    (r"(pytorch_)?model(_\d+)?(-\d+-of-\d+)?\.(safetensors|bin)(\.index\.json)?", "model weights"),
    (r"adapter_model\.(safetensors|bin)", "model weights"),
    (r"scheduler(_\d+)?\.(pt|bin)", "scheduler"),
    (r"trainer_state\.json", "trainer state"),
    (r"training_args\.bin", "training arguments"),
    (r"(generation_)?config\.json|adapter_config\.json", "model config"),
    (r"rng_state(_\d+)?\.pth|random_states_\d+\.pkl", "random number generator state"),
    (r"scaler\.pt", "gradient scaler"),
    (r"sampler(_\d+)?\.bin|dl_state_dict(_\d+)?\.bin", "data loader state"),
    (r"(tokenizer|special_tokens_map|vocab|merges|tokenizer_config)\.(json|txt|model)", "tokenizer"),
]
_OPTIMIZER = re.compile(r"optimizer(?:_(\d+))?\.(pt|bin)")


@dataclass(frozen=True)
class TrainingFolder:
    """A framework's checkpoint folder: ``kind`` (``"hf_trainer"``, ``"accelerate"``), its ``optimizer_files`` in the
    framework's order, every entry's role (``files``), and a few fields of ``trainer_state.json``."""

    path: str
    kind: str
    optimizer_files: list[str]
    files: dict[str, str] = field(default_factory=dict)
    trainer_state: dict[str, Any] | None = None

    @property
    def label(self) -> str:
        """The layout in words."""
        return "Hugging Face Trainer checkpoint folder" if self.kind == "hf_trainer" else "Accelerate save_state folder"


def _role(name: str, path: str) -> str:
    if os.path.isdir(os.path.join(path, name)):
        return "folder"
    for pattern, role in _ROLES:
        if re.fullmatch(pattern, name):
            return role
    return "other"


def _optimizer_order(name: str) -> tuple[int, str]:
    match = _OPTIMIZER.fullmatch(name)
    return (int(match.group(1) or 0) if match else 0, name)


def _trainer_state(path: str) -> dict[str, Any] | None:
    try:
        with open(os.path.join(path, "trainer_state.json")) as f:
            state = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(state, dict):
        return None
    return {k: state[k] for k in ("global_step", "epoch", "max_steps") if k in state}


def training_folder(path: str) -> TrainingFolder | None:
    """The framework checkpoint folder at ``path``, or None where it is none (a ``torch.distributed.checkpoint``
    folder, with its ``.metadata``, never is)."""
    try:
        names = sorted(os.listdir(path))
    except (NotADirectoryError, FileNotFoundError, PermissionError):
        return None
    if ".metadata" in names:
        return None
    files = {name: _role(name, path) for name in names}
    optimizers = sorted((n for n, role in files.items() if role == "optimizer"), key=_optimizer_order)
    if "trainer_state.json" in files or {"optimizer.pt", "scheduler.pt"} <= set(files):
        kind = "hf_trainer"
    elif any(n.endswith(".bin") for n in optimizers) and any(
        role in ("model weights", "random number generator state", "scheduler") for role in files.values()
    ):
        kind = "accelerate"
    else:
        return None
    return TrainingFolder(path, kind, optimizers, files, _trainer_state(path) if kind == "hf_trainer" else None)

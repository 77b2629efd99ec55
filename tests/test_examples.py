"""Every script in examples/ runs as written (on the simulated accelerator when there is no GPU), prints what
its docstring promises, and prints no warning."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _run(name: str, *args: str, cwd: Path) -> str:
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
        env={**os.environ, "PYTHONWARNINGS": "default"},
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stderr == "", out.stderr
    return out.stdout


def test_every_example_is_tested():
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == sorted(
        ["resume_on_another_device.py", "offload_around_evaluation.py", "inspect_checkpoint.py"]
    )


def test_resume_on_another_device(tmp_path):
    lines = _run("resume_on_another_device.py", cwd=tmp_path).splitlines()
    device = lines[0].rsplit(" ", 1)[1]
    assert lines[0].startswith("trained 3 steps on the CPU, saved checkpoint.pt; resuming on ")
    torch_line, ours_line = lines[1], lines[3]
    assert torch_line.startswith(f"torch's load_state_dict   : step on {device}, ")
    assert int(torch_line.split(", ")[1].split()[0]) > 0 and "misplaced entries" in lines[2]
    assert ours_line == "optimshift.load_state_dict: step on cpu, 0 host syncs in one training step"
    assert lines[4] == "  optimshift.check: ok"


def test_offload_around_evaluation(tmp_path):
    lines = _run("offload_around_evaluation.py", cwd=tmp_path).splitlines()
    held = lines[0].split(" holds ")[1].split()[0]
    assert int(held.replace(",", "")) > 0
    assert lines[1].startswith("while evaluating: 0 bytes on ")
    assert lines[3].startswith(f"after evaluation: {held} bytes on ")
    assert lines[4] == "every tensor back where it was, the same objects, bitwise the same values: True"


def test_inspect_checkpoint(tmp_path):
    out = _run("inspect_checkpoint.py", cwd=tmp_path)
    assert "optimizer 1 of 1: ['optimizer']  [nested entry]" in out
    assert "`step` saved on" in out and "for non-fused Adam (4 params)" in out
    assert "\nwarning: `step` on 4 params, 2 host syncs per param per step\n" in out
    assert "wrote " in out and "cpu.pt: 16 tensors on cpu" in out


def test_inspect_checkpoint_on_a_folder(tmp_path):
    import json

    import torch

    folder = tmp_path / "checkpoint-10"  # what a Hugging Face Trainer writes, less the model
    folder.mkdir()
    params = [torch.nn.Parameter(torch.randn(3)) for _ in range(2)]
    opt = torch.optim.AdamW(params)
    for p in params:
        p.grad = torch.ones(3)
    opt.step()
    torch.save(opt.state_dict(), folder / "optimizer.pt")
    torch.save({"last_epoch": 10}, folder / "scheduler.pt")
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": 10, "epoch": 1.5}))
    out = _run("inspect_checkpoint.py", str(folder), cwd=tmp_path)
    assert "(Hugging Face Trainer checkpoint folder; global step 10, epoch 1.5)" in out
    assert "\ninfo: `step` on 2 params\n" in out

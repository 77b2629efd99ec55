"""Resume training on another device: a checkpoint saved on the host, resumed on an accelerator.

Trains a small model with AdamW on the CPU and saves it, then resumes on the accelerator (a CUDA GPU when
there is one, else optimshift's simulated accelerator, which computes on the CPU) twice: with PyTorch's own
``load_state_dict`` after ``torch.load(map_location=device)`` (what the Hugging Face Trainer does on several
GPUs), and with ``optimshift.load_state_dict``. It prints where AdamW's ``step`` counter ends up and how many
device-to-host syncs each training step costs.

    python examples/resume_on_another_device.py
"""

import os
import sys
import tempfile

import torch

import optimshift


def accelerator() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", 0)
    from optimshift.testing import simulated_accelerator

    return simulated_accelerator()  # "sim:0": a simulated accelerator with real values, on the CPU


def model_and_optimizer(device: torch.device):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)).to(device)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train_step(model, optimizer, device: torch.device, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(8, 16, generator=g).to(device), torch.randn(8, 4, generator=g).to(device)
    optimizer.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()


def resume(path: str, device: torch.device, with_optimshift: bool) -> None:
    model, optimizer = model_and_optimizer(device)
    if with_optimshift:
        checkpoint = optimshift.load(path)  # weights_only, onto the host
        model.load_state_dict(checkpoint["model"])
        optimshift.load_state_dict(optimizer, checkpoint["optimizer"])  # each entry where a fresh AdamW keeps it
    else:
        checkpoint = torch.load(path, map_location=device, weights_only=True)
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
    with optimshift.count_syncs() as syncs:
        train_step(model, optimizer, device, seed=3)
    step = next(iter(optimizer.state.values()))["step"]
    how = "optimshift.load_state_dict" if with_optimshift else "torch's load_state_dict"
    print(f"{how:<26}: step on {step.device}, {syncs.total} host syncs in one training step")
    report = optimshift.check(optimizer)
    print(f"  optimshift.check: {'ok' if report.ok else f'{len(report.findings)} misplaced entries'}")


def main() -> int:
    host, device = torch.device("cpu"), accelerator()
    model, optimizer = model_and_optimizer(host)
    for seed in range(3):
        train_step(model, optimizer, host, seed)
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "checkpoint.pt")
        optimshift.save({"model": model.state_dict(), "optimizer": optimizer}, path)  # atomic
        print(f"trained 3 steps on the CPU, saved {os.path.basename(path)}; resuming on {device}")
        resume(path, device, with_optimshift=False)
        resume(path, device, with_optimshift=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

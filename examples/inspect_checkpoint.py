"""Inspect a checkpoint: what optimizer state it holds, where it was saved, and what resuming it will cost.

Without an argument, it first writes a checkpoint the way a training loop that moves every tensor to the GPU
leaves one (Adam's ``step`` counters on the accelerator too; a CUDA GPU when there is one, else optimshift's
simulated accelerator, which computes on the CPU). Then it runs ``optimshift inspect`` on it, reads the
findings from ``--json``, and runs ``optimshift convert ... --device cpu`` so that the file opens anywhere.
Give it a path (a torch.save file, a Hugging Face Trainer checkpoint-N folder, an Accelerate save_state
folder) to inspect your own instead.

    python examples/inspect_checkpoint.py [PATH]

The same from a shell: ``optimshift inspect PATH``, ``optimshift inspect PATH --json``,
``optimshift convert PATH OUT --device cpu`` (or ``python -m optimshift ...``).
"""

import contextlib
import io
import json
import os
import sys
import tempfile

import torch

from optimshift.cli import main as optimshift  # the `optimshift` command, called in this process


def accelerator() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", 0)
    from optimshift.testing import simulated_accelerator

    return simulated_accelerator()  # "sim:0": a simulated accelerator with real values, on the CPU


def write_checkpoint(path: str) -> None:
    device = accelerator()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()
    model.to(device)
    for state in optimizer.state.values():  # the naive move: every tensor, `step` included
        for key, value in state.items():
            state[key] = value.to(device)
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": 1}, path)


def main(argv: list) -> int:
    with tempfile.TemporaryDirectory() as folder:
        path = argv[0] if argv else os.path.join(folder, "checkpoint.pt")
        if not argv:
            write_checkpoint(path)
        if optimshift(["inspect", path]) != 0:
            return 1
        captured = io.StringIO()
        with contextlib.redirect_stdout(captured):
            optimshift(["inspect", path, "--json"])
        described = json.loads(captured.getvalue())
        files = described.get("optimizer_files", [described])  # a folder: each optimizer file in it
        for opt in (o for file in files for o in file["optimizers"]):
            for finding in opt["findings"]:
                cost = finding.get("syncs_per_param_per_step")
                print(
                    f"\n{finding['severity']}: `{finding['key']}` on {finding['count']} params"
                    + (f", {cost} host syncs per param per step" if cost else "")
                )
        if not argv:
            print()
            optimshift(["convert", path, os.path.join(folder, "cpu.pt"), "--device", "cpu"])
            torch.load(os.path.join(folder, "cpu.pt"), weights_only=True)  # opens without map_location now
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

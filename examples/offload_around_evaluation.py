"""Offload optimizer state around evaluation: free the accelerator's memory while the model evaluates.

Trains a small model with Adam on the accelerator (a CUDA GPU when there is one, else optimshift's simulated
accelerator, which computes on the CPU), then evaluates inside ``optimshift.offloaded(optimizer)``: the
optimizer's state waits in host memory and comes back exactly as it was (same devices, bitwise the same
values) when the block ends, even if the evaluation raises. It prints the device memory the state holds before,
during and after.

    python examples/offload_around_evaluation.py
"""

import sys

import torch

import optimshift


def accelerator() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", 0)
    from optimshift.testing import simulated_accelerator

    return simulated_accelerator()  # "sim:0": a simulated accelerator with real values, on the CPU


def device_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of optimizer state on an accelerator (optimshift.placement lists every tensor it holds)."""
    return sum(row.bytes for row in optimshift.placement(optimizer) if row.device != "cpu")


def main() -> int:
    device = accelerator()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    data = [(torch.randn(32, 64), torch.randint(0, 10, (32,))) for _ in range(4)]
    for x, y in data:
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x.to(device)), y.to(device)).backward()
        optimizer.step()

    before = optimshift.placement(optimizer)
    values = [t.detach().cpu().clone() for st in optimizer.state.values() for t in st.values()]
    objects = [id(t) for st in optimizer.state.values() for t in st.values()]  # a compiled step guards on these
    print(f"after training on {device}: optimizer state holds {device_bytes(optimizer):,} bytes there")
    with optimshift.offloaded(optimizer):
        print(f"while evaluating: {device_bytes(optimizer):,} bytes on {device}")
        with torch.no_grad():
            correct = sum((model(x.to(device)).argmax(1).cpu() == y).sum().item() for x, y in data)
        print(f"  accuracy {correct / 128:.2f}")
    print(f"after evaluation: {device_bytes(optimizer):,} bytes on {device} again")
    after = [t.detach().cpu() for st in optimizer.state.values() for t in st.values()]
    same = optimshift.placement(optimizer) == before and all(map(torch.equal, after, values))
    same = same and [id(t) for st in optimizer.state.values() for t in st.values()] == objects
    print(f"every tensor back where it was, the same objects, bitwise the same values: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())

"""What the async tests share: the simulator's schedules, and a fixture that drains queued work after a test."""

import pytest
import torch

from optimshift.testing import StreamRaceError

# (seed, progress): progress is how likely queued work runs on its own at each call into the simulator; 0 is the
# strictest schedule (nothing runs until something orders it)
SCHEDULES = [
    pytest.param(0, 0.0, id="strict"),
    pytest.param(1, 0.02, id="seed1"),
    pytest.param(2, 0.05, id="seed2"),
    pytest.param(3, 0.2, id="seed3"),
]


@pytest.fixture(autouse=True)
def drain_queued(sim):
    """After the test: run whatever a failed scenario left queued on the simulator (errors included), so that
    the next test starts with empty streams. Autouse in every module that imports it."""
    yield
    for _ in range(10):
        try:
            torch.sim.synchronize(0)
            torch.sim.synchronize(1)
            break
        except StreamRaceError:
            continue

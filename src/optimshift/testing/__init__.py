"""Testing helpers for optimshift and its users: test training code on a simulated accelerator, on a CPU.

- :func:`simulated_accelerator`: sets up ``sim:0`` and ``sim:1``, an accelerator with real values.
- :mod:`optimshift.testing.lightning`: ``L.Trainer(strategy=optimshift.testing.lightning.strategy())`` and
  ``L.Fabric(strategy=optimshift.testing.lightning.fabric_strategy())`` run on it.
- :mod:`optimshift.testing.accelerate`: ``with on_device(): ...`` makes every Accelerate ``Accelerator`` (and
  Transformers ``Trainer``) created inside run on it.

Importing this package sets nothing up and imports neither Lightning nor Accelerate.

Race-testing stream code on a CPU-only machine
----------------------------------------------

The simulated accelerator has streams and events (``torch.sim.Stream``, ``torch.sim.Event``,
``torch.sim.stream``, ``torch.sim.current_stream``, ``torch.sim.synchronize``: the ``torch.cuda`` names). Its
default stream runs every op at once; work issued on any other stream is *queued*, and runs only when something
orders it (an event or stream wait, a synchronize, a host read on that stream) or at random points drawn from a
seed. Races raise :class:`StreamRaceError`, decided by happens-before rather than by the schedule, so a missing
wait fails under every seed:

- an op that touches memory another stream wrote (or reads, for a write) with nothing ordering the two (a
  missing ``wait_stream``/``wait_event``, or a wait on the wrong stream) raises when it is issued;
- device memory freed while another stream than its allocation stream may still use it, without
  ``tensor.record_stream(that_stream)``, raises at the next call into the simulator;
- host memory that a queued copy reads or writes, changed by the host before the copy ran (a buffer reused
  before its event completed), raises when the copy runs; a copy's host destination reads as NaN (or all bits
  set) until the copy ran, so a host read that skips the wait sees garbage.

Write the code under test against the device module, ``torch.get_device_module(device)`` (``torch.cuda`` on a
GPU, ``torch.sim`` here): ``torch.Stream``/``torch.Event`` on ``"sim"`` are torch's own no-op streams, because
a Python backend's C++ device guard cannot have streams. Then run the test under several schedules::

    import torch
    from optimshift.testing import StreamRaceError, deferred_streams, simulated_accelerator

    def prefetch(host, device):                 # the code under test
        mod = torch.get_device_module(device)
        side = mod.Stream(device)
        with mod.stream(side):
            x = host.to(device, non_blocking=True)
        mod.current_stream(device).wait_stream(side)   # without this line: StreamRaceError
        x.record_stream(mod.current_stream(device))    # x was allocated on `side`, is used on the default stream
        return x

    def test_prefetch():
        device = simulated_accelerator()
        for seed in range(4):
            with deferred_streams(seed=seed, progress=0.3):
                y = prefetch(torch.arange(4.0), device) * 2
                assert torch.equal(y.cpu(), torch.arange(4.0) * 2)

``deferred_streams(seed, progress)`` fixes the schedule for its block (``progress=0``: queued work runs only
when ordered, the strictest schedule) and synchronizes every sim stream when the block ends. optimshift's own
non-blocking offload and reload are tested this way: its engine reaches these streams through
``optimshift._device_streams``, the same interface it uses for CUDA and other accelerators.
"""

from optimshift.testing import _sim_vmm as _sim_vmm  # (registers the simulator's virtual memory driver)
from optimshift.testing._sim_streams import StreamRaceError, deferred_streams
from optimshift.testing._sim_streams import memory_cached as simulated_memory_cached
from optimshift.testing.simulated import (
    SIM_DEVICE_TYPE,
    simulated_accelerator,
    simulated_memory_allocated,
)

__all__ = [
    "SIM_DEVICE_TYPE",
    "simulated_accelerator",
    "simulated_memory_allocated",
    "simulated_memory_cached",
    "StreamRaceError",
    "deferred_streams",
]

"""optimshift._device_streams: which streams and events each device type gets (one interface for every backend)."""

import pytest
import torch

from optimshift import _device_streams


@pytest.fixture()
def isolated(monkeypatch):
    """Choices and registrations made by a test stay in the test."""
    monkeypatch.setattr(_device_streams, "_registered", dict(_device_streams._registered))
    monkeypatch.setattr(_device_streams, "_chosen", {})
    return monkeypatch


def test_host_devices_have_no_streams():
    assert _device_streams.of(None) is None
    assert _device_streams.of(torch.device("cpu")) is None
    assert _device_streams.of(torch.device("meta")) is None


def test_the_simulated_accelerator_is_a_registered_backend(sim):
    streams = _device_streams.of(sim)
    assert isinstance(streams, _device_streams._ModuleStreams) and streams.module is torch.sim
    side = streams.side(sim)
    assert side is streams.side(sim), "one side stream per device, kept"
    assert side != streams.current(sim)
    lane = streams.side(sim, "stream")
    assert lane is streams.side(sim, "stream") and lane != side, "the streamed step's lane: its own, kept"
    assert not _device_streams.pins_host_for(sim), "a Python backend has no pinned host allocator"


def test_the_current_accelerator_gets_the_device_generic_api(isolated):
    isolated.setattr(_device_streams, "_generic_api", lambda: True)
    isolated.setattr(_device_streams, "current_accelerator", lambda: "xpu")
    assert isinstance(_device_streams._candidate("xpu"), _device_streams._AcceleratorStreams)
    assert _device_streams._candidate("mps") is None, "not the current accelerator: no streams"


def test_an_older_torch_falls_back_to_torch_cuda(isolated):
    isolated.setattr(_device_streams, "_generic_api", lambda: False)
    isolated.setattr(_device_streams, "_cuda_available", lambda: True)
    chosen = _device_streams._candidate("cuda")
    assert isinstance(chosen, _device_streams._ModuleStreams) and chosen.module is torch.cuda
    assert _device_streams._candidate("xpu") is None


def test_a_backend_that_fails_the_probe_gets_synchronous_transfers(isolated):
    class NoRecordStream:
        """Streams and events that work, but tensors cannot be recorded on a stream (as on MPS)."""

        class Stream:
            def __init__(self, device=None):
                pass

            def wait_event(self, event):
                pass

        class Event:
            def record(self, stream=None):
                pass

            def synchronize(self):
                pass

        @staticmethod
        def current_stream(device=None):
            return NoRecordStream.Stream()

        @staticmethod
        def stream(s):
            import contextlib

            return contextlib.nullcontext()

    _device_streams.register_backend("cpu", NoRecordStream)  # registered, and a tensor's record_stream fails on it
    probed = []
    real_probe = _device_streams._probe
    isolated.setattr(_device_streams, "_probe", lambda s, d: probed.append(s) or real_probe(s, d))
    assert _device_streams.of(torch.device("cpu")) is None and len(probed) == 1
    assert _device_streams.of(torch.device("cpu")) is None and len(probed) == 1, "probed once per device type"


def test_use_restores_the_stream_and_the_device(isolated):
    """torch.accelerator.set_stream also makes the stream's device current: use() puts both back."""
    calls = []
    state = {"index": 1, "stream": {0: "s0-default", 1: "s1-default"}}

    class FakeStream:
        def __init__(self, index, name):
            self.device, self.name = torch.device("cuda", index), name

    def set_stream(stream):
        calls.append(("set_stream", getattr(stream, "name", stream)))
        index = stream.device.index if isinstance(stream, FakeStream) else 0
        state["index"] = index
        state["stream"][index] = stream

    isolated.setattr(torch.accelerator, "current_device_index", lambda: state["index"])
    isolated.setattr(torch.accelerator, "current_stream", lambda device=None: state["stream"][device.index])
    isolated.setattr(torch.accelerator, "set_stream", set_stream)
    isolated.setattr(torch.accelerator, "set_device_index", lambda i: state.__setitem__("index", i))
    side = FakeStream(0, "side")
    with _device_streams._AcceleratorStreams("cuda").use(side):
        assert state["index"] == 0 and state["stream"][0] is side
    assert state["index"] == 1 and state["stream"][0] == "s0-default"
    assert calls == [("set_stream", "side"), ("set_stream", "s0-default")]


def test_no_pinning_without_an_accelerator_that_pins():
    assert _device_streams.host_pinning() == ("cuda" if torch.cuda.is_available() else None)
    assert _device_streams.pins_host_for(torch.device("cuda", 0)) == torch.cuda.is_available()
    assert not _device_streams.pins_host_for(torch.device("cpu"))
    _device_streams.empty_cache()  # nothing to give back, and no accelerator initialized for it

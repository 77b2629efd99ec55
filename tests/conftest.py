import pytest
import torch


@pytest.fixture(scope="session")
def sim() -> torch.device:
    """The simulated accelerator, device index 0 (index 1 is ``torch.device(sim.type, 1)``)."""
    from optimshift.testing import simulated_accelerator

    return simulated_accelerator()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)

import pytest
import torch


@pytest.fixture(scope="session")
def sim() -> torch.device:
    """The simulated accelerator, device index 0 (index 1 is ``torch.device(sim.type, 1)``)."""
    from optimshift.testing import simulated_accelerator

    return simulated_accelerator()


# Once the simulated accelerator (a Python PrivateUse1 backend) is registered, FakeTensorMode can no longer
# build some fake cuda tensors from host scalars (`torch.as_tensor(0.5, device="cuda:0")`, a 0-dim CPU
# tensor `.to("cuda:0")`): it reaches for the real CUDA backend. Tests on fake cuda:0 therefore run first.
FAKE_CUDA_MODULES = ("test_policy.py",)


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: 0 if item.path.name in FAKE_CUDA_MODULES else 1)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    """Each phase's report on its test (``item.rep_call``...): a fixture's teardown asks whether the test passed."""
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report

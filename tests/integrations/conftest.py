import warnings

import pytest


@pytest.fixture
def lightning_patch():
    """``patch(on)``: patch Lightning (on=True) or make sure it is not patched (on=False); always undone."""
    import optimshift.integrations.lightning as osl

    def apply(on: bool) -> None:
        (osl.patch if on else osl.unpatch)()

    yield apply
    osl.unpatch()


@pytest.fixture
def accelerate_patch():
    """``patch(on)`` for Accelerate; always undone."""
    import optimshift.integrations.accelerate as osa

    def apply(on: bool) -> None:
        (osa.patch if on else osa.unpatch)()

    yield apply
    osa.unpatch()


@pytest.fixture(autouse=True)
def _quiet_frameworks():
    # Lightning and Accelerate warn about CPU-only runs, workers and deprecations: noise for these tests.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield

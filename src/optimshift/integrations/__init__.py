"""Optional integrations: make training frameworks place optimizer state the way a fresh optimizer would.

Each submodule is opt-in and imports its framework only when you import it; importing :mod:`optimshift` or
this package never imports Lightning, Accelerate, verl or any optimizer library.

- :mod:`optimshift.integrations.lightning`: ``patch()`` makes Lightning's ``Trainer`` and ``Fabric`` move
  optimizer state with optimshift (strategy setup, checkpoint restore, teardown);
  ``OffloadOptimizerDuringEval`` keeps optimizer state on the host during validation/test/predict loops.
- :mod:`optimshift.integrations.accelerate`: ``patch()`` makes ``Accelerator.prepare`` and
  ``Accelerator.load_state`` (either ``map_location``) place optimizer state correctly.
- :mod:`optimshift.integrations.verl`: importing it (``VERL_USE_EXTERNAL_MODULES=optimshift.integrations.verl``
  does so in every verl process) makes verl's optimizer offload/load (``optimizer_offload=True``) keep ``step``
  on the host, every tensor object, and one persistent host pool.
- :mod:`optimshift.integrations.third_party`: ``register()`` installs the placement policies that third-party
  optimizer libraries need (``pytorch_optimizer``), and documents the classes no policy can fix.
"""

__all__: list[str] = []

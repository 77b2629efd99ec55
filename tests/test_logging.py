"""The ``optimshift`` logger: what each operation moved at DEBUG, a guessed rule at WARNING."""

import logging

import torch

import optimshift
from _matrix import Model, train


def test_debug_says_what_each_operation_moved(sim, caplog):
    model = Model([(3, 2), (2,)]).to(sim)
    opt = torch.optim.Adam(model.parameters(), foreach=False)
    train(model, opt, range(1))
    with caplog.at_level(logging.DEBUG, logger="optimshift"):
        optimshift.offload(opt)
        optimshift.reload(opt)
    lines = [r.getMessage() for r in caplog.records if r.name == "optimshift"]
    assert lines[0].startswith("offload Adam: 4 tensors (64 bytes)"), lines
    assert "1 device synchronizations" in lines[0]  # exp_avg + exp_avg_sq of 6 + 2 float32 elements
    assert "objects kept: 0 by set_data, 4 by swap, 0 replaced" in lines[0]
    assert lines[1].startswith("reload Adam: 4 tensors (64 bytes)"), lines


def test_warning_when_a_rule_was_guessed(caplog):
    """A class the probe cannot build from a param alone (it needs ``data``) gets the default rule, said once."""

    class Homemade(torch.optim.Optimizer):
        def __init__(self, params, data):
            super().__init__(params, {"lr": 0.1})

        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    self.state[p].setdefault("step", torch.tensor(0.0))

    p = torch.nn.Parameter(torch.zeros(2))
    opt = Homemade([p], data=None)
    opt.step()
    with caplog.at_level(logging.WARNING, logger="optimshift"):
        optimshift.move(opt)
    (warned,) = [r.getMessage() for r in caplog.records if "no placement rule is known for Homemade" in r.getMessage()]
    assert "the probe could not build Homemade" in warned and "'data'" in warned

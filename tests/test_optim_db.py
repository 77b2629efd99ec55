"""optimshift over every configuration PyTorch tests its optimizers with: ``optim_db``.

Each ``OptimizerInfo``'s ``optim_inputs_func`` inputs for the cpu and cuda device types, with the global flags
(foreach, fused, differentiable) added as torch's own tests add them, skips honoured (those optim_db declares
for ``TestOptimRenewed.test_state_dict_with_cuda_params``, our closest analogue) and ``supports_*`` flags
followed (param groups where supported, a closure where the step requires one). Each configuration is built on
the host, moved to the simulated device, moved back, offloaded and reloaded, and loaded into a fresh optimizer
with ``optimshift.load_state_dict``: after each, placement (device, dtype, sharing) equals a fresh optimizer's,
params and state stay bitwise equal to an optimizer that never moved, and each step costs the host syncs a
fresh optimizer's costs (``_optim_db_cases`` has the scenario).

Differentiable configurations run in one child process: their placement probe once aborted the process
(issue 13), and a regression must fail their tests, not kill the run.

Excluded (listed by ``test_exclusions_are_only_the_listed_ones``): SparseAdam's 8 inputs, which need sparse
gradients (``only_supports_sparse_grads``); the simulated accelerator has no sparse tensors. Runtime: about
30 s alone on a 2-core machine (the differentiable cases' child process about 10 s of it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import optimshift
from _optim_db_cases import SPARSE_ONLY, collect, run_case

CASES, EXCLUDED, TOTAL = collect()
IN_PROCESS = [c for c in CASES if not c.subprocess]
CHILD = [c for c in CASES if c.subprocess]
CHILD_TIMEOUT_S = 300


def test_every_input_is_run_or_excluded():
    """No configuration is silently dropped: every input of both device types' lists is a case (an input both
    lists give is one case) or an exclusion."""
    covered = sum(len(c.device_types) for c in CASES) + len(EXCLUDED)
    assert covered == TOTAL
    assert len({c.ident for c in CASES}) == len(CASES), "each case has its own name (the child finds it by name)"
    assert len(CASES) > 500 and {c.info.optim_cls.__name__ for c in CASES} >= {
        "Adadelta",
        "Adafactor",
        "Adagrad",
        "Adam",
        "AdamW",
        "Adamax",
        "ASGD",
        "LBFGS",
        "Muon",
        "NAdam",
        "RAdam",
        "RMSprop",
        "Rprop",
        "SGD",
    }


def test_exclusions_are_only_the_listed_ones():
    """Only SparseAdam's inputs (4 per device type) are left out, for needing sparse grads; an optim_db skip
    that starts to apply fails here, to be listed with its reason."""
    assert {reason for _, reason in EXCLUDED} == {SPARSE_ONLY}
    assert {label.split(":")[0] for label, _ in EXCLUDED} == {"SparseAdam"} and len(EXCLUDED) == 8


@pytest.mark.parametrize("case", IN_PROCESS, ids=[c.ident for c in IN_PROCESS])
def test_optim_db_case(sim, case):
    run_case(case, sim)


@pytest.fixture(scope="module")
def child_results(tmp_path_factory) -> dict:
    """Run every differentiable case in one child process; {ident: result}, plus how the child ended."""
    work = tmp_path_factory.mktemp("optim_db")
    ids, out = work / "ids.json", work / "results.jsonl"
    ids.write_text(json.dumps([c.ident for c in CHILD]))
    env = dict(os.environ)
    src = str(Path(optimshift.__file__).resolve().parents[1])  # the optimshift under test, wherever it is
    env["PYTHONPATH"] = os.pathsep.join([src, str(Path(__file__).parent), env.get("PYTHONPATH", "")])
    script = Path(__file__).with_name("_optim_db_cases.py")
    try:
        proc = subprocess.run(
            [sys.executable, str(script), str(ids), str(out)],
            env=env,
            capture_output=True,
            text=True,
            timeout=CHILD_TIMEOUT_S,
        )
        ended = f"exit code {proc.returncode}; stderr tail:\n{proc.stderr[-3000:]}"
    except subprocess.TimeoutExpired:
        ended = f"killed after {CHILD_TIMEOUT_S} s"
    results: dict = {}
    last = None
    for line in out.read_text().splitlines() if out.exists() else []:
        entry = json.loads(line)
        if "start" in entry:
            last = entry["start"]
        else:
            results[entry["ident"]] = entry
    return {"results": results, "last": last, "ended": ended}


@pytest.mark.parametrize("case", CHILD, ids=[c.ident for c in CHILD])
def test_optim_db_differentiable_case(child_results, case):
    result = child_results["results"].get(case.ident)
    if result is None:
        died = child_results["last"]
        raise AssertionError(
            f"{case.ident}: no result: the child process died ({child_results['ended']}) while running "
            f"{died!r}" + (" (this case)" if died == case.ident else ", before reaching this case")
        )
    assert result["ok"], result["error"]

"""What ``inspect`` reads in a checkpoint file, as data (what torch's ``load_state_dict`` would do with each
entry, judged by the saved device *type*); nothing here renders it (:mod:`optimshift.cli._inspect` does) or runs
code from a file."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .. import policy as _policy
from .._dtensor import tensor_bytes
from .._errors import dtype_name
from .._state import GROUP_SKIP
from .._state import IMPLEMENTATION_FLAGS as _FLAGS
from .._state import tensors as all_tensors
from ..report import assumed, default_rule_note, runs_foreach, sync_cost
from . import _files as ckpt
from ._checks import fresh_group, torch_cast

SCHEDULER_KEYS = {"initial_lr", "max_lr", "min_lr", "base_momentum", "max_momentum", "base_lr"}


_SHOWN_DEPTH = 16  # containers nested deeper than this are summarised (a hostile file may nest thousands)


def jsonable(value: Any, depth: int = 0, locations: Mapping[int, str] | None = None) -> Any:
    """``value`` as JSON data; a tensor as one (a tensor ``lr`` is no float: where it sits decides placement), with
    its value if 0-dim and where it was saved, given :func:`optimshift.checkpoint._files._load_recording`'s table."""
    if isinstance(value, torch.Tensor):
        shown: dict[str, Any] = {"tensor": list(value.shape)}
        if value.dim() == 0 and not value.is_meta:  # (a meta tensor has no value to show)
            shown["value"] = jsonable(value.item(), depth)  # (a NaN as a float's: no bare NaN token in --json)
        shown["dtype"] = dtype_name(value.dtype)
        if locations is not None:
            shown["saved_on"] = ckpt.saved_location(value, locations)
        return shown
    if isinstance(value, (list, tuple, Mapping)) and depth >= _SHOWN_DEPTH:
        return f"<{type(value).__name__} nested deeper than {_SHOWN_DEPTH} levels>"
    if isinstance(value, (list, tuple)):
        return [jsonable(v, depth + 1, locations) for v in value]
    if isinstance(value, Mapping):
        return {str(k): jsonable(v, depth + 1, locations) for k, v in value.items()}
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


# --- which optimizer class a state dict came from --------------------------------------------------------


def _torch_optimizers() -> list[tuple[str, type[torch.optim.Optimizer], frozenset[str]]]:
    """(name, class, the keys of its param groups) for every torch.optim optimizer of the installed torch."""
    found: list[tuple[str, type[torch.optim.Optimizer], frozenset[str]]] = []
    for name in sorted(dir(torch.optim)):
        cls = getattr(torch.optim, name)
        if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)) or cls is torch.optim.Optimizer:
            continue
        group = fresh_group(cls)
        if group is not None:
            found.append((name, cls, frozenset(group)))
    return found


def guess_classes(groups: list[Mapping[str, Any]]) -> list[str]:
    """torch.optim classes whose param groups have the keys these have (best matches; ties all listed)."""
    if not groups:
        return []
    keys = frozenset(groups[0]) - set(GROUP_SKIP) - SCHEDULER_KEYS
    best, names = 0.0, []
    for name, _cls, ckeys in _torch_optimizers():
        score = len(keys & ckeys) / max(1, len(keys | ckeys))
        if score > best + 1e-9:
            best, names = score, [name]
        elif abs(score - best) <= 1e-9:
            names.append(name)
    return names if best >= 0.8 else []


def _resolve_class(recorded: str | None, guessed: list[str]) -> type[torch.optim.Optimizer] | None:
    """The torch.optim class to judge placement by (only torch.optim classes: nothing else is imported)."""
    name = None
    if recorded:
        module, _, qual = recorded.rpartition(".")
        if module.startswith("torch.optim") or not module:
            name = qual
    elif guessed:
        name = guessed[0]
    cls = getattr(torch.optim, name, None) if name else None
    return cls if isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer) else None


# --- inspect -----------------------------------------------------------------------------------------------


def describe(
    obj: Any, locations: Mapping[int, str], *, path: str = "", size: int = 0, fmt: str = "", opaque: Sequence[str] = ()
) -> dict[str, Any]:
    """What ``inspect`` reports about a loaded checkpoint, as JSON-ready data; ``opaque``: the globals its pickle
    names that were not rebuilt (``checkpoint._files.Opaque`` objects stand for them)."""
    tensors = list(all_tensors(obj))
    saved_on = Counter(ckpt.saved_location(t, locations) for t in tensors)
    out: dict[str, Any] = {
        "path": path,
        "bytes": size,
        "format": fmt,
        "top_level_keys": [str(k) for k in obj] if isinstance(obj, Mapping) else None,
        "tensors": {"count": len(tensors), "bytes": ckpt.storage_bytes(tensors), "saved_on": dict(saved_on)},
        "optimizers": [_describe_optimizer(found, locations) for found in ckpt.find_optimizer_states(obj)],
        "not_rebuilt": list(opaque),
        "findings": [_opaque_finding(opaque)] if opaque else [],
    }
    elsewhere = {tag: n for tag, n in saved_on.items() if not tag.startswith("cpu")}
    if elsewhere:
        where = ", ".join(f"{tag} ({n})" for tag, n in sorted(elsewhere.items()))
        message = (
            f"tensors saved on {where}: plain torch.load restores them there (and fails where that device is "
            f"missing); optimshift.load uses map_location='cpu', or run `optimshift convert IN OUT --device cpu` once"
        )
        out["findings"].append(_finding("info", "-", sum(elsewhere.values()), message))
    return out


def _finding(severity: str, key: str, count: int, message: str, **more: Any) -> dict[str, Any]:
    """One of ``inspect``'s findings, as data."""
    return {"severity": severity, "key": key, "count": count, "message": message, **more}


def _opaque_finding(names: Sequence[str]) -> dict[str, Any]:
    """What ``inspect`` says about the classes a file names that it did not rebuild (it imports none)."""
    scripts = [n for n in names if n.partition(".")[0] == "__main__"]
    whose = " (__main__: the script that saved the file)" if scripts else ""
    message = (
        f"not rebuilt: {', '.join(names)}{whose}. inspect imports no class a file names and runs none of its code: "
        f"it leaves these objects opaque and reads everything else as saved. optimshift.load refuses the file until "
        f"they are allowed, for a file you trust: torch.serialization.safe_globals([...]) in a process that has the "
        f"classes"
    )
    return _finding("info", "-", len(names), message)


def _hashable(value: Any) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


def _state_of(states: Mapping[Any, Any], sid: Any) -> Any:
    """The saved state of param id ``sid`` (None for ids a corrupt file made unhashable)."""
    return states.get(sid) if _hashable(sid) else None


def _describe_optimizer(found: ckpt.FoundOptimizer, locations: Mapping[int, str]) -> dict[str, Any]:
    sd = found.state_dict
    groups = list(sd["param_groups"])
    states = sd["state"]
    guessed = [] if found.class_name else guess_classes(groups)
    cls = _resolve_class(found.class_name, guessed)
    n_params = sum(len(g["params"]) for g in groups)
    listed = {sid for g in groups for sid in g["params"] if _hashable(sid)}
    stringified = set(ckpt.stringified_ids(states, listed))
    # (a JSON round trip's text keys still hold each param's state: described as such, with the error below)
    per_param = [_state_of(states, str(sid) if str(sid) in stringified else sid) for g in groups for sid in g["params"]]
    # (a state that holds anything; a corrupt file's may be a tensor: never its truth)
    with_state = sum(st is not None and (not isinstance(st, (Mapping, list, tuple)) or len(st) > 0) for st in per_param)
    desc: dict[str, Any] = {
        "where": found.where,
        "kind": found.kind,
        "class": found.class_name,
        "class_guess": guessed,
        "params": n_params,
        "params_with_state": with_state,
        "groups": [],
        "state": [],
        "findings": [],
    }
    for gi, g in enumerate(groups):
        hyper = {str(k): jsonable(v, 0, locations) for k, v in g.items() if k not in GROUP_SKIP + _FLAGS}
        flags = {k: jsonable(g[k], 0, locations) for k in _FLAGS if k in g}
        desc["groups"].append({"index": gi, "params": len(g["params"]), "hyperparameters": hyper, "flags": flags})
    table: dict[str, dict[str, Any]] = {}
    # Optimizer-wide entries (keys of state that are no param's id, e.g. MADGRAD's "k"), shown as "state[key]".
    wide = {
        f"state[{k!r}]": v
        for k, v in states.items()
        if k not in listed and k not in stringified and type(k) not in {type(sid) for sid in listed}
    }
    for st in per_param + ([wide] if wide else []):
        if not isinstance(st, Mapping):
            continue
        for key, value in st.items():
            row = table.setdefault(
                str(key), dict(key=str(key), count=0, saved_on=Counter(), dtypes=Counter(), bytes=0, kinds=Counter())
            )
            row["count"] += 1
            ts = [value] if isinstance(value, torch.Tensor) else list(all_tensors(value))
            if not ts:
                row["kinds"][type(value).__name__] += 1
            for t in ts:
                row["saved_on"][ckpt.saved_location(t, locations)] += 1
                row["dtypes"][dtype_name(t.dtype)] += 1
                row["bytes"] += tensor_bytes(t)
    for row in table.values():
        row["saved_on"], row["dtypes"], row["kinds"] = dict(row["saved_on"]), dict(row["dtypes"]), dict(row["kinds"])
        desc["state"].append(row)
    desc["findings"] = _findings(cls, found, groups, states, locations)
    if stringified:
        shown = ", ".join(repr(k) for k in sorted(stringified)[:3])
        message = (
            f"the state's keys are text ({shown}{', …' if len(stringified) > 3 else ''}) while the param groups list "
            f"numbers: the file went through JSON or a similar round trip. optimizer.load_state_dict silently drops "
            f"every param's state (it keeps them as optimizer-wide entries); optimshift.load_state_dict refuses it. "
            f"Turn the keys back into the groups' ids ({{int(k): v for k, v in sd['state'].items()}})"
        )
        desc["findings"].insert(0, _finding("error", "-", len(stringified), message))
    return desc


def _findings(
    cls: type[torch.optim.Optimizer] | None,
    found: ckpt.FoundOptimizer,
    groups: list[Mapping[str, Any]],
    states: Mapping[Any, Any],
    locations: Mapping[int, str],
) -> list[dict[str, Any]]:
    findings: list[dict[str, Any]] = []
    recorded = found.class_name.rpartition(".")[2] if found.class_name else "this optimizer"
    name = cls.__name__ if cls is not None else recorded
    holder = cls.__new__(cls) if cls is not None else _GENERIC  # policy.decide reads only its type
    # (key, saved on, where optimizer.load_state_dict puts it, where a fresh optimizer keeps it, whether by the
    # default rule, flags) -> count
    moved: Counter[tuple[str, str, str, str, bool, bool, bool, bool, bool]] = Counter()
    guessed: dict[str, None] = {}  # why the default rule placed an entry found moved, each reason once, in order
    base = _policy.stepping_base(cls) if cls is not None else None
    torch_name = base.__name__ if base is not None else name  # (which torch step runs: its default foreach)
    unknown: dict[torch.device, str] = {}  # stand-ins for saved device types this process does not know
    placers: dict[torch.device, _policy.Placer] = {}  # (the policy's memoizing front, per device)

    def tag(device: torch.device) -> str:
        return unknown.get(device, str(device))

    for gi, g in enumerate(groups):
        findings.extend(_flag_finding(f, gi, len(g["params"])) for f in ("fused", "capturable") if g.get(f))
        for sid in g["params"]:
            st = _state_of(states, sid)
            if not isinstance(st, Mapping):
                continue
            for key, value in st.items():
                if isinstance(value, str) or any(isinstance(v, str) for v in _shallow(value)):
                    findings.append(_mangle(key, "holds a string", "turns it into the text of a generator object"))
                elif any(isinstance(v, tuple) and hasattr(type(v), "_fields") for v in [value, *_shallow(value)]):
                    findings.append(_mangle(key, "holds a namedtuple", "raises TypeError rebuilding it"))
            if cls is None and found.class_name:
                continue  # a recorded class that is not torch.optim: its placement rules are not known here
            big = next((v for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0), None)
            pdev = ckpt.tag_device(ckpt.saved_location(big, locations), unknown) if big is not None else None
            if pdev is None or big is None:
                continue
            fake = torch.empty(big.shape, device="meta")  # the param: only its rank matters to the policy
            for key, value in st.items():
                if not isinstance(value, torch.Tensor) or value.dim() != 0:
                    continue
                saved_on = ckpt.tag_device(ckpt.saved_location(value, locations), unknown)
                if saved_on is None:
                    continue
                puts_on = torch_cast(key, g, (big.dtype, pdev), (value.dtype, saved_on))[1]
                # (judged as the load leaves it: an entry that stays on its own side, LBFGS's `t`, is on puts_on)
                loaded = value if puts_on.type == "cpu" else torch.empty_like(value, device="meta")
                # NOTE: over host params a fresh optimizer keeps everything on the host (unless a registered
                # policy says otherwise), so a host checkpoint skips the Placer's probe (over 1 s).
                if pdev.type == "cpu" and not _policy.has_registered_policy(holder):
                    fresh_on, source = pdev, "rule"
                else:
                    if (placer := placers.get(pdev)) is None:
                        placer = placers[pdev] = _policy.Placer(holder, pdev, values=False)  # (stand-ins)
                    fresh_on, source = placer((gi, 0, (("key", str(key)),)), fake, g, str(key), loaded)
                if puts_on != fresh_on:
                    default = source == "default"
                    if default:
                        why = "the file records no class, and its param groups match none of torch.optim's"
                        guessed[why if cls is None else _policy.why_guessed(cls, g, fake.dim(), str(key))] = None
                    # foreach=None: the implementation torch picks for the params (runs_foreach).
                    foreach = runs_foreach(torch_name, g.get("foreach"), pdev.type != "cpu", g)
                    flags = (bool(g.get("fused")), bool(g.get("capturable")), foreach, bool(g.get("differentiable")))
                    moved[(str(key), tag(saved_on), tag(puts_on), tag(fresh_on), default) + flags] += 1
    for (key, saved, torch_puts, fresh, default, fused, capturable, foreach, differentiable), n in sorted(
        moved.items()
    ):
        kind = "fused " if fused else "capturable " if capturable else "non-fused " if key == "step" else ""
        subject = f"{kind}{name}" if cls is not None else "an optimizer of unrecorded class"
        cost = sync_cost(cls, name, key, foreach, True, hyper={"differentiable": differentiable})
        head = f"`{key}` saved on {saved} for {subject} ({n} param{'s' if n != 1 else ''}): optimizer.load_state_dict"
        if fresh.partition(":")[0] == "cpu":
            verb = "keeps it there" if torch_puts == saved else f"moves it to {torch_puts}"
            if cost == 0:
                price = "which this torch reads without a host sync (it still holds device memory)"
            elif cost:
                price = f"costing {cost} host sync{'s' if cost != 1 else ''} per param per step"
            else:
                price = "where each read of it is a host sync"
            message = f"{head} {verb}, {price}; optimshift.load_state_dict places it on the host"
        else:
            message = (
                f"{head} leaves it on {torch_puts}, but a fresh {name} keeps it on its param's device ({fresh}); "
                f"optimshift.load_state_dict places it there"
            )
        message = assumed(name) + message if default else message
        where = {"saved_on": saved, "torch_load_puts_it_on": torch_puts, "fresh_optimizer_keeps_it_on": fresh}
        severity = "info" if cost == 0 else "warning"
        findings.append(_finding(severity, key, n, message, **where, syncs_per_param_per_step=cost))
    if guessed:
        assumed_n = sum(n for k, n in moved.items() if k[4])
        findings.append(_finding("info", "-", assumed_n, default_rule_note(name, guessed, register=cls is not None)))
    return _merge(findings)


def _flag_finding(flag: str, group: int, count: int) -> dict[str, Any]:
    """What a group saved with ``fused``/``capturable`` means for a resume, by the device types this torch runs
    those kernels on."""
    import torch.optim.optimizer as torch_optimizer

    # (torch.optim.optimizer imports it from torch.utils._foreach_utils without re-exporting it in its stubs)
    fused_devices: Any = torch_optimizer._get_fused_kernels_supported_devices  # type: ignore[attr-defined]
    listed = fused_devices() if flag == "fused" else torch_optimizer._get_capturable_supported_devices()
    # ("privateuseone": the out-of-tree backend's slot while no backend has renamed it)
    devices = [d for d in dict.fromkeys(listed) if d != "privateuseone"]
    on_cpu = "cpu" in devices
    where = "a CPU or any other device outside that list" if not on_cpu else "a device outside that list"
    message = (
        f"group {group} was saved with {flag}=True, and optimizer.load_state_dict adopts the checkpoint's "
        f"flags: this torch runs {flag} kernels on {', '.join(devices)}, so resuming on {where} fails at "
        f"step(); optimshift.load_state_dict keeps the live optimizer's flags and places the state for them"
    )
    return _finding("info" if on_cpu else "warning", flag, count, message, group=group, kernel_devices=devices)


# Stands for an optimizer of unknown class (policy.decide reads only its type): the default rule applies.
_GENERIC = object.__new__(torch.optim.Optimizer)


def _shallow(value: Any) -> list[Any]:
    if isinstance(value, (list, tuple, set, frozenset)):
        return list(value)
    if isinstance(value, Mapping):
        return list(value.values())
    return []


def _mangle(key: Any, what: str, effect: str) -> dict[str, Any]:
    message = (
        f"state key `{key}` {what}: optimizer.load_state_dict {effect}; optimshift.load_state_dict keeps it as saved"
    )
    return _finding("warning", str(key), 1, message)


def _merge(findings: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Identical findings (one per param) become one, with a count."""
    merged: dict[tuple[str, str, str], dict[str, Any]] = {}
    for f in findings:
        merged.setdefault((f["severity"], f["key"], f["message"]), {**f, "count": 0})["count"] += f["count"]
    return list(merged.values())


def trainer_resume_findings(o: Mapping[str, Any]) -> list[dict[str, Any]]:
    """What the Trainer's multi-device resume does to this optimizer's ``step`` (when it keeps one on the host)."""
    hosted = [g for g in o["groups"] if not (g["flags"].get("fused") or g["flags"].get("capturable"))]
    if not hosted or not any(row["key"] == "step" for row in o["state"]):
        return []
    message = (
        "the Trainer resumes this file with torch.load(map_location=its device) when it trains on more than one "
        "device, and optimizer.load_state_dict then leaves each non-fused `step` on the accelerator, where every read "
        "is a host sync; calling optimshift.integrations.accelerate.patch() before the Trainer is built keeps it on "
        "the host"
    )
    return [_finding("info", "step", sum(g["params"] for g in hosted), message)]

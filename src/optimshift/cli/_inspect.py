"""``optimshift inspect`` and ``optimshift convert``: look inside a checkpoint, and rewrite one for a device.

``inspect`` never needs the device a file was saved on: tensors are read onto the host (lazily, by mmap) and
their saved locations are taken from the file's location tags. Its findings say where
``optimizer.load_state_dict`` would put each optimizer entry and where a fresh optimizer keeps it.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json
import math
import os
import re
import secrets
import shutil
import sys
import time
import warnings
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from typing import IO, Any

import torch

from .. import policy as _policy
from .._dtensor import tensor_bytes
from .._state import tensors as all_tensors
from ..checkpoint import _files as ckpt
from ..checkpoint._checks import fresh_group, torch_cast
from ..checkpoint._folders import TrainingFolder, training_folder
from ..report import format_table, sync_cost

__all__ = ["register", "describe", "render", "run_inspect", "run_convert"]

_LARGE = 64 << 20  # bytes: show a progress bar for files at least this big (on a terminal)
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}
_FLAGS = ("fused", "capturable", "foreach", "differentiable")
_SCHEDULER_KEYS = {"initial_lr", "max_lr", "min_lr", "base_momentum", "max_momentum", "base_lr"}


def register(subparsers: Any) -> None:
    """Add the ``inspect`` and ``convert`` subcommands to the ``optimshift`` parser."""
    p = subparsers.add_parser(
        "inspect",
        help="show the optimizer state inside a checkpoint, where it was saved, and what a resume will cost",
        description="Shows each optimizer state in PATH: its class, param groups, a table per state key (where "
        "each was saved, dtypes, bytes), and findings: what optimizer.load_state_dict would do with it and what "
        "that costs on every step. PATH is a torch.save file (a bare optimizer state_dict, a Lightning .ckpt, a "
        "dict with an 'optimizer' entry, an optimshift.save file), a Hugging Face Trainer checkpoint-N folder, "
        "an Accelerate save_state folder, or a torch.distributed.checkpoint folder. Never runs code from the "
        "file, and needs none of the devices it was saved on.",
    )
    p.add_argument("path", metavar="PATH")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON instead of tables")
    _allow_global_arg(p)
    p.set_defaults(func=run_inspect)

    c = subparsers.add_parser(
        "convert",
        help="rewrite a checkpoint with every tensor on one device (atomically)",
        description="Loads IN without running code from it, puts every tensor on --device (and casts floating "
        "tensors to --dtype, keeping optimizer scalars such as 'step' exact), and writes OUT atomically, so that "
        "a GPU checkpoint opens on a CPU-only machine without map_location. IN may be a Hugging Face Trainer "
        "checkpoint-N folder or an Accelerate save_state folder: its optimizer files are rewritten and every "
        "other file is copied into the new folder OUT (give IN itself as OUT to rewrite them in place).",
    )
    c.add_argument("input", metavar="IN")
    c.add_argument("output", metavar="OUT")
    c.add_argument("--device", default="cpu", help="where every tensor goes (default: cpu)")
    c.add_argument("--dtype", choices=sorted(_DTYPES), help="cast floating tensors to this dtype")
    c.add_argument("--json", action="store_true", help="print the result (or the error) as JSON on stdout")
    _allow_global_arg(c)
    c.set_defaults(func=run_convert)


def _allow_global_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--allow-global",
        action="append",
        default=[],
        metavar="NAME",
        help="allow one class the file's pickle names (e.g. a config class), for a file you trust; repeatable",
    )


# --- output helpers ----------------------------------------------------------------------------------------


def _use_color(stream: IO[str]) -> bool:
    if os.environ.get("NO_COLOR") or os.environ.get("TERM") == "dumb":
        return False
    return _isatty(stream)


_COLORS = {"error": "31", "warning": "33", "info": "36", "bold": "1", "dim": "2"}


def _isatty(stream: IO[str]) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def _paint(text: str, style: str, color: bool) -> str:
    return f"\x1b[{_COLORS[style]}m{text}\x1b[0m" if color else text


def human_bytes(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    size = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        size /= 1024
        if size < 1024 or unit == "TiB":
            return f"{size:.1f} {unit}"
    return f"{size} B"  # pragma: no cover


def _fail(command: str, message: str, *, as_json: bool = False, error: BaseException | None = None) -> int:
    """Report a failure in one line (stderr), or as ``{"error": {...}}`` on stdout with ``--json``; exit 1."""
    line = re.sub(r"\s*\n\s*", " ", re.sub(r"\x1b\[[0-9;]*m", "", message)).strip()
    if as_json:
        kind = type(error).__name__ if error is not None else "UsageError"
        print(json.dumps({"error": {"command": command, "type": kind, "message": line}}))
    else:
        print(f"optimshift {command}: error: {line}", file=sys.stderr)
    return 1


@contextlib.contextmanager
def _allowed(names: list[str]) -> Iterator[None]:
    objs = [ckpt.resolve_global(n) for n in names]
    if not objs:
        yield
        return
    with torch.serialization.safe_globals(objs):
        yield


_SHOWN_DEPTH = 16  # containers nested deeper than this are summarised (a hostile file may nest thousands)


def _jsonable(value: Any, depth: int = 0) -> Any:
    if isinstance(value, torch.Tensor):
        if value.dim() == 0:
            return value.item()
        return {"tensor": list(value.shape), "dtype": str(value.dtype).replace("torch.", "")}
    if isinstance(value, (list, tuple, Mapping)) and depth >= _SHOWN_DEPTH:
        return f"<{type(value).__name__} nested deeper than {_SHOWN_DEPTH} levels>"
    if isinstance(value, (list, tuple)):
        return [_jsonable(v, depth + 1) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v, depth + 1) for k, v in value.items()}
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def _short(value: Any) -> str:
    v = _jsonable(value)
    if isinstance(v, list):  # at most _SHOWN_DEPTH deep: _jsonable summarised the rest
        return "(" + ", ".join(_short(x) for x in v) + ")"
    if isinstance(v, float):
        return f"{v:g}"
    return str(v)


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
    keys = frozenset(groups[0]) - {"params", "param_names"} - _SCHEDULER_KEYS
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


_TAG = re.compile(r"([A-Za-z_]\w*)(?::(\d+))?")


def _device(tag: str, unknown: dict[torch.device, str] | None = None) -> torch.device | None:
    """The device a storage's location tag names, for torch's placement rules (None for a malformed tag).

    NOTE: torch parses the device types it is built with and the PrivateUse1 backend registered in this process;
    a saved type it cannot parse is another process's PrivateUse1 backend (an out-of-tree accelerator: ``npu``,
    the simulator's ``sim``). What a load does with it follows from its type alone (torch's optimizer rules tell
    the host from accelerators, never whether the device is here), so this process's PrivateUse1 device of the
    same index stands in for it; ``unknown`` records the stand-in's tag, for messages.
    """
    try:
        return torch.device(tag)
    except Exception:
        pass
    match = _TAG.fullmatch(tag)
    if unknown is None or match is None:
        return None
    try:
        stand_in = torch.device(torch._C._get_privateuse1_backend_name(), int(match.group(2) or 0))
    except Exception:
        return None
    unknown.setdefault(stand_in, tag)
    return stand_in


def describe(
    obj: Any,
    locations: Mapping[int, str],
    *,
    path: str = "",
    size: int = 0,
    fmt: str = "",
    opaque: Sequence[str] = (),
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
        "tensors": {"count": len(tensors), "bytes": sum(tensor_bytes(t) for t in tensors), "saved_on": dict(saved_on)},
        "optimizers": [],
        "not_rebuilt": list(opaque),
        "findings": [_opaque_finding(opaque)] if opaque else [],
    }
    elsewhere = {tag: n for tag, n in saved_on.items() if not tag.startswith("cpu")}
    if elsewhere:
        where = ", ".join(f"{tag} ({n})" for tag, n in sorted(elsewhere.items()))
        out["findings"].append(
            {
                "severity": "info",
                "key": "-",
                "count": sum(elsewhere.values()),
                "message": f"tensors saved on {where}: plain torch.load restores them there (and fails where that "
                f"device is missing); optimshift.load uses map_location='cpu', or run `optimshift convert IN OUT "
                f"--device cpu` once",
            }
        )
    for found in ckpt.find_optimizer_states(obj):
        out["optimizers"].append(_describe_optimizer(found, locations))
    return out


def _opaque_finding(names: Sequence[str]) -> dict[str, Any]:
    """What ``inspect`` says about the classes a file names that it did not rebuild (it imports none)."""
    scripts = [n for n in names if n.partition(".")[0] == "__main__"]
    whose = " (__main__: the script that saved the file)" if scripts else ""
    return {
        "severity": "info",
        "key": "-",
        "count": len(names),
        "message": f"not rebuilt: {', '.join(names)}{whose}. inspect imports no class a file names and runs none "
        f"of its code: it leaves these objects opaque and reads everything else as saved. optimshift.load "
        f"refuses the file until they are allowed, for a file you trust: "
        f"torch.serialization.safe_globals([...]) in a process that has the classes",
    }


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
    desc: dict[str, Any] = {
        "where": found.where,
        "kind": found.kind,
        "class": found.class_name,
        "class_guess": guessed,
        "params": n_params,
        "params_with_state": sum(1 for g in groups for sid in g["params"] if _state_of(states, sid)),
        "groups": [],
        "state": [],
        "findings": [],
    }
    for gi, g in enumerate(groups):
        desc["groups"].append(
            {
                "index": gi,
                "params": len(g["params"]),
                "hyperparameters": {
                    str(k): _jsonable(v) for k, v in g.items() if k not in ("params", "param_names") + _FLAGS
                },
                "flags": {k: _jsonable(g[k]) for k in _FLAGS if k in g},
            }
        )
    table: dict[str, dict[str, Any]] = {}
    listed = {sid for g in groups for sid in g["params"] if _hashable(sid)}
    stringified = set(ckpt.stringified_ids(states, listed))
    # Optimizer-wide entries (keys of state that are no param's id, e.g. MADGRAD's "k"), shown as "state[key]".
    wide = {
        f"state[{k!r}]": v
        for k, v in states.items()
        if k not in listed and k not in stringified and type(k) not in {type(sid) for sid in listed}
    }
    per_param = [_state_of(states, sid) for g in groups for sid in g["params"]]
    for st in per_param + ([wide] if wide else []):
        if not isinstance(st, Mapping):
            continue
        for key, value in st.items():
            row = table.setdefault(
                str(key),
                {
                    "key": str(key),
                    "count": 0,
                    "saved_on": Counter(),
                    "dtypes": Counter(),
                    "bytes": 0,
                    "kinds": Counter(),
                },
            )
            row["count"] += 1
            ts = [value] if isinstance(value, torch.Tensor) else list(all_tensors(value))
            if not ts:
                row["kinds"][type(value).__name__] += 1
            for t in ts:
                row["saved_on"][ckpt.saved_location(t, locations)] += 1
                row["dtypes"][str(t.dtype).replace("torch.", "")] += 1
                row["bytes"] += tensor_bytes(t)
    for row in table.values():
        row["saved_on"], row["dtypes"], row["kinds"] = dict(row["saved_on"]), dict(row["dtypes"]), dict(row["kinds"])
        desc["state"].append(row)
    desc["findings"] = _findings(cls, found, groups, states, locations)
    if stringified:
        shown = ", ".join(repr(k) for k in sorted(stringified)[:3])
        desc["findings"].insert(
            0,
            {
                "severity": "error",
                "key": "-",
                "count": len(stringified),
                "message": f"the state's keys are text ({shown}{', …' if len(stringified) > 3 else ''}) while the "
                f"param groups list numbers: the file went through JSON or a similar round trip. "
                f"optimizer.load_state_dict silently drops every param's state (it keeps them as "
                f"optimizer-wide entries); optimshift.load_state_dict refuses it. Turn the keys back into "
                f"the groups' ids ({{int(k): v for k, v in sd['state'].items()}})",
            },
        )
    return desc


def _class_label(cls: type[torch.optim.Optimizer] | None, found: ckpt.FoundOptimizer) -> str:
    if cls is not None:
        return cls.__name__
    if found.class_name:
        return found.class_name.rpartition(".")[2]
    return "this optimizer"


def _findings(
    cls: type[torch.optim.Optimizer] | None,
    found: ckpt.FoundOptimizer,
    groups: list[Mapping[str, Any]],
    states: Mapping[Any, Any],
    locations: Mapping[int, str],
) -> list[dict[str, Any]]:
    findings: list[dict[str, Any]] = []
    name = _class_label(cls, found)
    stand_in = cls.__new__(cls) if cls is not None else None  # policy.decide reads only its type
    # (key, saved on, where optimizer.load_state_dict puts it, where a fresh optimizer keeps it, flags) -> count
    moved: Counter[tuple[str, str, str, str, bool, bool, bool]] = Counter()
    unknown: dict[torch.device, str] = {}  # stand-ins for saved device types this process does not know
    placers: dict[tuple[int, torch.device], _policy.Placer] = {}  # (the policy's memoizing front, per device)

    def tag(device: torch.device) -> str:
        return unknown.get(device, str(device))

    for gi, g in enumerate(groups):
        flagged = [f for f in ("fused", "capturable") if g.get(f)]
        for f in flagged:
            findings.append(_flag_finding(f, gi, len(g["params"])))
        for sid in g["params"]:
            st = _state_of(states, sid)
            if not isinstance(st, Mapping):
                continue
            for key, value in st.items():
                if isinstance(value, str) or any(isinstance(v, str) for v in _shallow(value)):
                    findings.append(_mangle(key, "holds a string", "turns it into the text of a generator object"))
                elif _has_namedtuple(value):
                    findings.append(_mangle(key, "holds a namedtuple", "raises TypeError rebuilding it"))
            if cls is None and found.class_name:
                continue  # a recorded class that is not torch.optim: its placement rules are not known here
            big = next((v for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0), None)
            pdev = _device(ckpt.saved_location(big, locations), unknown) if big is not None else None
            if pdev is None or big is None:
                continue
            fake = torch.empty(big.shape, device="meta")  # the param: only its rank matters to the policy
            holder = stand_in if stand_in is not None else _GENERIC
            for key, value in st.items():
                if not isinstance(value, torch.Tensor) or value.dim() != 0:
                    continue
                saved_on = _device(ckpt.saved_location(value, locations), unknown)
                if saved_on is None:
                    continue
                fresh_on = _fresh_device(placers, holder, gi, g, fake, str(key), value, pdev)
                puts_on = torch_cast(key, g, (big.dtype, pdev), (value.dtype, saved_on))[1]
                if puts_on != fresh_on:
                    # foreach=None: torch picks the foreach implementation for accelerator params.
                    foreach = g.get("foreach") if g.get("foreach") is not None else pdev.type != "cpu"
                    moved[
                        (
                            str(key),
                            tag(saved_on),
                            tag(puts_on),
                            tag(fresh_on),
                            bool(g.get("fused")),
                            bool(g.get("capturable")),
                            bool(foreach),
                        )
                    ] += 1
    for (key, saved, torch_puts, fresh, fused, capturable, foreach), n in sorted(moved.items()):
        kind = "fused " if fused else "capturable " if capturable else "non-fused " if key == "step" else ""
        subject = f"{kind}{name}" if cls is not None else "an optimizer of unrecorded class (default rule)"
        cost = sync_cost(cls, name, key, foreach, True)
        plural = "s" if n != 1 else ""
        if fresh.partition(":")[0] == "cpu":
            verb = "keeps it there" if torch_puts == saved else f"moves it to {torch_puts}"
            if cost == 0:
                price = "which this torch reads without a host sync (it still holds device memory)"
            elif cost:
                price = f"costing {cost} host sync{'s' if cost != 1 else ''} per param per step"
            else:
                price = "where each read of it is a host sync"
            message = (
                f"`{key}` saved on {saved} for {subject} ({n} param{plural}): optimizer.load_state_dict "
                f"{verb}, {price}; optimshift.load_state_dict places it on the host"
            )
        else:
            message = (
                f"`{key}` saved on {saved} for {subject} ({n} param{plural}): optimizer.load_state_dict "
                f"leaves it on {torch_puts}, but a fresh {name} keeps it on its param's device ({fresh}); "
                f"optimshift.load_state_dict places it there"
            )
        findings.append(
            {
                "severity": "info" if cost == 0 else "warning",
                "key": key,
                "count": n,
                "message": message,
                "saved_on": saved,
                "torch_load_puts_it_on": torch_puts,
                "fresh_optimizer_keeps_it_on": fresh,
                "syncs_per_param_per_step": cost,
            }
        )
    return _merge(findings)


def _fresh_device(
    placers: dict[tuple[int, torch.device], _policy.Placer],
    holder: Any,
    gi: int,
    group: Mapping[str, Any],
    param: torch.Tensor,
    key: str,
    value: torch.Tensor,
    device: torch.device,
) -> torch.device:
    """Where a fresh optimizer keeps ``value`` when its param is on ``device``.

    NOTE: for host params the answer needs no probe: a fresh optimizer over host params keeps everything on the
    host (state either follows its param or stays on the host). Only a registered policy could say otherwise.
    The probe (policy.decide builds the optimizer under FakeTensorMode) costs more than a second the first time,
    so a host checkpoint is read without it.
    """
    if device.type == "cpu" and not _policy.has_registered_policy(holder):
        return device
    placer = placers.get((id(holder), device))
    if placer is None:
        placer = placers[(id(holder), device)] = _policy.Placer(holder, device)
    return placer((gi, 0, (("key", key),)), param, group, key, value)[0]


def _kernel_devices(flag: str) -> list[str]:
    """The device types the installed torch runs ``fused`` or ``capturable`` optimizer kernels on."""
    import torch.optim.optimizer as torch_optimizer

    # (torch.optim.optimizer imports it from torch.utils._foreach_utils without re-exporting it in its stubs)
    fused_devices: Any = torch_optimizer._get_fused_kernels_supported_devices  # type: ignore[attr-defined]
    listed = fused_devices() if flag == "fused" else torch_optimizer._get_capturable_supported_devices()
    unnamed = "privateuseone"  # the out-of-tree backend's slot while no backend has renamed it
    return [d for d in dict.fromkeys(listed) if d != unnamed]


def _flag_finding(flag: str, group: int, count: int) -> dict[str, Any]:
    """What a group saved with ``fused``/``capturable`` means for a resume, as this torch has it."""
    devices = _kernel_devices(flag)
    on_cpu = "cpu" in devices
    where = "a CPU or any other device outside that list" if not on_cpu else "a device outside that list"
    message = (
        f"group {group} was saved with {flag}=True, and optimizer.load_state_dict adopts the checkpoint's "
        f"flags: this torch runs {flag} kernels on {', '.join(devices)}, so resuming on {where} fails at "
        f"step(); optimshift.load_state_dict keeps the live optimizer's flags and places the state for them"
    )
    return {
        "severity": "info" if on_cpu else "warning",
        "key": flag,
        "count": count,
        "group": group,
        "message": message,
        "kernel_devices": devices,
    }


# Stands for an optimizer of unknown class (policy.decide reads only its type): the default rule applies.
_GENERIC = object.__new__(torch.optim.Optimizer)


def _shallow(value: Any) -> list[Any]:
    if isinstance(value, (list, tuple, set, frozenset)):
        return list(value)
    if isinstance(value, Mapping):
        return list(value.values())
    return []


def _has_namedtuple(value: Any) -> bool:
    if isinstance(value, tuple) and hasattr(type(value), "_fields"):
        return True
    return any(isinstance(v, tuple) and hasattr(type(v), "_fields") for v in _shallow(value))


def _mangle(key: Any, what: str, effect: str) -> dict[str, Any]:
    return {
        "severity": "warning",
        "key": str(key),
        "count": 1,
        "message": f"state key `{key}` {what}: optimizer.load_state_dict {effect}; "
        f"optimshift.load_state_dict keeps it as saved",
    }


def _merge(findings: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Identical findings (one per param) become one, with a count."""
    merged: dict[tuple[str, str, str], dict[str, Any]] = {}
    for f in findings:
        k = (f["severity"], f["key"], f["message"])
        if k in merged:
            merged[k]["count"] += f["count"]
        else:
            merged[k] = dict(f)
    return list(merged.values())


def render(desc: Mapping[str, Any], *, color: bool = False) -> str:
    """``describe``'s data as aligned text tables."""
    lines = []
    head = desc["path"] or "checkpoint"
    formats = {"zip": "torch.save zip", "legacy": "torch.save legacy", "pickle": "pickle"}
    fmt = formats.get(desc["format"], desc["format"])
    t = desc["tensors"]
    count = f"{t['count']} tensor{'s' if t['count'] != 1 else ''}"
    lines.append(
        _paint(head, "bold", color)
        + f"  ({human_bytes(desc['bytes'])}, {fmt} format, {count}, {human_bytes(t['bytes'])})"
    )
    if t["saved_on"]:
        lines.append("  saved on: " + ", ".join(f"{k} ×{v}" for k, v in sorted(t["saved_on"].items())))
    whole = len(desc["optimizers"]) == 1 and desc["optimizers"][0]["where"] == ""  # the file is one state dict
    if desc["top_level_keys"] is not None and not whole:
        keys = desc["top_level_keys"]
        more = f", … ({len(keys) - 20} more)" if len(keys) > 20 else ""
        lines.append("  top-level keys: " + ", ".join(keys[:20]) + more)
    if not desc["optimizers"]:
        lines.append("")
        lines.append("no optimizer state found in this file")
    for i, o in enumerate(desc["optimizers"]):
        lines.append("")
        kind = {
            "optimshift": "optimshift.save file",
            "state_dict": "bare optimizer state_dict",
            "lightning": "Lightning checkpoint",
            "nested": "nested entry",
        }.get(o["kind"], o["kind"])
        where = o["where"] or "(the whole file)"
        lines.append(_paint(f"optimizer {i + 1} of {len(desc['optimizers'])}: {where}", "bold", color) + f"  [{kind}]")
        if o["class"]:
            lines.append(f"  class: {o['class']} (recorded)")
        elif o["class_guess"]:
            lines.append(f"  class: not recorded; its param groups look like {' or '.join(o['class_guess'])}")
        else:
            lines.append("  class: not recorded")
        lines.append(
            f"  params: {o['params']} in {len(o['groups'])} group{'s' if len(o['groups']) != 1 else ''}, "
            f"{o['params_with_state']} with state"
        )
        hyper_keys: list[str] = []
        for g in o["groups"]:
            for k in g["hyperparameters"]:
                if k not in hyper_keys:
                    hyper_keys.append(k)
        shown = o["groups"][:20]
        rows = [
            [str(g["index"]), str(g["params"])]
            + [_short(g["hyperparameters"].get(k, "")) for k in hyper_keys]
            + [" ".join(f"{k}={_short(v)}" for k, v in g["flags"].items())]
            for g in shown
        ]
        lines.append("")
        lines.append(_indent(format_table(["group", "params"] + hyper_keys + ["flags"], rows)))
        if len(o["groups"]) > len(shown):
            lines.append(f"  … {len(o['groups']) - len(shown)} more groups")
        if o["state"]:
            rows = []
            for r in o["state"]:
                on = ", ".join(f"{k} ×{v}" for k, v in sorted(r["saved_on"].items())) or "-"
                dt = ", ".join(f"{k} ×{v}" if len(r["dtypes"]) > 1 else k for k, v in sorted(r["dtypes"].items()))
                if not dt:
                    dt = ", ".join(sorted(r["kinds"])) or "-"
                rows.append([r["key"], str(r["count"]), on, dt, human_bytes(r["bytes"])])
            lines.append("")
            lines.append(_indent(format_table(["state key", "count", "saved on", "dtype", "bytes"], rows)))
        else:
            lines.append("  no per-param state (the optimizer never stepped)")
        lines.append("")
        lines.extend(
            _render_findings(
                o["findings"],
                color,
                none="  findings: none; optimizer.load_state_dict "
                "and optimshift.load_state_dict place this state alike",
            )
        )
    if desc["findings"]:
        lines.append("")
        lines.append(_paint("file", "bold", color))
        lines.extend(_render_findings(desc["findings"], color, none=""))
    return "\n".join(lines)


def _render_findings(findings: list[dict[str, Any]], color: bool, *, none: str) -> list[str]:
    if not findings:
        return [none] if none else []
    out = ["  " + _paint("findings", "bold", color)]
    for f in findings:
        sev = _paint(f["severity"].ljust(7), f["severity"] if f["severity"] in _COLORS else "bold", color)
        out.append(f"    {sev}  {f['message']}")
    return out


def _indent(text: str, by: str = "  ") -> str:
    return "\n".join(by + line for line in text.splitlines())


def run_inspect(args: argparse.Namespace) -> int:
    path, as_json = args.path, args.json
    if os.path.isdir(path):
        folder = training_folder(path)
        if folder is not None:
            return _inspect_training_folder(folder, args)
        return _inspect_folder(path, as_json=as_json)
    try:
        fmt = ckpt._sniff(path)
        with _allowed(args.allow_global), _warnings_only_on_success():
            obj, locations, opaque = ckpt._load_recording(path, opaque=True)
    except (ckpt.CheckpointError, OSError, ValueError, RuntimeError) as e:
        return _fail("inspect", str(e), as_json=as_json, error=e)
    try:
        desc = describe(obj, locations, path=path, size=os.path.getsize(path), fmt=fmt, opaque=opaque)
        text = json.dumps(desc, indent=2, default=str) if as_json else render(desc, color=_use_color(sys.stdout))
    except Exception as e:  # NOTE: a last resort, so that a file we misread never prints a traceback
        return _fail(
            "inspect",
            f"{path} loaded, but describing it failed ({type(e).__name__}: {e}); please report this",
            as_json=as_json,
            error=e,
        )
    print(text)
    return 0


@contextlib.contextmanager
def _warnings_only_on_success() -> Iterator[None]:
    """Hold back the warnings torch emits while reading a file: shown if it loads, dropped if it fails (the
    error says what matters, in one line)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        yield
    for w in caught:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


# What ``inspect`` reads, said once for every message that names it.
_READS = (
    "a torch.save file, a Hugging Face Trainer checkpoint-N folder, an Accelerate save_state folder or a "
    "torch.distributed.checkpoint folder (one with a .metadata file)"
)


def _inspect_folder(path: str, *, as_json: bool) -> int:
    try:
        from optimshift.distributed import describe_dcp
        from optimshift.distributed._checkpoint import is_dcp_folder
    except ImportError as e:
        return _fail(
            "inspect",
            f"{path} is a directory (a torch.distributed.checkpoint folder?); reading those needs "
            f"optimshift.distributed, which this installation does not have. Pass a file.",
            as_json=as_json,
            error=e,
        )
    if not is_dcp_folder(path):
        return _fail(
            "inspect",
            f"{path} is a folder of none of the kinds inspect reads; pass {_READS}",
            as_json=as_json,
            error=IsADirectoryError(path),
        )
    try:
        info = describe_dcp(path)
    except Exception as e:
        return _fail("inspect", f"{path}: {type(e).__name__}: {e}", as_json=as_json, error=e)
    if as_json:
        print(json.dumps(info, indent=2, default=str))
    else:
        print(_paint(path, "bold", _use_color(sys.stdout)) + "  (torch.distributed.checkpoint folder)")
        print(_render_mapping(info))
    return 0


def _render_mapping(info: Mapping[str, Any], limit: int = 50) -> str:
    """A dict from ``describe_dcp``: scalars as ``key: value``, dicts inline, lists of dicts as tables."""
    lines, tables = [], []
    for key, value in info.items():
        if isinstance(value, list) and value and all(isinstance(v, Mapping) for v in value):
            header: list[str] = []
            for row in value:
                header.extend(k for k in row if k not in header)
            rows = [[_short(row.get(k, "")) for k in header] for row in value[:limit]]
            table = _indent(format_table(header, rows), "    ")
            more = f"\n    … {len(value) - limit} more" if len(value) > limit else ""
            tables.append(f"  {key} ({len(value)})\n{table}{more}")
        elif isinstance(value, Mapping):
            inner = ", ".join(
                f"{k}: {json.dumps(v, default=str) if isinstance(v, (dict, list)) else v}" for k, v in value.items()
            )
            lines.append(f"  {key}: {inner}")
        else:
            lines.append(f"  {key}: {json.dumps(value, default=str) if isinstance(value, list) else value}")
    return "\n".join(lines + ([""] if tables else []) + tables)


# --- convert -----------------------------------------------------------------------------------------------


class _Progress:
    """A one-line progress bar on stderr (only created for large files on a terminal)."""

    def __init__(self, label: str, total: int, stream: IO[str]) -> None:
        self.label, self.total, self.stream = label, max(total, 1), stream
        self.shown = -1
        self.start = time.monotonic()

    def __call__(self, done: int) -> None:
        pct = min(100, int(100 * done / self.total))
        if pct == self.shown:
            return
        self.shown = pct
        bar = "#" * (pct * 30 // 100)
        self.stream.write(f"\r{self.label} [{bar:<30}] {pct:3d}%  {human_bytes(done)} / ~{human_bytes(self.total)}")
        self.stream.flush()

    def close(self) -> None:
        if self.shown >= 0:
            self.stream.write(f"  {time.monotonic() - self.start:.1f}s\n")
            self.stream.flush()


def _protected(obj: Any) -> set[int]:
    """ids of tensors a dtype cast must not touch: optimizer scalars (``step``, ``mu_product``…) and tensors
    in param groups, whose exact values and dtypes the optimizer relies on."""
    keep: set[int] = set()
    for found in ckpt.find_optimizer_states(obj):
        for st in found.state_dict["state"].values():
            for t in all_tensors(st):
                if t.dim() == 0:
                    keep.add(id(t))
        for g in found.state_dict["param_groups"]:
            keep.update(id(t) for t in all_tensors({k: v for k, v in g.items() if k != "params"}))
    return keep


_CAST_DEPTH = 64  # containers nested deeper than this are refused by --dtype (the copy is recursive)


def _cast_tree(
    obj: Any,
    dtype: torch.dtype,
    keep: set[int],
    memo: dict[int, Any],
    counts: Counter[str],
    where: str = "",
    depth: int = 0,
) -> Any:
    if isinstance(obj, torch.Tensor):
        if id(obj) in memo:
            return memo[id(obj)]
        new = obj
        if obj.is_floating_point() and obj.dtype != dtype:
            if id(obj) in keep:
                counts["kept"] += 1
            else:
                why = ckpt.overexpanded(obj)
                if why is not None:
                    raise ValueError(
                        f"refusing to cast the tensor at {where or 'the top'}: {why}; casting it would "
                        f"allocate every element"
                    )
                new = obj.to(dtype)
                counts["cast"] += 1
        memo[id(obj)] = new
        return new
    if isinstance(obj, (dict, list)) or type(obj) is tuple:  # dict subclasses too: OrderedDict state_dicts
        if id(obj) in memo:
            return memo[id(obj)]
        if depth >= _CAST_DEPTH:
            raise ValueError(
                f"the object at {where} is nested deeper than {_CAST_DEPTH} levels; --dtype cannot rewrite it"
            )
        if isinstance(obj, dict):
            out: Any = copy.copy(obj)  # keeps the type (OrderedDict, defaultdict) and its attributes (_metadata)
            for k, v in obj.items():
                out[k] = _cast_tree(v, dtype, keep, memo, counts, f"{where}[{k!r}]", depth + 1)
        else:
            out = type(obj)(
                _cast_tree(v, dtype, keep, memo, counts, f"{where}[{i}]", depth + 1) for i, v in enumerate(obj)
            )
        memo[id(obj)] = out
        return out
    return obj


def _storage_bytes(obj: Any) -> int:
    seen: set[int] = set()
    total = 0
    for t in all_tensors(obj):
        try:
            s = t.untyped_storage()
            key = s.data_ptr()
            if key in seen and key != 0:
                continue
            seen.add(key)
            total += s.nbytes()
        except Exception:
            total += tensor_bytes(t)
    return total


def _missing_device(device: torch.device) -> str | None:
    """What to do when ``device`` is not on this machine (``convert --device cuda`` without a GPU), else None."""
    from .._devices import resolve

    try:
        resolve(device, what="--device")
    except (ValueError, TypeError) as e:
        return (
            f"{e}. Convert to the CPU here instead (--device cpu, the default): a CPU checkpoint opens on "
            f"any machine, and optimshift.load_state_dict (or torch.load's map_location) puts the state on the "
            f"accelerator when you resume there. To write a {device.type} checkpoint, run this command on a machine "
            f"that has the device."
        )
    return None


def run_convert(args: argparse.Namespace) -> int:
    src, dst, as_json = args.input, args.output, args.json

    def fail(message: str, error: BaseException | None = None) -> int:
        return _fail("convert", message, as_json=as_json, error=error)

    try:
        device = torch.device(args.device)
    except Exception as e:
        return fail(f"--device {args.device!r} is not a device PyTorch knows", e)
    missing = _missing_device(device)
    if missing:
        return fail(missing, ValueError(missing))
    if os.path.isdir(src):
        folder = training_folder(src)
        if folder is not None:
            return _convert_training_folder(folder, args)
        return fail(
            f"{src} is a directory but not a Hugging Face Trainer checkpoint-N folder or an Accelerate "
            f"save_state folder; convert reads torch.save files and those folders",
            IsADirectoryError(),
        )
    try:
        torch.empty(0, device=device)
    except Exception as e:
        return fail(f"cannot put {src}'s tensors on {device}: {_first_line(str(e))}", e)
    try:
        with _allowed(args.allow_global), _warnings_only_on_success():
            obj = ckpt.load(src, map_location=device, mmap=device.type == "cpu")
    except (ckpt.CheckpointError, OSError, ValueError) as e:
        return fail(str(e), e)
    except RuntimeError as e:
        return fail(f"cannot put {src}'s tensors on {device}: {_first_line(str(e))}", e)
    counts: Counter[str] = Counter()
    try:
        if args.dtype:
            obj = _cast_tree(obj, _DTYPES[args.dtype], _protected(obj), {}, counts)
    except (ValueError, RuntimeError) as e:  # RuntimeError: an OOM while casting
        return fail(f"{src}: {e}", e)
    total = _storage_bytes(obj)
    bar = (
        _Progress(f"writing {os.path.basename(dst)}", total, sys.stderr)
        if (total >= _LARGE and _isatty(sys.stderr) and not as_json)
        else None
    )
    try:
        ckpt._save(obj, dst, progress=bar)
    except (OSError, RuntimeError, ValueError) as e:
        if bar:
            bar.close()
        return fail(f"cannot write {dst}: {e}", e)
    if bar:
        bar.close()
    tensors = list(all_tensors(obj))
    size = os.path.getsize(dst)
    if as_json:
        print(
            json.dumps(
                {
                    "wrote": dst,
                    "tensors": len(tensors),
                    "device": str(device),
                    "bytes": size,
                    "dtype": args.dtype,
                    "cast": counts["cast"],
                    "kept": counts["kept"],
                }
            )
        )
        return 0
    summary = f"wrote {dst}: {len(tensors)} tensors on {device}, {human_bytes(size)}"
    if args.dtype:
        summary += f"; cast {counts['cast']} floating tensors to {args.dtype}"
        if counts["kept"]:
            summary += f", kept {counts['kept']} optimizer scalars (step, …) in their dtype"
    print(summary)
    return 0


# --- framework checkpoint folders (Hugging Face Trainer checkpoint-N/, Accelerate save_state) ----------------


def _inspect_training_folder(folder: TrainingFolder, args: argparse.Namespace) -> int:
    """``inspect`` of a Trainer or Accelerate folder: its files, then each optimizer file as ``inspect FILE``."""
    described = []
    for name in folder.optimizer_files:
        file = os.path.join(folder.path, name)
        try:
            fmt = ckpt._sniff(file)
            with _allowed(args.allow_global):
                obj, locations, opaque = ckpt._load_recording(file, opaque=True)
        except (ckpt.CheckpointError, OSError, ValueError, RuntimeError) as e:
            return _fail("inspect", str(e))
        desc = describe(obj, locations, path=file, size=os.path.getsize(file), fmt=fmt, opaque=opaque)
        if folder.kind == "hf_trainer":
            for o in desc["optimizers"]:
                o["findings"].extend(_trainer_resume_findings(o))
        described.append(desc)
    info: dict[str, Any] = {
        "path": folder.path,
        "folder": folder.kind,
        "trainer_state": folder.trainer_state,
        "files": [
            {"name": name, "role": role, "bytes": _file_bytes(os.path.join(folder.path, name))}
            for name, role in folder.files.items()
        ],
        "optimizer_files": described,
    }
    if args.json:
        print(json.dumps(info, indent=2, default=str))
        return 0
    color = _use_color(sys.stdout)
    head = folder.label
    state = folder.trainer_state or {}
    if "global_step" in state:
        head += f"; global step {state['global_step']}"
    if "epoch" in state:
        head += f", epoch {_short(state['epoch'])}"
    lines = [_paint(folder.path, "bold", color) + f"  ({head})", ""]
    rows = [
        [
            f["name"] + ("/" if f["role"] == "folder" else ""),
            f["role"],
            "-" if f["bytes"] is None else human_bytes(f["bytes"]),
        ]
        for f in info["files"]
    ]
    lines.append(_indent(format_table(["file", "holds", "bytes"], rows)))
    for name, role in folder.files.items():
        if role == "folder" and os.path.exists(os.path.join(folder.path, name, ".metadata")):
            lines.append(
                f"  {name}/ is a torch.distributed.checkpoint folder (sharded state): "
                f"`optimshift inspect {os.path.join(folder.path, name)}` describes it"
            )
    if not described:
        lines += ["", "no optimizer file in this folder (a model-only save?)"]
    for desc in described:
        lines += ["", render(desc, color=color)]
    print("\n".join(lines))
    return 0


def _trainer_resume_findings(o: Mapping[str, Any]) -> list[dict[str, Any]]:
    """What the Trainer's multi-device resume does to this optimizer's ``step`` (when it keeps one on the host)."""
    hosted = [g for g in o["groups"] if not (g["flags"].get("fused") or g["flags"].get("capturable"))]
    if not hosted or not any(row["key"] == "step" for row in o["state"]):
        return []
    return [
        {
            "severity": "info",
            "key": "step",
            "count": sum(g["params"] for g in hosted),
            "message": "the Trainer resumes this file with torch.load(map_location=its device) when it trains on "
            "more than one device, and optimizer.load_state_dict then leaves each non-fused `step` on "
            "the accelerator, where every read is a host sync; calling "
            "optimshift.integrations.accelerate.patch() before the Trainer is built keeps it on the "
            "host",
        }
    ]


def _file_bytes(path: str) -> int | None:
    return os.path.getsize(path) if os.path.isfile(path) else None


def _convert_training_folder(folder: TrainingFolder, args: argparse.Namespace) -> int:
    """``convert`` of a Trainer or Accelerate folder: its optimizer files are rewritten, the rest copied as is.

    OUT the folder itself rewrites the optimizer files in place (each atomically). Otherwise OUT must not exist
    (or be an empty folder): the copy is built in a hidden folder beside it and renamed into place at the end,
    so OUT never holds half a checkpoint (a framework would resume from a folder that lacks its optimizer file
    without a word).
    """

    def convert(src: str, dst: str) -> int:
        return run_convert(
            argparse.Namespace(
                input=src, output=dst, device=args.device, dtype=args.dtype, allow_global=args.allow_global, json=False
            )
        )

    if not folder.optimizer_files:
        return _fail("convert", f"{folder.path} is a {folder.label} without an optimizer file: nothing to convert")
    dst = args.output
    if os.path.exists(dst) and os.path.samefile(dst, folder.path):
        for name in folder.optimizer_files:
            path = os.path.join(folder.path, name)
            if convert(path, path):
                return 1
        return 0
    if os.path.exists(dst) and not (os.path.isdir(dst) and not os.listdir(dst)):
        return _fail(
            "convert",
            f"{dst} exists: give a new folder, or {folder.path} itself to rewrite its optimizer files in place",
        )
    target = os.path.abspath(dst)
    tmp = os.path.join(os.path.dirname(target), f".{os.path.basename(target)}.{secrets.token_hex(6)}.tmp")
    os.mkdir(tmp)
    try:
        written = io.StringIO()
        for name in folder.optimizer_files:
            with contextlib.redirect_stdout(written):
                failed = convert(os.path.join(folder.path, name), os.path.join(tmp, name))
            if failed:
                return 1
        for name, role in folder.files.items():
            if role == "optimizer":
                continue
            source = os.path.join(folder.path, name)
            if os.path.isdir(source):
                shutil.copytree(source, os.path.join(tmp, name), symlinks=True)
            else:
                shutil.copy2(source, os.path.join(tmp, name), follow_symlinks=False)
        os.replace(tmp, target)  # an empty OUT folder is replaced too (POSIX)
    except OSError as e:
        return _fail("convert", f"cannot write {dst}: {e}")
    finally:
        if os.path.exists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    # NOTE: each file's summary names the hidden folder it was written to; report where it is now.
    sys.stdout.write(written.getvalue().replace(tmp, os.path.normpath(dst)))
    copied = len(folder.files) - len(folder.optimizer_files)
    print(f"copied {copied} other entr{'y' if copied == 1 else 'ies'} of {folder.path} unchanged into {dst}")
    return 0


def _first_line(message: str) -> str:
    lines = message.strip().splitlines()
    return lines[0] if lines else ""

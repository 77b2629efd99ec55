"""``optimshift inspect``: show what :mod:`optimshift.checkpoint._inspection` reads in a checkpoint.

``inspect`` never needs the device a file was saved on: tensors are read onto the host (lazily, by mmap) and
their saved locations are taken from the file's location tags. Its findings say where
``optimizer.load_state_dict`` would put each optimizer entry and where a fresh optimizer keeps it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping
from typing import Any

from ..checkpoint import _files as ckpt
from ..checkpoint._folders import TrainingFolder, training_folder
from ..checkpoint._inspection import describe, jsonable, trainer_resume_findings
from ..report import format_table
from ._common import (
    COLORS,
    allow_global_arg,
    allowed,
    failure,
    file_bytes,
    human_bytes,
    indent,
    paint,
    short,
    use_color,
    warnings_only_on_success,
)

__all__ = ["register", "render", "run_inspect"]


def register(subparsers: Any) -> None:
    """Add the ``inspect`` subcommand to the ``optimshift`` parser."""
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
    allow_global_arg(p)
    p.set_defaults(func=run_inspect)


def render(desc: Mapping[str, Any], *, color: bool = False) -> str:
    """``describe``'s data as aligned text tables."""
    lines = []
    head = desc["path"] or "checkpoint"
    formats = {"zip": "torch.save zip", "legacy": "torch.save legacy", "pickle": "pickle"}
    fmt = formats.get(desc["format"], desc["format"])
    t = desc["tensors"]
    count = f"{t['count']} tensor{'s' if t['count'] != 1 else ''}"
    lines.append(
        paint(head, "bold", color)
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
        lines.append(paint(f"optimizer {i + 1} of {len(desc['optimizers'])}: {where}", "bold", color) + f"  [{kind}]")
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
            + [short(g["hyperparameters"].get(k, "")) for k in hyper_keys]
            + [" ".join(f"{k}={short(v)}" for k, v in g["flags"].items())]
            for g in shown
        ]
        lines.append("")
        lines.append(indent(format_table(["group", "params"] + hyper_keys + ["flags"], rows)))
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
            lines.append(indent(format_table(["state key", "count", "saved on", "dtype", "bytes"], rows)))
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
        lines.append(paint("file", "bold", color))
        lines.extend(_render_findings(desc["findings"], color, none=""))
    return "\n".join(lines)


def _render_findings(findings: list[dict[str, Any]], color: bool, *, none: str) -> list[str]:
    if not findings:
        return [none] if none else []
    out = ["  " + paint("findings", "bold", color)]
    for f in findings:
        sev = paint(f["severity"].ljust(7), f["severity"] if f["severity"] in COLORS else "bold", color)
        out.append(f"    {sev}  {f['message']}")
    return out


def run_inspect(args: argparse.Namespace) -> int:
    path, as_json = args.path, args.json
    folder_of = os.path.dirname(os.path.abspath(path))
    dcp_part = os.path.basename(path) == ".metadata" or path.endswith(".distcp")
    if dcp_part and os.path.isfile(path) and os.path.isfile(os.path.join(folder_of, ".metadata")):
        path = folder_of  # (a file of a torch.distributed.checkpoint folder: the folder is the checkpoint)
    if (lone := _lone_shards(path)) is not None:
        return failure("inspect", lone, as_json=as_json, error=FileNotFoundError(lone))
    if os.path.isdir(path):
        folder = training_folder(path)
        if folder is not None:
            return _inspect_training_folder(folder, args)
        return _inspect_folder(path, as_json=as_json)
    try:
        fmt = ckpt._sniff(path)
        ckpt.verify_checksums(path)
        with allowed(args.allow_global), warnings_only_on_success():
            obj, locations, opaque = ckpt._load_recording(path)
    except (ckpt.CheckpointError, OSError, ValueError, RuntimeError) as e:
        return failure("inspect", str(e), as_json=as_json, error=e)
    try:
        desc = describe(obj, locations, path=path, size=os.path.getsize(path), fmt=fmt, opaque=opaque)
        text = json.dumps(desc, indent=2, default=str) if as_json else render(desc, color=use_color(sys.stdout))
    except Exception as e:  # NOTE: a last resort, so that a file we misread never prints a traceback
        return failure(
            "inspect",
            f"{path} loaded, but describing it failed ({type(e).__name__}: {e}); please report this",
            as_json=as_json,
            error=e,
        )
    print(text)
    return 0


def _lone_shards(path: str) -> str | None:
    """What is wrong with ``path`` where it is torch.distributed.checkpoint shards (a ``.distcp`` file, or a folder
    of them) whose folder lacks its ``.metadata`` (without which no shard can be read), else None."""
    folder = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    metadata = os.path.join(folder, ".metadata")
    try:
        names = os.listdir(path) if folder == path else [path] if os.path.isfile(path) else []
    except OSError:
        return None  # (what reading it says)
    shards = [n for n in names if n.endswith(".distcp")]
    if not shards or os.path.lexists(metadata):
        return None
    n = len(shards)
    what = f"holds torch.distributed.checkpoint shards ({n} .distcp file{'s' if n != 1 else ''})"
    return (
        f"{path} {what if folder == path else 'is a torch.distributed.checkpoint shard'}, and {metadata} is "
        f"missing: it says which tensor each shard's bytes belong to, and nothing reads the shards without it; copy "
        f"the whole folder, .metadata included, from where it was saved"
    )


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
        return failure(
            "inspect",
            f"{path} is a directory (a torch.distributed.checkpoint folder?); reading those needs "
            f"optimshift.distributed, which this installation does not have. Pass a file.",
            as_json=as_json,
            error=e,
        )
    if not is_dcp_folder(path):
        return failure(
            "inspect",
            f"{path} is a folder of none of the kinds inspect reads; pass {_READS}",
            as_json=as_json,
            error=IsADirectoryError(path),
        )
    try:
        info = describe_dcp(path)
    except Exception as e:
        return failure("inspect", f"{path}: {type(e).__name__}: {e}", as_json=as_json, error=e)
    if info.get("incomplete"):
        missing = ", ".join(info["incomplete"])
        return failure(
            "inspect",
            f"{path} is incomplete: it lacks {missing}, or holds fewer bytes there than its metadata names (a copy "
            f"cut short?); optimshift.distributed.load refuses it",
            as_json=as_json,
            error=ValueError(missing),
        )
    if as_json:
        print(json.dumps(info, indent=2, default=str))
    else:
        print(paint(path, "bold", use_color(sys.stdout)) + "  (torch.distributed.checkpoint folder)")
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
            rows = [[short(row.get(k, "")) for k in header] for row in value[:limit]]
            table = indent(format_table(header, rows), "    ")
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


# --- framework checkpoint folders (Hugging Face Trainer checkpoint-N/, Accelerate save_state) ----------------


def _inspect_training_folder(folder: TrainingFolder, args: argparse.Namespace) -> int:
    """``inspect`` of a Trainer or Accelerate folder: its files, then each optimizer file as ``inspect FILE``."""
    described = []
    for name in folder.optimizer_files:
        file = os.path.join(folder.path, name)
        try:
            fmt = ckpt._sniff(file)
            ckpt.verify_checksums(file)
            with allowed(args.allow_global):
                obj, locations, opaque = ckpt._load_recording(file)
        except (ckpt.CheckpointError, OSError, ValueError, RuntimeError) as e:
            return failure("inspect", str(e), as_json=args.json, error=e)
        desc = describe(obj, locations, path=file, size=os.path.getsize(file), fmt=fmt, opaque=opaque)
        if folder.kind == "hf_trainer":
            for o in desc["optimizers"]:
                o["findings"].extend(trainer_resume_findings(o))
        described.append(desc)
    info: dict[str, Any] = {
        "path": folder.path,
        "folder": folder.kind,
        "trainer_state": jsonable(folder.trainer_state),  # (a NaN epoch as text: no bare NaN token in the JSON)
        "files": [
            {"name": name, "role": role, "bytes": file_bytes(os.path.join(folder.path, name))}
            for name, role in folder.files.items()
        ],
        "optimizer_files": described,
    }
    if args.json:
        print(json.dumps(info, indent=2, default=str))
        return 0
    color = use_color(sys.stdout)
    head = folder.label
    state = folder.trainer_state or {}
    if "global_step" in state:
        head += f"; global step {state['global_step']}"
    if "epoch" in state:
        head += f", epoch {short(state['epoch'])}"
    lines = [paint(folder.path, "bold", color) + f"  ({head})", ""]
    rows = [
        [
            f["name"] + ("/" if f["role"] == "folder" else ""),
            f["role"],
            "-" if f["bytes"] is None else human_bytes(f["bytes"]),
        ]
        for f in info["files"]
    ]
    lines.append(indent(format_table(["file", "holds", "bytes"], rows)))
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

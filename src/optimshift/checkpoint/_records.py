"""Every storage a torch.save zip's pickle claims checked against its record's size (read by an unpickler that
builds nothing), and the records' CRC-32: ``torch.load(mmap=True)`` returns the bytes after a record cut short."""

from __future__ import annotations

import contextlib
import io
import pickle
import zipfile
from typing import Any

import torch


class RecordMismatch(Exception):
    """A storage whose claimed size is not its record's (or whose record is missing): the file is corrupt."""


class Unverifiable(Exception):
    """The pickle could not be read by the placeholder pass (the caller falls back to an eager load)."""


class _Inert:
    """What every global in the pickle stands for: accepts any construction, state and items, does nothing."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def _ignore(self, *args: Any) -> None:
        pass

    __setstate__ = __setitem__ = append = extend = _ignore


class _StorageName:
    def __init__(self, itemsize: int) -> None:
        self.itemsize = itemsize


class _ClaimsReader(pickle.Unpickler):
    """Collects ``{key: {claimed bytes}}`` from the pickle's persistent ids (``("storage", type, key, location,
    numel)``, torch.save's format)."""

    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data), encoding="utf-8")
        self.claims: dict[str, set[int]] = {}

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and isinstance(name, str) and name.endswith("Storage"):
            with contextlib.suppress(Exception):  # (a name StorageType, unannotated in torch, knows not: inert)
                typed = name != "UntypedStorage"
                storage = torch.serialization.StorageType(name) if typed else None  # type: ignore[no-untyped-call]
                return _StorageName(storage.dtype.itemsize if storage is not None else 1)
        return _Inert

    def persistent_load(self, pid: Any) -> Any:
        try:
            tag, storage_type, key, _location, numel = pid
            nbytes = numel * storage_type.itemsize
        except (TypeError, ValueError, AttributeError):
            raise Unverifiable(f"unexpected persistent id {pid!r:.60}") from None
        if type(key) is bytes:
            key = key.decode("ascii", "replace")
        if type(key) is not str or type(numel) is not int or type(storage_type) is not _StorageName:
            raise Unverifiable(f"unexpected persistent id {pid!r:.60}")
        self.claims.setdefault(key, set()).add(nbytes)
        return _INERT


_INERT = _Inert()


def check_records(path: str) -> None:
    """Raise :class:`RecordMismatch` if a storage the pickle of ``path`` (a torch.save zip file) asks for has
    no record or a record of another size; :class:`Unverifiable` if the pickle cannot be read that way."""
    try:
        with zipfile.ZipFile(path) as zf:
            infos = zf.infolist()
            if not infos:
                raise RecordMismatch("the zip archive is empty")
            # torch's reader: every record sits under the first record's top folder (the archive name).
            prefix = infos[0].filename.split("/", 1)[0]
            sizes = {i.filename: i.file_size for i in infos}
            pkl = f"{prefix}/data.pkl"
            if pkl not in sizes:
                raise RecordMismatch(f"it has no {pkl} record")
            data = zf.read(pkl)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, EOFError, ValueError, KeyError) as e:
        raise Unverifiable(f"{type(e).__name__}: {e}") from None
    reader = _ClaimsReader(data)
    try:
        reader.load()
    except (Unverifiable, RecordMismatch):
        raise
    except Exception as e:  # the placeholder pass cannot follow this pickle; torch could
        raise Unverifiable(f"{type(e).__name__}: {e}") from None
    for key, claimed in reader.claims.items():
        name = f"{prefix}/data/{key}"
        size = sizes.get(name)
        if size is None:
            raise RecordMismatch(f"its pickle asks for a storage in record {name}, which the file does not have")
        for nbytes in sorted(claimed):
            if nbytes != size:
                raise RecordMismatch(
                    f"record {name} holds {size} bytes but its pickle asks for a storage of {nbytes} bytes"
                )


def check_checksums(path: str) -> None:
    """Raise :class:`RecordMismatch` naming the first record of ``path`` (a zip file) whose bytes fail their CRC-32
    (a bit changed after the write, which neither torch's reader nor the size check sees). Reads every byte."""
    name = ""
    try:
        with zipfile.ZipFile(path) as zf:
            for info in zf.infolist():
                if info.CRC == 0 and info.file_size:
                    continue  # (none recorded: torch.serialization.set_crc32_options(False) writes 0)
                name = info.filename
                with zf.open(info) as f:
                    while f.read(1 << 24):
                        pass
    except zipfile.BadZipFile as e:
        if "CRC" in str(e):
            raise RecordMismatch(
                f"record {name} fails its CRC-32 check (its bytes changed after the file was written)"
            ) from None
        raise Unverifiable(f"{type(e).__name__}: {e}") from None
    except (zipfile.LargeZipFile, OSError, EOFError, ValueError) as e:
        raise Unverifiable(f"{type(e).__name__}: {e}") from None

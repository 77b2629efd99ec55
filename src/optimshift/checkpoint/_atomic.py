"""Temporary files and folders for atomic saves (``.NAME.<12 hex>.tmp`` next to ``NAME``), the rename that commits
them, and sweeping those crashed saves left. A writer holds an ``flock`` the kernel drops however it dies; a sweep
removes only what it could lock itself, and skips this process's own (on NFS another thread could take the lock)."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import hashlib
import os
import re
import secrets
import shutil
import stat
import sys
import threading
from collections.abc import Callable

from .._engine import uninterrupted

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]


# NOTE: the name format is the one earlier versions used, so strays they left are recognised (and removed) too.
_TOKEN_HEX = 12
_O_BINARY = getattr(os, "O_BINARY", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)

_live: set[str] = set()  # temporaries this process is writing right now
_live_lock = threading.Lock()


_NAME_MAX = 255  # bytes in one file name (Linux, macOS; NTFS counts 255 characters)


def _stem(target: str) -> str:
    """What ``target``'s temporaries are named after: its name, or for a name too long to take the temporary's
    18 more bytes, its start and a digest of the whole (unique to it, the same in every process)."""
    name = os.path.basename(target)
    if len(f".{name}.{'0' * _TOKEN_HEX}.tmp".encode("utf-8", "surrogateescape")) <= _NAME_MAX:  # (as os.fsencode)
        return name
    digest = hashlib.sha1(name.encode("utf-8", "surrogateescape")).hexdigest()[:16]
    start = name.encode("utf-8", "surrogateescape")[: _NAME_MAX - 64].decode("utf-8", "ignore")
    return f"{start}~{digest}"


def not_a_file(target: str) -> str | None:
    """What ``target`` is where it is neither a regular file nor a folder (``"a FIFO"``), else None: an atomic
    write's rename over its path would delete it (``/dev/null`` replaced by a checkpoint)."""
    try:
        mode = os.stat(target).st_mode
    except OSError:
        return None
    for test, kind in (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return kind
    return None


def read_only(target: str) -> str | None:
    """Why the file ``target`` may not be replaced, else None: with no write bit it was made read-only on purpose,
    and an atomic write's rename would replace it anyway."""
    try:
        mode = os.stat(target).st_mode
    except OSError:
        return None
    if mode & 0o222:
        return None
    return f"{target} is read-only (mode {stat.S_IMODE(mode):o}); make it writable to replace it"


def keep_mode(tmp: str, target: str) -> None:
    """Give the temporary ``tmp`` the permissions of the file ``target`` it will replace, if any (0600 stays
    private)."""
    with contextlib.suppress(FileNotFoundError):
        os.chmod(tmp, stat.S_IMODE(os.stat(target).st_mode))


def temp_pattern(target: str) -> re.Pattern[str]:
    """The names of ``target``'s temporaries (and of no other destination's: the token is exactly 12 hex)."""
    return re.compile(rf"\.{re.escape(_stem(target))}\.[0-9a-f]{{{_TOKEN_HEX}}}\.tmp")


def temp_name(target: str) -> str:
    """A new path for a temporary of ``target`` (a file or a folder), in its folder: hidden, named after it."""
    return os.path.join(os.path.dirname(target), f".{_stem(target)}.{secrets.token_hex(_TOKEN_HEX // 2)}.tmp")


def create_temp(target: str, made: dict[str, int]) -> tuple[int, str]:
    """A new temporary ``(fd, path)`` for ``target`` in its folder, open for writing (mode 0o666 under the umask)
    and locked; both go into ``made`` (path: descriptor) in one step once complete, its owner's from then on (a
    Ctrl-C before this returns included), handed to :func:`drop_temps` once renamed or failed."""
    for _ in range(100):
        fd = -1
        path = temp_name(target)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_BINARY, 0o666)
            if fcntl is None or _locked(fd, path):
                with _live_lock:
                    _live.add(path)
                made[path] = fd  # (the caller's from here on, the descriptor with the file)
                return fd, path
            closing, fd = fd, -1  # (not closed twice below, whichever side of the close a Ctrl-C lands)
            os.close(closing)
            _unlink(path)
        except BaseException as e:
            if path in made:  # (a Ctrl-C once it was handed over: the caller's cleanup removes it)
                raise
            if fd >= 0:
                os.close(fd)
            # (os.open's own error made nothing; anything else, a Ctrl-C landing as os.open returned, before its
            # descriptor was kept, included, may leave the file: the locked one would stay, never swept while
            # this process lives)
            if fd >= 0 or not isinstance(e, OSError):
                _unlink(path)
            release_temp(path)
            raise
    # (a sweep would have to win a hundred races in a row)
    raise OSError(f"could not create a temporary file next to {target} (a hundred names taken)")


def _locked(fd: int, path: str) -> bool:
    """Whether this writer holds the lock on its new temporary ``fd`` at ``path``: False where a sweep holds it,
    or locked, removed and released it between the open and this lock (try another name)."""
    assert fcntl is not None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
        return False  # removed by a sweep
    except OSError as e:
        if e.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):  # a sweep holds it
            return False
        raise


def release_temp(path: str) -> None:
    """``path`` (from :func:`create_temp`) is no longer being written: renamed over its target or removed."""
    with _live_lock:
        _live.discard(path)


def drop_temps(made: dict[str, int]) -> None:
    """The end of ``made``'s temporaries (from :func:`create_temp`): each removed where not renamed, its descriptor
    closed (its lock with it) and released; a Ctrl-C is held until all are done (none left open or marked live),
    one landing before the hold is taken once they are (each taken out of ``made``: none closed twice)."""
    try:
        with uninterrupted(to_the_end=False):
            _drop(made)
    finally:
        _drop(made)


def _drop(made: dict[str, int]) -> None:
    while made:
        path, fd = made.popitem()
        _unlink(path)  # (while locked: a sweep leaves it to us; renamed, nothing is there)
        with contextlib.suppress(OSError):
            os.close(fd)
        release_temp(path)


def _listed(folder: str | os.PathLike[str], accept: Callable[[str], object]) -> list[str]:
    """The paths of the entries of ``folder`` whose names ``accept`` takes (none if it cannot be listed)."""
    try:
        return [os.path.join(folder, name) for name in os.listdir(folder) if accept(name)]
    except OSError:
        return []


def sweep(target: str) -> None:
    """Remove the temporaries of ``target`` whose writer is gone. Never raises."""
    for path in _listed(os.path.dirname(target), temp_pattern(target).fullmatch):
        with _live_lock:
            live = path in _live
        if not live:
            _remove_if_abandoned(path, stat.S_ISREG, _unlink)


def _remove_if_abandoned(path: str, kind: Callable[[int], bool], remove: Callable[[str], object]) -> bool:
    """Remove the temporary ``path`` (of the ``kind`` a ``stat`` test takes, not a link) if no writer holds its
    lock, and it is still the one locked; whether it did."""
    if fcntl is None:  # Windows: a file still open in its writer cannot be removed
        remove(path)
        return True
    try:
        fd = os.open(path, os.O_RDONLY | _O_NOFOLLOW | _O_BINARY)
    except OSError:
        return False  # gone already, a symlink, or not ours to open
    try:
        st = os.fstat(fd)
        if not kind(st.st_mode) or not _abandoned(fd):
            return False  # not of its kind, or its writer holds the lock: still being written
        with contextlib.suppress(OSError):
            if os.path.samestat(st, os.stat(path)):
                remove(path)
                return True
        return False
    finally:
        os.close(fd)


def _abandoned(fd: int) -> bool:
    """Whether no process holds the writer's lock on the open file or folder ``fd`` (taking it ourselves: the
    kernel drops a writer's lock when it dies, however it dies)."""
    assert fcntl is not None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    return True


def make_folder(folder: str | os.PathLike[str]) -> int | None:
    """Create the temporary folder ``folder`` and take its writer's lock (:func:`lock_folder`), made again if a
    sweep removed it between the two (the gap ``create_temp`` closes for files); the descriptor, to close once
    the folder is committed or removed."""
    for _ in range(100):
        os.mkdir(folder)
        fd = lock_folder(folder)
        if fd is None:
            return None
        try:
            if os.path.samestat(os.fstat(fd), os.stat(folder)):
                return fd
        except FileNotFoundError:
            pass  # swept before our lock: make it again
        os.close(fd)
    raise OSError(f"could not create the temporary folder {folder}")  # pragma: no cover - a hundred lost races


def lock_folder(folder: str | os.PathLike[str]) -> int | None:
    """An open descriptor holding the writer's lock on ``folder`` (released when closed, or when the process
    dies): what keeps :func:`sweep_folders` off a live writer's temporary folder. None where folders cannot be
    opened; where locks are unsupported the folder is merely not protected."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return None
    if fcntl is not None:
        _abandoned(fd)  # (taken: ours now)
    return fd


def sweep_folders(parent: str | os.PathLike[str], is_temp: Callable[[str], bool]) -> int:
    """Remove the temporary folders in ``parent`` (names ``is_temp`` accepts) whose writer is gone: no process
    holds their lock; returns how many. A live writer's is left alone, and so is everything without locks."""
    if fcntl is None:
        return 0
    remove = functools.partial(shutil.rmtree, ignore_errors=True)
    return sum(_remove_if_abandoned(path, stat.S_ISDIR, remove) for path in _listed(parent, is_temp))


def commit_folder(
    tmp: str | os.PathLike[str],
    target: str | os.PathLike[str],
    old: str | os.PathLike[str],
    replaceable: Callable[[str | os.PathLike[str]], bool],
) -> None:
    """Put the complete folder ``tmp`` at ``target``: a rename, an atomic exchange with a folder there where the
    kernel can, else two renames (a crash between them leaves the previous one at ``old``, which goes once the
    commit is durable), and nothing raises after; ``replaceable``: whether a folder that appeared at ``target``
    since the caller checked may be replaced."""
    parent = os.path.dirname(os.path.abspath(target))
    renamed = False
    if not os.path.lexists(target):
        try:
            os.rename(tmp, target)
            renamed = True
        except OSError as e:  # (another commit put a folder there since: replaced as below, the last one wins)
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST) or not os.path.lexists(target):
                raise
            if not replaceable(target):
                raise FileExistsError(
                    e.errno, f"{target} appeared while this folder was written, and is not one it may replace", target
                ) from None
    if not renamed and exchange(tmp, target):
        shutil.rmtree(tmp, ignore_errors=True)  # it now holds the previous folder
    elif not renamed:
        shutil.rmtree(old, ignore_errors=True)
        os.rename(target, old)
        os.rename(tmp, target)
    fsync_dir(parent)
    # (a crashed two-rename commit's leftover, or this one's: its removal durable too, else a power loss brings
    # it back, read once ``target`` goes)
    shutil.rmtree(old, ignore_errors=True)
    fsync_dir(parent)


def exchange(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> bool:
    """Swap two paths atomically (Linux ``renameat2(RENAME_EXCHANGE)``); False where that is unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # glibc < 2.28, musl
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    renameat2.restype = ctypes.c_int
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False  # the kernel or this filesystem cannot exchange
    raise OSError(code, os.strerror(code), os.fspath(b))


def _unlink(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def fsync_dir(folder: str | os.PathLike[str]) -> None:
    """Make the rename durable (POSIX); a no-op where folders cannot be opened (Windows)."""
    try:
        dfd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):
            os.fsync(dfd)
    finally:
        os.close(dfd)

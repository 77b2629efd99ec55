"""A simulated accelerator ("sim") with real values, for testing device moves on CPU-only machines.

``simulated_accelerator(index)`` turns PyTorch's PrivateUse1 backend into a device called
``"sim"`` with two indices (``sim:0`` and ``sim:1``), implemented entirely in Python: every
sim tensor is backed by an ordinary CPU tensor that holds its values, and every operator on
sim tensors runs on those CPU tensors. Code under test sees tensors whose ``.device`` is
``sim:N``, so it has to move optimizer state, steps and parameters exactly as it would for
CUDA, and it fails the same way when it forgets to.

What it enforces (each violation raises ``RuntimeError``, as CUDA does):

1. An operator may not mix a sim tensor with a CPU tensor that has one or more dimensions
   ("Expected all tensors to be on the same device, but found at least two devices, sim:0
   and cpu!"). 0-dim CPU tensors are accepted as inputs, as CUDA accepts them (but a device
   op may not write into a CPU tensor; ``fill_`` of one from a 0-dim device value reads the
   value with ``.item()`` first, as ATen does). Copies (``copy_``, ``_copy_from``, ``_to_copy``,
   ``_foreach_copy_``...) may cross devices, and the index tensors of indexing ops may stay
   on the CPU, as on CUDA.
2. A fused optimizer kernel (``aten::_fused_*``, e.g. ``_fused_adam_``, ``_fused_adamw_``,
   ``_fused_sgd_``, ``_fused_adagrad_``) may not receive any CPU tensor, not even a 0-dim
   one: CUDA's fused kernels reject a CPU ``step``. The one exception is ``lr``, which may be
   a one-element CPU tensor: CUDA's kernels read a host ``lr`` with ``.item()``.
3. An operator other than a copy may not mix ``sim:0`` and ``sim:1`` tensors.

(PyTorch itself already rejects some of these mixes before the simulator sees them, with the
same message; the simulator's own checks cover the rest, e.g. a CPU ``step`` in a fused op.)

``.item()`` (and anything else that reads a value on the host) goes through
``aten::_local_scalar_dense``, so a ``TorchDispatchMode`` can count host syncs exactly as on
CUDA. ``torch.optim`` treats "sim" like CUDA: it is in the foreach, fused and capturable
device lists (they include the PrivateUse1 backend's name), so ``Adam(fused=True)``,
``Adam(capturable=True)`` and the default foreach paths really run on sim, and a default
(non-capturable, non-fused) Adam keeps its ``step`` on the CPU, as on CUDA.

Limits, honestly:

* It is slow: every operator goes through Python and every result is wrapped through
  DLPack plumbing (tens of microseconds per op). Fine for unit tests on small models.
* It is not a real CUDA. Streams and events exist (``torch.sim.Stream``, ``torch.sim.Event``,
  ``torch.sim.stream``: see :mod:`optimshift.testing._sim_streams`): the default stream runs
  every op at once, work on any other stream is deferred until something orders it, and
  races between streams raise. There is no pinned memory (a
  ``non_blocking`` copy to the CPU returns an ordinary tensor; ``pin_memory()`` and
  ``pin_memory=True`` raise ``NotImplementedError`` once the simulator is set up, because
  PyTorch then asks the sim backend for a pinned allocator), random ops use the CPU's
  default generator (``torch.randn(..., device=sim)`` gives the CPU's values, there is no
  per-device generator), there is no caching allocator, and numerics are the CPU kernels'.
* PyTorch's C++ device guard for a Python backend always reports device 0 and a device
  count of 1. Python-level queries (``torch.sim.device_count()``, ``current_device()``) say
  2 and whatever ``torch.sim.set_device`` chose on the calling thread (per thread, as CUDA's), but C++ only
  ever sees device 0; the
  autograd engine's per-device worker threads are the visible consequence, see below.
* ``torch.autocast("sim")`` is accepted but casts nothing (CUDA's autocast op lists are
  C++ registrations a Python backend cannot reuse).
* Sparse, quantized and nested tensors, custom generators and CUDA-graph capture on sim are
  not supported. Conjugate and negative views of sim tensors (``x.conj()``) copy, and PyTorch resolves
  them for most ops, but ops that take them as they are (``mm``, ``dot``, ...) refuse them: use
  ``x.conj_physical()``.
* FakeTensorMode on fake ``cuda`` tensors breaks once this backend is registered (it then treats
  device initialization as allowed and reaches for real CUDA kernels when building fake cuda
  tensors from host scalars): run fake-cuda code before calling ``simulated_accelerator()``.

Global side effects, once per process (the first call to ``simulated_accelerator``; merely
importing ``optimshift.testing`` sets nothing up):

* PrivateUse1 is renamed to ``"sim"`` (PyTorch allows one rename per process, so a process
  that uses another PrivateUse1 backend cannot use this one); ``torch.sim`` becomes the
  backend module; ``Tensor.sim()``, ``Tensor.is_sim``, ``Module.sim()`` and storage
  methods appear; ``torch.accelerator.is_available()`` becomes true and reports "sim".
* ``torch.__future__.set_swap_module_params_on_conversion(True)`` is switched on so that
  ``module.to(sim)`` keeps each ``Parameter`` object's identity (its contents are swapped
  in place), as ``module.to("cuda")`` does. This changes ``module.to()`` for every device.
* Autograd multithreading is switched off *for the thread that sets the simulator up*
  (``torch.autograd.set_multithreading_enabled(False)``): the engine sizes its device
  queues from the C++ guard's device count (1), so backward through ``sim:1`` tensors on a
  multithreaded engine hits an internal assert. Device backward then runs on the calling
  thread. Other threads that run backward on ``sim:1`` must switch it off themselves.
* ``torch.UntypedStorage.__new__`` is wrapped so that ``torch.UntypedStorage(n,
  device="sim:N")`` works: a Python backend cannot register a C++ allocator, and without
  one PyTorch dereferences a null allocator (segfault) in ``copy.deepcopy`` of a sim
  tensor, ``storage.to(sim)`` and ``torch.load(..., map_location=sim)``. Other devices go
  straight to the original constructor.
* ``torch.UntypedStorage.resize_`` is wrapped so that a sim storage can be resized (``resize_(0)`` frees its
  memory, ``resize_(n)`` allocates it again, the bytes kept copied, as on CUDA): PyTorch asks a
  PrivateUse1 hook that Python cannot provide. Other devices go straight to the original.
* ``torch.Tensor.new_tensor`` is wrapped to pass a sim tensor's own device when none is given:
  PyTorch makes the new tensor on the device its C++ guard reports (always ``sim:0``).
* ``torch.accelerator.empty_cache()``, ``empty_host_cache()``, ``memory_stats()`` (and what is
  built on it: ``memory_allocated()``, ...) and the ``reset_*_stats()`` answer, while the sim is
  the current accelerator, as for an allocator not yet in use: nothing to empty, no statistics
  (without this PyTorch fails an internal assert, or segfaults, for a backend with no C++
  allocator). ``get_memory_info()`` still fails that assert: the sim has no total memory to
  report. Other accelerators are asked as before.
* A boxed fallback and a few kernels are registered for the PrivateUse1 dispatch key, and a
  ``_copy_from`` kernel for the Conjugate and Negative keys (see ``_copy_from_math_bits``).

How it works: a sim tensor is an ordinary ``torch.Tensor`` of device ``sim:N`` whose storage
was created through DLPack (device type ``kDLExtDev``, which PyTorch imports as
PrivateUse1) over the memory of a whole CPU storage; that CPU storage is the *backing* of
the sim storage and lives exactly as long as it. The CPU view of a sim tensor has the same
size, stride and storage offset over the backing storage as the sim tensor has over its own
storage, so views that PyTorch builds on the device tensor itself (``as_strided`` in device
coordinates, as autograd does through transposes) alias exactly the right values. View ops
run their CPU kernels directly on the sim tensor (they only build metadata over ``self``'s
storage); everything else runs on the backing tensors and its results are wrapped back.
"""

from __future__ import annotations

import ctypes
import functools
import math
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = [
    "SIM_DEVICE_TYPE",
    "simulated_accelerator",
    "simulated_memory_allocated",
]

SIM_DEVICE_TYPE = "sim"
_NUM_DEVICES = 2

_setup_lock = threading.Lock()
_is_setup = False


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------


def simulated_accelerator(index: int = 0) -> torch.device:
    """Set up the simulated ``"sim"`` accelerator (once per process) and return ``sim:index``.

    Idempotent and thread-safe; later calls only return the device. The first call has
    process-wide side effects (the module docstring lists them all): PrivateUse1 is renamed
    to ``"sim"``; ``torch.__future__.set_swap_module_params_on_conversion(True)`` is switched
    on, so that ``module.to(device)`` keeps ``Parameter`` identity, as on CUDA; autograd
    multithreading is switched off for the calling thread (needed for backward on
    ``sim:1``); ``torch.UntypedStorage(n, device="sim")`` is made to work.

    Two devices exist, ``sim:0`` and ``sim:1``; copies between them are allowed, other
    ops mixing them raise, as on CUDA.

    Raises:
        ValueError: ``index`` is not 0 or 1.
        RuntimeError: PrivateUse1 was already renamed to another backend in this process, or
            this PyTorch lacks the Python PrivateUse1 hooks this simulator is built on.
    """
    if isinstance(index, bool) or not isinstance(index, int):
        raise TypeError(f"simulated_accelerator index must be an int, got {index!r}")
    if not 0 <= index < _NUM_DEVICES:
        raise ValueError(
            f"simulated accelerator index {index} out of range: the simulated "
            f"'{SIM_DEVICE_TYPE}' backend has {_NUM_DEVICES} devices "
            f"({', '.join(f'{SIM_DEVICE_TYPE}:{i}' for i in range(_NUM_DEVICES))})"
        )
    _ensure_setup()
    return torch.device(SIM_DEVICE_TYPE, index)


def simulated_memory_allocated(index: int | str | torch.device = 0) -> int:
    """Bytes of live backing storage on simulated device ``sim:index`` (an index, or the device, as
    ``torch.cuda.memory_allocated`` takes).

    Counts every storage allocated on that device (parameters, optimizer state, temporaries)
    until the last tensor using it is freed, and the mapped bytes of reserved ranges (state kept at
    fixed addresses, ``offload(keep_addresses=True)``) while they are mapped, not their tensors.
    Freed storages are subtracted as soon as CPython frees them; call ``gc.collect()`` first if
    reference cycles may hold tensors.
    Returns 0 if the backend was never set up.
    """
    if isinstance(index, (str, torch.device)):
        try:
            device = torch.device(index)
        except RuntimeError as e:
            raise ValueError(f"simulated_memory_allocated: {index!r} is not a device") from e
        if device.type != SIM_DEVICE_TYPE:
            raise ValueError(f"simulated_memory_allocated: {device} is not a simulated device ({SIM_DEVICE_TYPE})")
        # (no index: the current device, as torch's own)
        index = getattr(torch, SIM_DEVICE_TYPE).current_device() if device.index is None else device.index
    if isinstance(index, bool) or not isinstance(index, int):
        raise TypeError(f"device index must be an int or a {SIM_DEVICE_TYPE} device, got {index!r}")
    if not 0 <= index < _NUM_DEVICES:
        raise ValueError(f"simulated accelerator index {index} out of range (0..{_NUM_DEVICES - 1})")
    with _registry_lock:
        return _allocated[index]


# --------------------------------------------------------------------------------------------
# Backing storage registry
# --------------------------------------------------------------------------------------------
#
# Every sim storage is a DLPack import of a whole CPU storage, so its data pointer *is* the
# backing storage's data pointer. The registry maps that pointer to a weak reference to the
# backing CPU storage. The sim storage owns the backing (through the DLPack manager), and
# PyTorch keeps a storage's Python object alive as long as the storage itself, so the weak
# reference dies exactly when the last sim tensor on that storage is freed; its callback
# removes the entry and updates the per-device byte counter. Keys cannot be confused while
# an entry is alive: the backing memory cannot be reused while the backing storage lives.


class _Entry:
    __slots__ = ("ref", "nbytes", "index", "counted", "guard", "below")

    def __init__(
        self,
        ref: weakref.ref[torch.UntypedStorage],
        nbytes: int,
        index: int,
        counted: bool = True,
        guard: Callable[[], None] | None = None,
    ) -> None:
        self.ref = ref
        self.nbytes = nbytes
        self.index = index
        self.counted = counted  # counted in simulated_memory_allocated (mapped ranges count their mappings)
        self.guard = guard  # raises if the memory is not mapped now (a storage over a reserved range)
        self.below: _Entry | None = None  # another storage over the same mapped memory, still alive


class _State:
    """Process-wide simulator state, kept on ``torch.sim`` once set up.

    A second copy of this module (``importlib.reload``, or the package imported under two
    names) picks it up again at import instead of starting empty, since the kernels that
    PyTorch calls belong to whichever copy did the setup.
    """

    def __init__(self) -> None:
        self.lock = threading.RLock()  # reentrant: a GC pass inside may run _unregister
        self.registry: dict[int, _Entry] = {}
        self.allocated = [0] * _NUM_DEVICES
        self.local = threading.local()  # .device: this thread's current device, as CUDA's is per thread

    @property
    def current_device(self) -> int:
        return getattr(self.local, "device", 0)

    @current_device.setter
    def current_device(self, index: int) -> None:
        self.local.device = index


# Reading torch.sim sets nothing up; it only finds the state of an earlier setup.
_state: _State = getattr(getattr(torch, SIM_DEVICE_TYPE, None), "_optimshift_state", None) or _State()
_registry_lock = _state.lock
_registry = _state.registry
_allocated = _state.allocated


def _unregister(key: int, ref: weakref.ref[torch.UntypedStorage]) -> None:
    with _registry_lock:
        entry = _registry.get(key)
        if entry is not None and entry.ref is not ref:  # (a storage over mapped memory that another covers)
            while entry.below is not None and entry.below.ref is not ref:
                entry = entry.below
            if entry.below is not None:
                entry.below = entry.below.below
            return
        if entry is not None and entry.ref is ref:
            if entry.below is not None:  # another storage over the same mapped memory takes its place
                _registry[key] = entry.below
                return
            del _registry[key]
            counted = entry.nbytes if entry.counted else 0
            _allocated[entry.index] -= counted
            if _deferred is not None:
                _deferred.on_free(key, counted)


def _register(
    storage: torch.UntypedStorage, index: int, counted: bool = True, guard: Callable[[], None] | None = None
) -> None:
    key = storage.data_ptr()
    nbytes = storage.nbytes()

    def gone(ref: weakref.ref[torch.UntypedStorage], key: int = key) -> None:
        _unregister(key, ref)

    ref = weakref.ref(storage, gone)
    entry = _Entry(ref, nbytes, index, counted, guard)
    with _registry_lock:
        old = _registry.get(key)
        if old is not None and not old.counted and not counted and old.ref() is not None:
            entry.below = old  # (two storages over one mapped memory: a view held across a reload)
        elif old is not None and old.counted:
            _allocated[old.index] -= old.nbytes
        _registry[key] = entry
        if counted:
            _allocated[index] += nbytes
    if _deferred is not None:
        _deferred.on_alloc(key, index, nbytes if counted else 0)


def _wrap_mapped(cpu: torch.Tensor, index: int, guard: Callable[[], None]) -> torch.Tensor:
    """A flat uint8 ``sim:index`` tensor over ``cpu``'s memory (mapped pages of a reserved host range: see
    :mod:`optimshift.testing._sim_vmm`): not counted as an allocation (the mapping is), and every op that reaches
    its memory calls ``guard`` first, which raises where the memory is not mapped, as an illegal address would."""
    return _new_sim_storage_root(cpu.untyped_storage(), index, counted=False, guard=guard)


def _guard_of(t: Any) -> Callable[[], None] | None:
    """The guard of a sim tensor over a reserved range's memory (see :func:`_wrap_mapped`), else None."""
    if not _is_sim(t):
        return None
    # (the storage's data pointer, without making a Python storage object, which torch would keep)
    entry = _registry.get(t.data_ptr() - t.storage_offset() * t.element_size())
    return None if entry is None else entry.guard


def _count_mapped(index: int, nbytes: int) -> None:
    """``nbytes`` of a reserved range were mapped (negative: unmapped) on ``sim:index``."""
    with _registry_lock:
        _allocated[index] += nbytes


def _lookup(key: int) -> torch.UntypedStorage | None:
    entry = _registry.get(key)
    return None if entry is None else entry.ref()


# --------------------------------------------------------------------------------------------
# DLPack plumbing: give a CPU storage a sim twin
# --------------------------------------------------------------------------------------------

_KDL_EXT_DEV = 12  # DLPack's kDLExtDev; PyTorch imports it as PrivateUse1


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [
        ("dl_tensor", _DLTensor),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
    ]


_capsule_get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_get_pointer.restype = ctypes.c_void_p
_capsule_get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


def _new_sim_storage_root(
    storage: torch.UntypedStorage, index: int, *, counted: bool = True, guard: Callable[[], None] | None = None
) -> torch.Tensor:
    """Return a flat uint8 sim tensor covering all of ``storage`` (a CPU storage).

    PyTorch exports a flat byte view of the CPU storage as a legacy DLPack capsule whose
    deleter (PyTorch's own, in C++) keeps that view alive; we retarget the capsule to
    ``kDLExtDev:index`` and import it, which yields a PrivateUse1 tensor on ``sim:index``
    whose storage owns the CPU storage. No Python code runs when it is freed except the
    registry's weakref callback.
    """
    flat = torch.empty(0, dtype=torch.uint8).set_(storage)
    capsule = torch._C._to_dlpack(flat)
    del flat
    managed = _DLManagedTensor.from_address(_capsule_get_pointer(capsule, b"dltensor"))
    managed.dl_tensor.device.device_type = _KDL_EXT_DEV
    managed.dl_tensor.device.device_id = index
    root = torch._C._from_dlpack(capsule)
    if root.device != torch.device(SIM_DEVICE_TYPE, index):  # pragma: no cover - torch change
        raise RuntimeError(
            f"simulated accelerator: DLPack import produced {root.device}, expected "
            f"{SIM_DEVICE_TYPE}:{index}; this PyTorch does not map kDLExtDev to PrivateUse1"
        )
    if storage.nbytes() > 0:
        _register(storage, index, counted, guard)
    return root


# --------------------------------------------------------------------------------------------
# Moving between sim tensors and their CPU backing
# --------------------------------------------------------------------------------------------

_CPU_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
_aten = torch.ops.aten


def _on_cpu_kernel(op: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
    """Call ``op``'s CPU kernel directly on sim tensors.

    Only for kernels that touch metadata, never data (views, set_, resize_ within capacity):
    those build the result from ``self``'s storage and dispatch keys, so applied to a sim
    tensor they give a sim tensor sharing its storage.
    """
    result: torch.Tensor = op.redispatch(_CPU_KEYS, *args, **kwargs)  # every such kernel returns a tensor
    return result


def _is_sim(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.device.type == SIM_DEVICE_TYPE


def _backing(t: torch.Tensor) -> torch.Tensor:
    """The CPU tensor holding ``t``'s values: same size/stride/offset over the backing storage."""
    st = t.untyped_storage()
    storage: torch.UntypedStorage | None
    if st.nbytes() == 0:
        if t.numel():  # (its storage resized to 0: CUDA's check)
            raise RuntimeError(
                "The tensor has a non-zero number of elements, but its data is not allocated yet "
                f"(simulated accelerator: a {t.device} tensor whose storage was resized to 0 bytes)"
            )
        storage = torch.UntypedStorage(0)  # type: ignore[no-untyped-call]  # unannotated in torch
    else:
        entry = _registry.get(st.data_ptr())
        storage = None if entry is None else entry.ref()
        if storage is None:  # pragma: no cover - would be a bug in this module
            raise RuntimeError(f"simulated accelerator: {t.device} tensor has no backing storage")
        if entry is not None and entry.guard is not None:
            entry.guard()  # (memory of a reserved range: raises where it is not mapped)
    cpu = torch.empty(0, dtype=t.dtype).set_(storage, t.storage_offset(), t.size(), t.stride())
    if t.is_conj():
        cpu = torch._conj(cpu)
    if t.is_neg():
        cpu = torch._neg_view(cpu)
    return cpu


def _sim_view(base: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A sim tensor on ``base``'s storage with ``like``'s dtype, size, stride and offset."""
    if base.dtype != like.dtype:
        # Re-type through an empty view: view.dtype on a 0-element tensor always succeeds.
        base = _on_cpu_kernel(_aten.as_strided.default, base, (0,), (1,), 0)
        base = _on_cpu_kernel(_aten.view.dtype, base, like.dtype)
    return _on_cpu_kernel(_aten.as_strided.default, base, like.size(), like.stride(), like.storage_offset())


def _wrap_fresh(cpu: torch.Tensor, index: int, roots: dict[int, torch.Tensor]) -> torch.Tensor:
    """Put a freshly computed CPU tensor on ``sim:index`` (its storage becomes a backing)."""
    st = cpu.untyped_storage()
    key = st.data_ptr()
    if st.nbytes() == 0:
        root = _new_sim_storage_root(st, index)
    elif key in roots:  # several outputs of one op sharing one new storage
        root = roots[key]
    else:
        if _lookup(key) is not None:
            # The CPU kernel returned memory that already backs some other sim storage (it
            # was not one of this op's inputs): give the result its own memory.
            cpu = cpu.clone()
            st = cpu.untyped_storage()
            key = st.data_ptr()
        root = roots[key] = _new_sim_storage_root(st, index)
    return _sim_view(root, cpu)


# --------------------------------------------------------------------------------------------
# Device rules
# --------------------------------------------------------------------------------------------

# Operators allowed to take tensors on several devices (sim:0, sim:1 and CPU at once).
_COPY_OPS = frozenset(
    {
        "aten::copy_",
        "aten::copy",
        "aten::_copy_from",
        "aten::_copy_from_and_resize",
        "aten::_to_copy",
        "aten::_foreach_copy_",
        "aten::_foreach_copy",
        "aten::lift_fresh_copy",
    }
)
# Indexing ops whose ``indices`` may live on the CPU (CUDA moves them to the device).
_INDEX_OPS = frozenset({"aten::index", "aten::index_put_", "aten::index_put", "aten::_index_put_impl_"})


# Arguments of fused optimizer kernels that may be a one-element host tensor: CUDA's (and XPU's, MPS's) kernels
# check `lr.is_cpu()` and then read it with `lr.item()` (no device sync: it is on the host). Everything else
# must be on the params' device (a host `step` is refused).
_FUSED_HOST_ARGS = frozenset({"lr"})

_schema_args: dict[Any, dict[str, Any]] = {}  # op -> {argument name: schema argument}


def _iter_tensors(x: Any) -> Iterator[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _iter_tensors(y)


def _check_devices(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    """Enforce the device rules for ``op``; return the sim index of its tensor inputs, if any."""
    name = op._schema.name
    skip_indices = name in _INDEX_OPS
    sim_indices: list[int] = []
    cpu_tensor: torch.Tensor | None = None
    cpu_scalar: torch.Tensor | None = None
    other: torch.Tensor | None = None

    cpu_written: torch.Tensor | None = None  # a CPU tensor the op would write into

    schema_args = _schema_args.get(op)
    if schema_args is None:
        schema_args = _schema_args[op] = {a.name: a for a in op._schema.arguments}
    named = list(zip(schema_args, args)) + list(kwargs.items())
    fused = name.startswith("aten::_fused_")
    for arg_name, value in named:
        if skip_indices and arg_name == "indices":
            continue
        schema_arg = schema_args.get(arg_name)
        written = schema_arg is not None and schema_arg.alias_info is not None and schema_arg.alias_info.is_write
        host_scalar_ok = fused and arg_name in _FUSED_HOST_ARGS
        for t in _iter_tensors(value):
            dev = t.device
            if host_scalar_ok and dev.type == "cpu" and t.numel() == 1:
                continue  # read with .item() on the host, as CUDA's fused kernels do
            if dev.type == SIM_DEVICE_TYPE:
                if dev.index not in sim_indices:
                    sim_indices.append(dev.index)
            elif dev.type == "cpu":
                if t.dim() == 0:
                    cpu_scalar = t
                else:
                    cpu_tensor = t
                if written:
                    cpu_written = t
            else:
                other = t

    first = f"{SIM_DEVICE_TYPE}:{sim_indices[0]}" if sim_indices else None
    if name in _COPY_OPS:
        return sim_indices[0] if sim_indices else None
    if len(sim_indices) > 1:
        raise RuntimeError(
            "Expected all tensors to be on the same device, but found at least two devices, "
            f"{SIM_DEVICE_TYPE}:{sim_indices[0]} and {SIM_DEVICE_TYPE}:{sim_indices[1]}! "
            f"(simulated accelerator, in {name})"
        )
    if fused and (cpu_tensor is not None or cpu_scalar is not None):
        bad = cpu_tensor if cpu_tensor is not None else cpu_scalar
        assert bad is not None  # (one of the two is set)
        raise RuntimeError(
            f"{name}: all tensors must be on the device of the params ({first}), but found a "
            f"CPU tensor of shape {tuple(bad.shape)} (simulated accelerator: fused kernels "
            "reject CPU tensors, even 0-dim ones such as a CPU `step`, as CUDA does)"
        )
    if other is not None and first is not None:
        raise RuntimeError(
            "Expected all tensors to be on the same device, but found at least two devices, "
            f"{first} and {other.device}! (simulated accelerator, in {name})"
        )
    if cpu_written is not None and first is not None:
        raise RuntimeError(
            "Expected all tensors to be on the same device, but found at least two devices, "
            f"{first} and cpu! (simulated accelerator, in {name}: a device op cannot write "
            "into a CPU tensor, not even a 0-dim one)"
        )
    if cpu_tensor is not None and first is not None:
        raise RuntimeError(
            "Expected all tensors to be on the same device, but found at least two devices, "
            f"{first} and cpu! (simulated accelerator, in {name}: only 0-dim CPU tensors may "
            "be mixed with device tensors)"
        )
    return sim_indices[0] if sim_indices else None


# --------------------------------------------------------------------------------------------
# The fallback: run any operator on the CPU backing tensors
# --------------------------------------------------------------------------------------------


def _current_index() -> int:
    return _backend_module.current_device()


def _sim_index_of(device: Any) -> int | None:
    if device is None:
        return None
    device = torch.device(device)
    if device.type != SIM_DEVICE_TYPE:
        return None
    index = _current_index() if device.index is None else device.index
    if not 0 <= index < _NUM_DEVICES:
        raise RuntimeError(
            f"Invalid device {device}: the simulated '{SIM_DEVICE_TYPE}' backend has {_NUM_DEVICES} devices"
        )
    return index


def _fallback(op: Any, *args: Any, **kwargs: Any) -> Any:
    if op is _FILL_TENSOR:
        self, value = args[0], args[1] if len(args) > 1 else kwargs["value"]
        if value.dim() == 0 and self.device != value.device:
            # ATen's fill_(Tensor) takes a value on another device as value.item() (CUDA's too): a host 0-dim
            # tensor filled from a device value, as an LR scheduler fills a host tensor lr from device base_lrs,
            # costs a host sync and is no device op writing into a CPU tensor. Both run as they do there: the
            # read of the value (ordered, counted), then a fill with a Python number.
            return self.fill_(value.item())
    # (record_stream has no kernel to run on the backing: the streams take it, in use or not)
    if _deferred is not None and (_deferred._state.tracking or op is _RECORD_STREAM):  # see _sim_streams
        return _deferred.dispatch(op, args, kwargs, _fallback_now)
    return _fallback_now(op, *args, **kwargs)


_FILL_TENSOR = _aten.fill_.Tensor
_RECORD_STREAM = _aten.record_stream.default


def _fallback_now(op: Any, *args: Any, **kwargs: Any) -> Any:
    special = _SPECIAL_KERNELS.get(op)
    if special is not None:
        return special(*args, **kwargs)
    return _run_on_backing(op, args, kwargs)


def _run_on_backing(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    index = _check_devices(op, args, kwargs)

    # Factory-style arguments: a ``device=sim`` runs on the CPU and decides the output device.
    if "device" in kwargs:
        dev_index = _sim_index_of(kwargs["device"])
        if dev_index is not None:
            if kwargs.get("pin_memory"):
                raise RuntimeError("Only dense CPU tensors can be pinned (simulated accelerator)")
            kwargs = dict(kwargs, device=torch.device("cpu"))
            index = dev_index
    if index is None:
        index = _current_index()

    # Unwrap sim tensors to their CPU backing, remembering which backing belongs to which.
    # (Plain module-level helpers, not recursive closures: a closure that refers to itself is
    # a reference cycle and would keep every tensor it saw alive until the next GC pass.)
    unwrapped = _Unwrapped()
    cpu_args = _unwrap(args, unwrapped)
    cpu_kwargs = {k: _unwrap(v, unwrapped) for k, v in kwargs.items()}
    out = op(*cpu_args, **cpu_kwargs)
    del cpu_args, cpu_kwargs

    # A mutated argument may have been resized by the CPU kernel (out= with a wrong shape).
    for cpu, sim in unwrapped.by_id.values():
        _sync_metadata(sim, cpu)

    return _wrap(out, index, unwrapped, {})


class _Unwrapped:
    """What ``_unwrap`` saw: needed to map a CPU kernel's results back to sim tensors."""

    __slots__ = ("by_id", "by_storage", "cpu_storages")

    def __init__(self) -> None:
        self.by_id: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(cpu) -> (cpu, sim)
        self.by_storage: dict[int, torch.Tensor] = {}  # backing data_ptr -> a sim tensor on it
        self.cpu_storages: set[int] = set()  # data_ptrs of the caller's own CPU tensors


def _unwrap(x: Any, seen: _Unwrapped) -> Any:
    if isinstance(x, torch.Tensor):
        if x.device.type != SIM_DEVICE_TYPE:
            if x.device.type == "cpu":
                seen.cpu_storages.add(x.untyped_storage().data_ptr())
            return x
        if x.is_conj() or x.is_neg():
            # A CPU kernel that takes the view as it is (mm, dot, vdot) would read the backing's lazy
            # conjugate/negation wrongly (vdot's values come out wrong): refuse with an error instead.
            raise NotImplementedError(
                "simulated accelerator: ops on conjugate or negative views (x.conj() of a complex tensor) are not "
                "supported; use x.conj_physical(), or resolve the view on the host"
            )
        cpu = _backing(x)
        seen.by_id[id(cpu)] = (cpu, x)
        st = x.untyped_storage()
        if st.nbytes():
            seen.by_storage[st.data_ptr()] = x
        return cpu
    if isinstance(x, (list, tuple)):
        return type(x)(_unwrap(y, seen) for y in x)
    return x


def _wrap(x: Any, index: int, seen: _Unwrapped, roots: dict[int, torch.Tensor]) -> Any:
    if isinstance(x, torch.Tensor):
        hit = seen.by_id.get(id(x))
        if hit is not None and hit[0] is x:
            return hit[1]  # in-place / out= result: the caller's own tensor
        if x.device.type != "cpu":
            return x
        st = x.untyped_storage()
        alias_of = seen.by_storage.get(st.data_ptr()) if st.nbytes() else None
        if alias_of is not None:
            return _sim_view(alias_of, x)  # a view of an input
        if st.nbytes() and st.data_ptr() in seen.cpu_storages:
            x = x.clone()  # never turn a caller's CPU memory into device memory
        return _wrap_fresh(x, index, roots)
    if isinstance(x, (list, tuple)):
        return type(x)(_wrap(y, index, seen, roots) for y in x)
    return x


def _sync_metadata(sim: torch.Tensor, cpu: torch.Tensor) -> None:
    """Make ``sim`` describe ``cpu`` again after a CPU kernel resized ``cpu`` in place."""
    st_cpu = cpu.untyped_storage()
    st_sim = sim.untyped_storage()
    same_storage = st_cpu.data_ptr() == st_sim.data_ptr() and st_cpu.nbytes() == st_sim.nbytes()
    if (
        same_storage
        and cpu.size() == sim.size()
        and cpu.stride() == sim.stride()
        and cpu.storage_offset() == sim.storage_offset()
    ):
        return
    if not same_storage:
        # The CPU kernel grew (reallocated) the backing storage: give it a new sim twin and
        # move ``sim`` onto it. Other views of the old sim storage lose their backing, so
        # using them raises instead of silently reading stale memory.
        old_key = st_sim.data_ptr()
        with _registry_lock:
            entry = _registry.pop(old_key, None)
            if entry is not None and entry.counted:
                _allocated[entry.index] -= entry.nbytes
        st_sim = _new_sim_storage_root(st_cpu, sim.device.index).untyped_storage()
    _on_cpu_kernel(
        _aten.set_.source_Storage_storage_offset,
        sim,
        st_sim,
        cpu.storage_offset(),
        cpu.size(),
        cpu.stride(),
    )


# --------------------------------------------------------------------------------------------
# Explicit kernels
# --------------------------------------------------------------------------------------------


def _copy_from(self: torch.Tensor, dst: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    # Reached from copy_ (and so from .to(), .cpu(), clone, ...) whenever a sim tensor is
    # involved: sim->cpu, cpu->sim, sim->sim, including sim:0 <-> sim:1.
    src = _backing(self) if _is_sim(self) else self
    dst_cpu = _backing(dst) if _is_sim(dst) else dst
    dst_cpu.copy_(src)
    return dst


def _to_copy(
    self: torch.Tensor,
    *,
    dtype: torch.dtype | None = None,
    layout: torch.layout | None = None,
    device: Any = None,
    pin_memory: bool | None = None,
    non_blocking: bool = False,
    memory_format: torch.memory_format | None = None,
) -> torch.Tensor:
    # Registered for PrivateUse1 ahead of the composite _to_copy, which would ask the (absent)
    # PrivateUse1 pinned-memory allocator for the result of a non_blocking sim->cpu copy.
    # Copies are synchronous here and results are never pinned.
    src = _backing(self) if _is_sim(self) else self
    if device is None:
        index = self.device.index if _is_sim(self) else None
    else:
        index = _sim_index_of(device)
        if index is None and torch.device(device).type != "cpu":
            raise RuntimeError(f"simulated accelerator: cannot copy a sim tensor to {device}")
    result: torch.Tensor = _aten._to_copy.default(
        src, dtype=dtype, layout=layout, device=torch.device("cpu"), memory_format=memory_format
    )
    if index is None:
        return result
    return _wrap_fresh(result, index, {})


_PAST_MATH_BITS = torch._C._dispatch_keyset_full_after(torch._C.DispatchKey.Conjugate)  # (Negative comes first)


def _copy_from_math_bits(keys: Any, self: torch.Tensor, dst: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    """``_copy_from`` of a conjugate/negative view straight to the sim kernel, whose backing views keep the bit:
    PyTorch's fallback clones the view, and a clone copies through ``_copy_from`` again (endless: a segfault)."""
    if not (_is_sim(self) or _is_sim(dst)) and (self.is_conj() or self.is_neg()):
        self = self.clone()  # (another backend's: what the fallback does)
    return _aten._copy_from.default.redispatch(keys & _PAST_MATH_BITS, self, dst, non_blocking)  # type: ignore[no-any-return]


def _copy_from_and_resize(self: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    if dst.size() != self.size():
        dst.resize_(self.size())
    return _copy_from(self, dst)


def _resize_(self: torch.Tensor, size: Any, memory_format: torch.memory_format | None = None) -> torch.Tensor:
    needed = (self.storage_offset() + math.prod(size)) * self.element_size()
    st = self.untyped_storage()
    if needed > st.nbytes():
        # Grow: new backing with the old bytes, then point ``self`` at its sim twin.
        new = torch.empty(needed, dtype=torch.uint8)
        if st.nbytes():
            backing = _lookup(st.data_ptr())
            if backing is None:  # pragma: no cover - would be a bug in this module
                raise RuntimeError(f"simulated accelerator: {self.device} tensor has no backing storage")
            old = torch.empty(0, dtype=torch.uint8).set_(backing)
            new[: st.nbytes()].copy_(old)
        root = _new_sim_storage_root(new.untyped_storage(), self.device.index)
        _on_cpu_kernel(
            _aten.set_.source_Storage_storage_offset,
            self,
            root.untyped_storage(),
            self.storage_offset(),
            self.size(),
            self.stride(),
        )
    return _on_cpu_kernel(_aten.resize_.default, self, size, memory_format=memory_format)


def _set_empty(self: torch.Tensor) -> torch.Tensor:
    root = _new_sim_storage_root(torch.UntypedStorage(0), self.device.index)  # type: ignore[no-untyped-call]  # unannotated in torch
    return _on_cpu_kernel(_aten.set_.source_Storage_storage_offset, self, root.untyped_storage(), 0, (0,), (1,))


def _mse_loss_out(self: torch.Tensor, target: torch.Tensor, reduction: int = 1, *, out: torch.Tensor) -> torch.Tensor:
    # The CPU kernel of mse_loss.out first resizes ``out`` to the unreduced shape, warning
    # that resizing a non-empty output is deprecated, and the composite mse_loss that every
    # non-CPU/CUDA backend gets calls mse_loss.out. Compute functionally instead.
    result = _run_on_backing(_aten.mse_loss.default, (self, target, reduction), {})
    if out.size() != result.size():
        out.resize_(result.size())
    return out.copy_(result)


_CPU = torch.device("cpu")


def _factory_index(device: Any, pin_memory: bool | None) -> int:
    index = _sim_index_of(device)
    if pin_memory:
        raise RuntimeError("Only dense CPU tensors can be pinned (simulated accelerator)")
    return _current_index() if index is None else index


# NOTE: the two allocating factories get kernels of their own (what _run_on_backing does for them, without its
# walk over arguments that hold no tensor): every copy to a device allocates, and an empty tensor must not cost
# the simulator more than a copy does (on a real device it costs a small fraction of one).
def _empty(
    size: Any,
    *,
    dtype: torch.dtype | None = None,
    layout: torch.layout | None = None,
    device: Any = None,
    pin_memory: bool | None = None,
    memory_format: torch.memory_format | None = None,
) -> torch.Tensor:
    index = _factory_index(device, pin_memory)
    cpu = _aten.empty.memory_format(size, dtype=dtype, layout=layout, device=_CPU, memory_format=memory_format)
    return _wrap_fresh(cpu, index, {})


def _empty_strided(
    size: Any,
    stride: Any,
    *,
    dtype: torch.dtype | None = None,
    layout: torch.layout | None = None,
    device: Any = None,
    pin_memory: bool | None = None,
) -> torch.Tensor:
    index = _factory_index(device, pin_memory)
    cpu = _aten.empty_strided.default(size, stride, dtype=dtype, layout=layout, device=_CPU)
    return _wrap_fresh(cpu, index, {})


def _metadata_only(op: Any) -> Any:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        return _on_cpu_kernel(op, *args, **kwargs)

    return kernel


_SPECIAL_KERNELS: dict[Any, Any] = {
    _aten._to_copy.default: _to_copy,
    _aten._copy_from.default: _copy_from,
    _aten._copy_from_and_resize.default: _copy_from_and_resize,
    _aten.resize_.default: _resize_,
    _aten.set_.default: _set_empty,
    _aten.mse_loss.out: _mse_loss_out,
    _aten.empty.memory_format: _empty,
    _aten.empty_strided.default: _empty_strided,
}
# View ops and storage swaps with backend-specific (CPU/Meta/...) kernels: their CPU kernels
# only build a new TensorImpl on ``self``'s storage, which works unchanged for sim tensors and
# keeps device coordinates identical to the backing's.
for _op in (
    _aten.view.default,
    _aten.as_strided.default,
    _aten._reshape_alias.default,
    _aten.unfold.default,
    _aten.view_as_real.default,
    _aten.view_as_complex.default,
    _aten.set_.source_Storage,
    _aten.set_.source_Storage_storage_offset,
    _aten.set_.source_Tensor,
):
    _SPECIAL_KERNELS[_op] = _metadata_only(_op)
del _op


# --------------------------------------------------------------------------------------------
# Storages created directly on sim: torch.UntypedStorage(n, device="sim")
# --------------------------------------------------------------------------------------------
#
# PyTorch allocates such storages with the C++ allocator registered for the device, and a
# Python backend cannot register one: with none set, the constructor dereferences a null
# allocator and the process dies with a segfault. It is reached by ``copy.deepcopy`` of a sim
# tensor (storage.clone()), ``storage.sim()``/``storage.to()`` and ``torch.load`` with a sim
# ``map_location``. Setup therefore routes sim-device storage construction through here.

_storage_base_new = torch._C.StorageBase.__new__


def _untyped_storage_new(cls: type, *args: Any, **kwargs: Any) -> Any:
    device = kwargs.get("device")
    try:
        parsed = None if device is None else torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        parsed = None  # let the original constructor report it
    if parsed is None or parsed.type != SIM_DEVICE_TYPE:
        return _storage_base_new(cls, *args, **kwargs)
    index = _sim_index_of(parsed)  # raises for an index out of range
    assert index is not None  # (a sim device)
    if cls is not torch.UntypedStorage or kwargs.get("allocator") is not None:
        raise RuntimeError(
            f"simulated accelerator: cannot construct {cls.__name__} on {device} with "
            f"{sorted(kwargs)}; only torch.UntypedStorage(size_or_data, device=...) is supported"
        )
    cpu_kwargs = {k: v for k, v in kwargs.items() if k != "device"}
    backing = _storage_base_new(cls, *args, **cpu_kwargs)  # a CPU storage with the contents
    return _new_sim_storage_root(backing, index).untyped_storage()


_storage_resize = torch.UntypedStorage.resize_


def _storage_resize_(self: torch.UntypedStorage, size: int) -> torch.UntypedStorage:
    """``storage.resize_(size)`` of a sim storage: new memory allocated on the current stream with the bytes
    that fit copied, then swapped in under the same storage object (the old memory is freed with the swap)."""
    if self.device.type != SIM_DEVICE_TYPE:
        return _storage_resize(self, size)  # type: ignore[no-any-return]  # unannotated in torch
    old, index = self.nbytes(), self.device.index
    if old and (entry := _registry.get(self.data_ptr())) is not None and entry.guard is not None:
        raise RuntimeError("Trying to resize storage that is not resizable (simulated accelerator: mapped memory)")
    new = torch.empty(size, dtype=torch.uint8, device=self.device)
    if old and size:
        new[: min(old, size)].copy_(torch.empty(0, dtype=torch.uint8, device=self.device).set_(self)[:size])
    swap: Any = getattr(self, "_swap_data_ptr_")  # noqa: B009  # (missing from the stubs)
    if old:
        swap(_new_sim_storage_root(torch.UntypedStorage(0), index).untyped_storage())  # type: ignore[no-untyped-call]  # unannotated in torch
    if size:
        swap(new.untyped_storage())
    return self


_tensor_new_tensor = torch.Tensor.new_tensor


@functools.wraps(_tensor_new_tensor)  # (its name for a __torch_function__ handler, an error, help())
def _new_tensor(self: torch.Tensor, data: Any, **kwargs: Any) -> torch.Tensor:
    """``self.new_tensor(data)`` on ``self``'s device, as CUDA's (the C++ guard would say ``sim:0``). Asked by
    dispatch key, not ``self.device``: that would be one more call for another tensor's ``__torch_function__``."""
    if kwargs.get("device") is None and torch._C._dispatch_keys(self).has(torch._C.DispatchKey.PrivateUse1):
        kwargs["device"] = self.device
    return _tensor_new_tensor(self, data, **kwargs)


# --------------------------------------------------------------------------------------------
# torch.accelerator's allocator queries: empty_cache(), memory_stats(), empty_host_cache()
# --------------------------------------------------------------------------------------------
#
# They read the C++ caching allocators of the current accelerator, and a Python backend has neither: asked
# whether its device allocator is initialized, PyTorch fails an internal assert ("Allocator for sim is not a
# DeviceAllocator"), and emptying a host cache that was never registered dereferences a null pointer
# (segfault). Frameworks call them on whatever accelerator is current (Accelerate's ``free_memory`` calls
# ``torch.accelerator.empty_cache()``, as the Transformers ``Trainer`` does at the start of ``train``).
# While the sim is the current accelerator, setup makes them answer as PyTorch does for an allocator not
# yet in use: nothing cached to empty, no statistics (``simulated_memory_allocated`` counts the memory).

# (None on a torch without them: nothing to answer for)
_accelerator_allocator_initialized = getattr(torch._C, "_accelerator_isAllocatorInitialized", None)
_accelerator_empty_host_cache = getattr(torch._C, "_accelerator_emptyHostCache", None)


def _sim_is_current_accelerator() -> bool:
    current = torch.accelerator.current_accelerator()
    return current is not None and current.type == SIM_DEVICE_TYPE


def _allocator_initialized() -> bool:
    assert _accelerator_allocator_initialized is not None  # (installed only where torch has it)
    return False if _sim_is_current_accelerator() else bool(_accelerator_allocator_initialized())


def _empty_host_cache() -> None:
    assert _accelerator_empty_host_cache is not None  # (installed only where torch has it)
    if not _sim_is_current_accelerator():
        _accelerator_empty_host_cache()


# --------------------------------------------------------------------------------------------
# Backend module (torch.sim), hooks, device guard, setup
# --------------------------------------------------------------------------------------------


class _SimBackendModule:
    """What ``torch.sim`` is. Mirrors the parts of ``torch.cuda`` that PyTorch and tests use."""

    def __init__(self, state: _State) -> None:
        self._optimshift_state = state  # also marks a torch.sim set up by this module

    def is_available(self) -> bool:
        return True

    def is_initialized(self) -> bool:
        return True

    def device_count(self) -> int:
        return _NUM_DEVICES

    def current_device(self) -> int:
        return self._optimshift_state.current_device

    def set_device(self, device: Any) -> None:
        index = device if isinstance(device, int) else _sim_index_of(device)
        if index is None or not 0 <= index < _NUM_DEVICES:
            raise ValueError(f"invalid simulated device {device!r}")
        self._optimshift_state.current_device = index

    def device(self, device: Any) -> _DeviceContext:
        """Context manager making ``device`` the current sim device (like torch.cuda.device)."""
        return _DeviceContext(self, device)

    def synchronize(self, device: Any = None) -> None:
        """Wait for the work queued on every stream of ``device`` (see :mod:`._sim_streams`)."""
        if _deferred is not None:
            _deferred.synchronize(device)

    def memory_allocated(self, device: Any = None) -> int:
        index = (
            self.current_device() if device is None else (device if isinstance(device, int) else _sim_index_of(device))
        )
        if index is None:  # not a sim device: what simulated_memory_allocated(None) raises
            raise TypeError(f"device index must be an int, got {index!r}")
        return simulated_memory_allocated(index)

    # RNG: the simulator uses the CPU's default generator.
    def _is_in_bad_fork(self) -> bool:
        return False

    def manual_seed(self, seed: int) -> None:
        """No-op: random ops on sim use the CPU generator, seeded by ``torch.manual_seed``."""

    def manual_seed_all(self, seed: int) -> None:
        """No-op: random ops on sim use the CPU generator, seeded by ``torch.manual_seed``."""

    def seed(self) -> None:
        pass

    def seed_all(self) -> None:
        pass

    def initial_seed(self) -> int:
        return torch.initial_seed()

    def get_rng_state(self, device: Any = None) -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(self, new_state: torch.Tensor, device: Any = None) -> None:
        torch.set_rng_state(new_state)

    def get_amp_supported_dtype(self) -> list[torch.dtype]:
        return [torch.float16, torch.bfloat16]


class _DeviceContext:
    def __init__(self, module: _SimBackendModule, device: Any) -> None:
        self._module = module
        self._index = device if isinstance(device, int) else _sim_index_of(device)
        self._previous: int | None = None

    def __enter__(self) -> None:
        self._previous = self._module.current_device()
        if self._index is not None and self._index >= 0:
            self._module.set_device(self._index)

    def __exit__(self, *exc: object) -> None:
        if self._previous is not None:
            self._module.set_device(self._previous)


_backend_module = _SimBackendModule(_state)


def _make_hooks_and_guard() -> tuple[Any, Any]:
    acc = torch._C._acc  # pyright: ignore[reportAttributeAccessIssue]  # (a private module missing from the stubs)

    class _SimHooks(acc.PrivateUse1Hooks):
        def is_available(self) -> bool:
            return True

        def has_primary_context(self, dev_id: int) -> bool:
            return True

        def is_built(self) -> bool:
            return True

    class _SimDeviceGuard(acc.DeviceGuard):
        # PyTorch's Python device guard only lets Python choose the device type: in C++ it
        # always reports device 0, a device count of 1, and no-op streams and events.
        def type_(self) -> Any:
            return torch._C._autograd.DeviceType.PrivateUse1  # pyright: ignore[reportAttributeAccessIssue]

    return _SimHooks(), _SimDeviceGuard()


def _ensure_setup() -> None:
    global _is_setup
    if _is_setup:
        return
    with _setup_lock:
        if _is_setup:
            return
        current = torch._C._get_privateuse1_backend_name()
        existing = getattr(torch, SIM_DEVICE_TYPE, None)
        if current == SIM_DEVICE_TYPE and getattr(existing, "_optimshift_state", None) is _state:
            # Set up by another copy of this module (importlib.reload, or the package
            # imported under two names); the state below is shared with it (see _State).
            _is_setup = True
            return
        if current != "privateuseone":
            raise RuntimeError(
                f"cannot set up the simulated accelerator: PyTorch's PrivateUse1 backend was "
                f"already renamed to {current!r} in this process (PyTorch allows one rename "
                f"per process; the simulator needs it to be '{SIM_DEVICE_TYPE}')"
            )
        try:
            from torch.utils.backend_registration import (
                _setup_privateuseone_for_python_backend,
            )

            torch._C._acc.DeviceGuard  # noqa: B018  # pyright: ignore[reportAttributeAccessIssue]  (a feature check)
        except (ImportError, AttributeError) as exc:  # pragma: no cover - old torch
            raise RuntimeError(
                "the simulated accelerator needs PyTorch's Python PrivateUse1 hooks "
                "(torch.utils.backend_registration._setup_privateuseone_for_python_backend, "
                f"torch._C._acc); torch {torch.__version__} lacks them"
            ) from exc

        hook, guard = _make_hooks_and_guard()
        _setup_privateuseone_for_python_backend(
            SIM_DEVICE_TYPE, backend_module=_backend_module, hook=hook, device_guard=guard
        )
        fallback_lib = torch.library.Library("_", "IMPL")  # type: ignore[no-untyped-call]  # unannotated in torch
        fallback_lib.fallback(_fallback, "PrivateUse1")  # type: ignore[no-untyped-call]  # unannotated in torch
        # Nothing is registered for AutocastPrivateUse1, so without this every op under
        # torch.autocast("sim") fails. Autocast on sim is therefore a no-op (no casts).
        fallback_lib.fallback(torch.library.fallthrough_kernel, "AutocastPrivateUse1")  # type: ignore[no-untyped-call]  # unannotated in torch
        # Ops with a CompositeExplicitAutograd kernel never reach the fallback; these need
        # their own PrivateUse1 kernel to take precedence over the composite one.
        aten_lib = torch.library.Library("aten", "IMPL")  # type: ignore[no-untyped-call]  # unannotated in torch
        aten_lib.impl("_to_copy", _to_copy_entry, "PrivateUse1")  # type: ignore[no-untyped-call]  # unannotated in torch
        for key in ("Conjugate", "Negative"):
            aten_lib.impl("_copy_from", _copy_from_math_bits, key, with_keyset=True)  # type: ignore[no-untyped-call]  # unannotated in torch
        # Keep the registrations (and the hook/guard objects) alive with torch.sim itself.
        _backend_module._libraries = (fallback_lib, aten_lib)  # type: ignore[attr-defined]
        _backend_module._hooks = (hook, guard)  # type: ignore[attr-defined]
        torch.UntypedStorage.__new__ = _untyped_storage_new  # type: ignore[method-assign]
        torch.UntypedStorage.resize_ = _storage_resize_  # type: ignore[method-assign, assignment]
        torch.Tensor.new_tensor = _new_tensor  # type: ignore[method-assign, assignment]
        if _accelerator_allocator_initialized is not None:
            torch._C._accelerator_isAllocatorInitialized = _allocator_initialized  # pyright: ignore[reportAttributeAccessIssue]
        if _accelerator_empty_host_cache is not None:
            torch._C._accelerator_emptyHostCache = _empty_host_cache  # pyright: ignore[reportAttributeAccessIssue]
        # The autograd engine sizes its per-device worker queues from the C++ device guard,
        # which reports a single device for Python backends, so backward on sim:1 would hit an
        # internal assert. With multithreading off, this thread runs device backward itself.
        torch._C._set_multithreading_enabled(False)
        torch.__future__.set_swap_module_params_on_conversion(True)
        _install_streams()
        _is_setup = True


# --------------------------------------------------------------------------------------------
# Streams and events (optimshift.testing._sim_streams): deferred work on non-default streams
# --------------------------------------------------------------------------------------------

# NOTE: the dependency runs one way. _sim_streams is built on this module's helpers and plugs itself in
# through attach_streams() when it is imported (optimshift.testing imports it before anything can set the
# simulator up); this module never imports it.
_deferred: Any = None  # what attach_streams' installer returned, once the simulator is set up
_stream_installer: Callable[[Any], Any] | None = None


def attach_streams(installer: Callable[[Any], Any]) -> None:
    """Give the simulator its streams: ``installer(torch.sim)`` runs at setup (at once if it is already set up)
    and returns the hooks the simulator calls (``on_alloc``, ``on_free``, ``dispatch``, ``synchronize``)."""
    global _stream_installer
    _stream_installer = installer
    if _is_setup:
        _install_streams()


def _to_copy_entry(*args: Any, **kwargs: Any) -> Any:
    # _to_copy is registered directly (ahead of the composite kernel); go through _fallback like every other
    # op so that the stream machinery sees it.
    return _fallback(_aten._to_copy.default, *args, **kwargs)


def _install_streams() -> None:
    global _deferred
    if _stream_installer is not None and _deferred is None:
        _deferred = _stream_installer(_backend_module)

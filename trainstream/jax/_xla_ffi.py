"""XLA typed-FFI handlers written in Python (ctypes), with no C/C++ compilation.

Why
---
Under ``jax.jit`` the only supported way to call out of an XLA program into our own
code without a device round trip is a *custom call*. The modern mechanism is XLA's
**typed FFI** (``api_version=1``); the legacy custom-call API still runs but is
deprecated and must not be built on. The typed FFI is a plain C ABI, described in the
header that jaxlib ships (``jax.ffi.include_dir()/xla/ffi/api/c_api.h``). Nothing in
it requires C++: a handler is just a function pointer::

    XLA_FFI_Error* handler(XLA_FFI_CallFrame* call_frame);

so we implement it with a :func:`ctypes.CFUNCTYPE` callback, wrap the function pointer
in a PyCapsule and hand it to ``jax.ffi.register_ffi_target(name, capsule,
platform=..., api_version=1)``. The ctypes structures below mirror ``c_api.h`` of the
jaxlib in this venv (jax/jaxlib 0.10.2, ``XLA_FFI_API_MAJOR.MINOR == 0.3``).

How XLA talks to a handler (the C API "stages")
-----------------------------------------------
Every call passes one ``XLA_FFI_CallFrame``::

    struct XLA_FFI_CallFrame {
      size_t struct_size; XLA_FFI_Extension_Base* extension_start;
      const XLA_FFI_Api* api;          // function table (Error_Create, Stream_Get, ...)
      XLA_FFI_ExecutionContext* ctx;   // opaque, passed back to api functions
      XLA_FFI_ExecutionStage stage;    // INSTANTIATE=0 PREPARE=1 INITIALIZE=2 EXECUTE=3
      XLA_FFI_Args args; XLA_FFI_Rets rets; XLA_FFI_Attrs attrs;
      XLA_FFI_Future* future;          // out, for async handlers (unused here)
    };

1. **Metadata query.** When a handler is registered, XLA calls it once with a call
   frame whose ``extension_start`` chain contains an ``XLA_FFI_Metadata_Extension``
   (``type == XLA_FFI_Extension_Metadata``), ``stage == EXECUTE`` and *empty*
   args/rets/attrs (and, in some XLA versions, ``api == NULL``). The handler must not
   run; it fills ``extension->metadata->api_version`` (the FFI version the handler was
   written against, which XLA checks against its supported range) and ``traits``
   (``XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE`` or 0), exactly as
   ``xla/ffi/api/api.h``'s ``Handler::PopulateMetadata`` does, then returns NULL.
2. **Instantiate / prepare / initialize.** Only called if a handler is registered for
   those stages (``register_ffi_target`` also accepts a dict ``{stage: capsule}``).
   Ours return success and do nothing.
3. **Execute.** Decode ``args``/``rets`` into :class:`Buffer` tuples, build a
   :class:`CallContext` and call the Python function. Return NULL for success, or an
   ``XLA_FFI_Error*`` made with ``api->XLA_FFI_Error_Create`` (XLA takes ownership and
   turns it into a failed ``absl::Status``; JAX raises ``JaxRuntimeError`` carrying the
   message).

An exception escaping a ctypes callback is printed and *swallowed* (the callback
returns 0, i.e. "success"), so the trampoline catches ``BaseException`` and converts it
into an FFI error. Errors that come back from api functions (e.g. ``Stream_Get`` on
CPU) are owned by us and destroyed with ``XLA_FFI_Error_Destroy`` after reading the
message.

Versioning
----------
All struct layouts are append-only within major version 0; every struct carries
``struct_size`` computed like the header's ``XLA_FFI_STRUCT_SIZE(type, last_field)``
(``offsetof(last) + sizeof(last)``, i.e. *without* trailing padding). We check
sizes with ``>=`` (newer runtimes may append fields) before trusting a struct, and we
check ``XLA_FFI_Api.struct_size`` before using a function that may be missing from an
older runtime (``RunId_Get``, ``DeviceOrdinal_Get``). At registration the installed
header is parsed (once) for ``XLA_FFI_API_MAJOR/MINOR``, the order of the
``XLA_FFI_Api`` function table and the field order of every struct mirrored here
(:func:`header_info`); registration refuses to proceed if they disagree with the
layout written here (field *names/order* are checked, C types cannot be without a
compiler; a type change would be a major-version bump). The handler declares API version
``(0, min(header_minor, 3))``: 0.3 is the header these structs are transcribed from,
and XLA accepts any version in ``[0.1, its own]``.

Threading and GPU
-----------------
ctypes acquires the GIL on entry to the callback, so handlers may be invoked from XLA
runtime threads (on CPU, in our tests, they ran on the calling Python thread).

GPU (written from the header, *not tested here*: this machine has no GPU). Register
with ``platform="gpu"`` (JAX maps it to "CUDA"); XLA:GPU calls the execute handler on
the host while it enqueues the program on its compute stream. The handler must
*enqueue* its kernels on ``ctx.stream()`` (``XLA_FFI_Stream_Get``: the ``CUstream`` /
``cudaStream_t`` of this call, as int; e.g. ``with
cupy.cuda.ExternalStream(ctx.stream()):``) and must not wait for them: buffer
contents are only valid in stream order. ``ctx.device_ordinal()`` gives the device.
GPU buffers hold device pointers: use :func:`cuda_array_interface` or the raw
``Buffer.data``, never :func:`as_numpy` (``ctx.numpy`` refuses). A handler doing host
work must not be marked command-buffer compatible (XLA would capture it into a CUDA
graph once and replay it without calling Python); the default traits are 0.

Ordering, DCE and CSE (measured with jax 0.10.2, CPU; see tests/test_xla_ffi.py)
------------------------------------------------------------------------------
* ``jax.ffi.ffi_call(...)`` without ``has_side_effect``: XLA treats the call as pure.
  A call whose results are unused is **dropped**, and two identical calls are
  **merged (CSE)** into one. Not acceptable for a stateful handler.
* ``jax.ffi.ffi_call(..., has_side_effect=True)`` emits
  ``custom_call_has_side_effect=true``: never dropped, never merged. But JAX also puts
  an FFI effect on the jaxpr, and jit then leaves its C++ fast path: dispatch costs
  ~100 us instead of ~10-20 us per call.
* :func:`stateful_ffi_call` gets the HLO side-effect flag without a jaxpr effect: no
  DCE/CSE by XLA and the fast path is kept, but JAX's own jaxpr DCE still drops the
  call if none of its results is used. Use it where the results are consumed (the
  updated parameters of a train step).
* Order: independent side-effecting calls ran in program order in every trial, but
  nothing guarantees it. The reliable way is a data dependency: thread a state array
  (the parameters, or a 1-element "token" array) through the calls with
  ``input_output_aliases={i: j}`` so that each call consumes the previous output.
  Donating that array (``jax.jit(..., donate_argnums=...)``) makes the update truly in
  place: the handler sees ``args[i].data == rets[j].data`` and the output jax Array
  reuses the input's memory. Without donation XLA copies the input into the output
  buffer before the call (still aliased inside the handler); without
  ``input_output_aliases`` the handler must copy (:func:`alias_or_copy` does both).

Overhead (jax 0.10.2, this CPU-only dev box, noisy, best of several runs)
-------------------------------------------------------------------------
* Python trampoline (decode 2 args + 1 ret, build ctx, call a no-op fn): ~5-6 us.
* One trivial handler call inside a jitted ``fori_loop`` (XLA custom-call thunk +
  ctypes entry + trampoline): ~9-12 us per call.
* ``jax.jit`` dispatch of a function holding one such call: ~10-20 us per call
  (``x + s`` alone: ~5 us); with ``has_side_effect=True`` ~95-125 us (Python dispatch
  path); with :func:`stateful_ffi_call` ~15-25 us.

Minimal example::

    import jax, jax.numpy as jnp, numpy as np
    from trainstream.jax import _xla_ffi as xf

    def add_scalar(ctx, args, rets):
        x, s = args
        (out,) = rets
        xf.alias_or_copy(ctx, x, out)           # no-op when aliased
        xf.as_numpy(out)[...] += xf.as_numpy(s)[0]

    xf.register_python_handler("my_add_scalar", add_scalar)

    @jax.jit  # add donate_argnums=0 to update in place without a copy
    def step(x, s):
        return jax.ffi.ffi_call("my_add_scalar", jax.ShapeDtypeStruct(x.shape, x.dtype),
                                input_output_aliases={0: 0}, has_side_effect=True)(x, s)
"""

from __future__ import annotations

import ctypes
import enum
import math
import os
import re
import struct
import sys
import threading
import traceback
from ctypes import (
    CFUNCTYPE,
    Structure,
    c_char,
    c_char_p,
    c_int,
    c_int32,
    c_int64,
    c_size_t,
    c_uint32,
    c_void_p,
    sizeof,
)
from typing import Any, Callable, NamedTuple

import numpy as np

__all__ = [
    "Buffer",
    "CallContext",
    "DataType",
    "ErrorCode",
    "ExecutionStage",
    "FfiError",
    "HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE",
    "HandlerRecord",
    "alias_or_copy",
    "as_numpy",
    "cuda_array_interface",
    "handler_api_version",
    "header_info",
    "register_python_handler",
    "registered_handlers",
    "stateful_ffi_call",
]

# ---------------------------------------------------------------------------
# Enums (values from c_api.h)
# ---------------------------------------------------------------------------


class ErrorCode(enum.IntEnum):
    """``XLA_FFI_Error_Code`` (absl status codes)."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


class ExecutionStage(enum.IntEnum):
    """``XLA_FFI_ExecutionStage``."""

    INSTANTIATE = 0
    PREPARE = 1
    INITIALIZE = 2
    EXECUTE = 3
    RECORD = 4  # FFI 0.4 (jaxlib 0.11): command-buffer recording; never registered here


class DataType(enum.IntEnum):
    """``XLA_FFI_DataType`` (mirrors ``xla::PrimitiveType``)."""

    INVALID = 0
    PRED = 1
    S1 = 30
    S2 = 26
    S4 = 21
    S8 = 2
    S16 = 3
    S32 = 4
    S64 = 5
    U1 = 31
    U2 = 27
    U4 = 22
    U8 = 6
    U16 = 7
    U32 = 8
    U64 = 9
    F16 = 10
    F32 = 11
    F64 = 12
    BF16 = 16
    C64 = 15
    C128 = 18
    TOKEN = 17
    F8E5M2 = 19
    F8E3M4 = 29
    F8E4M3 = 28
    F8E4M3FN = 20
    F8E4M3B11FNUZ = 23
    F8E5M2FNUZ = 24
    F8E4M3FNUZ = 25
    F4E2M1FN = 32
    F8E8M0FNU = 33


_EXTENSION_METADATA = 1  # XLA_FFI_Extension_Metadata
_ARG_TYPE_BUFFER = 1  # XLA_FFI_ArgType_BUFFER
_RET_TYPE_BUFFER = 1  # XLA_FFI_RetType_BUFFER
_ATTR_ARRAY, _ATTR_DICTIONARY, _ATTR_SCALAR, _ATTR_STRING = 1, 2, 3, 4

#: ``XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE``. Do NOT set this for handlers
#: that do host-side work: XLA:GPU may capture the call into a CUDA graph and replay
#: the captured kernels without calling the handler again.
HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE = 1

# ---------------------------------------------------------------------------
# Struct layouts (transcribed from c_api.h, XLA_FFI_API_MAJOR 0 / MINOR 3).
# C enums are `int` (4 bytes) on the Linux x86-64/aarch64 ABIs we target.
# All pointers are declared c_void_p so that field reads give int/None cheaply.
# ---------------------------------------------------------------------------


class _ExtensionBase(Structure):  # XLA_FFI_Extension_Base
    _fields_ = [("struct_size", c_size_t), ("type", c_int), ("next", c_void_p)]


class _ApiVersion(Structure):  # XLA_FFI_Api_Version
    _fields_ = [
        ("struct_size", c_size_t),
        ("extension_start", c_void_p),
        ("major_version", c_int),
        ("minor_version", c_int),
    ]


class _ErrorCreateArgs(Structure):  # XLA_FFI_Error_Create_Args
    _fields_ = [
        ("struct_size", c_size_t),
        ("extension_start", c_void_p),
        ("message", c_char_p),
        ("errc", c_int),
    ]


class _ErrorGetMessageArgs(Structure):  # XLA_FFI_Error_GetMessage_Args
    _fields_ = [
        ("struct_size", c_size_t),
        ("extension_start", c_void_p),
        ("error", c_void_p),
        ("message", c_void_p),  # out: const char*
        # XLA_FFI_Error_GetDetails_Args (jaxlib 0.11, FFI 0.4) appends the code (out); the
        # field is here so that a newer runtime writing it stays inside this struct.
        ("errc", c_int),
    ]


class _ErrorDestroyArgs(Structure):  # XLA_FFI_Error_Destroy_Args
    _fields_ = [("struct_size", c_size_t), ("extension_start", c_void_p), ("error", c_void_p)]


class _Buffer(Structure):  # XLA_FFI_Buffer
    _fields_ = [
        ("struct_size", c_size_t),
        ("extension_start", c_void_p),
        ("dtype", c_int),
        ("data", c_void_p),
        ("rank", c_int64),
        ("dims", c_void_p),  # int64_t*, length == rank
    ]


class _ByteSpan(Structure):  # XLA_FFI_ByteSpan
    _fields_ = [("ptr", c_void_p), ("len", c_size_t)]


class _Scalar(Structure):  # XLA_FFI_Scalar
    _fields_ = [("dtype", c_int), ("value", c_void_p)]


class _Array(Structure):  # XLA_FFI_Array
    _fields_ = [("dtype", c_int), ("size", c_size_t), ("data", c_void_p)]


class _Args(Structure):  # XLA_FFI_Args (XLA_FFI_Rets has the identical layout)
    _fields_ = [
        ("struct_size", c_size_t),
        ("extension_start", c_void_p),
        ("size", c_int64),
        ("types", c_void_p),  # XLA_FFI_ArgType* (int*)
        ("args", c_void_p),  # void**
    ]


class _Attrs(Structure):  # XLA_FFI_Attrs
    _fields_ = [
        ("struct_size", c_size_t),
        ("extension_start", c_void_p),
        ("size", c_int64),
        ("types", c_void_p),  # XLA_FFI_AttrType*
        ("names", c_void_p),  # XLA_FFI_ByteSpan**
        ("attrs", c_void_p),  # void**
    ]


class _CallFrame(Structure):  # XLA_FFI_CallFrame
    _fields_ = [
        ("struct_size", c_size_t),
        ("extension_start", c_void_p),
        ("api", c_void_p),
        ("ctx", c_void_p),
        ("stage", c_int),
        ("args", _Args),
        ("rets", _Args),
        ("attrs", _Attrs),
        ("future", c_void_p),  # out; NOT covered by XLA_FFI_CallFrame_STRUCT_SIZE
    ]


class _Metadata(Structure):  # XLA_FFI_Metadata
    _fields_ = [
        ("struct_size", c_size_t),
        ("api_version", _ApiVersion),
        ("traits", c_uint32),
        ("state_type_id", c_int64),  # XLA_FFI_TypeId; beyond STRUCT_SIZE (last=traits)
    ]


class _MetadataExtension(Structure):  # XLA_FFI_Metadata_Extension
    _fields_ = [("extension_base", _ExtensionBase), ("metadata", c_void_p)]


class _CtxArgs(Structure):
    """Common prefix of the ``*_Get_Args`` structs that take an execution context."""

    _fields_ = [("struct_size", c_size_t), ("extension_start", c_void_p), ("ctx", c_void_p)]


class _StreamGetArgs(Structure):  # XLA_FFI_Stream_Get_Args
    _fields_ = _CtxArgs._fields_ + [("stream", c_void_p)]  # out: CUstream / cudaStream_t


class _RunIdGetArgs(Structure):  # XLA_FFI_RunId_Get_Args
    _fields_ = _CtxArgs._fields_ + [("run_id", c_int64)]


class _DeviceOrdinalGetArgs(Structure):  # XLA_FFI_DeviceOrdinal_Get_Args
    _fields_ = _CtxArgs._fields_ + [("device_ordinal", c_int32)]


class _ThreadPoolNumThreadsArgs(Structure):  # XLA_FFI_ThreadPool_NumThreads_Args
    _fields_ = _CtxArgs._fields_ + [("num_threads", c_void_p)]  # int64_t* out


# Function table, in header order. Appended to (never reordered) within major 0.
_API_FUNCTIONS = (
    "XLA_FFI_Error_Create",
    "XLA_FFI_Error_GetMessage",
    "XLA_FFI_Error_Destroy",
    "XLA_FFI_Handler_Register",
    "XLA_FFI_Stream_Get",
    "XLA_FFI_Type_Register",
    "XLA_FFI_ExecutionContext_Get",
    "XLA_FFI_State_Set",
    "XLA_FFI_State_Get",
    "XLA_FFI_DeviceMemory_Allocate",
    "XLA_FFI_DeviceMemory_Free",
    "XLA_FFI_ThreadPool_Schedule",
    "XLA_FFI_ThreadPool_NumThreads",
    "XLA_FFI_Future_Create",
    "XLA_FFI_Future_SetAvailable",
    "XLA_FFI_Future_SetError",
    "XLA_FFI_RunId_Get",
    "XLA_FFI_DeviceOrdinal_Get",
)


class _ApiStruct(Structure):  # XLA_FFI_Api
    _fields_ = [
        ("struct_size", c_size_t),
        ("extension_start", c_void_p),
        ("api_version", _ApiVersion),
        ("internal_api", c_void_p),
    ] + [(n, c_void_p) for n in _API_FUNCTIONS]


# C struct name -> our ctypes mirror; field order is checked against the installed
# header at registration (see header_info / _check_header_compat).
_HEADER_STRUCTS = {
    "XLA_FFI_Extension_Base": _ExtensionBase,
    "XLA_FFI_Api_Version": _ApiVersion,
    "XLA_FFI_Error_Create_Args": _ErrorCreateArgs,
    "XLA_FFI_Error_GetMessage_Args": _ErrorGetMessageArgs,
    "XLA_FFI_Error_Destroy_Args": _ErrorDestroyArgs,
    "XLA_FFI_Buffer": _Buffer,
    "XLA_FFI_ByteSpan": _ByteSpan,
    "XLA_FFI_Scalar": _Scalar,
    "XLA_FFI_Array": _Array,
    "XLA_FFI_Args": _Args,
    "XLA_FFI_Attrs": _Attrs,
    "XLA_FFI_CallFrame": _CallFrame,
    "XLA_FFI_Metadata": _Metadata,
    "XLA_FFI_Metadata_Extension": _MetadataExtension,
    "XLA_FFI_Stream_Get_Args": _StreamGetArgs,
    "XLA_FFI_RunId_Get_Args": _RunIdGetArgs,
    "XLA_FFI_DeviceOrdinal_Get_Args": _DeviceOrdinalGetArgs,
    "XLA_FFI_ThreadPool_NumThreads_Args": _ThreadPoolNumThreadsArgs,
}


def _struct_size(cls: type, last_field: str) -> int:
    """``XLA_FFI_STRUCT_SIZE(cls, last_field)``: offsetof(last) + sizeof(last)."""
    field = getattr(cls, last_field)
    return field.offset + field.size


# The *_STRUCT_SIZE constants of the header (note: last fields as in the header).
_API_VERSION_SIZE = _struct_size(_ApiVersion, "minor_version")
_ERROR_CREATE_SIZE = _struct_size(_ErrorCreateArgs, "errc")
_ERROR_GET_MESSAGE_SIZE = _struct_size(_ErrorGetMessageArgs, "message")
_ERROR_GET_DETAILS_SIZE = _struct_size(_ErrorGetMessageArgs, "errc")
_ERROR_DESTROY_SIZE = _struct_size(_ErrorDestroyArgs, "error")
_BUFFER_SIZE = _struct_size(_Buffer, "dims")
_ARGS_SIZE = _struct_size(_Args, "args")
_ATTRS_SIZE = _struct_size(_Attrs, "attrs")
_CALL_FRAME_SIZE = _struct_size(_CallFrame, "attrs")
_METADATA_SIZE = _struct_size(_Metadata, "traits")
_METADATA_FULL_SIZE = _struct_size(_Metadata, "state_type_id")
_METADATA_EXTENSION_SIZE = _struct_size(_MetadataExtension, "metadata")
_STREAM_GET_SIZE = _struct_size(_StreamGetArgs, "stream")
_RUN_ID_GET_SIZE = _struct_size(_RunIdGetArgs, "run_id")
_DEVICE_ORDINAL_GET_SIZE = _struct_size(_DeviceOrdinalGetArgs, "device_ordinal")
_THREAD_POOL_NUM_THREADS_SIZE = _struct_size(_ThreadPoolNumThreadsArgs, "num_threads")


def _api_field_end(name: str) -> int:
    return _struct_size(_ApiStruct, name)


# Sanity: these match the values a C compiler gives for c_api.h on LP64 Linux.
assert sizeof(c_void_p) == 8, "only 64-bit platforms are supported"
assert _CALL_FRAME_SIZE == 168 and _BUFFER_SIZE == 48 and _METADATA_SIZE == 36
assert _ERROR_CREATE_SIZE == 28 and _DEVICE_ORDINAL_GET_SIZE == 28
assert _api_field_end("XLA_FFI_DeviceOrdinal_Get") == 192

# Handler ABI: XLA_FFI_Error* (*)(XLA_FFI_CallFrame*). Arg as c_void_p -> int address.
_HANDLER_T = CFUNCTYPE(c_void_p, c_void_p)
# All api functions take a single pointer to an *_Args struct.
_ERROR_RETURNING_FN_T = CFUNCTYPE(c_void_p, c_void_p)
_VOID_FN_T = CFUNCTYPE(None, c_void_p)

# Version of c_api.h these structs were transcribed from.
_WRITTEN_AGAINST = (0, 3)

# ---------------------------------------------------------------------------
# Header inspection (once, at registration)
# ---------------------------------------------------------------------------

_header_cache: dict | None = None


def header_info() -> dict:
    """Parse the installed ``xla/ffi/api/c_api.h`` (from ``jax.ffi.include_dir()``).

    Returns a dict with ``path`` (str or None), ``major``/``minor`` (int or None),
    ``api_functions`` (tuple of the ``XLA_FFI_Api`` function-table entries in order)
    and ``structs`` (``{C struct name: field names in order}`` for the structs this
    module transcribes). The result is cached.
    """
    global _header_cache
    if _header_cache is not None:
        return _header_cache
    info: dict[str, Any] = {"path": None, "major": None, "minor": None, "api_functions": (), "structs": {}}
    try:
        import jax

        path = os.path.join(jax.ffi.include_dir(), "xla", "ffi", "api", "c_api.h")
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except Exception:  # header not shipped / unreadable: skip the checks
        _header_cache = info
        return info
    info["path"] = path
    m = re.search(r"#define\s+XLA_FFI_API_MAJOR\s+(\d+)", text)
    n = re.search(r"#define\s+XLA_FFI_API_MINOR\s+(\d+)", text)
    info["major"] = int(m.group(1)) if m else None
    info["minor"] = int(n.group(1)) if n else None
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    text = re.sub(r"//[^\n]*", "", text)
    body = re.search(r"struct\s+XLA_FFI_Api\s*\{(.*?)\};", text, re.S)
    if body:
        info["api_functions"] = tuple(re.findall(r"_XLA_FFI_API_STRUCT_FIELD\((\w+)\)", body.group(1)))
    structs = {}
    for cname in (*_HEADER_STRUCTS, "XLA_FFI_Error_GetDetails_Args"):
        m = re.search(r"struct\s+" + cname + r"\s*\{(.*?)\}", text, re.S)
        if m:
            decls = [d.strip() for d in m.group(1).split(";") if d.strip()]
            structs[cname] = tuple(re.search(r"(\w+)\s*$", d).group(1) for d in decls)
    info["structs"] = structs
    _header_cache = info
    return info


def handler_api_version() -> tuple[int, int]:
    """The (major, minor) FFI API version our handlers declare in the metadata query.

    ``min(installed header, 0.3)``: XLA accepts handler versions in
    ``[0.1, runtime version]`` and 0.3 is what the layouts in this file follow.
    """
    info = header_info()
    if info["major"] is None or info["minor"] is None:
        return _WRITTEN_AGAINST
    return min((info["major"], info["minor"]), _WRITTEN_AGAINST)


# Renames between header versions that keep the ABI (XLA's rule: a rename is a *minor*
# change; reordering or retyping is a major one). Seen in jaxlib 0.11: the error-message
# getter became ``XLA_FFI_Error_GetDetails`` and the execution context the "invoke context".
_KNOWN_RENAMES = {
    "XLA_FFI_Error_GetDetails": "XLA_FFI_Error_GetMessage",
    "XLA_FFI_InvokeContext_Get": "XLA_FFI_ExecutionContext_Get",
}


def _check_header_compat() -> None:
    """Refuse a header whose layout differs from the one mirrored here (another major
    version, other struct fields, another function table), except for the renames listed
    in ``_KNOWN_RENAMES`` (a minor change by XLA's rules: same ABI)."""
    info = header_info()
    if info["path"] is None:
        return
    if info["major"] is not None and info["major"] != _WRITTEN_AGAINST[0]:
        raise RuntimeError(
            f"{info['path']} declares XLA_FFI_API_MAJOR={info['major']}; "
            f"{__name__} was written for major version {_WRITTEN_AGAINST[0]} "
            "(ABI-incompatible). Update the struct definitions."
        )
    for cname, fields in info["structs"].items():
        if cname not in _HEADER_STRUCTS:
            continue
        ours = tuple(f[0] for f in _HEADER_STRUCTS[cname]._fields_)
        n = min(len(fields), len(ours))
        if fields[:n] != ours[:n]:
            raise RuntimeError(
                f"{cname} in {info['path']} has fields {fields}; {__name__} assumes {ours}"
            )
    funcs = tuple(_KNOWN_RENAMES.get(f, f) for f in info["api_functions"])
    if funcs:
        n = min(len(funcs), len(_API_FUNCTIONS))
        if funcs[:n] != _API_FUNCTIONS[:n]:
            raise RuntimeError(
                f"XLA_FFI_Api function table in {info['path']} differs from the layout in "
                f"{__name__} beyond the known renames {_KNOWN_RENAMES}: {info['api_functions']} "
                f"vs {_API_FUNCTIONS}"
            )



def _has_get_details() -> bool:
    return "XLA_FFI_Error_GetDetails_Args" in header_info()["structs"]


def _error_message_readable() -> bool:
    """Whether the installed header's error-message getter takes the args we pass
    ``(struct_size, extension_start, error, message)``; if a newer one does not, error
    messages from api calls are not read (the error is still destroyed)."""
    structs = header_info()["structs"]
    for cname in ("XLA_FFI_Error_GetMessage_Args", "XLA_FFI_Error_GetDetails_Args"):
        if cname in structs:
            return structs[cname][:4] == ("struct_size", "extension_start", "error", "message")
    return True  # no header to read: the layout of this file


# ---------------------------------------------------------------------------
# Api function table wrapper (one per XLA_FFI_Api* address; CPU and GPU plugins
# have different tables)
# ---------------------------------------------------------------------------


class _Api:
    """Callable view of one ``XLA_FFI_Api`` function table."""

    __slots__ = ("address", "struct_size", "version", "_fns")

    def __init__(self, address: int):
        s = _ApiStruct.from_address(address)
        self.address = address
        self.struct_size = s.struct_size
        self.version = (s.api_version.major_version, s.api_version.minor_version)
        self._fns: dict[str, Any] = {}
        for name in _API_FUNCTIONS:
            if self.struct_size >= _api_field_end(name):
                ptr = getattr(s, name)
                if ptr:
                    proto = _VOID_FN_T if name in ("XLA_FFI_Error_GetMessage", "XLA_FFI_Error_Destroy") else _ERROR_RETURNING_FN_T
                    self._fns[name] = proto(ptr)

    def fn(self, name: str):
        f = self._fns.get(name)
        if f is None:
            raise FfiError(
                f"{name} is not available in this XLA runtime (XLA_FFI_Api version "
                f"{self.version[0]}.{self.version[1]}, struct_size {self.struct_size})",
                ErrorCode.UNIMPLEMENTED,
            )
        return f

    def create_error(self, code: int, message: str) -> int:
        """``XLA_FFI_Error_Create``; ownership passes to whoever we return it to."""
        msg = message.encode("utf-8", "replace").replace(b"\0", b"\\0")
        args = _ErrorCreateArgs(_ERROR_CREATE_SIZE, None, msg, int(code))
        # XLA copies the message into an absl::Status, so `msg` may die afterwards.
        return self.fn("XLA_FFI_Error_Create")(ctypes.addressof(args)) or 0

    def take_error(self, err: int) -> str:
        """Read the message of an error returned *to us* and destroy it."""
        try:
            if _error_message_readable():
                size = _ERROR_GET_DETAILS_SIZE if _has_get_details() else _ERROR_GET_MESSAGE_SIZE
                ga = _ErrorGetMessageArgs(size, None, err, None, 0)
                self.fn("XLA_FFI_Error_GetMessage")(ctypes.addressof(ga))
                msg = ctypes.string_at(ga.message).decode("utf-8", "replace") if ga.message else ""
            else:
                msg = "(this jaxlib's error-details getter has another layout; message not read)"
        finally:
            da = _ErrorDestroyArgs(_ERROR_DESTROY_SIZE, None, err)
            self.fn("XLA_FFI_Error_Destroy")(ctypes.addressof(da))
        return msg

    def call(self, name: str, args: Structure) -> None:
        """Call an error-returning api function; raise :class:`FfiError` on error."""
        err = self.fn(name)(ctypes.addressof(args))
        if err:
            raise FfiError(f"{name} failed: {self.take_error(err)}", ErrorCode.INTERNAL)


_apis: dict[int, _Api] = {}
_apis_lock = threading.Lock()


def _get_api(address: int) -> _Api:
    api = _apis.get(address)
    if api is None:
        with _apis_lock:
            api = _apis.get(address)
            if api is None:
                api = _apis[address] = _Api(address)
    return api


# ---------------------------------------------------------------------------
# Public data types
# ---------------------------------------------------------------------------


class FfiError(Exception):
    """Raise from a handler to choose the XLA error code (default INTERNAL)."""

    def __init__(self, message: str, code: int = ErrorCode.INTERNAL):
        super().__init__(message)
        self.code = ErrorCode(code)


def _build_dtype_table() -> dict[int, np.dtype | None]:
    t: dict[int, np.dtype | None] = {
        DataType.PRED: np.dtype(np.bool_),
        DataType.S8: np.dtype(np.int8),
        DataType.S16: np.dtype(np.int16),
        DataType.S32: np.dtype(np.int32),
        DataType.S64: np.dtype(np.int64),
        DataType.U8: np.dtype(np.uint8),
        DataType.U16: np.dtype(np.uint16),
        DataType.U32: np.dtype(np.uint32),
        DataType.U64: np.dtype(np.uint64),
        DataType.F16: np.dtype(np.float16),
        DataType.F32: np.dtype(np.float32),
        DataType.F64: np.dtype(np.float64),
        DataType.C64: np.dtype(np.complex64),
        DataType.C128: np.dtype(np.complex128),
        DataType.TOKEN: None,
    }
    try:  # ml_dtypes is a hard dependency of jax; bf16 without it -> raw uint16 bits
        import ml_dtypes
    except ImportError:  # pragma: no cover
        ml_dtypes = None
    if ml_dtypes is None:  # pragma: no cover
        t[DataType.BF16] = np.dtype(np.uint16)
    names = {
        DataType.BF16: "bfloat16",
        DataType.F8E5M2: "float8_e5m2",
        DataType.F8E3M4: "float8_e3m4",
        DataType.F8E4M3: "float8_e4m3",
        DataType.F8E4M3FN: "float8_e4m3fn",
        DataType.F8E4M3B11FNUZ: "float8_e4m3b11fnuz",
        DataType.F8E5M2FNUZ: "float8_e5m2fnuz",
        DataType.F8E4M3FNUZ: "float8_e4m3fnuz",
        DataType.F8E8M0FNU: "float8_e8m0fnu",
        DataType.F4E2M1FN: "float4_e2m1fn",
        DataType.S1: None, DataType.U1: None,
        DataType.S2: "int2", DataType.U2: "uint2",
        DataType.S4: "int4", DataType.U4: "uint4",
    }
    for code, nm in names.items():
        if code in t:
            continue
        dt = getattr(ml_dtypes, nm, None) if (ml_dtypes is not None and nm) else None
        t[code] = np.dtype(dt) if dt is not None else None
    return t


#: XLA_FFI_DataType -> numpy dtype (``ml_dtypes.bfloat16`` for BF16; None for TOKEN
#: and types numpy cannot represent).
XLA_DTYPE_TO_NUMPY: dict[int, np.dtype | None] = _build_dtype_table()

# Bits per element for sub-byte types (XLA packs them; as_numpy refuses them).
_SUB_BYTE_BITS = {
    DataType.S1: 1, DataType.U1: 1, DataType.S2: 2, DataType.U2: 2,
    DataType.S4: 4, DataType.U4: 4, DataType.F4E2M1FN: 4,
}


class Buffer(NamedTuple):
    """One decoded ``XLA_FFI_Buffer`` (argument or result).

    Attributes:
      dtype: numpy dtype (``ml_dtypes.bfloat16`` for bf16, ml_dtypes float8 types...),
        or None for tokens / types without a numpy equivalent.
      dims: shape tuple (row-major unless the ffi_call asked for other layouts).
      data: data pointer as int (host pointer on CPU, device pointer on GPU; 0 for
        empty buffers is possible).
      xla_dtype: the raw ``XLA_FFI_DataType`` value.

    Valid only during the handler call: XLA owns the memory.
    """

    dtype: np.dtype | None
    dims: tuple
    data: int
    xla_dtype: int

    @property
    def shape(self) -> tuple:
        return self.dims

    @property
    def ndim(self) -> int:
        return len(self.dims)

    @property
    def size(self) -> int:
        return math.prod(self.dims)

    @property
    def nbytes(self) -> int:
        bits = _SUB_BYTE_BITS.get(self.xla_dtype)
        if bits is not None:
            return (self.size * bits + 7) // 8
        return 0 if self.dtype is None else self.size * self.dtype.itemsize


def as_numpy(buf: Buffer, *, readonly: bool = False) -> np.ndarray:
    """Zero-copy numpy view of a **host (CPU)** buffer; writable unless ``readonly``.

    The view aliases XLA-owned memory and must not outlive the handler call. Writing
    into an *argument* is only legitimate when it is aliased to a result
    (``input_output_aliases``); write results through the ``rets`` buffers.
    """
    if buf.dtype is None or buf.xla_dtype in _SUB_BYTE_BITS:
        raise TypeError(f"no numpy view for XLA dtype {DataType(buf.xla_dtype).name}")
    n = buf.size
    if n == 0 or not buf.data:
        arr = np.empty(buf.dims, dtype=buf.dtype)
    else:
        raw = (c_char * (n * buf.dtype.itemsize)).from_address(buf.data)
        arr = np.frombuffer(raw, dtype=buf.dtype).reshape(buf.dims)
    if readonly:
        arr.flags.writeable = False
    return arr


class _CudaArrayView:
    __slots__ = ("__cuda_array_interface__",)

    def __init__(self, cai: dict):
        self.__cuda_array_interface__ = cai


def cuda_array_interface(buf: Buffer, *, bf16_as_uint16: bool = True) -> Any:
    """Wrap a **GPU** buffer as an object exposing ``__cuda_array_interface__`` (v3).

    ``cupy.asarray(cuda_array_interface(buf))`` gives a zero-copy CuPy array. The
    interface's ``stream`` entry is omitted (= no synchronisation by the consumer):
    launch the kernels on ``ctx.stream()`` yourself, e.g. inside
    ``with cupy.cuda.ExternalStream(ctx.stream()):``. bf16 (no CAI typestr) is
    exposed as ``<u2`` raw bits. Untested here (no GPU on the dev machine).
    """
    if buf.xla_dtype == DataType.BF16 and bf16_as_uint16:
        typestr = "<u2"
    elif buf.dtype is None or buf.xla_dtype in _SUB_BYTE_BITS or buf.dtype.kind == "V":
        raise TypeError(f"no __cuda_array_interface__ typestr for {DataType(buf.xla_dtype).name}")
    else:
        typestr = buf.dtype.str
    return _CudaArrayView({
        "shape": tuple(buf.dims),
        "typestr": typestr,
        "data": (int(buf.data), False),
        "strides": None,  # C-contiguous
        "version": 3,
    })


# ---------------------------------------------------------------------------
# Call context
# ---------------------------------------------------------------------------


class CallContext:
    """Per-call view of the XLA execution context, passed to handlers as ``ctx``.

    Attributes:
      name, platform: registration name and canonical XLA platform ("Host", "CUDA").
      stage: the :class:`ExecutionStage` (always EXECUTE for ``fn``).
      call_frame, api, ctx_ptr: raw addresses (valid during the call only).
    """

    __slots__ = ("name", "platform", "is_cpu", "stage", "call_frame", "api", "ctx_ptr", "_api", "_attrs")

    def __init__(self, name: str, platform: str, is_cpu: bool, stage: int, call_frame: int, api: _Api, ctx_ptr: int):
        self.name = name
        self.platform = platform
        self.is_cpu = is_cpu
        self.stage = stage
        self.call_frame = call_frame
        self.api = api.address
        self.ctx_ptr = ctx_ptr
        self._api = api
        self._attrs = None

    @property
    def api_version(self) -> tuple[int, int]:
        """(major, minor) of the XLA runtime's FFI api table."""
        return self._api.version

    def stream(self) -> int:
        """``XLA_FFI_Stream_Get``: XLA's platform stream (``cudaStream_t``) as int.

        Enqueue device work on this stream; XLA orders it with the rest of the
        program. Raises :class:`FfiError` on platforms without a stream (CPU).
        """
        a = _StreamGetArgs(_STREAM_GET_SIZE, None, self.ctx_ptr, None)
        self._api.call("XLA_FFI_Stream_Get", a)
        return a.stream or 0

    def device_ordinal(self) -> int:
        """``XLA_FFI_DeviceOrdinal_Get`` (API >= 0.1 with this table entry)."""
        a = _DeviceOrdinalGetArgs(_DEVICE_ORDINAL_GET_SIZE, None, self.ctx_ptr, 0)
        self._api.call("XLA_FFI_DeviceOrdinal_Get", a)
        return int(a.device_ordinal)

    def run_id(self) -> int:
        """``XLA_FFI_RunId_Get``: id of the current logical execution."""
        a = _RunIdGetArgs(_RUN_ID_GET_SIZE, None, self.ctx_ptr, 0)
        self._api.call("XLA_FFI_RunId_Get", a)
        return int(a.run_id)

    def num_threads(self) -> int:
        """``XLA_FFI_ThreadPool_NumThreads`` (XLA:CPU intra-op pool)."""
        out = c_int64(0)
        a = _ThreadPoolNumThreadsArgs(_THREAD_POOL_NUM_THREADS_SIZE, None, self.ctx_ptr, ctypes.addressof(out))
        self._api.call("XLA_FFI_ThreadPool_NumThreads", a)
        return int(out.value)

    def numpy(self, buf: Buffer, *, readonly: bool = False) -> np.ndarray:
        """:func:`as_numpy`, refusing device buffers (non-CPU platforms)."""
        if not self.is_cpu:
            raise FfiError(f"as_numpy on a {self.platform} device buffer; use cuda_array_interface",
                           ErrorCode.INVALID_ARGUMENT)
        return as_numpy(buf, readonly=readonly)

    @property
    def attrs(self) -> dict:
        """The call's attributes (``ffi_call(...)(x, foo=1)``), decoded lazily.

        Scalars -> Python int/float/bool, strings -> str, arrays -> numpy copies,
        dictionaries -> dict. Attributes are compile-time constants of the call site;
        pass per-step values as a small array argument instead.
        """
        if self._attrs is None:
            cf = _CallFrame.from_address(self.call_frame)
            self._attrs = _decode_attrs(cf.attrs)
        return self._attrs


def alias_or_copy(ctx: CallContext, src: Buffer, dst: Buffer, *, copy: Callable[[int, int, int], None] | None = None) -> bool:
    """Make ``dst`` hold ``src``'s contents so it can then be updated in place.

    Returns True if ``dst`` already *is* ``src`` (the ffi_call aliased them with
    ``input_output_aliases``; XLA guarantees that, inserting a copy of a non-donated
    input itself), False if the data was copied (no alias declared). On CPU the copy is a
    memmove; on GPU it is ``copy(dst_ptr, src_ptr, nbytes)`` if given, else an async
    device-to-device ``cudaMemcpyAsync`` via CuPy on ``ctx.stream()`` (untested here).
    """
    if src.dims != dst.dims or src.xla_dtype != dst.xla_dtype:
        raise FfiError(f"alias_or_copy: {src.dims}/{src.dtype} vs {dst.dims}/{dst.dtype}", ErrorCode.INVALID_ARGUMENT)
    if src.data == dst.data:
        return True
    nbytes = src.nbytes
    if nbytes == 0:
        return False
    if copy is not None:
        copy(dst.data, src.data, nbytes)
    elif ctx.is_cpu:
        ctypes.memmove(dst.data, src.data, nbytes)
    else:
        import cupy  # noqa: PLC0415 (GPU only)

        rt = cupy.cuda.runtime
        rt.memcpyAsync(dst.data, src.data, nbytes, rt.memcpyDeviceToDevice, ctx.stream())
    return False


# ---------------------------------------------------------------------------
# Decoding
# ---------------------------------------------------------------------------

# Hot path: the ctypes Structures above document the layout; per call we instead read
# whole structs with precompiled `struct` formats through a zero-copy ctypes view
# (`_View.from_address(p)` touches no memory; unpack_from reads only fmt.size bytes).
# This is ~3x faster than ctypes field access. Formats use native ('@') alignment,
# which equals the C layout; checked against the Structures below at import.
_View = c_char * (1 << 30)
_view = _View.from_address
_CALL_FRAME_FMT = struct.Struct("@QPPPi" + "QPqPP" + "QPqPP" + "QPqPPP")
_BUFFER_FMT = struct.Struct("@QPiPqP")
assert _CALL_FRAME_FMT.size == _CALL_FRAME_SIZE and _BUFFER_FMT.size == _BUFFER_SIZE
assert sizeof(_CallFrame) == _CALL_FRAME_SIZE + 8  # + `future`
_tuple_new = tuple.__new__


class _FmtCache(dict):
    """n -> struct.Struct(f"@{n}{code}"), created on first use."""

    def __init__(self, code: str):
        super().__init__()
        self.code = code

    def __missing__(self, n: int) -> struct.Struct:
        fmt = self[n] = struct.Struct(f"@{n}{self.code}")
        return fmt


_INTS = _FmtCache("i")  # enum arrays (XLA_FFI_ArgType*, ...)
_PTRS = _FmtCache("P")  # void** arrays
_I64S = _FmtCache("q")  # int64_t* dims


def _decode_buffers(n: int, types_ptr: int, ptrs_ptr: int, kind: int) -> list:
    """Decode an XLA_FFI_Args/XLA_FFI_Rets (size, types, args) into Buffers."""
    if n <= 0:
        return []
    types = _INTS[n].unpack_from(_view(types_ptr))
    ptrs = _PTRS[n].unpack_from(_view(ptrs_ptr))
    dt_table = XLA_DTYPE_TO_NUMPY
    out = []
    for i in range(n):
        if types[i] != kind:
            out.append(None)  # a future argument kind; keep positions stable
            continue
        size, _, code, data, rank, dims_ptr = _BUFFER_FMT.unpack_from(_view(ptrs[i]))
        if size < _BUFFER_SIZE:
            raise FfiError(f"XLA_FFI_Buffer struct_size {size} < {_BUFFER_SIZE}", ErrorCode.INVALID_ARGUMENT)
        dims = _I64S[rank].unpack_from(_view(dims_ptr)) if rank > 0 else ()
        out.append(_tuple_new(Buffer, (dt_table.get(code), dims, data or 0, code)))
    return out


def _read_scalar(code: int, addr: int):
    dt = XLA_DTYPE_TO_NUMPY.get(code)
    if dt is None or not addr:
        raise FfiError(f"cannot decode scalar attribute of dtype {code}", ErrorCode.INVALID_ARGUMENT)
    v = np.frombuffer((c_char * dt.itemsize).from_address(addr), dtype=dt)[0]
    return v.item() if dt.kind in "biufc" else v


def _decode_attrs(a: _Attrs) -> dict:
    n = a.size
    if n <= 0:
        return {}
    if a.struct_size < _ATTRS_SIZE:
        raise FfiError(f"XLA_FFI_Attrs struct_size {a.struct_size} < {_ATTRS_SIZE}", ErrorCode.INVALID_ARGUMENT)
    types = (c_int * n).from_address(a.types)
    names = (c_void_p * n).from_address(a.names)
    ptrs = (c_void_p * n).from_address(a.attrs)
    out: dict[str, Any] = {}
    for i in range(n):
        span = _ByteSpan.from_address(names[i])
        name = ctypes.string_at(span.ptr, span.len).decode("utf-8") if span.len else ""
        t, p = types[i], ptrs[i]
        if t == _ATTR_SCALAR:
            s = _Scalar.from_address(p)
            out[name] = _read_scalar(s.dtype, s.value)
        elif t == _ATTR_STRING:
            s = _ByteSpan.from_address(p)
            out[name] = ctypes.string_at(s.ptr, s.len).decode("utf-8") if s.len else ""
        elif t == _ATTR_ARRAY:
            s = _Array.from_address(p)
            dt = XLA_DTYPE_TO_NUMPY.get(s.dtype)
            if dt is None:
                raise FfiError(f"cannot decode array attribute {name!r}", ErrorCode.INVALID_ARGUMENT)
            if s.size == 0:
                out[name] = np.empty(0, dt)
            else:
                raw = (c_char * (s.size * dt.itemsize)).from_address(s.data)
                out[name] = np.frombuffer(raw, dtype=dt).copy()
        elif t == _ATTR_DICTIONARY:
            out[name] = _decode_attrs(_Attrs.from_address(p))
        else:
            out[name] = None
    return out


# ---------------------------------------------------------------------------
# Metadata
# ---------------------------------------------------------------------------


def _find_metadata_extension(ext: int | None) -> int | None:
    # Walk the extension chain (api.h only looks at the first element; walking is a
    # superset and tolerates future extensions placed in front).
    seen = 0
    while ext and seen < 64:
        base = _ExtensionBase.from_address(ext)
        if base.type == _EXTENSION_METADATA:
            return ext
        ext = base.next
        seen += 1
    return None


def _populate_metadata(api_addr: int | None, ext_addr: int, traits: int) -> int | None:
    """Port of ``api.h``'s ``Handler::PopulateMetadata``. Returns an error ptr or None."""
    ext = _MetadataExtension.from_address(ext_addr)
    problem = None
    if ext.extension_base.struct_size < _METADATA_EXTENSION_SIZE:
        problem = f"Unexpected XLA_FFI_Metadata_Extension size: expected at least {_METADATA_EXTENSION_SIZE} got {ext.extension_base.struct_size}"
    elif not ext.metadata:
        problem = "XLA_FFI_Metadata_Extension.metadata is NULL"
    else:
        md = _Metadata.from_address(ext.metadata)
        if md.struct_size < _METADATA_SIZE:
            problem = f"Unexpected XLA_FFI_Metadata size: expected at least {_METADATA_SIZE} got {md.struct_size}"
    if problem is not None:
        if api_addr:  # some XLA versions pass api == NULL in the metadata query
            return _get_api(api_addr).create_error(ErrorCode.INVALID_ARGUMENT, problem)
        raise RuntimeError(problem)
    major, minor = handler_api_version()
    md.api_version.struct_size = _API_VERSION_SIZE
    md.api_version.extension_start = None
    md.api_version.major_version = major
    md.api_version.minor_version = minor
    md.traits = traits
    # XLA zero-initialises the rest (state_type_id = XLA_FFI_UNKNOWN_TYPE_ID); only
    # write it if the caller declares the field part of its struct.
    if md.struct_size >= _METADATA_FULL_SIZE:
        md.state_type_id = 0
    return None


# ---------------------------------------------------------------------------
# Registration
# ---------------------------------------------------------------------------


def _error_code_for(exc: BaseException) -> ErrorCode:
    if isinstance(exc, FfiError):
        return exc.code
    if isinstance(exc, (ValueError, TypeError, IndexError, KeyError)):
        return ErrorCode.INVALID_ARGUMENT
    if isinstance(exc, NotImplementedError):
        return ErrorCode.UNIMPLEMENTED
    if isinstance(exc, MemoryError):
        return ErrorCode.RESOURCE_EXHAUSTED
    if isinstance(exc, KeyboardInterrupt):
        return ErrorCode.CANCELLED
    return ErrorCode.INTERNAL


class HandlerRecord:
    """Registry record returned by :func:`register_python_handler`.

    Owns the ctypes trampoline (kept alive for the life of the process). Public
    attributes: ``name``, ``platform``, ``is_cpu``, ``fn`` (swappable), ``traits``,
    ``address`` (the C handler pointer), ``calls``, ``stage_calls``,
    ``metadata_queries``, ``last_exception``.
    """

    def __init__(self, name: str, platform: str, fn: Callable, traits: int, include_traceback: bool):
        self.name = name
        self.platform = platform
        self.is_cpu = platform.lower() in ("host", "cpu")
        self.fn = fn
        self.traits = int(traits)
        self.include_traceback = include_traceback
        self.calls = 0  # execute-stage calls that reached fn
        self.stage_calls = [0, 0, 0, 0]  # per ExecutionStage, excluding metadata queries
        self.metadata_queries = 0
        self.last_exception: BaseException | None = None
        self.c_handler = _HANDLER_T(self._trampoline)
        self.address = ctypes.cast(self.c_handler, c_void_p).value
        self.capsule = None

    def _trampoline(self, cf_addr):  # -> XLA_FFI_Error* as int (0/None = success)
        try:
            (cf_size, ext, api_addr, ctx_ptr, stage,
             a_size, _, a_n, a_types, a_ptrs,
             r_size, _, r_n, r_types, r_ptrs,
             *_attrs) = _CALL_FRAME_FMT.unpack_from(_view(cf_addr))
            if ext:
                md = _find_metadata_extension(ext)
                if md is not None:
                    self.metadata_queries += 1
                    return _populate_metadata(api_addr, md, self.traits)
            if cf_size < _CALL_FRAME_SIZE:
                raise FfiError(
                    f"Unexpected XLA_FFI_CallFrame size: expected at least {_CALL_FRAME_SIZE} got {cf_size}",
                    ErrorCode.INVALID_ARGUMENT,
                )
            if 0 <= stage < 4:
                self.stage_calls[stage] += 1
            if stage != 3:  # ExecutionStage.EXECUTE
                return None  # instantiate / prepare / initialize: nothing to do
            if (a_n > 0 and a_size < _ARGS_SIZE) or (r_n > 0 and r_size < _ARGS_SIZE):
                raise FfiError("XLA_FFI_Args/Rets struct_size too small", ErrorCode.INVALID_ARGUMENT)
            api = _apis.get(api_addr) or _get_api(api_addr)
            args = _decode_buffers(a_n, a_types, a_ptrs, _ARG_TYPE_BUFFER)
            rets = _decode_buffers(r_n, r_types, r_ptrs, _RET_TYPE_BUFFER)
            ctx = CallContext(self.name, self.platform, self.is_cpu, stage, cf_addr, api, ctx_ptr or 0)
            self.calls += 1
            self.fn(ctx, args, rets)
            return None
        except BaseException as exc:  # noqa: BLE001 -- must never escape into ctypes
            return self._error_from_exception(cf_addr, exc)

    def _error_from_exception(self, cf_addr, exc: BaseException):
        self.last_exception = exc
        try:
            msg = f"[ffi handler {self.name!r}] {type(exc).__name__}: {exc}"
            if self.include_traceback:
                msg += "\n" + "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
            api_addr = _CallFrame.from_address(cf_addr).api if cf_addr else None
            if api_addr:
                err = _get_api(api_addr).create_error(_error_code_for(exc), msg)
                if err:
                    return err
            # No api table (possible only in the metadata query of some XLA
            # versions): we cannot report an error; say so loudly.
            print(f"{__name__}: cannot report handler error to XLA: {msg}", file=sys.stderr)
        except BaseException:  # noqa: BLE001
            try:
                traceback.print_exc()
            except BaseException:  # noqa: BLE001
                pass
        return None


_registry: dict[tuple[str, str], HandlerRecord] = {}
_registry_lock = threading.Lock()


def _canonical_platform(platform: str) -> str:
    try:
        from jax._src.lib import xla_client

        names = getattr(xla_client, "xla_platform_names", {"cpu": "Host", "gpu": "CUDA"})
    except Exception:  # pragma: no cover
        names = {"cpu": "Host", "gpu": "CUDA"}
    p = names.get(platform.lower(), platform)
    return {"host": "Host", "cuda": "CUDA", "rocm": "ROCM"}.get(p.lower(), p)


def register_python_handler(
    name: str,
    fn: Callable[[CallContext, list, list], None],
    platform: str = "cpu",
    *,
    traits: int = 0,
    stages: tuple[str, ...] = ("execute",),
    include_traceback: bool = False,
) -> HandlerRecord:
    """Register ``fn`` as the XLA typed-FFI target ``name`` on ``platform``.

    ``fn(ctx: CallContext, args: list[Buffer], rets: list[Buffer]) -> None`` runs at
    the EXECUTE stage only; any exception becomes an XLA error (code from
    :class:`FfiError` or derived from the exception type) whose message contains
    ``"<ExcType>: <message>"``, so the jitted call raises ``JaxRuntimeError``.

    Call it with ``jax.ffi.ffi_call(name, result_shape_dtypes, ...)``.

    Args:
      platform: "cpu", "gpu"/"cuda" (anything ``register_ffi_target`` accepts).
      traits: XLA handler traits (0 or HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE --
        leave 0 for handlers doing host work).
      stages: which bundle slots to fill with the same trampoline: "execute" is
        required; "instantiate", "prepare", "initialize" answer success.
      include_traceback: append the Python traceback to the XLA error message.

    Registering the same ``(name, platform)`` again swaps the Python function in the
    existing trampoline (XLA's registry cannot be changed) and returns the record;
    ``stages`` of the first registration are kept, a different ``traits`` raises.
    The record (and the C function pointer) is kept alive for the life of the process.
    """
    stages = tuple(stages)
    valid = ("instantiate", "prepare", "initialize", "execute")
    if "execute" not in stages or any(s not in valid for s in stages):
        raise ValueError(f"stages must include 'execute' and be among {valid}; got {stages}")
    if not callable(fn):
        raise TypeError("fn must be callable")
    canon = _canonical_platform(platform)
    key = (name, canon)
    with _registry_lock:
        rec = _registry.get(key)
        if rec is not None:
            if rec.traits != int(traits):
                raise ValueError(f"{name!r} on {canon} already registered with traits={rec.traits}")
            rec.fn = fn
            rec.include_traceback = include_traceback
            return rec
        _check_header_compat()
        import jax

        rec = HandlerRecord(name, canon, fn, traits, include_traceback)
        rec.capsule = jax.ffi.pycapsule(rec.address)
        target = rec.capsule if stages == ("execute",) else {s: rec.capsule for s in stages}
        kwargs = {}
        if traits:
            from jax._src.lib import xla_client

            kwargs["traits"] = xla_client.CustomCallTargetTraits(int(traits))
        # Keep the record alive *before* XLA may call it (metadata query).
        _registry[key] = rec
        try:
            jax.ffi.register_ffi_target(name, target, platform=platform, api_version=1, **kwargs)
        except BaseException:
            del _registry[key]
            raise
        return rec


# ---------------------------------------------------------------------------
# Calling: a side-effecting call that keeps jit's C++ fast path
# ---------------------------------------------------------------------------


class _HashableArrayAttr:
    """numpy array attribute wrapped so that primitive params stay hashable."""

    __slots__ = ("array", "_key")

    def __init__(self, array: np.ndarray):
        self.array = np.array(array, copy=True)
        self._key = (self.array.dtype.str, self.array.shape, self.array.tobytes())

    def __hash__(self):
        return hash(self._key)

    def __eq__(self, other):
        return isinstance(other, _HashableArrayAttr) and self._key == other._key


_stateful_prim = None
_stateful_lock = threading.Lock()


def _get_stateful_primitive():
    global _stateful_prim
    with _stateful_lock:
        if _stateful_prim is not None:
            return _stateful_prim
        import functools

        import jax
        from jax.extend.core import Primitive
        from jax.interpreters import mlir

        prim = Primitive("trainstream_stateful_ffi_call")
        prim.multiple_results = True
        # No jaxpr effect on purpose (see stateful_ffi_call).
        prim.def_abstract_eval(lambda *avals, result_avals, **_: result_avals)

        @functools.lru_cache(maxsize=256)
        def _jitted(params_key):
            params = dict(params_key)
            return jax.jit(lambda *a: prim.bind(*a, **params))

        prim.def_impl(lambda *a, **params: _jitted(tuple(params.items()))(*a))

        def _lowering(ctx, *operands, target_name, result_avals, aliases, attrs):
            del result_avals  # ctx.avals_out carries them
            kw = {k: (v.array if isinstance(v, _HashableArrayAttr) else v) for k, v in attrs}
            rule = jax.ffi.ffi_lowering(target_name, has_side_effect=True, operand_output_aliases=dict(aliases))
            return rule(ctx, *operands, **kw)

        mlir.register_lowering(prim, _lowering)
        _stateful_prim = prim
        return prim


def stateful_ffi_call(target_name: str, result_shape_dtypes, *, input_output_aliases: dict | None = None):
    """Like ``jax.ffi.ffi_call(..., has_side_effect=True)`` but keeps jit's fast path.

    Returns ``call(*args, **attrs)`` giving one array (or a tuple if
    ``result_shape_dtypes`` is a list/tuple). The HLO custom call is marked
    ``custom_call_has_side_effect=true``, so XLA never CSEs two identical calls,
    never DCEs it and does not duplicate it; but the *jaxpr* carries no effect, so:

    * ``jax.jit`` dispatch stays on the C++ fast path (jax 0.10.2 CPU: ~15-25 us per
      call instead of ~100+ us with ``ffi_call(has_side_effect=True)``, whose FFI
      effect forces the Python dispatch path);
    * JAX's own jaxpr DCE **drops the call if none of its results is used**. Use it
      only where the results are consumed (e.g. the updated parameters returned by a
      train step, aliased in->out); otherwise use ``jax.ffi.ffi_call(...,
      has_side_effect=True)``.

    No vmap/grad rules are defined. Attributes must be hashable scalars/strings or
    numpy arrays.
    """
    import jax

    prim = _get_stateful_primitive()
    multiple = isinstance(result_shape_dtypes, (list, tuple))
    results = tuple(result_shape_dtypes) if multiple else (result_shape_dtypes,)
    try:
        from jax.core import ShapedArray
    except ImportError:  # pragma: no cover - moved in a future jax
        from jax._src.core import ShapedArray
    result_avals = tuple(ShapedArray(tuple(r.shape), np.dtype(r.dtype)) for r in results)
    aliases = tuple(sorted((input_output_aliases or {}).items()))

    def call(*args, **attrs):
        items = []
        for k, v in sorted(attrs.items()):
            if isinstance(v, np.ndarray):
                v = _HashableArrayAttr(v)
            else:
                hash(v)  # TypeError early for unhashable attributes
            items.append((k, v))
        out = prim.bind(*args, target_name=target_name, result_avals=result_avals,
                        aliases=aliases, attrs=tuple(items))
        return tuple(out) if multiple else out[0]

    del jax
    return call


def registered_handlers() -> dict[tuple[str, str], HandlerRecord]:
    """Snapshot of ``{(name, canonical_platform): record}``; records expose ``fn``,
    ``calls`` (execute count), ``stage_calls``, ``metadata_queries`` and
    ``last_exception``."""
    with _registry_lock:
        return dict(_registry)

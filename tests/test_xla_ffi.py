"""Tests for trainstream.jax._xla_ffi (Python typed-FFI handlers, CPU only)."""

import ctypes

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

from trainstream.jax import _xla_ffi as xf  # noqa: E402

# XLA's handler registry is process-global: every test uses its own target names.


def _sds(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype)


# --------------------------------------------------------------------------- aliasing


def _add_scalar_handler(log):
    def handler(ctx, args, rets):
        x, s = args
        (out,) = rets
        assert x.dtype == np.float32 and s.dims == (1,)
        aliased = xf.alias_or_copy(ctx, x, out)
        log.append((aliased, x.data, out.data))
        xf.as_numpy(out)[...] += xf.as_numpy(s, readonly=True)[0]

    return handler


def test_inplace_add_scalar_aliased_donated_under_jit():
    log = []
    xf.register_python_handler("ts_test_add_scalar", _add_scalar_handler(log))

    @jax.jit
    def step_impl(x, s):
        return jax.ffi.ffi_call("ts_test_add_scalar", _sds(x), input_output_aliases={0: 0},
                                has_side_effect=True)(x, s)

    step = jax.jit(step_impl, donate_argnums=0)
    x = jnp.arange(12, dtype=jnp.float32).reshape(3, 4)
    expected = np.arange(12, dtype=np.float32).reshape(3, 4)
    ptr = x.unsafe_buffer_pointer()
    for i in range(5):
        s = jnp.array([0.5 * (i + 1)], jnp.float32)
        x = step(x, s)
        expected = expected + np.float32(0.5 * (i + 1))
        np.testing.assert_array_equal(np.asarray(x), expected)
    assert len(log) == 5
    # aliased: the handler saw out == in, and with donation no copy was made at all
    assert all(aliased and a == b for aliased, a, b in log)
    assert x.unsafe_buffer_pointer() == ptr


def test_aliased_without_donation_keeps_input():
    log = []
    xf.register_python_handler("ts_test_add_scalar_nd", _add_scalar_handler(log))
    f = jax.jit(lambda x, s: jax.ffi.ffi_call("ts_test_add_scalar_nd", _sds(x),
                                                input_output_aliases={0: 0})(x, s))
    x = jnp.ones((5,), jnp.float32)
    y = f(x, jnp.array([2.0], jnp.float32))
    np.testing.assert_array_equal(np.asarray(y), np.full(5, 3.0, np.float32))
    np.testing.assert_array_equal(np.asarray(x), np.ones(5, np.float32))  # XLA copied first
    assert log[-1][0] is True


def test_not_aliased_copies_input_to_output():
    log = []
    xf.register_python_handler("ts_test_add_scalar_copy", _add_scalar_handler(log))
    f = jax.jit(lambda x, s: jax.ffi.ffi_call("ts_test_add_scalar_copy", _sds(x))(x, s))
    x = jnp.arange(7, dtype=jnp.float32)
    y = f(x, jnp.array([1.0], jnp.float32))
    np.testing.assert_array_equal(np.asarray(y), np.arange(7, dtype=np.float32) + 1)
    np.testing.assert_array_equal(np.asarray(x), np.arange(7, dtype=np.float32))
    aliased, a, b = log[-1]
    assert aliased is False and a != b


# --------------------------------------------------------------------------- dtypes


def test_multiple_args_and_rets_dtypes_shapes():
    seen = {}

    def handler(ctx, args, rets):
        seen["args"] = [(b.dtype, b.dims, b.xla_dtype) for b in args]
        seen["rets"] = [(b.dtype, b.dims, b.xla_dtype) for b in rets]
        for a, r in zip(args, rets):
            xf.as_numpy(r)[...] = xf.as_numpy(a) * 2

    xf.register_python_handler("ts_test_multi", handler)
    import ml_dtypes

    ins = (
        jnp.arange(6, dtype=jnp.float32).reshape(2, 3),
        jnp.arange(4, dtype=jnp.float16),
        jnp.arange(8, dtype=jnp.bfloat16).reshape(2, 2, 2),
        jnp.arange(3, dtype=jnp.int32),
        jnp.float32(1.25),  # rank-0
        jnp.zeros((0, 3), jnp.float32),  # empty
    )

    @jax.jit
    def f(*xs):
        return jax.ffi.ffi_call("ts_test_multi", [_sds(x) for x in xs])(*xs)

    outs = f(*ins)
    assert seen["args"] == [
        (np.dtype(np.float32), (2, 3), xf.DataType.F32),
        (np.dtype(np.float16), (4,), xf.DataType.F16),
        (np.dtype(ml_dtypes.bfloat16), (2, 2, 2), xf.DataType.BF16),
        (np.dtype(np.int32), (3,), xf.DataType.S32),
        (np.dtype(np.float32), (), xf.DataType.F32),
        (np.dtype(np.float32), (0, 3), xf.DataType.F32),
    ]
    assert seen["rets"] == seen["args"]
    for x, y in zip(ins, outs):
        assert y.dtype == x.dtype and y.shape == x.shape
        np.testing.assert_array_equal(np.asarray(y), np.asarray(x) * 2)


def test_buffer_properties_and_bf16_bits():
    b = xf.Buffer(np.dtype(np.float32), (2, 3), 0, int(xf.DataType.F32))
    assert b.shape == (2, 3) and b.size == 6 and b.nbytes == 24 and b.ndim == 2
    bits = {}

    def handler(ctx, args, rets):
        bits["raw"] = xf.as_numpy(args[0]).view(np.uint16).copy()
        xf.alias_or_copy(ctx, args[0], rets[0])

    xf.register_python_handler("ts_test_bf16bits", handler)
    x = jnp.array([1.0, -2.0], jnp.bfloat16)
    jax.jit(lambda x: jax.ffi.ffi_call("ts_test_bf16bits", _sds(x))(x))(x).block_until_ready()
    np.testing.assert_array_equal(bits["raw"], np.asarray(x).view(np.uint16))


def test_attributes_decoded():
    seen = {}

    def handler(ctx, args, rets):
        seen.update(ctx.attrs)
        xf.alias_or_copy(ctx, args[0], rets[0])

    xf.register_python_handler("ts_test_attrs", handler)
    x = jnp.zeros(2)
    jax.jit(lambda x: jax.ffi.ffi_call("ts_test_attrs", _sds(x))(
        x, i=np.int64(-7), f=np.float32(2.5), d=1.5, flag=True, name="adamw",
        arr=np.arange(3, dtype=np.int32)))(x).block_until_ready()
    assert seen["i"] == -7 and seen["f"] == 2.5 and seen["d"] == 1.5
    assert seen["flag"] is True and seen["name"] == "adamw"
    np.testing.assert_array_equal(seen["arr"], np.arange(3, dtype=np.int32))


# --------------------------------------------------------------------------- errors


def test_exception_surfaces_and_process_stays_healthy():
    calls = []

    def handler(ctx, args, rets):
        calls.append(1)
        if float(xf.as_numpy(args[0])[0]) < 0:
            raise ValueError("negative learning rate: original text 42")
        xf.as_numpy(rets[0])[...] = xf.as_numpy(args[0]) + 1

    rec = xf.register_python_handler("ts_test_raise", handler)
    f = jax.jit(lambda x: jax.ffi.ffi_call("ts_test_raise", _sds(x))(x))
    with pytest.raises(Exception) as ei:
        f(jnp.array([-1.0], jnp.float32)).block_until_ready()
    msg = str(ei.value)
    assert "negative learning rate: original text 42" in msg
    assert "ValueError" in msg and "INVALID_ARGUMENT" in msg
    assert not isinstance(ei.value, ValueError)  # it came back through XLA
    assert isinstance(rec.last_exception, ValueError)
    # healthy afterwards: the same executable and a new one both work
    np.testing.assert_array_equal(np.asarray(f(jnp.array([1.0], jnp.float32))), [2.0])
    g = jax.jit(lambda x: jax.ffi.ffi_call("ts_test_raise", _sds(x))(x) * 3)
    np.testing.assert_array_equal(np.asarray(g(jnp.array([1.0], jnp.float32))), [6.0])
    assert len(calls) == 3


def test_ffi_error_code_and_base_exceptions():
    def handler(ctx, args, rets):
        mode = int(xf.as_numpy(args[0])[0])
        if mode == 0:
            raise xf.FfiError("state handle 17 is gone", xf.ErrorCode.FAILED_PRECONDITION)
        if mode == 1:
            raise SystemExit("exit inside handler")
        xf.alias_or_copy(ctx, args[0], rets[0])

    xf.register_python_handler("ts_test_codes", handler)
    f = jax.jit(lambda x: jax.ffi.ffi_call("ts_test_codes", _sds(x))(x))
    with pytest.raises(Exception, match="FAILED_PRECONDITION.*state handle 17 is gone"):
        f(jnp.array([0], jnp.int32)).block_until_ready()
    with pytest.raises(Exception, match="SystemExit: exit inside handler"):
        f(jnp.array([1], jnp.int32)).block_until_ready()
    assert int(f(jnp.array([5], jnp.int32))[0]) == 5


def test_traceback_option_and_reregistration_swaps_fn():
    def bad(ctx, args, rets):
        raise RuntimeError("first version")

    def good(ctx, args, rets):
        xf.as_numpy(rets[0])[...] = 7

    rec = xf.register_python_handler("ts_test_swap", bad, include_traceback=True)
    f = jax.jit(lambda x: jax.ffi.ffi_call("ts_test_swap", _sds(x))(x))
    with pytest.raises(Exception, match="(?s)first version.*Traceback"):
        f(jnp.zeros(1)).block_until_ready()
    assert xf.register_python_handler("ts_test_swap", good) is rec
    # the compiled executable calls the same C pointer, now dispatching to `good`
    np.testing.assert_array_equal(np.asarray(f(jnp.zeros(1))), [7.0])


# --------------------------------------------------------------------------- context


def test_context_helpers_on_cpu():
    seen = {}

    def handler(ctx, args, rets):
        assert ctx.numpy(args[0]).shape == (3,)
        seen["ordinal"] = ctx.device_ordinal()
        seen["run_id"] = ctx.run_id()
        seen["threads"] = ctx.num_threads()
        seen["api_version"] = ctx.api_version
        seen["platform"] = (ctx.platform, ctx.is_cpu, ctx.stage)
        with pytest.raises(xf.FfiError):  # no stream on CPU; error read and destroyed
            ctx.stream()
        xf.alias_or_copy(ctx, args[0], rets[0])

    xf.register_python_handler("ts_test_ctx", handler)
    x = jnp.zeros(3)
    jax.jit(lambda x: jax.ffi.ffi_call("ts_test_ctx", _sds(x))(x))(x).block_until_ready()
    assert seen["ordinal"] == 0
    assert isinstance(seen["run_id"], int) and seen["threads"] >= 1
    assert seen["api_version"][0] == 0 and seen["api_version"] >= xf.handler_api_version()
    assert seen["platform"] == ("Host", True, xf.ExecutionStage.EXECUTE)


def test_header_matches_struct_layout():
    info = xf.header_info()
    if info["path"] is None:
        pytest.skip("jaxlib ships no FFI headers")
    assert info["major"] == 0
    funcs = tuple(xf._KNOWN_RENAMES.get(f, f) for f in info["api_functions"])
    n = min(len(funcs), len(xf._API_FUNCTIONS))
    assert funcs[:n] == xf._API_FUNCTIONS[:n]
    assert xf.handler_api_version() <= (info["major"], info["minor"])
    getter = {"XLA_FFI_Error_GetMessage_Args"}
    assert set(xf._HEADER_STRUCTS) - getter <= set(info["structs"])  # all found in the header
    assert xf._error_message_readable()
    for cname, fields in info["structs"].items():
        if cname not in xf._HEADER_STRUCTS:
            continue
        ours = tuple(f[0] for f in xf._HEADER_STRUCTS[cname]._fields_)
        assert fields[:len(ours)] == ours[:len(fields)], cname
    xf._check_header_compat()


# --------------------------------------------------------------------------- stages


def test_metadata_query_answered_directly():
    """Call the C handler like XLA's GetMetadata does (api may be NULL there)."""
    rec = xf.register_python_handler("ts_test_meta", lambda ctx, a, r: None)
    assert rec.metadata_queries >= 1  # XLA asked at registration
    md = xf._Metadata()
    md.struct_size = xf._METADATA_SIZE
    md.api_version.struct_size = xf._API_VERSION_SIZE
    ext = xf._MetadataExtension()
    ext.extension_base.struct_size = xf._METADATA_EXTENSION_SIZE
    ext.extension_base.type = 1
    ext.metadata = ctypes.addressof(md)
    cf = xf._CallFrame()
    cf.struct_size = xf._CALL_FRAME_SIZE
    cf.extension_start = ctypes.addressof(ext)
    cf.api = None
    cf.stage = xf.ExecutionStage.EXECUTE
    handler = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)(rec.address)
    calls_before = rec.calls
    assert handler(ctypes.addressof(cf)) is None
    assert (md.api_version.major_version, md.api_version.minor_version) == xf.handler_api_version()
    assert md.api_version.struct_size == xf._API_VERSION_SIZE
    assert md.traits == 0 and md.state_type_id == 0
    assert rec.calls == calls_before  # fn not run for the metadata query


def test_all_stages_registered_fn_runs_only_at_execute():
    stages = []
    rec = xf.register_python_handler(
        "ts_test_stages", lambda ctx, a, r: (stages.append(ctx.stage), xf.alias_or_copy(ctx, a[0], r[0])),
        stages=("instantiate", "prepare", "initialize", "execute"))
    f = jax.jit(lambda x: jax.ffi.ffi_call("ts_test_stages", _sds(x))(x))
    for _ in range(3):
        f(jnp.ones(2)).block_until_ready()
    assert stages == [xf.ExecutionStage.EXECUTE] * 3
    assert rec.stage_calls[xf.ExecutionStage.EXECUTE] == 3
    assert rec.stage_calls[xf.ExecutionStage.INSTANTIATE] >= 1  # XLA:CPU instantiates once


def test_bad_registration_arguments():
    with pytest.raises(ValueError):
        xf.register_python_handler("ts_test_bad", lambda c, a, r: None, stages=("prepare",))
    with pytest.raises(TypeError):
        xf.register_python_handler("ts_test_bad2", 3)


# --------------------------------------------------------------------------- ordering / DCE


def _counter_handler(log):
    def handler(ctx, args, rets):
        log.append(ctx.attrs.get("tag"))
        xf.alias_or_copy(ctx, args[0], rets[0])
    return handler


def test_side_effect_flag_prevents_dce_and_cse():
    log = []
    xf.register_python_handler("ts_test_dce", _counter_handler(log))
    x = jnp.ones(3)

    def run(has_side_effect, tag):
        def f(x):
            c = lambda: jax.ffi.ffi_call("ts_test_dce", _sds(x), has_side_effect=has_side_effect)(x, tag=tag)
            c()  # result unused
            return c() + c()  # two identical calls
        log.clear()
        jax.jit(f)(x).block_until_ready()
        return list(log)

    assert run(False, 1) == [1]  # unused call dropped, identical calls merged (CSE)
    assert run(True, 2) == [2, 2, 2]  # all kept


def test_stateful_ffi_call_no_cse_and_chained_order():
    log = []
    xf.register_python_handler("ts_test_chain", _counter_handler(log))

    @jax.jit
    def f(x):
        for t in range(6):
            x = xf.stateful_ffi_call("ts_test_chain", _sds(x), input_output_aliases={0: 0})(x, tag=t)
        return x

    np.testing.assert_array_equal(np.asarray(f(jnp.ones(2))), [1.0, 1.0])
    assert log == list(range(6))
    log.clear()
    g = jax.jit(lambda x: xf.stateful_ffi_call("ts_test_chain", _sds(x))(x, tag=9)
                + xf.stateful_ffi_call("ts_test_chain", _sds(x))(x, tag=9))
    g(jnp.ones(2)).block_until_ready()
    assert log == [9, 9]  # not merged by XLA CSE
    log.clear()
    out = xf.stateful_ffi_call("ts_test_chain", _sds(jnp.ones(2)))(jnp.ones(2), tag=3)  # eager
    np.testing.assert_array_equal(np.asarray(out), [1.0, 1.0])
    assert log == [3]


def test_inside_fori_loop():
    n = []

    def handler(ctx, args, rets):
        n.append(1)
        xf.alias_or_copy(ctx, args[0], rets[0])
        xf.as_numpy(rets[0])[...] += xf.as_numpy(args[1])

    xf.register_python_handler("ts_test_loop", handler)

    @jax.jit
    def f(x, s):
        body = lambda i, x: jax.ffi.ffi_call("ts_test_loop", _sds(x), input_output_aliases={0: 0},
                                             has_side_effect=True)(x, s)
        return jax.lax.fori_loop(0, 10, body, x)

    y = f(jnp.zeros(3, jnp.float32), jnp.full((3,), 0.5, jnp.float32))
    np.testing.assert_array_equal(np.asarray(y), np.full(3, 5.0, np.float32))
    assert len(n) == 10


# --------------------------------------------------------------------------- GPU (what can run on CPU)


def test_gpu_registration_is_accepted_and_device_guards():
    # On a CPU-only install JAX defers "CUDA" registrations until a CUDA plugin
    # loads; this checks the platform mapping and that nothing is called early.
    rec = xf.register_python_handler("ts_test_gpu_reg", lambda ctx, a, r: None, platform="gpu")
    assert rec.platform == "CUDA" and rec.is_cpu is False
    assert xf.registered_handlers()[("ts_test_gpu_reg", "CUDA")] is rec
    fake_api = xf._Api.__new__(xf._Api)
    fake_api.address, fake_api.struct_size, fake_api.version, fake_api._fns = 0, 0, (0, 0), {}
    ctx = xf.CallContext("n", "CUDA", False, xf.ExecutionStage.EXECUTE, 0, fake_api, 0)
    buf = xf.Buffer(np.dtype(np.float32), (4,), 12345, int(xf.DataType.F32))
    with pytest.raises(xf.FfiError):
        ctx.numpy(buf)
    with pytest.raises(xf.FfiError, match="not available"):
        ctx.stream()  # api table without Stream_Get -> clean FfiError, no crash
    cai = xf.cuda_array_interface(buf).__cuda_array_interface__
    assert cai["shape"] == (4,) and cai["typestr"] == "<f4" and cai["data"] == (12345, False)
    bf = xf.Buffer(None, (2,), 1, int(xf.DataType.BF16))
    assert xf.cuda_array_interface(bf).__cuda_array_interface__["typestr"] == "<u2"

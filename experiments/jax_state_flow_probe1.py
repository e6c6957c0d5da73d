# Run (GPU machine, from the repository root, the WIP patch tree of experiments/log/2026-12-01_wip_jax_buffer_callback.patch on PYTHONPATH as ./wt): OUT=$OUT python3 experiments/jax_state_flow_probe1.py NAME
"""GPU probe 1 (research for issue #19): how optimizer state in pinned host memory flows
through a plain jax.jit on XLA:GPU with jax.experimental.buffer_callback.

python3 probe1.py NAME  runs one probe (the driver runs each in its own process).
"""
import ctypes
import json
import os
import sys
import time
import traceback

import numpy as np

OUT = os.environ.get("OUT", "/tmp")
RES = {}


def emit(k, v):
    RES[k] = v
    print(f"RESULT {k} = {v!r}", flush=True)


# ---- libcuda pointer attributes ------------------------------------------------------------
_cu = None


def cu():
    global _cu
    if _cu is None:
        _cu = ctypes.CDLL("libcuda.so.1")
    return _cu


def ptr_info(ptr):
    """(memory type: 1 host 2 device 4 unified, device pointer, host pointer) or error."""
    lib = cu()
    out = {}
    for name, attr, ty in (("type", 2, ctypes.c_uint), ("devptr", 3, ctypes.c_uint64),
                           ("hostptr", 4, ctypes.c_uint64), ("ordinal", 9, ctypes.c_int)):
        v = ty(0)
        rc = lib.cuPointerGetAttribute(ctypes.byref(v), ctypes.c_int(attr), ctypes.c_uint64(int(ptr)))
        out[name] = int(v.value) if rc == 0 else f"rc{rc}"
    return out


def bptr(buf):
    try:
        return int(buf.__cuda_array_interface__["data"][0])
    except Exception:  # noqa: BLE001 - XLA:CPU buffers (local dry run)
        return int(np.asarray(buf).ctypes.data)


# ---- the scalar matrix (the WIP contract function) -----------------------------------------
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def setup():
    import jax
    import jax.numpy as jnp
    import optax
    from trainstream import _contract as C
    from trainstream import _device_kernels as dk
    return jax, jnp, optax, C, dk


def make_case(jax, jnp, sizes, dtype="float32", seed=0):
    rng = np.random.default_rng(seed)
    dev = jax.devices("gpu")[0]
    p = [jax.device_put(jnp.asarray(rng.standard_normal(n).astype(np.float32), dtype), dev) for n in sizes]
    return dev, p, rng


# ============================================================================================
def probe_env():
    import inspect
    import jax
    import jaxlib
    emit("jax", jax.__version__)
    emit("jaxlib", jaxlib.__version__)
    from jax.experimental import buffer_callback as bc
    emit("buffer_callback_sig", str(inspect.signature(bc.buffer_callback)))
    emit("ExecutionContext_attrs", [a for a in dir(bc.ExecutionContext) if not a.startswith("_")])
    emit("Buffer_attrs", [a for a in dir(bc.Buffer) if not a.startswith("_")])
    d = jax.devices("gpu")[0]
    emit("device", str(d))
    emit("memories", [str(m) for m in d.addressable_memories()])
    emit("default_memory", str(d.default_memory()))
    emit("has_jax_memory_Space", hasattr(jax, "memory") and hasattr(jax.memory, "Space"))
    for mod in ("flax", "orbax.checkpoint", "optax", "cupy", "numba"):
        try:
            m = __import__(mod, fromlist=["x"])
            emit(f"ver_{mod}", getattr(m, "__version__", "?"))
        except Exception as e:  # noqa: BLE001
            emit(f"ver_{mod}", f"missing {e}")
    x = jax.device_put(np.ones(4, np.float32), jax.sharding.SingleDeviceSharding(d, memory_kind="pinned_host"))
    emit("pinned_host_put_typeof", str(jax.typeof(x)))
    emit("pinned_host_ptr", ptr_info(x.unsafe_buffer_pointer()))
    seen = {}

    def f(x, y):
        seen["x"], seen["y"] = str(jax.typeof(x)), str(jax.typeof(y))
        return x, y * 2

    r = jax.jit(f)(x, jax.device_put(np.ones(4, np.float32), d))
    emit("traced_avals", seen)
    emit("passthrough_kinds", [a.sharding.memory_kind for a in r])


# ============================================================================================
def _flow(wrap, donate, sizes=(1000, 4097, 33), steps=5, dtype="float32", check_ref=True, dump_hlo=False,
          n_big=None):
    """gpu mode prototype: the zero-copy kernel on pinned_host moments, compared with jitted
    optax.adamw on the GPU (bits)."""
    jax, jnp, optax, C, dk = setup()
    from jax.experimental.buffer_callback import buffer_callback
    if n_big:
        sizes = (n_big,)
    dev, p, rng = make_case(jax, jnp, sizes, dtype)
    host = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
    n = len(sizes)
    half = dtype != "float32"
    mu = [jax.device_put(np.zeros(k, np.float32), host) for k in sizes]
    nu = [jax.device_put(np.zeros(k, np.float32), host) for k in sizes]
    master = [jax.device_put(np.asarray(x.astype(jnp.float32)), host) for x in p] if half else []
    seen = {}
    lr, wd = 1e-2, 1e-2

    def cb(ctx, outs, scal, *ins):
        g, pp = ins[:n], ins[n:2 * n]
        if not seen:
            seen["stream"] = int(ctx.stream)
            seen["in_g"] = ptr_info(bptr(g[0]))
            seen["in_p"] = ptr_info(bptr(pp[0]))
            seen["in_mu"] = ptr_info(bptr(ins[2 * n]))
            seen["out_p"] = ptr_info(bptr(outs[0]))
            seen["out_mu"] = ptr_info(bptr(outs[n]))
            seen["in_mu_ptr"] = bptr(ins[2 * n])
            seen["out_mu_ptr"] = bptr(outs[n])
        s0 = bptr(scal)
        for i in range(n):
            dk.launch_adamw(C.VARIANT_OPTAX_CUDA, bptr(outs[i]), dtype, bptr(g[i]), dtype,
                            bptr(outs[3 * n + i]) if half else 0, bptr(outs[n + i]), bptr(outs[2 * n + i]),
                            sizes[i], None, stream=int(ctx.stream), scalars_ptr=s0 + 4 * C.N_SCALARS * i, device=0)

    def step(count, g, p, mu, nu, master):
        sc = C.optax_scalar_matrix(count, [0] * n, [True] * n, learning_rate=lr, b1=0.9, b2=0.999, eps=1e-8,
                                   weight_decay=wd, xp=jnp)
        sds = jax.ShapeDtypeStruct
        res = [sds(x.shape, x.dtype) for x in p] + [sds(x.shape, jnp.float32) for x in p] * 2 + \
              [sds(x.shape, jnp.float32) for x in master]
        args = [sc.scalars, *g, *p, *mu, *nu, *master]
        aliases = {1 + n + i: i for i in range(n)}
        aliases.update({1 + 2 * n + j: n + j for j in range(2 * n + len(master))})
        outs = buffer_callback(cb, res, input_output_aliases=aliases)(*args)
        newp = list(outs[:n])
        st = list(outs[n:])
        if wrap == "space":
            st = [jax.device_put(x, jax.memory.Space.Host) for x in st]
        elif wrap == "sharding":
            st = [jax.device_put(x, host) for x in st]
        mu_, nu_, ma_ = st[:n], st[n:2 * n], st[2 * n:]
        return sc.count_inc, newp, mu_, nu_, ma_

    jstep = jax.jit(step, donate_argnums=(2, 3, 4, 5) if donate else ())
    count = jax.device_put(jnp.zeros([], jnp.int32), dev)
    gs = [[jax.device_put(jnp.asarray(rng.standard_normal(k).astype(np.float32) * 0.1, dtype), dev) for k in sizes]
          for _ in range(steps)]
    if dump_hlo:
        txt = jstep.lower(count, gs[0], p, mu, nu, master).compile().as_text()
        with open(os.path.join(OUT, f"hlo_{wrap}_{'donate' if donate else 'nodonate'}.txt"), "w") as f:
            f.write(txt)
        lines = [ln for ln in txt.splitlines() if ("custom-call" in ln or " copy" in ln or "S(5)" in ln
                                                   or "compute_type" in ln)]
        emit("hlo_interesting", lines[:40])
    p0 = [x for x in p]
    p0_np = [np.asarray(x.astype(jnp.float32)) for x in p]
    t0 = time.perf_counter()
    cur = (count, p, mu, nu, master)
    for t in range(steps):
        c, pp, m, v, ma = cur
        cur = jstep(c, gs[t], pp, m, v, ma)
    jax.block_until_ready(cur)
    emit("run_s", time.perf_counter() - t0)
    c, pp, m, v, ma = cur
    emit("seen", seen)
    emit("out_memory_kinds", [x.sharding.memory_kind for x in (m[0], v[0], pp[0])])
    emit("out_mu_ptr", ptr_info(m[0].unsafe_buffer_pointer()))
    if check_ref:
        ref = optax.adamw(lr, weight_decay=wd)
        P = [jax.device_put(jnp.asarray(a), dev) for a in p0_np]
        S = ref.init(P)

        @jax.jit
        def rstep(g, s, pr):
            u, s = ref.update(g, s, pr)
            return optax.apply_updates(pr, u), s

        for t in range(steps):
            P, S = rstep([x.astype(jnp.float32) for x in gs[t]], S, P)
        ours = [np.asarray(x) for x in (ma if half else pp)]
        bad = sum(int((a.view(np.uint32) != np.asarray(b).view(np.uint32)).sum()) for a, b in zip(ours, P))
        badm = sum(int((np.asarray(a).view(np.uint32) != np.asarray(b).view(np.uint32)).sum())
                   for a, b in zip(m, S[0].mu))
        emit("ref_mismatch_weights", bad)
        emit("ref_mismatch_mu", badm)
    del p0


def probe_flow_space_donate():
    _flow("space", True, dump_hlo=True)


def probe_flow_space_nodonate():
    _flow("space", False, dump_hlo=True)


def probe_flow_sharding_donate():
    _flow("sharding", True)


def probe_flow_nowrap():
    _flow("none", True)


def probe_flow_bf16():
    _flow("space", True, dtype="bfloat16")


def probe_flow_big():
    """bandwidth of gpu mode design A, donated vs not: 64M fp32 elements."""
    jax, jnp, optax, C, dk = setup()
    for donate in (True, False):
        _flow("space", donate, n_big=1 << 26, steps=1, check_ref=False)
        t = time.perf_counter()
        _flow("space", donate, n_big=1 << 26, steps=6, check_ref=False)
        emit(f"big_total_s_donate{donate}", time.perf_counter() - t)


# ============================================================================================
def probe_select_on_host():
    """optax.MultiSteps does jnp.where(emit, new, old) on the inner state, and lax.cond."""
    import jax
    import jax.numpy as jnp
    dev = jax.devices("gpu")[0]
    host = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
    n = 1 << 24
    a = jax.device_put(np.ones(n, np.float32), host)
    b = jax.device_put(np.zeros(n, np.float32), host)

    def f(a, b, k):
        return jnp.where(k > 0, a, b)

    try:
        j = jax.jit(f)
        txt = j.lower(a, b, jnp.int32(1)).compile().as_text()
        emit("select_hlo", [ln for ln in txt.splitlines() if "select" in ln or "S(5)" in ln][:10])
        r = j(a, b, jax.device_put(jnp.int32(1), dev))
        r.block_until_ready()
        t = time.perf_counter()
        for _ in range(5):
            r = j(a, b, jax.device_put(jnp.int32(1), dev))
        r.block_until_ready()
        emit("select_ms", (time.perf_counter() - t) / 5 * 1e3)
        emit("select_kind", r.sharding.memory_kind)
        emit("select_ok", bool(np.asarray(r)[:10].sum() == 10))
    except Exception as e:  # noqa: BLE001
        emit("select_error", f"{type(e).__name__}: {str(e)[:800]}")

    def g(a, b, k):
        return jax.lax.cond(k > 0, lambda x, y: x, lambda x, y: y, a, b)

    try:
        r = jax.jit(g)(a, b, jax.device_put(jnp.int32(1), dev))
        emit("cond_kind", r.sharding.memory_kind)
        emit("cond_ok", bool(np.asarray(r)[:10].sum() == 10))
    except Exception as e:  # noqa: BLE001
        emit("cond_error", f"{type(e).__name__}: {str(e)[:800]}")

    def h(a, k):
        return a * 2.0

    try:
        r = jax.jit(h)(a, 1)
        emit("mul_kind", r.sharding.memory_kind)
    except Exception as e:  # noqa: BLE001
        emit("mul_error", f"{type(e).__name__}: {str(e)[:800]}")


# ============================================================================================
def probe_cpu_mode():
    """cpu mode prototypes (64M fp32): (a) D2H memcpy on XLA's stream + sync + host kernel on
    pinned_host views + H2D upload; (b) XLA moves the gradient to host memory in the program,
    the callback syncs, updates, writes host output weights, XLA moves them back."""
    jax, jnp, optax, C, dk = setup()
    from jax.experimental.buffer_callback import buffer_callback
    from trainstream import _host_kernels as K
    cp = dk._cupy()
    n = 1 << 24
    dev, p, rng = make_case(jax, jnp, (n,))
    host = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
    mu = jax.device_put(np.zeros(n, np.float32), host)
    nu = jax.device_put(np.zeros(n, np.float32), host)
    g = jax.device_put(jnp.asarray(rng.standard_normal(n).astype(np.float32)), dev)
    stage_g = cp.cuda.alloc_pinned_memory(4 * n)
    stage_p = cp.cuda.alloc_pinned_memory(4 * n)
    stage_s = cp.cuda.alloc_pinned_memory(4 * 64)
    sg = np.frombuffer(stage_g, np.float32, n)
    sp = np.frombuffer(stage_p, np.float32, n)
    ss = np.frombuffer(stage_s, np.float32, 64)
    info = {}

    def hv(buf, k):
        return dk.host_view(bptr(buf), k, np.float32)

    def cb_a(ctx, outs, scal, g, p, mu, nu):
        s = int(ctx.stream)
        rt = cp.cuda.runtime
        t0 = time.perf_counter()
        rt.memcpyAsync(sg.ctypes.data, bptr(g), 4 * n, 2, s)
        rt.memcpyAsync(sp.ctypes.data, bptr(p), 4 * n, 2, s)
        rt.memcpyAsync(ss.ctypes.data, bptr(scal), 4 * C.N_SCALARS, 2, s)
        rt.streamSynchronize(s)
        t1 = time.perf_counter()
        K.adamw_chunk(C.VARIANT_OPTAX_CUDA, sp, hv(outs[1], n), hv(outs[2], n), sg, K.KIND_F32, None, 0, 0, n,
                      ss[:C.N_SCALARS].copy(), 0)
        t2 = time.perf_counter()
        rt.memcpyAsync(bptr(outs[0]), sp.ctypes.data, 4 * n, 1, s)
        info.setdefault("a", []).append((t1 - t0, t2 - t1))

    def step_a(count, g, p, mu, nu):
        sc = C.optax_scalar_matrix(count, [0], [True], learning_rate=1e-3, b1=0.9, b2=0.999, eps=1e-8,
                                   weight_decay=1e-2, xp=jnp)
        sds = jax.ShapeDtypeStruct
        o = buffer_callback(cb_a, [sds(p.shape, p.dtype), sds(p.shape, jnp.float32), sds(p.shape, jnp.float32)],
                            input_output_aliases={2: 0, 3: 1, 4: 2})(sc.scalars, g, p, mu, nu)
        return sc.count_inc, o[0], jax.device_put(o[1], jax.memory.Space.Host), jax.device_put(o[2], jax.memory.Space.Host)

    def cb_b(ctx, outs, scal, g, p, mu, nu):
        s = int(ctx.stream)
        rt = cp.cuda.runtime
        t0 = time.perf_counter()
        rt.memcpyAsync(ss.ctypes.data, bptr(scal), 4 * C.N_SCALARS, 2, s)
        rt.streamSynchronize(s)
        t1 = time.perf_counter()
        info.setdefault("b_ptrs", [ptr_info(bptr(g)), ptr_info(bptr(p)), ptr_info(bptr(outs[0]))])
        K.adamw_chunk(C.VARIANT_OPTAX_CUDA, hv(outs[0], n), hv(outs[1], n), hv(outs[2], n), hv(g, n), K.KIND_F32,
                      None, 0, 0, n, ss[:C.N_SCALARS].copy(), 0)
        t2 = time.perf_counter()
        info.setdefault("b", []).append((t1 - t0, t2 - t1))

    def step_b(count, g, p, mu, nu):
        sc = C.optax_scalar_matrix(count, [0], [True], learning_rate=1e-3, b1=0.9, b2=0.999, eps=1e-8,
                                   weight_decay=1e-2, xp=jnp)
        H = jax.memory.Space.Host
        gh = jax.device_put(g, H)
        ph = jax.device_put(p, H)
        sds = jax.ShapeDtypeStruct
        o = buffer_callback(cb_b, [sds(p.shape, p.dtype), sds(p.shape, jnp.float32), sds(p.shape, jnp.float32)],
                            input_output_aliases={2: 0, 3: 1, 4: 2})(sc.scalars, gh, ph, mu, nu)
        o = [jax.device_put(x, H) for x in o]
        return sc.count_inc, jax.device_put(o[0], jax.memory.Space.Device), o[1], o[2]

    for name, fn in (("a", step_a), ("b", step_b)):
        try:
            j = jax.jit(fn, donate_argnums=(2, 3, 4))
            count = jax.device_put(jnp.zeros([], jnp.int32), dev)
            pp = jax.device_put(p[0] + 0, dev)
            m = jax.device_put(np.zeros(n, np.float32), host)
            v = jax.device_put(np.zeros(n, np.float32), host)
            if name == "b":
                txt = j.lower(count, g, pp, m, v).compile().as_text()
                emit("cpu_b_hlo", [ln for ln in txt.splitlines() if "custom-call" in ln or "copy" in ln][:20])
            cur = (count, pp, m, v)
            for t in range(6):
                if t == 1:
                    jax.block_until_ready(cur)
                    t0 = time.perf_counter()
                cur = j(cur[0], g, cur[1], cur[2], cur[3])
            jax.block_until_ready(cur)
            emit(f"cpu_{name}_ms_per_step", (time.perf_counter() - t0) / 5 * 1e3)
            emit(f"cpu_{name}_kinds", [x.sharding.memory_kind for x in cur[1:]])
            emit(f"cpu_{name}_p_sample", np.asarray(cur[1][:3]).tolist())
        except Exception as e:  # noqa: BLE001
            emit(f"cpu_{name}_error", f"{type(e).__name__}: {str(e)[:1500]}")
    emit("cpu_info", {k: (v[:3] if isinstance(v, list) else v) for k, v in info.items()})


# ============================================================================================
def probe_overhead():
    """per-call cost of an empty buffer_callback on XLA:GPU (jitted, blocking)."""
    import jax
    import jax.numpy as jnp
    from jax.experimental.buffer_callback import buffer_callback
    dev = jax.devices("gpu")[0]
    x = jax.device_put(jnp.ones(16), dev)

    def cb(ctx, out, x):
        pass

    f0 = jax.jit(lambda x: x + 1)
    f1 = jax.jit(lambda x: buffer_callback(cb, jax.ShapeDtypeStruct(x.shape, x.dtype), input_output_aliases={0: 0})(x + 1))
    for name, f in (("plain", f0), ("buffer_callback", f1)):
        y = f(x)
        y.block_until_ready()
        t = time.perf_counter()
        for _ in range(300):
            y = f(x)
            y.block_until_ready()
        emit(f"overhead_{name}_us", (time.perf_counter() - t) / 300 * 1e6)


PROBES = {k[6:]: v for k, v in globals().items() if k.startswith("probe_")}

if __name__ == "__main__":
    name = sys.argv[1]
    try:
        PROBES[name]()
        emit("status", "ok")
    except Exception as e:  # noqa: BLE001
        emit("status", f"FAILED {type(e).__name__}: {str(e)[:3000]}")
        traceback.print_exc()
    with open(os.path.join(OUT, f"res_{name}.json"), "w") as f:
        json.dump(RES, f, default=str, indent=1)

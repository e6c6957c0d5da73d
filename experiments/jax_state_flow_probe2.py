# Run (GPU machine, repository root): PYTHONPATH=. OUT=$OUT python3 experiments/jax_state_flow_probe2.py NAME   (NAME: m2_donate, m2_nodonate, m2_bf16_nodonate, m2_tok_state, overhead, compose, m2_268m, cpu_mode_268m)
"""GPU probe 2 (issue #19): the three-callback flow (M2) for optimizer state in pinned host
memory under a plain jax.jit on XLA:GPU.

  cb_own(p) -> p'                       aliased, device only: the buffer the new weights go to
  cb_upd(S, g, p', mu, nu, master, tok) -> (mu', nu', master', tok')
                                        aliased host operands, host-only outputs; launches the
                                        zero-copy kernel (reads p', g; writes p' and the state)
  cb_ord(p', tok') -> p''               aliased, device only: orders every use of the weights
                                        after the update

python3 probe2.py NAME (the driver runs each probe in its own process).
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
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def emit(k, v):
    RES[k] = v
    print(f"RESULT {k} = {v!r}", flush=True)


def ptr_info(ptr):
    lib = ctypes.CDLL("libcuda.so.1")
    out = {}
    for name, attr, ty in (("type", 2, ctypes.c_uint), ("devptr", 3, ctypes.c_uint64)):
        v = ty(0)
        rc = lib.cuPointerGetAttribute(ctypes.byref(v), ctypes.c_int(attr), ctypes.c_uint64(int(ptr)))
        out[name] = int(v.value) if rc == 0 else f"rc{rc}"
    return out


def bptr(buf):
    return int(buf.__cuda_array_interface__["data"][0])


import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from jax.experimental.buffer_callback import buffer_callback  # noqa: E402

from trainstream import contract as C  # noqa: E402
from trainstream import _device_kernels as dk  # noqa: E402

H = jax.memory.Space.Host
SDS = jax.ShapeDtypeStruct


def scalar_matrix(count, n, lr, wd, b1=0.9, b2=0.999, eps=1e-8, decays=None, clip=None, norm=None):
    """The WIP contract function (optax's expressions, jnp, one row per leaf)."""
    f32 = np.float32
    xp = jnp
    count = xp.asarray(count, dtype=xp.int32)
    i32_max = xp.asarray(np.iinfo(np.int32).max, xp.int32)
    count_inc = xp.where(count < i32_max, count + xp.asarray(1, xp.int32), i32_max)
    step_size = xp.asarray(-1 * lr(count), f32) if callable(lr) else -1 * lr
    one = xp.asarray(1.0, f32)
    cols = [one] * C.N_SCALARS
    cols[C.S_WD] = xp.asarray(wd, f32)
    cols[C.S_OMB1] = xp.asarray(1 - b1, f32)
    cols[C.S_BETA1] = xp.asarray(b1, f32)
    cols[C.S_BETA2] = xp.asarray(b2, f32)
    cols[C.S_OMB2] = xp.asarray(1 - b2, f32)
    cols[C.S_BC1] = xp.asarray(1 - b1 ** count_inc).astype(f32)
    cols[C.S_BC2_OPTAX] = xp.asarray(1 - b2 ** count_inc).astype(f32)
    cols[C.S_EPS] = xp.asarray(eps, f32)
    cols[C.S_NEG_LR] = xp.asarray(step_size, f32)
    code = 0
    if clip is not None:
        trig = norm < clip
        cols[C.S_CLIP_DIV] = xp.where(trig, one, norm.astype(f32))
        cols[C.S_CLIP] = xp.where(trig, one, xp.asarray(clip, f32))
        code = C.OX_CLIP
    cols[C.S_OX_CODE] = xp.asarray(float(code), f32)
    base = xp.stack([xp.asarray(c).astype(f32).reshape(()) for c in cols])
    mat = xp.broadcast_to(base, (n, C.N_SCALARS))
    if decays is not None:
        mat = mat.at[:, C.S_WD].set(xp.where(xp.asarray(decays), mat[:, C.S_WD], 0.0))
    return count_inc, mat


# ============================================================================================
INFO = {}


def make_update(mode="gpu", tok_kind="host_in", emit_u=False):
    """A prototype of the adapter's update on a GPU: (count, g, p, mu, nu, master) ->
    (count', p_new or u, mu', nu', master')."""

    def own(ctx, outs, *ins):
        pass

    def order(ctx, outs, *ins):
        pass

    def update(ctx, outs, scal, *ins):
        n = INFO["n"]
        g, pw = ins[:n], ins[n:2 * n]
        st = outs
        if "ptrs" not in INFO:
            INFO["ptrs"] = {"g": ptr_info(bptr(g[0])), "p'": ptr_info(bptr(pw[0])),
                            "mu'": ptr_info(bptr(st[0])), "mu_in": ptr_info(bptr(ins[2 * n]))}
        s = int(ctx.stream)
        half = INFO["half"]
        for i in range(n):
            dk.launch_adamw(C.VARIANT_OPTAX_CUDA, bptr(pw[i]), INFO["dtype"], bptr(g[i]), INFO["dtype"],
                            bptr(st[2 * n + i]) if half else 0, bptr(st[i]), bptr(st[n + i]), INFO["sizes"][i],
                            None, stream=s, scalars_ptr=bptr(scal) + 4 * C.N_SCALARS * i, device=0)

    def fn(count, g, p, mu, nu, master, lr=1e-2, wd=1e-2):
        n = len(p)
        count_inc, mat = scalar_matrix(count, n, lr, wd)
        pw = buffer_callback(own, [SDS(x.shape, x.dtype) for x in p],
                             input_output_aliases={i: i for i in range(n)})(*p)
        if tok_kind == "host_in":
            tok_in = [jax.device_put(jnp.zeros((1,), jnp.float32), H)]
        else:
            tok_in = []
        st_in = list(mu) + list(nu) + list(master) + tok_in
        base = 1 + 2 * n
        res = [SDS(x.shape, jnp.float32) for x in st_in]
        outs = buffer_callback(update, res, input_output_aliases={base + j: j for j in range(len(st_in))})(
            mat, *g, *pw, *st_in)
        outs = [jax.device_put(x, H) for x in outs]  # host avals: jit's outputs stay in host memory
        tok = outs[-1] if tok_kind == "host_in" else outs[0]
        p_new = buffer_callback(order, [SDS(x.shape, x.dtype) for x in p],
                                input_output_aliases={i: i for i in range(n)})(*pw, tok)
        k = len(master)
        return count_inc, list(p_new), list(outs[:n]), list(outs[n:2 * n]), list(outs[2 * n:2 * n + k])

    return fn


def _case(sizes, dtype, seed=0):
    dev = jax.devices("gpu")[0]
    rng = np.random.default_rng(seed)
    host = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
    p = [jax.device_put(jnp.asarray(rng.standard_normal(k).astype(np.float32), dtype), dev) for k in sizes]
    mu = [jax.device_put(np.zeros(k, np.float32), host) for k in sizes]
    nu = [jax.device_put(np.zeros(k, np.float32), host) for k in sizes]
    master = [jax.device_put(np.asarray(x.astype(jnp.float32)), host) for x in p] if dtype != "float32" else []
    return dev, rng, host, p, mu, nu, master


def _flow(donate, dtype="float32", tok_kind="host_in", sizes=(1000, 4097, 33, 4), steps=5, hlo=False):
    INFO.clear()
    INFO.update(n=len(sizes), sizes=sizes, dtype=dtype, half=dtype != "float32")
    dev, rng, host, p, mu, nu, master = _case(sizes, dtype)
    fn = make_update(tok_kind=tok_kind)

    def step(count, g, p, mu, nu, master):
        c, pn, m, v, ma = fn(count, g, p, mu, nu, master)
        check = sum(jnp.sum(x.astype(jnp.float32)) for x in pn)  # a use of the new weights in the program
        return c, pn, m, v, ma, check

    j = jax.jit(step, donate_argnums=(2, 3, 4, 5) if donate else ())
    count = jax.device_put(jnp.zeros([], jnp.int32), dev)
    gs = [[jax.device_put(jnp.asarray(rng.standard_normal(k).astype(np.float32) * 0.1, dtype), dev)
           for k in sizes] for _ in range(steps)]
    if hlo:
        txt = j.lower(count, gs[0], p, mu, nu, master).compile().as_text()
        tag = f"{'donate' if donate else 'nodonate'}_{dtype}_{tok_kind}"
        with open(os.path.join(OUT, f"hlo2_{tag}.txt"), "w") as f:
            f.write(txt)
        emit("hlo_copies", [ln.strip()[:200] for ln in txt.splitlines() if " copy" in ln and "=" in ln][:20])
        emit("entry_layout", [ln[:400] for ln in txt.splitlines() if "entry_computation_layout" in ln][:1])
    p0 = [np.asarray(x.astype(jnp.float32)) for x in p]
    keep_mu0 = None if donate else np.asarray(mu[0]).copy()
    keep_p_arr = None if donate else p[0]
    keep_mu_arr = None if donate else mu[0]
    cur = (count, p, mu, nu, master)
    checks = []
    for t in range(steps):
        c, pp, m, v, ma, chk = j(*cur[:1], gs[t], *cur[1:])
        cur = (c, pp, m, v, ma)
        checks.append(chk)
    jax.block_until_ready(cur)
    c, pp, m, v, ma = cur
    emit("ptrs", INFO.get("ptrs"))
    emit("kinds", {"mu": m[0].sharding.memory_kind, "p": pp[0].sharding.memory_kind,
                   "master": ma[0].sharding.memory_kind if ma else None})
    emit("mu_out_ptr", ptr_info(m[0].unsafe_buffer_pointer()))
    # the use of the new weights inside the program saw the new weights
    last = float(sum(np.asarray(x.astype(jnp.float32)).sum() for x in pp))
    emit("in_program_use_sees_update", abs(float(checks[-1]) - last) <= 1e-3 * max(1.0, abs(last)))
    if not donate:
        emit("old_mu_unchanged", bool(np.array_equal(np.asarray(keep_mu_arr), keep_mu0)))
        emit("old_p_unchanged", bool(np.array_equal(np.asarray(keep_p_arr.astype(jnp.float32)), p0[0])))
    # reference: optax.adamw jitted on the GPU, fp32 masters fed the upcast gradients
    ref = optax.adamw(1e-2, weight_decay=1e-2)
    P = [jax.device_put(jnp.asarray(a), dev) for a in p0]
    S = ref.init(P)

    @jax.jit
    def rstep(g, s, pr):
        u, s = ref.update(g, s, pr)
        return optax.apply_updates(pr, u), s

    for t in range(steps):
        P, S = rstep([x.astype(jnp.float32) for x in gs[t]], S, P)
    ours = [np.asarray(x) for x in (ma if ma else pp)]
    emit("mismatch_weights", sum(int((a.view(np.uint32) != np.asarray(b).view(np.uint32)).sum())
                                 for a, b in zip(ours, P)))
    emit("mismatch_mu", sum(int((np.asarray(a).view(np.uint32) != np.asarray(b).view(np.uint32)).sum())
                            for a, b in zip(m, S[0].mu)))
    emit("mismatch_nu", sum(int((np.asarray(a).view(np.uint32) != np.asarray(b).view(np.uint32)).sum())
                            for a, b in zip(v, S[0].nu)))
    if ma:
        emit("mismatch_rounded", sum(int((np.asarray(a).view(np.uint16) != np.asarray(b.astype(a.dtype)).view(np.uint16)).sum())
                                     for a, b in zip(pp, P)))


def probe_m2_donate():
    _flow(True, hlo=True)


def probe_m2_nodonate():
    _flow(False, hlo=True)


def probe_m2_bf16_nodonate():
    _flow(False, dtype="bfloat16")


def probe_m2_tok_state():
    _flow(True, tok_kind="state")


def probe_m2_268m():
    """gpu mode at the 268M MLP's sizes (16 x 4096^2 fp32), optimizer step alone, donated."""
    sizes = tuple([4096 * 4096] * 16)
    INFO.clear()
    INFO.update(n=len(sizes), sizes=sizes, dtype="float32", half=False)
    dev, rng, host, p, mu, nu, master = _case(sizes, "float32")
    fn = make_update()
    j = jax.jit(fn, donate_argnums=(2, 3, 4, 5))
    g = [jax.device_put(jnp.full((k,), 1e-3, jnp.float32), dev) for k in sizes]
    cur = (jax.device_put(jnp.zeros([], jnp.int32), dev), p, mu, nu, master)
    ts = []
    for t in range(8):
        t0 = time.perf_counter()
        cur = j(cur[0], g, *cur[1:])
        jax.block_until_ready(cur)
        ts.append(time.perf_counter() - t0)
    emit("m2_268m_ms", [round(x * 1e3, 2) for x in ts])
    emit("m2_268m_GBps", 268435456 * 16 / min(ts[2:]) / 1e9)


def probe_overhead():
    """three callbacks vs one, tiny tensors: per-step wall time, blocking."""
    sizes = (64, 32, 8)
    INFO.clear()
    INFO.update(n=3, sizes=sizes, dtype="float32", half=False)
    dev, rng, host, p, mu, nu, master = _case(sizes, "float32")
    fn = make_update()
    j = jax.jit(fn, donate_argnums=(2, 3, 4, 5))
    g = [jax.device_put(jnp.full((k,), 1e-3, jnp.float32), dev) for k in sizes]
    cur = (jax.device_put(jnp.zeros([], jnp.int32), dev), p, mu, nu, master)
    for t in range(300):
        if t == 100:
            jax.block_until_ready(cur)
            t0 = time.perf_counter()
        cur = j(cur[0], g, *cur[1:])
        jax.block_until_ready(cur)
    emit("m2_step_us_tiny", (time.perf_counter() - t0) / 200 * 1e6)

    def plain(c, g, p):
        return c + 1, [a - 1e-3 * b for a, b in zip(p, g)]
    jp = jax.jit(plain)
    cc, pp = cur[0], cur[1]
    for t in range(300):
        if t == 100:
            t0 = time.perf_counter()
        cc, pp = jp(cc, g, pp)
        jax.block_until_ready(pp)
    emit("plain_step_us_tiny", (time.perf_counter() - t0) / 200 * 1e6)


# ============================================================================================
def probe_cpu_mode_268m():
    """cpu mode prototype on the M2 flow: per leaf, D2H of g and p' on XLA's stream with an
    event, the host kernel on a thread pool as each lands, H2D of the new weights into p' on
    XLA's stream; the callback returns when the host work is done."""
    import concurrent.futures as cf
    from trainstream import _cuda
    from trainstream import _host_kernels as K
    cp = dk._cupy()
    sizes = tuple([4096 * 4096] * 16)
    n = len(sizes)
    dev, rng, host, p, mu, nu, master = _case(sizes, "float32")
    ctx = _cuda.Context(0)
    stg = [(cp.cuda.alloc_pinned_memory(4 * k), cp.cuda.alloc_pinned_memory(4 * k)) for k in sizes]
    sview = [(np.frombuffer(a, np.float32, k), np.frombuffer(b, np.float32, k)) for (a, b), k in zip(stg, sizes)]
    sc_buf = cp.cuda.alloc_pinned_memory(4 * C.N_SCALARS * n)
    sc_view = np.frombuffer(sc_buf, np.float32, C.N_SCALARS * n)
    pool = cf.ThreadPoolExecutor(15)
    chunk = 1 << 20
    tim = {}

    def own(ctx_, outs, *ins):
        pass

    def order(ctx_, outs, *ins):
        pass

    def update(xctx, outs, scal, *ins):
        s = int(xctx.stream)
        t0 = time.perf_counter()
        g, pw = ins[:n], ins[n:2 * n]
        ctx.memcpy_dtoh_async(sc_view.ctypes.data, bptr(scal), 4 * C.N_SCALARS * n, s)
        evs = []
        for i in range(n):
            gv, pv = sview[i]
            ctx.memcpy_dtoh_async(gv.ctypes.data, bptr(g[i]), 4 * sizes[i], s)
            ctx.memcpy_dtoh_async(pv.ctypes.data, bptr(pw[i]), 4 * sizes[i], s)
            evs.append(_cuda.Event(ctx, s))
        futs = []
        for i in range(n):
            gv, pv = sview[i]
            m_ = dk.host_view(bptr(outs[i]), sizes[i])
            v_ = dk.host_view(bptr(outs[n + i]), sizes[i])

            def job(b, e, i=i, gv=gv, pv=pv, m_=m_, v_=v_):
                evs[i].synchronize()
                K.adamw_chunk(C.VARIANT_OPTAX_CUDA, pv, m_, v_, gv, K.KIND_F32, None, 0, b, e,
                              sc_view[C.N_SCALARS * i:C.N_SCALARS * (i + 1)].copy(), 0)
            futs.append([pool.submit(job, b, min(sizes[i], b + chunk)) for b in range(0, sizes[i], chunk)])
        evs[0].synchronize()
        for i in range(n):
            for f in futs[i]:
                f.result()
            ctx.memcpy_htod_async(bptr(pw[i]), sview[i][1].ctypes.data, 4 * sizes[i], s)
        tim.setdefault("cb_s", []).append(time.perf_counter() - t0)

    def fn(count, g, p, mu, nu):
        count_inc, mat = scalar_matrix(count, n, 1e-3, 1e-2)
        pw = buffer_callback(own, [SDS(x.shape, x.dtype) for x in p], input_output_aliases={i: i for i in range(n)})(*p)
        tok_in = jax.device_put(jnp.zeros((1,), jnp.float32), H)
        st = list(mu) + list(nu) + [tok_in]
        outs = buffer_callback(update, [SDS(x.shape, jnp.float32) for x in st],
                               input_output_aliases={1 + 2 * n + j: j for j in range(len(st))})(mat, *g, *pw, *st)
        outs = [jax.device_put(x, H) for x in outs]
        pn = buffer_callback(order, [SDS(x.shape, x.dtype) for x in p], input_output_aliases={i: i for i in range(n)})(*pw, outs[-1])
        return count_inc, list(pn), list(outs[:n]), list(outs[n:2 * n])

    j = jax.jit(fn, donate_argnums=(2, 3, 4))
    g = [jax.device_put(jnp.full((k,), 1e-3, jnp.float32), dev) for k in sizes]
    cur = (jax.device_put(jnp.zeros([], jnp.int32), dev), p, mu, nu)
    ts = []
    for t in range(6):
        t0 = time.perf_counter()
        cur = j(cur[0], g, *cur[1:])
        jax.block_until_ready(cur)
        ts.append(time.perf_counter() - t0)
    emit("cpu_268m_ms", [round(x * 1e3, 2) for x in ts])
    emit("cpu_268m_cb_ms", [round(x * 1e3, 2) for x in tim.get("cb_s", [])])
    emit("cpu_268m_p_sample", np.asarray(cur[1][0][:3]).tolist())
    # check against the host contract (NumPy, optax/cuda in IEEE) for one leaf: 6 steps of g = 1e-3
    emit("cpu_kinds", [cur[2][0].sharding.memory_kind, cur[1][0].sharding.memory_kind])


# ============================================================================================
def probe_compose():
    """The prototype in optax's and flax's wrappers, gpu mode: MultiSteps (jnp.where and
    lax.cond on host state), inject_hyperparams, masked, chain(clip), nnx.Optimizer, orbax."""
    dev = jax.devices("gpu")[0]
    host = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")

    class S(tuple):
        pass

    from typing import NamedTuple

    class St(NamedTuple):
        count: object
        mu: object
        nu: object

    def offload(lr):
        def init(params):
            leaves = jax.tree.leaves(params)
            z = lambda x: jax.device_put(np.zeros(x.shape, np.float32), host)  # noqa: E731
            return St(jax.device_put(jnp.zeros([], jnp.int32), dev), jax.tree.map(z, params), jax.tree.map(z, params))

        def update(g, st, params):
            lg, td = jax.tree.flatten(g)
            lp = jax.tree.leaves(params)
            INFO.clear()
            INFO.update(n=len(lp), sizes=[int(np.prod(x.shape)) for x in lp], dtype="float32", half=False)
            fn = make_update()
            c, pn, m, v, _ = fn(st.count, lg, lp, jax.tree.leaves(st.mu), jax.tree.leaves(st.nu), [], lr=lr, wd=1e-4)
            u = [a - b for a, b in zip(pn, lp)]  # (a prototype: not optax's u)
            return jax.tree.unflatten(td, u), St(c, jax.tree.unflatten(td, m), jax.tree.unflatten(td, v))
        return optax.GradientTransformation(init, update)

    rng = np.random.default_rng(0)
    params = {"w": jax.device_put(jnp.asarray(rng.standard_normal(64 * 32).astype(np.float32)), dev),
              "b": jax.device_put(jnp.asarray(rng.standard_normal(32).astype(np.float32)), dev)}
    xs = [jax.device_put(jnp.asarray(rng.standard_normal((8, 64)).astype(np.float32)), dev) for _ in range(6)]

    def loss(p, x):
        return jnp.mean((x @ p["w"].reshape(64, 32) + p["b"]) ** 2)

    def train(tx, steps=6):
        @jax.jit
        def step(p, s, x):
            u, s = tx.update(jax.grad(loss)(p, x), s, p)
            return optax.apply_updates(p, u), s
        p, s = params, tx.init(params)
        for t in range(steps):
            p, s = step(p, s, xs[t])
        jax.block_until_ready((p, s))
        return p, s

    def kinds(s):
        return sorted({str(getattr(getattr(x, "sharding", None), "memory_kind", None)) for x in jax.tree.leaves(s)})

    for name, mk in (
        ("plain", lambda: (offload(1e-2), optax.adamw(1e-2, weight_decay=1e-4))),
        ("multisteps", lambda: (optax.MultiSteps(offload(1e-2), 2), optax.MultiSteps(optax.adamw(1e-2, weight_decay=1e-4), 2))),
        ("chain_clip", lambda: (optax.chain(optax.clip_by_global_norm(0.1), offload(1e-2)),
                                optax.chain(optax.clip_by_global_norm(0.1), optax.adamw(1e-2, weight_decay=1e-4)))),
        ("masked", lambda: (optax.masked(offload(1e-2), {"w": True, "b": False}),
                            optax.masked(optax.adamw(1e-2, weight_decay=1e-4), {"w": True, "b": False}))),
    ):
        try:
            ours, ref = mk()
            p, s = train(ours)
            pr, _ = train(ref)
            emit(name + "_maxdiff", max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(pr))))
            emit(name + "_kinds", kinds(s))
        except Exception as e:  # noqa: BLE001
            emit(name + "_error", f"{type(e).__name__}: {str(e)[:1500]}")
            traceback.print_exc()
    try:  # a scan over steps, the state in the carry
        tx = offload(1e-2)

        @jax.jit
        def many(p, s, xs):
            def body(c, x):
                p, s = c
                u, s = tx.update(jax.grad(loss)(p, x), s, p)
                return (optax.apply_updates(p, u), s), None
            return jax.lax.scan(body, (p, s), xs)[0]
        p, s = many(params, tx.init(params), jnp.stack(xs[:4]))
        jax.block_until_ready((p, s))
        p2, s2 = train(tx, 4)
        emit("scan_maxdiff", max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(p2))))
        emit("scan_kinds", kinds(s))
    except Exception as e:  # noqa: BLE001
        emit("scan_error", f"{type(e).__name__}: {str(e)[:1500]}")
        traceback.print_exc()
    try:
        import orbax.checkpoint as ocp
        import tempfile
        p, s = train(offload(1e-2), 3)
        d = tempfile.mkdtemp()
        ck = ocp.StandardCheckpointer()
        ck.save(os.path.join(d, "c"), {"p": p, "s": s})
        ck.wait_until_finished()
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, {"p": p, "s": s})
        emit("orbax_abstract_kinds", sorted({str(getattr(getattr(x, "sharding", None), "memory_kind", None))
                                            for x in jax.tree.leaves(abstract)}))
        r = ck.restore(os.path.join(d, "c"), abstract)
        emit("orbax_restored_kinds", kinds(r["s"]))
        emit("orbax_same", all(np.array_equal(np.asarray(a), np.asarray(b))
                               for a, b in zip(jax.tree.leaves(r), jax.tree.leaves({"p": p, "s": s}))))
    except Exception as e:  # noqa: BLE001
        emit("orbax_error", f"{type(e).__name__}: {str(e)[:1500]}")
        traceback.print_exc()
    try:
        from flax import nnx

        class M(nnx.Module):
            def __init__(self, rngs):
                self.l = nnx.Linear(64, 32, rngs=rngs)

            def __call__(self, x):
                return self.l(x)
        with jax.default_device(dev):
            model = M(nnx.Rngs(0))
            opt = nnx.Optimizer(model, offload(1e-2), wrt=nnx.Param)

        @nnx.jit
        def st(model, opt, x):
            g = nnx.grad(lambda m: jnp.mean(m(x) ** 2))(model)
            opt.update(model, g)
        for t in range(4):
            st(model, opt, xs[t])
        emit("nnx_kinds", kinds(nnx.state(opt)))
        emit("nnx_ok", True)
    except Exception as e:  # noqa: BLE001
        emit("nnx_error", f"{type(e).__name__}: {str(e)[:1500]}")
        traceback.print_exc()


PROBES = {k[6:]: v for k, v in globals().items() if k.startswith("probe_")}

if __name__ == "__main__":
    name = sys.argv[1]
    try:
        PROBES[name]()
        emit("status", "ok")
    except Exception as e:  # noqa: BLE001
        emit("status", f"FAILED {type(e).__name__}: {str(e)[:3000]}")
        traceback.print_exc()
    with open(os.path.join(OUT, f"res2_{name}.json"), "w") as f:
        json.dump(RES, f, default=str, indent=1)

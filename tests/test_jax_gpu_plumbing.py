"""The GPU code path of offload_adamw (trainstream.jax._gpu), run on XLA:CPU with its CUDA
calls simulated: the state in ``pinned_host`` memory, the three callbacks (own, update,
order), the engine pipeline of ``mode="cpu"`` (its staging ring, events, uploads) and the grouped
launches of ``mode="gpu"`` (the engine's device placement and its staging ring).

The simulated launches run the host kernel of the same variant (optax/cuda), so both modes
must give the contract's NumPy reference bit for bit here; what this checks is the
plumbing (operands, aliases, memory kinds, orders), which the H200 tests
(tests/test_jax_gpu.py) then check with the real kernel against XLA:GPU's optax.
"""

import numpy as np
import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
jnp = jax.numpy

import trainstream.jax as tsj  # noqa: E402
from trainstream import contract as C  # noqa: E402
from trainstream.jax import _gpu as G  # noqa: E402

from _fuzz_jax import xla_float16  # noqa: E402
from _jax_gpu_sim import _Context, _Kernels, _Mapped, simulate_gpu  # noqa: E402

if jax.default_backend() != "cpu":  # pragma: no cover - the simulation needs XLA:CPU buffers
    pytest.skip("simulates the CUDA calls on XLA:CPU (tests/test_jax_gpu.py runs them for real)",
                allow_module_level=True)


@pytest.fixture
def simulated_gpu(monkeypatch):
    yield from simulate_gpu(monkeypatch)


SHAPES = {"a": (37, 19), "b": (64, 16), "c": (1001,), "d": (4,), "e": (3, 5)}


def _params(dtype):
    rng = np.random.default_rng(0)
    return {k: jnp.asarray(rng.standard_normal(s).astype(np.float32), dtype) for k, s in SHAPES.items()}


def _grads(rng, params):
    return {k: jnp.asarray(rng.standard_normal(p.shape).astype(np.float32) * 0.1, p.dtype) for k, p in params.items()}


def _mask(p):
    return {k: k != "d" for k in p}


def _reference(params, grads_seq, lr, wd):
    """The contract's NumPy update (optax/cuda) on fp32 masters, scalars from the contract's
    matrix evaluated by XLA (as in the program)."""
    keys = list(params)
    decays = [_mask(params)[k] for k in keys]
    mat = jax.jit(lambda c: C.optax_scalar_matrix(c, [0] * len(keys), decays, learning_rate=lr, b1=0.9, b2=0.999,
                                                  eps=1e-8, weight_decay=wd, xp=jnp).scalars)
    p = {k: np.asarray(params[k], np.float32).ravel() for k in keys}
    m = {k: np.zeros_like(v) for k, v in p.items()}
    v = {k: np.zeros_like(x) for k, x in p.items()}
    for t, g in enumerate(grads_seq):
        s = np.asarray(mat(jnp.int32(t)))
        for i, k in enumerate(keys):
            p[k], m[k], v[k] = C.reference_update(p[k], m[k], v[k], np.asarray(g[k], np.float32).ravel(), s[i],
                                                  "optax", "cuda")
    return p, m, v


def _bits(a):
    a = np.asarray(a)
    return a.view(np.uint32 if a.itemsize == 4 else np.uint16)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("mode", ["gpu", "cpu"])
def test_gpu_path_step_and_update_equal_the_contract(simulated_gpu, mode, dtype):
    lr, wd = 1e-2, 0.05
    params = _params(jnp.dtype(dtype))
    rng = np.random.default_rng(1)
    gs = [_grads(rng, params) for _ in range(4)]
    want_p, want_m, want_v = _reference(params, gs, lr, wd)
    live0 = _Mapped.live
    tx = tsj.offload_adamw(lr, master_weights=True, weight_decay=wd, mask=_mask, mode=mode, threads=2)
    for donate in (True, False):
        for via in ("step", "update"):
            s = tx.init(params)
            assert {x.sharding.memory_kind for x in jax.tree.leaves((s.mu, s.nu, s.master))} == {"pinned_host"}

            # params and state in the same order in and out: with uncommitted params JAX
            # pairs donated inputs with outputs by shape and dtype alone (see the docstring
            # of offload_adamw on donation)
            def body(p, s, g, via=via):
                if via == "step":
                    return tx.step(g, s, p)
                u, s = tx.update(g, s, p)
                return optax.apply_updates(p, u), s

            step = jax.jit(body, donate_argnums=(0, 1) if donate else ())
            p = jax.tree.map(lambda x: jnp.array(x, copy=True), params)
            for g in gs:
                old_mu = None if donate else np.asarray(jax.tree.leaves(s.mu)[0]).copy()
                keep = s.mu
                p, s = step(p, s, g)
                if not donate:  # the caller's state is untouched (XLA copied it first)
                    np.testing.assert_array_equal(np.asarray(jax.tree.leaves(keep)[0]), old_mu)
            what = f"{mode} {dtype} {via} donate={donate}"
            assert {x.sharding.memory_kind for x in jax.tree.leaves((s.mu, s.nu, s.master))} == {"pinned_host"}, what
            for k in params:
                got_master = s.master[k] if dtype != "float32" else p[k]
                if via == "step" or dtype != "float32":  # update's fp32 weights: XLA's p + (-lr)*u, below
                    np.testing.assert_array_equal(_bits(np.asarray(got_master).ravel()), _bits(want_p[k]), what + k)
                else:
                    np.testing.assert_allclose(np.asarray(got_master).ravel(), want_p[k], rtol=0, atol=1e-6)
                np.testing.assert_array_equal(_bits(np.asarray(s.mu[k]).ravel()), _bits(want_m[k]), what + k)
                np.testing.assert_array_equal(_bits(np.asarray(s.nu[k]).ravel()), _bits(want_v[k]), what + k)
                if dtype != "float32":
                    np.testing.assert_array_equal(_bits(p[k]), _bits(np.asarray(s.master[k]).astype(p[k].dtype)))
            assert int(s.count) == len(gs)
    if mode == "gpu":  # leaves of a dtype in launches of up to MULTI_MAX, their state staged in pieces
        assert {(w, n) for w, _, n in _Kernels.launches} >= {("w", 3), ("w", 2)}
        assert any(d == "h2d" for d, _ in _Context.copies) and any(d == "d2h" for d, _ in _Context.copies)
        ring = G._device_engines[0].device._ring
        d2h = ring.d2h  # XLA's stream waits for an event of the ring's copy-back stream
        assert any(st == 0 and ev.stream == d2h for st, ev in _Context.waits) and d2h != ring.h2d
        if dtype == "float32":
            assert ("u", "float32", 3) in _Kernels.launches
    else:  # mode="cpu": gradients (and fp32 weights) down, weights (or u) up, per piece of the staging ring
        ring = G._host_rings[0]
        pieces = sum(-(-int(np.prod(s)) // ring.elems) for s in SHAPES.values())
        assert ring.elems == 256 and len(ring.bufs) == 3 < pieces  # its buffers reused within each update
        ups = [n for d, n in _Context.copies if d == "h2d"]
        assert len(ups) == 2 * 2 * len(gs) * pieces
        # the plan's staging is the ring, shared by the four programs; nothing else was pinned
        assert tx.host_memory_plan(params)["staging_pinned"] == ring.nbytes == _Mapped.live - live0 > 0
        # a buffer is copied into after its last copy up; XLA's stream waits for both of the ring's streams
        reuse = [ev for st, ev in _Context.waits if st == ring.d2h and ev.stream == ring.h2d]
        assert len(reuse) == 2 * 2 * len(gs) * pieces - len(ring.bufs)
        ends = {ev.stream for st, ev in _Context.waits if st == 0}
        assert ends == {ring.d2h, ring.h2d}


def test_gpu_path_compositions_keep_the_state_in_host_memory(simulated_gpu):
    """MultiSteps (jnp.where and lax.cond on the state), chain with clipping, masked, a
    scan over steps: the state stays pinned_host and the weights equal the plain loop's."""
    params = _params(jnp.float32)
    rng = np.random.default_rng(2)
    gs = [_grads(rng, params) for _ in range(4)]

    def run(tx, scan=False):
        s = tx.init(params)
        if scan:
            @jax.jit
            def many(p, s, gs):
                def body(c, g):
                    u, s = tx.update(g, c[1], c[0])
                    return (optax.apply_updates(c[0], u), s), None
                return jax.lax.scan(body, (p, s), gs)[0]
            return many(params, s, jax.tree.map(lambda *x: jnp.stack(x), *gs))

        @jax.jit
        def step(p, s, g):
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s
        p = params
        for g in gs:
            p, s = step(p, s, g)
        return p, s

    kinds = lambda s: {x.sharding.memory_kind for x in jax.tree.leaves(s) if x.ndim}  # noqa: E731
    for mode in ("gpu", "cpu"):
        base = tsj.offload_adamw(1e-2, master_weights=True, mode=mode, threads=2)
        p_plain, s_plain = run(base)
        p_scan, s_scan = run(base, scan=True)
        for a, b in zip(jax.tree.leaves(p_scan), jax.tree.leaves(p_plain)):
            np.testing.assert_array_equal(_bits(a), _bits(b))
        p_ms, s_ms = run(optax.MultiSteps(base, 2))
        assert int(s_ms.inner_opt_state.count) == 2
        p_ch, s_ch = run(optax.chain(optax.clip_by_global_norm(0.5), base))
        mask = {k: k != "c" for k in params}
        p_mk, s_mk = run(optax.masked(base, mask))
        p_ref, _ = run(optax.masked(optax.adamw(1e-2), mask))  # leaf c: the raw gradients, as optax's
        np.testing.assert_array_equal(_bits(p_mk["c"]), _bits(p_ref["c"]))
        for s in (s_plain, s_scan, s_ms, s_ch, s_mk):
            ours = [x for x in jax.tree.leaves(s, is_leaf=lambda x: isinstance(x, tsj.OffloadAdamWState))
                    if isinstance(x, tsj.OffloadAdamWState)]
            assert len(ours) == 1 and kinds((ours[0].mu, ours[0].nu)) == {"pinned_host"}


def test_gpu_path_refuses_state_in_device_memory(simulated_gpu):
    params = _params(jnp.float32)
    tx = tsj.offload_adamw(1e-2, master_weights=True, mode="gpu")
    s = tx.init(params)
    on_device = s._replace(mu=jax.tree.map(lambda x: jax.device_put(np.asarray(x), jax.devices("cpu")[0]), s.mu))
    g = _grads(np.random.default_rng(3), params)
    with pytest.raises(ValueError, match="in GPU memory.*pinned host memory"):
        jax.jit(tx.step)(g, on_device, params)


#: optax.adamw's configurations with XLA:GPU lines of their own (trainstream.contract._optax_cuda): leaf dtype,
#: offload_adamw's (and optax.adamw's) arguments, the optax/cuda code each leaf gets.
LINES = {
    "bf16": ("bfloat16", {}, C.OX_HALF),
    "fp16": ("float16", {}, C.OX_HALF | C.OX_RSQRT),  # eps=1e-8 is 0 in float16
    "bf16_mu32": ("bfloat16", {"mu_dtype": jnp.float32}, C.OX_HALF | C.OX_MU_F32),
    "bf16_nesterov": ("bfloat16", {"nesterov": True}, C.OX_HALF | C.OX_NESTEROV),
    "fp32_mu16": ("float32", {"mu_dtype": jnp.bfloat16}, C.OX_MU_BF16),
    "fp32_nesterov": ("float32", {"nesterov": True}, C.OX_NESTEROV),
    "fp32_eps_root": ("float32", {"eps_root": 1e-8}, 0),
    "fp32_eps0": ("float32", {"eps": 0.0}, C.OX_RSQRT),
    "bf16_master_nesterov": ("bfloat16", {"nesterov": True, "master_weights": True}, C.OX_NESTEROV),
}


def _values(x):
    x = np.asarray(x)
    return x.astype(np.float32).ravel()


@pytest.mark.parametrize("mode", ["gpu", "cpu"])
@pytest.mark.parametrize("case", sorted(LINES))
def test_each_derived_line_runs_with_optax_state(simulated_gpu, case, mode):
    """Both modes on every configuration with lines of its own: the state typed and placed as optax.adamw's (pinned
    host memory), the launches of its kernel (mode="gpu"; optax's own state: no master) or the staging ring's pieces
    (mode="cpu": the weights of optax's own state down in their dtype, u up in optax's), and the contract's
    optax/cuda lines bit for bit through step and update (the host kernels run them; the simulated launches too; the
    GPU tests hold the CUDA kernels to optax on XLA:GPU)."""
    dtype, kw, code = LINES[case]
    if dtype == "float16" and not xla_float16():
        pytest.skip("XLA:CPU cannot compile float16 at this ISA level (the program around the simulated kernels)")
    lr, wd = 1e-2, 0.05
    params = _params(jnp.dtype(dtype))
    rng = np.random.default_rng(2)
    gs = [_grads(rng, params) for _ in range(3)]
    hyper = {"b1": 0.9, "b2": 0.999, "eps": 1e-8, "eps_root": 0.0, **{k: kw[k] for k in ("eps", "eps_root") if k in kw}}
    ref = optax.adamw(lr, weight_decay=wd, mask=_mask, **{k: v for k, v in kw.items() if k != "master_weights"})
    keys = list(params)
    master = kw.get("master_weights", False)
    mat = jax.jit(lambda c: C.optax_scalar_matrix(c, [code] * len(keys), [_mask(params)[k] for k in keys],
                                                  learning_rate=lr, weight_decay=wd, xp=jnp, platform="cuda",
                                                  dtypes=[dtype] * len(keys), **hyper).scalars)
    tx = tsj.offload_adamw(lr, weight_decay=wd, mask=_mask, mode=mode, threads=2, **kw)
    want_state = ref.init(jax.tree.map(lambda x: x.astype(jnp.float32), params) if master else params)[0]
    for via in ("step", "update"):
        _Kernels.launches.clear()
        _Context.copies.clear()
        s = tx.init(params)
        for got, want in ((s.mu, want_state.mu), (s.nu, want_state.nu)):  # optax's dtypes, in host memory
            assert jax.tree.map(lambda x: x.dtype, got) == jax.tree.map(lambda x: x.dtype, want), case
        assert {x.sharding.memory_kind for x in jax.tree.leaves((s.mu, s.nu, s.master))} == {"pinned_host"}
        assert (jax.tree.leaves(s.master) != []) == master

        def body(p, s, g, via=via):
            if via == "step":
                return (*tx.step(g, s, p), p)
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s, u

        step = jax.jit(body, donate_argnums=(0, 1))
        p = jax.tree.map(lambda x: jnp.array(x, copy=True), params)
        w = {k: _values(params[k]) for k in keys}
        m = {k: np.zeros_like(w[k]) for k in keys}
        v = {k: np.zeros_like(w[k]) for k in keys}
        for t, g in enumerate(gs):
            p_in = {k: _values(x) for k, x in p.items()}
            p, s, u = step(p, s, g)
            row = np.asarray(mat(jnp.int32(t)))
            for i, k in enumerate(keys):
                w[k], m[k], v[k], uk = C.optax_cuda_reference_update(w[k], m[k], v[k], _values(g[k]), row[i], dtype)
                if via == "update" and not master:  # optax's scale_by_learning_rate of u, in u's dtype
                    want_u = C.round_to(np.float32(uk * row[i][C.S_NEG_LR]), jnp.dtype(u[k].dtype).name)
                    np.testing.assert_array_equal(_bits(_values(u[k])), _bits(want_u), err_msg=f"{case} u {k} {t}")
                    w[k] = _values(p[k])  # XLA:CPU applies it (p + u: it may contract); the next step from there
                    np.testing.assert_allclose(w[k], p_in[k] + _values(u[k]), rtol=2 ** -7, atol=1e-30)
        what = f"{case} {mode} {via}"
        for k in keys:
            for got, want, name in ((s.mu[k], m[k], "mu"), (s.nu[k], v[k], "nu"),
                                    (s.master[k] if master else p[k], w[k], "weights")):
                np.testing.assert_array_equal(_bits(_values(got)), _bits(want), err_msg=f"{what} {name} {k}")
        kernel = ("u" if via == "update" and not master else "w")
        own = tuple(jnp.dtype(x["a"].dtype).name for x in (want_state.mu, want_state.nu))
        own = None if master or own == ("float32", "float32") else own
        if mode == "cpu":  # the gradients and (no master) the weights down, the weights or u up, in their dtypes
            item, numel = jnp.dtype(dtype).itemsize, sum(int(np.prod(np.shape(x))) for x in params.values())
            up = item if via == "step" or master or own == (dtype, dtype) else 4
            down = sum(n for d, n in _Context.copies if d == "d2h") - len(gs) * 4 * C.N_SCALARS * len(keys)
            ups = sum(n for d, n in _Context.copies if d == "h2d")
            assert (down, ups) == (len(gs) * numel * item * (1 if master else 2), len(gs) * numel * up), what
            assert not _Kernels.launches
            continue
        assert all(x[0] == kernel and (x[3:] == ((dtype, own) if kernel == "u" else (own,)) if own else len(x) == 3)
                   for x in _Kernels.launches), (what, _Kernels.launches)


@pytest.mark.parametrize("mode", ["gpu", "cpu"])
@pytest.mark.parametrize("dtype, kw", [("float16", {"eps": 1e-3}), ("bfloat16", {"eps_root": 1e-8}),
                                       ("float32", {"mu_dtype": jnp.bfloat16, "nesterov": True}),
                                       ("float16", {"mu_dtype": jnp.float32}), ("bfloat16", {"b1": 0.5}),
                                       ("float16", {"b2": 0.5}), ("bfloat16", {"b1": 0.5, "mu_dtype": jnp.float32})])
def test_gpu_path_refuses_lines_not_derived(simulated_gpu, mode, dtype, kw):
    """optax.adamw's configurations whose XLA:GPU lines nobody derived are refused on a GPU, naming the leaf and the
    configuration, before anything is allocated."""
    tx = tsj.offload_adamw(1e-2, mode=mode, **kw)
    with pytest.raises(NotImplementedError, match=r"on a GPU, leaf \['a'\].*lines of optax.adamw for .* not derived"):
        tx.init(_params(jnp.dtype(dtype)))


def test_cpu_mode_on_a_gpu_warns_once_with_the_bound(simulated_gpu, monkeypatch):
    """mode="cpu" on a GPU is within the contract's bound, not bit-identical (XLA:GPU's approximate root): init says
    so once per process, naming the bound and mode="gpu"; mode="gpu" says nothing."""
    from trainstream.jax import _config

    monkeypatch.setattr(_config, "_warned", [False])
    params = _params(jnp.float32)
    with pytest.warns(RuntimeWarning, match=rf"mode='cpu'\) on a GPU is not bit-identical.*within "
                                            rf"{C.OPTAX_CUDA_HOST_MAX_ULP} ULP.*mode='gpu' is bit-identical"):
        tsj.offload_adamw(1e-2, mode="cpu").init(params)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tsj.offload_adamw(1e-2, mode="cpu").init(params)  # once
        _config._warned[0] = False
        tsj.offload_adamw(1e-2, mode="gpu").init(params)


def test_cpu_mode_on_a_gpu_takes_eps_root_and_inject_hyperparams(simulated_gpu):
    """mode="cpu" on a GPU: the host's float32 lines add eps_root (a number, or an array as
    optax.inject_hyperparams passes it) under the root as the contract's optax/cuda lines do (within the
    contract's host bound: the host kernel may contract a moment's line into an FMA), and the weights are far from
    those without eps_root."""
    lr, wd = 1e-2, 0.05
    params = _params(jnp.float32)
    keys = list(params)
    rng = np.random.default_rng(4)
    gs = [_grads(rng, params) for _ in range(3)]
    def matrix(hyper):  # inject_hyperparams passes float32 arrays: 1 - b etc. in float32, as optax computes them
        return jax.jit(lambda c: C.optax_scalar_matrix(c, [0] * len(keys), [True] * len(keys), xp=jnp,
                                                       platform="cuda", **hyper).scalars)

    hyper = dict(learning_rate=lr, b1=0.9, b2=0.999, eps=1e-8, eps_root=1.0, weight_decay=wd)
    arrays = {k: jnp.float32(x) for k, x in hyper.items()}
    for tx, mat in ((tsj.offload_adamw(lr, weight_decay=wd, eps_root=1.0, mode="cpu"), matrix(hyper)),
                    (optax.inject_hyperparams(tsj.offload_adamw, static_args=("mode",))(
                        learning_rate=lr, weight_decay=wd, eps_root=1.0, mode="cpu"), matrix(arrays))):
        s, p = tx.init(params), dict(params)
        w = {k: _values(params[k]) for k in keys}
        m = {k: np.zeros_like(w[k]) for k in keys}
        v = {k: np.zeros_like(w[k]) for k in keys}
        def body(p, s, g, tx=tx):
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s

        step = jax.jit(body)
        for t, g in enumerate(gs):
            p, s = step(p, s, g)
            row = np.asarray(mat(jnp.int32(t)))
            for i, k in enumerate(keys):
                w[k], m[k], v[k], _ = C.optax_cuda_reference_update(w[k], m[k], v[k], _values(g[k]), row[i])
        inner = s.inner_state if hasattr(s, "inner_state") else s
        for k in keys:
            np.testing.assert_allclose(_values(inner.mu[k]), m[k], rtol=1e-6, atol=1e-8, err_msg=k)  # m cancels
            np.testing.assert_allclose(_values(inner.nu[k]), v[k], rtol=1e-6, atol=1e-15, err_msg=k)
            np.testing.assert_allclose(_values(p[k]), w[k], rtol=1e-5, atol=1e-7, err_msg=k)
        assert max(np.abs(_values(p[k]) - _values(params[k])).max() for k in keys) > 0
        # eps_root=1.0 is felt: without it (v / d2 alone) the weights move several times further
        moved = {k: np.abs(w[k] - _values(params[k])).max() for k in keys}
        assert all(moved[k] < 0.5 * 3 * lr for k in keys), moved


def test_gpu_state_bytes_with_optax_bf16_state_in_both_modes(simulated_gpu):
    """gpu_state_bytes on bf16 leaves with optax's own bf16 state: two leaves kept (optax's update), the third
    offloaded; step by step the two modes give the same weights (the offloaded leaf through the launches or the
    staging ring, both the host's optax/cuda lines here), and the kept leaves' state is not in host memory."""
    params = {k: v for k, v in _params(jnp.bfloat16).items() if k in ("a", "b", "c")}
    rng = np.random.default_rng(5)
    gs = [_grads(rng, params) for _ in range(3)]
    got = {}
    for mode in ("gpu", "cpu"):
        tx = tsj.offload_adamw(1e-2, weight_decay=0.1, mode=mode, threads=2, gpu_state_bytes=7000)
        assert tx.host_memory_plan(params)["gpu_state_leaves"] == 2
        s, p = tx.init(params), jax.tree.map(lambda x: jnp.array(x, copy=True), params)
        step = jax.jit(lambda p, s, g, tx=tx: tx.step(g, s, p), donate_argnums=(0, 1))
        for g in gs:
            p, s = step(p, s, g)
        kinds = {k: s.mu[k].sharding.memory_kind for k in params}
        assert kinds["c"] == "pinned_host" and kinds["a"] != "pinned_host" and kinds["b"] != "pinned_host", kinds
        got[mode] = p
    for k in params:
        np.testing.assert_array_equal(_bits(got["gpu"][k]), _bits(got["cpu"][k]), k)

"""offload_adamw on a CUDA GPU (XLA:GPU), against the same programs around optax.adamw
jitted on the GPU: ``mode="gpu"`` bit for bit (the kernel runs XLA:GPU's instructions),
``mode="cpu"`` within the contract's bound (IEEE arithmetic on the host where XLA:GPU
approximates); the optax wrappers, flax nnx and orbax in gpu mode bit for bit; the state
never in GPU memory; eager = jit; checkpoints; bad input.

Clipped runs use gradients whose squares sum exactly in float32 (``exact_norm``): XLA sums
a global norm in a program-dependent order, and the clip coefficient's last bit with it.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
import jax.numpy as jnp  # noqa: E402

import trainstream.jax as tsj  # noqa: E402
from trainstream import contract as C  # noqa: E402

pytestmark = pytest.mark.gpu


def _gpu():
    try:
        return jax.devices("gpu")[0]
    except RuntimeError:
        pytest.skip("JAX sees no GPU")


# Leaf sizes: odd, a multiple of 4, a prime: the kernels' scalar head/tail and vector body;
# "e" spans two host chunks.
SHAPES = {"a": (37, 19), "b": (256, 64), "c": (10007,), "d": (4,), "e": (1536, 1025)}
SCHEDULE = optax.warmup_cosine_decay_schedule(0.0, 3e-3, 5, 50, 1e-4)


def _mask(params):
    return {k: k != "d" for k in params}


def _params(dtype, dev, seed=0):
    rng = np.random.default_rng(seed)
    return {k: jax.device_put(jnp.asarray(rng.standard_normal(s).astype(np.float32), dtype), dev)
            for k, s in SHAPES.items()}


def _grads(rng, params, dev, exact_norm=False):
    """A spread of magnitudes, zeros included; ``exact_norm``: k * 2**-10, k in [-2, 2]
    (exact in bf16), whose squares sum exactly in float32 in any order."""
    out = {}
    for k, p in params.items():
        if exact_norm:
            g = rng.integers(-2, 3, p.shape).astype(np.float32) * np.float32(2.0**-10)
        else:
            g = rng.standard_normal(p.shape).astype(np.float32) * np.float32(10.0 ** rng.uniform(-3, 0.5))
            g[rng.random(p.shape) < 0.01] = 0
        out[k] = jax.device_put(jnp.asarray(g, p.dtype), dev)
    return out


def _bits(a):
    a = np.asarray(a)
    return a.view({4: np.uint32, 2: np.uint16}[a.itemsize])


def _read(x):
    """``x`` as NumPy, a pinned_host array read through a copy in device memory: a NumPy view of a pinned_host array
    may stay an external reference to its buffer, which XLA then refuses to donate (session u's bf16 failures: was it
    that, or init? experiments/diag_jax_bf16_donation.py)."""
    kind = getattr(getattr(x, "sharding", None), "memory_kind", None)
    return np.asarray(jax.device_put(x, x.sharding.with_memory_kind("device")) if kind == "pinned_host" else x)


def _same(got, want, what):
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want)):
        a, b = _read(a), _read(b)
        assert a.shape == b.shape and a.dtype == b.dtype, (what, path)
        bad = int((_bits(a) != _bits(b)).sum())
        assert bad == 0, f"{what} {jax.tree_util.keystr(path)}: {bad} of {a.size} elements differ"


def _f32(tree):
    return jax.tree.map(lambda x: x.astype(jnp.float32), tree)


def _ref_tx(lr, clip, wd=1e-2):
    inner = optax.adamw(lr, weight_decay=wd, mask=_mask)
    return optax.chain(optax.clip_by_global_norm(clip), inner) if clip else inner


def _adam_state(st):
    return [x for x in jax.tree.leaves(st, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
            if isinstance(x, optax.ScaleByAdamState)][0]


def _steps(tx, ref, via):
    """``(ours, theirs)``, jitted ``(params, state, grads) -> (params, state, updates)``: ours through ``tx.step`` (no
    updates) or ``tx.update`` + ``apply_updates``, params and state donated; theirs ``ref.update`` + ``apply_updates``."""
    def ours(p, s, g):
        if via == "step":
            p, s = tx.step(g, s, p)
            return p, s, None
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, u

    def theirs(p, s, g):
        u, s = ref.update(g, s, p)
        return optax.apply_updates(p, u), s, u

    return jax.jit(ours, donate_argnums=(0, 1)), jax.jit(theirs)


def _host_state(s):
    kinds = {x.sharding.memory_kind for x in jax.tree.leaves((s.mu, s.nu, s.master))}
    assert kinds == {"pinned_host"}, kinds


# -- gpu mode: optax's bits -----------------------------------------------------------------------


@pytest.mark.parametrize("via", ["step", "update"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("clip", [None, 0.5], ids=["noclip", "clip"])
def test_gpu_mode_is_optax_on_the_gpu_bit_for_bit(via, dtype, clip):
    """Weights (fp16/bf16: the fp32 master, and its rounding), moments and, for update, the
    updates themselves equal optax.adamw's jitted on the GPU, step after step."""
    dev = _gpu()
    params = _params(jnp.dtype(dtype), dev)
    tx = tsj.offload_adamw(SCHEDULE, master_weights=True, weight_decay=1e-2, mask=_mask, max_grad_norm=clip,
                           mode="gpu")
    ref = _ref_tx(SCHEDULE, clip)

    step, theirs = _steps(tx, ref, via)
    p, s = jax.tree.map(jnp.copy, params), tx.init(params)
    pr, sr = _f32(params), ref.init(_f32(params))
    rng = np.random.default_rng(1)
    for t in range(8):
        g = _grads(rng, params, dev, exact_norm=clip is not None)
        p, s, u = step(p, s, g)
        pr, sr, ur = theirs(pr, sr, _f32(g))
        what = f"{via} {dtype} clip={clip} step {t + 1}"
        _same(s.master if dtype != "float32" else p, pr, what + " weights")
        _same(s.mu, _adam_state(sr).mu, what + " mu")
        _same(s.nu, _adam_state(sr).nu, what + " nu")
        if dtype != "float32":
            _same(p, jax.tree.map(lambda x: x.astype(dtype), pr), what + " rounded weights")
        elif via == "update":
            _same(u, ur, what + " updates")
    _host_state(s)
    assert int(s.count) == 8


#: optax.adamw's configurations with XLA:GPU lines of their own (trainstream.contract._optax_cuda): leaf dtype and
#: the arguments (offload_adamw's master_weights aside, optax.adamw's).
LINES = {
    "bf16": ("bfloat16", {}),
    "bf16_b2_095": ("bfloat16", {"b1": 0.8, "b2": 0.95, "eps": 1e-6}),  # b2 not 1.0 in bfloat16: XLA keeps b2 * nu
    "fp16": ("float16", {}),  # eps=1e-8 is 0 in float16: m * rsqrt(v)
    "bf16_mu32": ("bfloat16", {"mu_dtype": jnp.float32}),
    "bf16_nesterov": ("bfloat16", {"nesterov": True}),
    "fp32_mu16": ("float32", {"mu_dtype": jnp.bfloat16}),
    "fp32_nesterov": ("float32", {"nesterov": True}),
    "fp32_nesterov_clip": ("float32", {"nesterov": True, "clip": 0.5}),
    "fp32_eps_root": ("float32", {"eps_root": 1e-8}),
    "fp32_eps0": ("float32", {"eps": 0.0}),
    "bf16_master_nesterov": ("bfloat16", {"nesterov": True, "master_weights": True}),
}


@pytest.mark.parametrize("via", ["step", "update"])
@pytest.mark.parametrize("case", sorted(LINES))
def test_gpu_mode_is_optax_on_the_gpu_for_each_line(via, case):
    """fp16/bf16 state as optax keeps it, mu_dtype, nesterov, eps_root, eps == 0: weights, moments (in optax's
    dtypes) and, for update, the updates equal optax.adamw's jitted on the GPU, step after step."""
    dev = _gpu()
    dtype, kw = LINES[case]
    kw = dict(kw)
    clip, master = kw.pop("clip", None), kw.pop("master_weights", False)
    params = _params(jnp.dtype(dtype), dev)
    tx = tsj.offload_adamw(SCHEDULE, weight_decay=1e-2, mask=_mask, max_grad_norm=clip, mode="gpu",
                           master_weights=master, **kw)
    inner = optax.adamw(SCHEDULE, weight_decay=1e-2, mask=_mask, **kw)
    ref = optax.chain(optax.clip_by_global_norm(clip), inner) if clip else inner

    step, theirs = _steps(tx, ref, via)
    p, s = jax.tree.map(jnp.copy, params), tx.init(params)
    pr = _f32(params) if master else jax.tree.map(jnp.copy, params)
    sr = ref.init(pr)
    rng = np.random.default_rng(3)
    for t in range(6):
        g = _grads(rng, params, dev, exact_norm=clip is not None)
        p, s, u = step(p, s, g)
        pr, sr, ur = theirs(pr, sr, _f32(g) if master else g)
        what = f"{case} {via} step {t + 1}"
        _same(s.mu, _adam_state(sr).mu, what + " mu")
        _same(s.nu, _adam_state(sr).nu, what + " nu")
        _same(s.master if master else p, pr, what + " weights")
        if via == "update" and not master:
            _same(u, ur, what + " updates")
    _host_state(s)


# -- cpu mode: within the contract's bound -----------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("clip", [None, 0.5], ids=["noclip", "clip"])
def test_cpu_mode_within_the_contract_bound(dtype, clip):
    """Each step starts optax from our state (so differences cannot compound): the moments
    within OPTAX_CUDA_HOST_MAX_ULP of XLA:GPU's, the weights within a small fraction of
    the step (IEEE sqrt and division on the host, XLA:GPU's approximations there)."""
    dev = _gpu()
    params = _params(jnp.dtype(dtype), dev)
    tx = tsj.offload_adamw(SCHEDULE, master_weights=True, weight_decay=1e-2, mask=_mask, max_grad_norm=clip,
                           mode="cpu")
    ref = _ref_tx(SCHEDULE, clip)

    @jax.jit
    def theirs(p, s, g):
        u, s = ref.update(g, s, p)
        return optax.apply_updates(p, u), s

    step = jax.jit(lambda p, s, g: tx.step(g, s, p), donate_argnums=(0, 1))
    p, s = jax.tree.map(jnp.copy, params), tx.init(params)
    sr = ref.init(_f32(params))
    rng = np.random.default_rng(2)
    worst_mv = worst_w = 0.0
    for t in range(10):
        g = _grads(rng, params, dev, exact_norm=clip is not None)
        master = _f32(s.master if dtype != "float32" else p)
        # copies: a NumPy view of a pinned_host array is an external reference to its buffer
        # (held by an asynchronous device_put until its transfer ends), and XLA refuses to
        # donate a buffer that has one
        to_dev = lambda a: jax.device_put(np.array(a, copy=True), dev)  # noqa: E731
        master = jax.tree.map(to_dev, master)
        adam = _adam_state(sr)._replace(mu=jax.tree.map(to_dev, s.mu), nu=jax.tree.map(to_dev, s.nu))
        sr = jax.tree.map(lambda x: adam if isinstance(x, optax.ScaleByAdamState) else x, sr,
                          is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
        want, sr = theirs(master, sr, _f32(g))
        prev_m, prev_v = jax.tree.map(lambda a: np.array(a, copy=True), (s.mu, s.nu))
        p, s = step(p, s, g)
        got = _f32(s.master if dtype != "float32" else p)
        for k in params:  # ULPs of the largest of the old moment, the new one and the change
            for ours_x, ref_x, old_x in ((s.mu, _adam_state(sr).mu, prev_m), (s.nu, _adam_state(sr).nu, prev_v)):
                u = C.update_ulps(np.asarray(ours_x[k]).ravel(), np.asarray(ref_x[k]).ravel(), old_x[k].ravel())
                worst_mv = max(worst_mv, float(u.max(initial=0.0)))
            lr_t = max(float(SCHEDULE(t)), 1e-6)
            worst_w = max(worst_w, float(np.abs(np.asarray(got[k]) - np.asarray(want[k])).max()) / lr_t)
    print(f"cpu mode {dtype} clip={clip}: moments <= {worst_mv:.0f} ULP, weights <= {worst_w:.2e} lr")
    assert worst_mv <= C.OPTAX_CUDA_HOST_MAX_ULP
    assert worst_w < 1e-2
    _host_state(s)


def _ulps(a, b) -> int:
    """The largest distance in ULPs of their dtype between same-shaped arrays ``a`` and ``b`` (+0 and -0 equal;
    NaN in both: equal, whatever their payloads)."""
    a, b = np.asarray(a).ravel(), np.asarray(b).ravel()
    both_nan = np.isnan(a.astype(np.float32)) & np.isnan(b.astype(np.float32))
    bits = {4: np.int32, 2: np.int16}[a.itemsize]
    top = np.int64(np.iinfo(bits).min)
    o = [np.where(x < 0, top - x.astype(np.int64), x.astype(np.int64)) for x in (a.view(bits), b.view(bits))]
    return int(np.where(both_nan, 0, np.abs(o[0] - o[1])).max(initial=0))


def _abs_diff(a, b) -> float:
    """The largest ``|a - b|`` in float32 (NaN in both: 0; in one: inf)."""
    a, b = (np.asarray(x, np.float32).ravel() for x in (a, b))
    d = np.where(np.isnan(a) & np.isnan(b), 0.0, np.abs(a - b))
    return float(np.nan_to_num(d, nan=np.inf).max(initial=0.0))


@pytest.mark.parametrize("case", sorted(LINES))
def test_cpu_mode_each_line_within_the_bound(case):
    """mode="cpu" on a GPU runs each of XLA:GPU's lines on the host in IEEE arithmetic. optax starts from our state at
    every step (so differences cannot compound): float32 moments within OPTAX_CUDA_HOST_MAX_ULP of optax's
    (``update_ulps``), 16-bit moments and weights within one ULP of their dtype, float32 weights within a hundredth
    of the step ``lr``; the figures printed (ULPs of each array's own dtype; ``u_abs``: the largest difference of
    optax's ``u``, the update before the learning rate) are the measured bound."""
    dev = _gpu()
    dtype, kw = LINES[case]
    kw = dict(kw)
    clip, master = kw.pop("clip", None), kw.pop("master_weights", False)
    params = _params(jnp.dtype(dtype), dev)
    with warnings.catch_warnings():  # (the warning of mode="cpu" on a GPU: tests/test_jax_gpu_plumbing.py)
        warnings.simplefilter("ignore", RuntimeWarning)
        tx = tsj.offload_adamw(SCHEDULE, weight_decay=1e-2, mask=_mask, max_grad_norm=clip, mode="cpu",
                               master_weights=master, **kw)
        s = tx.init(params)
    inner = optax.adamw(SCHEDULE, weight_decay=1e-2, mask=_mask, **kw)
    ref = optax.chain(optax.clip_by_global_norm(clip), inner) if clip else inner
    ours, theirs = _steps(tx, ref, "update")
    p, sr = jax.tree.map(jnp.copy, params), ref.init(_f32(params) if master else params)
    to_dev = lambda a: jax.device_put(_read(a), dev)  # noqa: E731
    rng = np.random.default_rng(4)
    worst = dict.fromkeys(("mu", "nu", "weights", "moments_update_ulps", "u_abs", "weights_per_lr"), 0.0)
    for t in range(6):
        g = _grads(rng, params, dev, exact_norm=clip is not None)
        prev = jax.tree.map(_read, (s.mu, s.nu))
        adam = _adam_state(sr)._replace(mu=jax.tree.map(to_dev, s.mu), nu=jax.tree.map(to_dev, s.nu))
        sr = jax.tree.map(lambda x: adam if isinstance(x, optax.ScaleByAdamState) else x, sr,
                          is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
        want, sr, ur = theirs(jax.tree.map(to_dev, s.master if master else p), sr, _f32(g) if master else g)
        p, s, u = ours(p, s, g)
        lr_t = max(float(SCHEDULE(t)), 1e-6)
        for k in params:
            pairs = [("mu", _read(s.mu[k]), _read(_adam_state(sr).mu[k]), prev[0][k]),
                     ("nu", _read(s.nu[k]), _read(_adam_state(sr).nu[k]), prev[1][k])]
            for name, got, ref_x, old in pairs:
                worst[name] = max(worst[name], _ulps(got, ref_x))
                if np.asarray(got).dtype == np.float32:
                    ul = C.update_ulps(np.asarray(got).ravel(), np.asarray(ref_x).ravel(), old.ravel())
                    worst["moments_update_ulps"] = max(worst["moments_update_ulps"], float(ul.max(initial=0.0)))
            w = _read((s.master if master else p)[k])
            worst["weights"] = max(worst["weights"], _ulps(w, want[k]))
            worst["weights_per_lr"] = max(worst["weights_per_lr"], _abs_diff(w, want[k]) / lr_t)
            if not master:  # (optax's u, before the learning rate: u * lr_t)
                worst["u_abs"] = max(worst["u_abs"], _abs_diff(u[k], ur[k]) / lr_t)
    print(f"cpu mode line {case}: each step from the same state, ULPs of their dtypes: {worst}")
    assert worst["moments_update_ulps"] <= C.OPTAX_CUDA_HOST_MAX_ULP, worst
    if dtype != "float32" and not master:  # optax's 16-bit state
        assert max(worst["mu"] if "mu_dtype" not in kw else 0, worst["nu"], worst["weights"]) <= 1, worst
    else:
        assert worst["weights_per_lr"] < 1e-2, worst
    if "mu_dtype" in kw and dtype == "float32":  # mu stored bfloat16
        assert worst["mu"] <= 1, worst
    assert worst["u_abs"] < 1e-2 or master, worst  # u's largest difference, as a fraction of the step lr
    _host_state(s)


@pytest.mark.parametrize("via", ["step", "update"])
def test_cpu_mode_pieces_through_the_staging_ring_are_the_contract_bits(via):
    """mode="cpu" stages through a ring of a few pinned buffers (trainstream.core._hostring): a leaf of 9 pieces
    (its 8 buffers reused in each update) beside small leaves, steps queued back to back, equal the contract's NumPy
    lines (optax/cuda in IEEE arithmetic) bit for bit with the scalars the update read; the plan's staging is the
    ring's pinned bytes."""
    from trainstream.core import _hostring
    from trainstream.jax import _gpu as G

    dev = _gpu()
    jax.effects_barrier()
    for ring in G._host_rings.values():  # a fresh ring: this test's geometry
        ring.close()
    G._host_rings.clear()
    elems, depth = _hostring.HOST_RING_ELEMS, _hostring.HOST_RING_DEPTH
    shapes = {"a": (37, 19), "big": (depth * elems // 4096 + 3, 4096), "c": (10007,)}
    rng = np.random.default_rng(4)
    params = {k: jax.device_put(jnp.asarray(rng.standard_normal(s).astype(np.float32)), dev) for k, s in shapes.items()}
    tx = tsj.offload_adamw(1e-2, weight_decay=1e-2, mask=_mask, mode="cpu")

    def body(p, s, g):
        if via == "step":
            return tx.step(g, s, p)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    step = jax.jit(body, donate_argnums=(0, 1))
    keys = sorted(shapes)  # the leaves' order
    want = {k: (np.asarray(params[k]).ravel().copy(), np.zeros(params[k].size, np.float32),
                np.zeros(params[k].size, np.float32)) for k in keys}
    gs = [{k: jax.device_put(jnp.asarray(rng.standard_normal(sh).astype(np.float32) * 0.1), dev)
           for k, sh in shapes.items()} for _ in range(3)]
    p_bb, s_bb = jax.tree.map(jnp.copy, params), tx.init(params)
    for g in gs:  # back to back: each update's copies queued behind the last one's
        p_bb, s_bb = step(p_bb, s_bb, g)
    p, s = jax.tree.map(jnp.copy, params), tx.init(params)
    rows = []
    for g in gs:  # one at a time, reading the scalars each update copied to the ring
        p, s = step(p, s, g)
        jax.block_until_ready((p, s))
        ring = G._host_rings[next(iter(G._host_rings))]
        rows.append(_hostring._view(ring.scalars.host_ptr, C.N_SCALARS * len(keys), np.float32)
                    .reshape(-1, C.N_SCALARS).copy())
    _same((p_bb, s_bb.mu, s_bb.nu), (p, s.mu, s.nu), f"back to back {via}")
    assert (ring.elems, len(ring.bufs)) == (elems, depth)
    assert ring.nbytes == tx.host_memory_plan(params)["staging_pinned"] == _hostring.host_ring_bytes(
        [params[k].size for k in keys])
    for g, row in zip(gs, rows):
        for i, k in enumerate(keys):
            want[k] = C.reference_update(*want[k], np.asarray(g[k]).ravel(), row[i], "optax", "cuda")
    for k in keys:
        wp, wm, wv = want[k]
        np.testing.assert_array_equal(_bits(np.asarray(s.mu[k]).ravel()), _bits(wm), k)
        np.testing.assert_array_equal(_bits(np.asarray(s.nu[k]).ravel()), _bits(wv), k)
        if via == "step":
            np.testing.assert_array_equal(_bits(np.asarray(p[k]).ravel()), _bits(wp), k)
        else:  # XLA's p + step_size * u
            np.testing.assert_allclose(np.asarray(p[k]).ravel(), wp, rtol=0, atol=1e-6)
    _host_state(s)


# -- the optax wrappers, flax nnx, orbax (gpu mode) ---------------------------------------------


def _train(tx, params, gs, dev):
    @jax.jit
    def step(p, s, g):
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    p, s = params, tx.init(params)
    out = []
    for g in gs:
        p, s = step(p, s, g)
        out.append(p)
    return out, s


@pytest.mark.parametrize("wrap", ["chain_clip", "multisteps", "inject_hyperparams", "masked"])
def test_optax_wrappers_in_gpu_mode_are_optax_bit_for_bit(wrap):
    dev = _gpu()
    params = _params(jnp.float32, dev, seed=3)
    rng = np.random.default_rng(4)
    gs = [_grads(rng, params, dev, exact_norm=True) for _ in range(6)]
    kw = dict(weight_decay=0.05)
    if wrap == "chain_clip":
        ours = optax.chain(optax.clip_by_global_norm(0.5),
                           tsj.offload_adamw(1e-3, master_weights=True, mode="gpu", **kw))
        ref = optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-3, **kw))
    elif wrap == "multisteps":
        ours = optax.MultiSteps(tsj.offload_adamw(1e-3, master_weights=True, mode="gpu", **kw), 2)
        ref = optax.MultiSteps(optax.adamw(1e-3, **kw), 2)
    elif wrap == "inject_hyperparams":
        ours = optax.inject_hyperparams(tsj.offload_adamw, static_args=("mode",))(
            learning_rate=SCHEDULE, b1=0.85, mode="gpu", **kw)
        ref = optax.inject_hyperparams(optax.adamw)(learning_rate=SCHEDULE, b1=0.85, **kw)
    else:
        mask = {k: k in ("a", "e") for k in params}
        ours, ref = optax.masked(tsj.offload_adamw(1e-3, master_weights=True, mode="gpu", **kw), mask), optax.masked(optax.adamw(1e-3, **kw), mask)
    a, sa = _train(ours, params, gs, dev)
    b, _ = _train(ref, params, gs, dev)
    for t, (x, y) in enumerate(zip(a, b)):
        _same(x, y, f"{wrap} step {t + 1}")
    _host_state([x for x in jax.tree.leaves(sa, is_leaf=lambda x: isinstance(x, tsj.OffloadAdamWState))
                 if isinstance(x, tsj.OffloadAdamWState)][0])


def test_nnx_optimizer_and_orbax_in_gpu_mode():
    """flax nnx.Optimizer gives optax.adamw's bits; orbax saves the state as it is and a
    restored state (still in host memory) resumes bit for bit."""
    nnx = pytest.importorskip("flax.nnx")
    ocp = pytest.importorskip("orbax.checkpoint")
    dev = _gpu()

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.Linear(24, 64, rngs=rngs)
            self.l2 = nnx.Linear(64, 5, rngs=rngs)

        def __call__(self, x):
            return self.l2(jax.nn.gelu(self.l1(x)))

    rng = np.random.default_rng(5)
    xs = [jax.device_put(jnp.asarray(rng.standard_normal((16, 24)).astype(np.float32)), dev) for _ in range(6)]

    # The gradients come from one compiled program that both runs share: inside one jit with
    # the update, XLA:GPU fuses and autotunes optax's program and ours apart, and the bias
    # weights once differed in 2 of 5 elements of a bias (dc70983; passed in other runs),
    # most likely through its gradient (a reduction), not the update.
    @nnx.jit
    def grads(model, x):
        return nnx.grad(lambda m: jnp.mean(m(x) ** 2))(model)

    def train(tx):
        with jax.default_device(dev):
            model = MLP(nnx.Rngs(0))
            opt = nnx.Optimizer(model, tx, wrt=nnx.Param)

        @nnx.jit
        def step(model, opt, g):
            opt.update(model, g)

        for x in xs:
            step(model, opt, grads(model, x))
        return nnx.to_pure_dict(nnx.state(model, nnx.Param))

    _same(train(tsj.offload_adamw(1e-2, master_weights=True, weight_decay=0.1, mode="gpu")),
          train(optax.adamw(1e-2, weight_decay=0.1)), "nnx.Optimizer")

    params = _params(jnp.bfloat16, dev, seed=6)
    gs = [_grads(rng, params, dev) for _ in range(6)]
    tx = tsj.offload_adamw(SCHEDULE, master_weights=True, weight_decay=0.1, mask=_mask, mode="gpu")

    @jax.jit
    def step(p, s, g):
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    p, s = params, tx.init(params)
    for g in gs[:3]:
        p, s = step(p, s, g)
    import tempfile

    ck = ocp.StandardCheckpointer()
    path = tempfile.mkdtemp() + "/ckpt"
    ck.save(path, {"params": p, "opt_state": s})
    ck.wait_until_finished()
    for g in gs[3:]:
        p, s = step(p, s, g)
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, {"params": params, "opt_state": tx.init(params)})
    r = ck.restore(path, abstract)
    _host_state(r["opt_state"])
    p2, s2 = r["params"], r["opt_state"]
    assert int(s2.count) == 3
    for g in gs[3:]:
        p2, s2 = step(p2, s2, g)
    _same(p2, p, "orbax resumed weights")
    _same(s2, s, "orbax resumed state")


# -- memory, programs, eager, checkpoints -------------------------------------------------------


def _mlp(params, x):
    h = x
    for k in ("w1", "w2"):
        h = jnp.tanh(h @ params[k])
    return jnp.mean(h ** 2)


@pytest.mark.parametrize("mode", ["gpu", "cpu"])
def test_no_optimizer_state_in_gpu_memory(mode):
    dev = _gpu()
    rng = np.random.default_rng(2)
    params = {k: jax.device_put(jnp.asarray(rng.standard_normal((1024, 1024)).astype(np.float32) * 0.03), dev)
              for k in ("w1", "w2")}
    x = jax.device_put(jnp.asarray(rng.standard_normal((64, 1024)).astype(np.float32)), dev)
    pbytes = sum(a.nbytes for a in params.values())
    tx = tsj.offload_adamw(1e-3, master_weights=True, mode=mode)
    before = dev.memory_stats()["bytes_in_use"]
    state = tx.init(params)
    after = dev.memory_stats()["bytes_in_use"]

    def ours(p, s, x):
        return tx.step(jax.grad(_mlp)(p, x), s, p)

    step = jax.jit(ours, donate_argnums=(0, 1))
    ma = step.lower(params, state, x).compile().memory_analysis()
    print(f"mode={mode}: args {ma.argument_size_in_bytes} temp {ma.temp_size_in_bytes} "
          f"host args {getattr(ma, 'host_argument_size_in_bytes', '?')}; init added {after - before} B; params {pbytes}")
    assert after - before < pbytes // 4  # the count, no moments
    assert ma.temp_size_in_bytes < 2 * pbytes  # gradients and activations; mu and nu would be 2 x params
    p = params
    for _ in range(3):
        p, state = step(p, state, x)
    jax.block_until_ready(p)
    assert dev.memory_stats()["bytes_in_use"] - before < 2 * pbytes + x.nbytes  # params (old and new), batch
    _host_state(state)
    tsj.close(state)


@pytest.mark.parametrize("mode", ["gpu", "cpu"])
@pytest.mark.parametrize("clip", [None, 1.0], ids=["noclip", "clip"])
def test_train_step_with_gradients_in_the_same_program(mode, clip):
    """Gradients computed in the same jitted program as the update: the update sees them
    (the callbacks run in XLA's stream order); the trajectory follows optax's."""
    dev = _gpu()
    rng = np.random.default_rng(11)
    a = jax.device_put(jnp.asarray(rng.standard_normal((512, 300)).astype(np.float32)), dev)
    y = jax.device_put(jnp.asarray(rng.standard_normal((512, 7)).astype(np.float32)), dev)
    w0 = {"w": jax.device_put(jnp.asarray(rng.standard_normal((300, 7)).astype(np.float32) * 0.1), dev),
          "b": jax.device_put(jnp.asarray(rng.standard_normal((7,)).astype(np.float32)), dev)}

    def loss(p):
        return jnp.mean((a @ p["w"] + p["b"] - y) ** 2)

    ref_tx = optax.chain(optax.clip_by_global_norm(clip), optax.adamw(1e-2)) if clip else optax.adamw(1e-2)
    tx = tsj.offload_adamw(1e-2, master_weights=True, max_grad_norm=clip, mode=mode)

    def make(opt):
        @jax.jit
        def step(p, s):
            l, g = jax.value_and_grad(loss)(p)
            u, s = opt.update(g, s, p)
            return optax.apply_updates(p, u), s, l
        return step

    pr, sr, ref_step = w0, ref_tx.init(w0), make(ref_tx)
    po, so, our_step = jax.tree.map(jnp.copy, w0), tx.init(w0), make(tx)
    for _ in range(20):
        pr, sr, lr_ = ref_step(pr, sr)
        po, so, lo = our_step(po, so)
    for k in pr:
        dist = np.abs(np.asarray(pr[k]) - np.asarray(po[k])).max() / 1e-2
        print(f"mode={mode} clip={clip} {k}: max |ours - optax| = {dist:.3g} lr")
        assert dist < 0.25, k  # a stale or missed gradient would move weights by whole steps
    assert abs(float(lo) - float(lr_)) <= 1e-3 * abs(float(lr_))


@pytest.mark.parametrize("mode", ["gpu", "cpu"])
def test_eager_equals_jit_and_the_state_is_pure(mode):
    """Outside jit the same program runs; a state passed twice (not donated) gives the same
    result twice, and the state passed in is left as it was."""
    dev = _gpu()
    p0 = _params(jnp.float32, dev, seed=3)
    rng = np.random.default_rng(4)
    gs = [_grads(rng, p0, dev) for _ in range(3)]
    tx = tsj.offload_adamw(1e-3, master_weights=True, max_grad_norm=1.0, mode=mode)
    pa, sa = p0, tx.init(p0)
    pb, sb = p0, tx.init(p0)
    jstep = jax.jit(tx.step)
    for g in gs:
        pa, sa = jstep(g, sa, pa)
        pb, sb = tx.step(g, sb, pb)
    _same(pb, pa, "eager vs jit")
    keep = jax.tree.map(np.asarray, sa)
    again = [jstep(gs[0], sa, pa) for _ in range(2)]
    _same(again[0], again[1], "the same state twice")
    _same(sa, keep, "the state passed in")


def test_state_dict_round_trip_between_modes_on_gpu():
    dev = _gpu()
    p0 = _params(jnp.bfloat16, dev, seed=5)
    rng = np.random.default_rng(6)
    gs = [_grads(rng, p0, dev) for _ in range(6)]
    kw = dict(weight_decay=1e-2, mask=_mask)
    tx = tsj.offload_adamw(1e-3, master_weights=True, mode="gpu", **kw)
    step = jax.jit(tx.step)
    p, s = p0, tx.init(p0)
    for g in gs[:3]:
        p, s = step(g, s, p)
    ckpt = jax.tree.map(np.array, tsj.state_dict(s, p))
    p_ck = p
    for g in gs[3:]:
        p, s = step(g, s, p)
    for mode in ("gpu", "cpu"):
        tx2 = tsj.offload_adamw(1e-3, master_weights=True, mode=mode, **kw)
        s2 = tx2.load_state_dict(tx2.init(p_ck), ckpt)
        _host_state(s2)
        assert int(s2.count) == 3
        if mode == "gpu":
            p2, step2 = p_ck, jax.jit(tx2.step)
            for g in gs[3:]:
                p2, s2 = step2(g, s2, p2)
            _same(p2, p, "resumed from state_dict")


def test_bad_input_on_gpu():
    dev = _gpu()
    params = _params(jnp.float32, dev)
    cpu_params = jax.tree.map(lambda a: jax.device_put(a, jax.devices("cpu")[0]), params)
    with pytest.raises(ValueError, match="mode='gpu'.*parameters are on the CPU"):
        tsj.offload_adamw(1e-3, master_weights=True, mode="gpu").init(cpu_params)
    tx = tsj.offload_adamw(1e-3, master_weights=True, mode="gpu")
    s = tx.init(params)
    g = jax.tree.map(jnp.zeros_like, params)
    on_device = s._replace(mu=jax.tree.map(lambda a: jax.device_put(np.asarray(a), dev), s.mu))
    with pytest.raises(ValueError, match="in GPU memory.*pinned host memory"):
        jax.jit(tx.step)(g, on_device, params)
    with pytest.raises(ValueError, match="state_dict.*params"):
        tsj.state_dict(s)


# -- parameters sharded over a mesh (here: a mesh of the one GPU) ------------------------------

_MESH_SPECS = {"a": ("x", None), "b": (None, "x"), "c": ("x",), "d": (), "e": ("x", None)}


def _on_mesh(tree, mesh):
    from jax.sharding import NamedSharding, PartitionSpec

    return {k: jax.device_put(v, NamedSharding(mesh, PartitionSpec(*_MESH_SPECS[k]))) for k, v in tree.items()}


@pytest.mark.parametrize("mode", ["gpu", "cpu"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sharded_over_a_one_device_mesh(mode, dtype, tmp_path):
    """NamedSharding parameters (a mesh of the one GPU): the moments and masters are
    NamedSharding ``pinned_host`` arrays with the parameters' specs, the count a replicated
    NamedSharding array; the update runs per device inside a shard_map and gives the bits
    of the single-device update (gpu mode: also optax.adamw's on the same sharded params);
    orbax restores the sharded host state into an abstract target, which resumes bit for bit."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    ocp = pytest.importorskip("orbax.checkpoint")
    dev = _gpu()
    mesh = Mesh(np.array([dev]), ("x",))
    params = _params(jnp.dtype(dtype), dev, seed=9)
    sharded = _on_mesh(params, mesh)
    rng = np.random.default_rng(10)
    gs = [_grads(rng, params, dev, exact_norm=True) for _ in range(6)]
    kw = dict(weight_decay=1e-2, mask=_mask, max_grad_norm=0.5, mode=mode)
    tx, tx1 = (tsj.offload_adamw(SCHEDULE, master_weights=True, **kw) for _ in range(2))
    ref = _ref_tx(SCHEDULE, 0.5)

    def make(opt):
        @jax.jit
        def step(p, s, g):
            u, s = opt.update(g, s, p)
            return optax.apply_updates(p, u), s
        return step

    step, step1, theirs = make(tx), make(tx1), make(ref)
    s = tx.init(sharded)
    _host_state(s)
    for k in params:
        want = NamedSharding(mesh, PartitionSpec(*_MESH_SPECS[k]), memory_kind="pinned_host")
        assert s.mu[k].sharding.is_equivalent_to(want, s.mu[k].ndim), (k, s.mu[k].sharding)
    assert isinstance(s.count.sharding, NamedSharding) and s.count.sharding.is_fully_replicated
    p, p1, s1 = sharded, params, tx1.init(params)
    pr, sr = _on_mesh(_f32(params), mesh), ref.init(_on_mesh(_f32(params), mesh))
    for t, g in enumerate(gs[:3]):
        p, s = step(p, s, _on_mesh(g, mesh))
        p1, s1 = step1(p1, s1, g)
        pr, sr = theirs(pr, sr, _on_mesh(_f32(g), mesh))
        what = f"{mode} {dtype} step {t + 1}"
        _same(p, p1, what + " weights, sharded vs single-device")
        _same(s, s1, what + " state, sharded vs single-device")
        if mode == "gpu":
            _same(s.master if dtype != "float32" else p, pr, what + " weights vs optax")
            _same(s.mu, _adam_state(sr).mu, what + " mu vs optax")
    _host_state(s)
    ck = ocp.StandardCheckpointer()
    ck.save(tmp_path / "ckpt", {"params": p, "opt_state": s})
    ck.wait_until_finished()
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, {"params": sharded, "opt_state": tx.init(sharded)})
    r = ck.restore(tmp_path / "ckpt", abstract)
    _host_state(r["opt_state"])
    p2, s2 = r["params"], r["opt_state"]
    assert int(s2.count) == 3
    for g in gs[3:]:
        g = _on_mesh(g, mesh)
        p, s = step(p, s, g)
        p2, s2 = step(p2, s2, g)
    _same(p2, p, "orbax resumed weights")
    _same(s2, s, "orbax resumed state")

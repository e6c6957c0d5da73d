"""offload_adamw on a CUDA GPU (XLA:GPU): both modes under jit against optax.adamw jitted on
the GPU, no optimizer state in GPU memory, eager = jit, checkpoints across modes, bad input.

XLA:GPU's optax uses approximate square root and division (``sqrt.approx``,
``div.full``), so the comparison is per step and bounded in ULPs
(``trainstream.contract.OPTAX_CUDA_MAX_ULP``): each step starts optax from *our* state
(exported with ``state_dict``), so differences cannot compound over the steps.
"""

from __future__ import annotations

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


# Leaf sizes: odd, a multiple of 4, a prime: the kernels' scalar head/tail and vector body.
SHAPES = {"a": (37, 19), "b": (256, 64), "c": (10007,), "d": (4,), "e": (1536, 1025)}  # e: 2 host chunks
SCHEDULE = optax.warmup_cosine_decay_schedule(0.0, 3e-3, 5, 50, 1e-4)


def _mask(params):
    return {k: k != "d" for k in params}


def _params(dtype, dev, seed=0):
    rng = np.random.default_rng(seed)
    return {k: jax.device_put(jnp.asarray(rng.standard_normal(s).astype(np.float32), dtype), dev)
            for k, s in SHAPES.items()}


def _grads(rng, params, dev, exact_norm=False):
    """A spread of magnitudes, zeros included. ``exact_norm``: k * 2**-10 with integer k in
    [-2, 2] (exact in bf16), whose squares sum exactly in float32 in any order (every
    partial sum is an integer multiple of 2**-20 below 2**24 of them):
    the global norm is then the same in every program (XLA's reduction order changes the
    last bits of a float32 sum, and with them the clip coefficient)."""
    out = {}
    for k, p in params.items():
        if exact_norm:
            g = rng.integers(-2, 3, p.shape).astype(np.float32) * np.float32(2.0**-10)
        else:
            g = rng.standard_normal(p.shape).astype(np.float32) * np.float32(10.0 ** rng.uniform(-3, 0.5))
            g[rng.random(p.shape) < 0.01] = 0
        out[k] = jax.device_put(jnp.asarray(g, p.dtype), dev)
    return out


def _optax_tx(lr, clip, wd=1e-2):
    """The reference: optax.adamw, chained after clip_by_global_norm when clipping."""
    inner = optax.adamw(lr, weight_decay=wd, mask=_mask)
    tx = optax.chain(optax.clip_by_global_norm(clip), inner) if clip else inner
    return tx


def _optax_state_like(tx, params32, sd, dev):
    """``tx.init`` with its moments and counts replaced by our checkpoint ``sd``."""
    st = tx.init(params32)
    mu = jax.tree.map(lambda a: jax.device_put(jnp.asarray(a), dev), sd["exp_avg"])
    nu = jax.tree.map(lambda a: jax.device_put(jnp.asarray(a), dev), sd["exp_avg_sq"])
    count = jax.device_put(jnp.asarray(sd["count"], jnp.int32), dev)

    def fix(x):
        if isinstance(x, optax.ScaleByAdamState):
            return optax.ScaleByAdamState(count=count, mu=mu, nu=nu)
        if isinstance(x, optax.ScaleByScheduleState):
            return optax.ScaleByScheduleState(count=count)
        return x

    return jax.tree.map(fix, st, is_leaf=lambda x: isinstance(x, (optax.ScaleByAdamState, optax.ScaleByScheduleState)))


def _max_ulps(got, want, prev):
    return max(float(C.update_ulps(np.asarray(g, np.float32).ravel(), np.asarray(w, np.float32).ravel(),
                                  np.asarray(p, np.float32).ravel()).max(initial=0.0))
               for g, w, p in zip(jax.tree.leaves(got), jax.tree.leaves(want), jax.tree.leaves(prev)))


@pytest.mark.parametrize("mode", ["gpu", "cpu"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("clip", [None, 0.5], ids=["noclip", "clip"])
def test_jit_matches_optax_on_gpu_per_step(mode, dtype, clip):
    dev = _gpu()
    steps = 30
    lr = SCHEDULE
    params = _params(jnp.dtype(dtype), dev)
    tx = tsj.offload_adamw(lr, weight_decay=1e-2, mask=_mask, max_grad_norm=clip, mode=mode)
    state = tx.init(params)
    ref_tx = _optax_tx(lr, clip)

    @jax.jit
    def ref_step(g32, st, p32):
        u, st = ref_tx.update(g32, st, p32)
        return optax.apply_updates(p32, u), st

    traces = []

    def our(g, s, p):
        traces.append(1)
        return tx.step(g, s, p)

    step = jax.jit(our)
    rng = np.random.default_rng(1)
    worst = worst_mv = worst_step = 0.0
    p = params
    for t in range(steps):
        g = _grads(rng, p, dev, exact_norm=clip is not None)
        sd = tsj.state_dict(state, p)  # our state before the step
        master = jax.tree.map(lambda a: jax.device_put(jnp.asarray(a), dev), sd["master"])
        g32 = jax.tree.map(lambda x: x.astype(jnp.float32), g)
        want, ref_st = ref_step(g32, _optax_state_like(ref_tx, master, sd, dev), master)
        p, state = step(g, state, p)
        sd2 = tsj.state_dict(state, p)
        assert int(sd2["count"]) == t + 1
        worst = max(worst, _max_ulps(sd2["master"], want, master))
        lr_t = float(SCHEDULE(t))  # optax: the schedule at the count before the step
        step_err = max(float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max())
                       for a, b in zip(jax.tree.leaves(sd2["master"]), jax.tree.leaves(want)))
        worst_step = max(worst_step, step_err / lr_t if lr_t > 0 else (np.inf if step_err else 0.0))
        adam = [x for x in jax.tree.leaves(ref_st, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
                if isinstance(x, optax.ScaleByAdamState)][0]
        worst_mv = max(worst_mv, _max_ulps(sd2["exp_avg"], adam.mu, sd["exp_avg"]),
                       _max_ulps(sd2["exp_avg_sq"], adam.nu, sd["exp_avg_sq"]))
        if dtype != "float32":  # the weights are the master's rounding, exactly
            for k in p:
                np.testing.assert_array_equal(
                    np.asarray(p[k]).view(np.uint16),
                    np.asarray(jnp.asarray(sd2["master"][k]).astype(p[k].dtype)).view(np.uint16))
    print(f"mode={mode} {dtype} clip={clip}: max ULP vs optax on the GPU, weights {worst}, moments {worst_mv}; "
          f"max weight difference {worst_step:.2e} lr")
    if mode == "gpu":  # the same instructions as XLA:GPU
        assert worst <= C.OPTAX_CUDA_MAX_ULP
        assert worst_mv <= C.OPTAX_CUDA_MAX_ULP
    else:
        # IEEE host arithmetic: the moments within the contract's bound; the weights within
        # a thousandth of the step (their ULPs blow up where Adam's m nearly cancels,
        # e.g. a gradient that flips sign: measured up to 326 ULP, from 2-ULP moments)
        assert worst_mv <= C.OPTAX_CUDA_HOST_MAX_ULP
        assert worst_step <= 1e-3
    assert len(traces) == 1, "the train step recompiled"
    tsj.close(state)


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

    def ref(p, s, x):
        g = jax.grad(_mlp)(p, x)
        u, s = optax.adamw(1e-3).update(g, s, p)
        return optax.apply_updates(p, u), s

    ref_state = optax.adamw(1e-3).init(params)
    ma_ref = jax.jit(ref, donate_argnums=(0, 1)).lower(params, ref_state, x).compile().memory_analysis()
    tx = tsj.offload_adamw(1e-3, mode=mode)
    before = dev.memory_stats()["bytes_in_use"]
    state = tx.init(params)
    after = dev.memory_stats()["bytes_in_use"]

    def ours(p, s, x):
        g = jax.grad(_mlp)(p, x)
        return tx.step(g, s, p)

    ma = jax.jit(ours, donate_argnums=(0,)).lower(params, state, x).compile().memory_analysis()
    print(f"mode={mode}: args {ma.argument_size_in_bytes} temp {ma.temp_size_in_bytes} "
          f"(optax in HBM: args {ma_ref.argument_size_in_bytes} temp {ma_ref.temp_size_in_bytes}); "
          f"init added {after - before} bytes of GPU memory; params {pbytes}")
    # the optax step carries mu and nu (2 x params) as arguments; ours only params, batch, count
    assert ma_ref.argument_size_in_bytes >= 3 * pbytes
    assert ma.argument_size_in_bytes <= pbytes + x.nbytes + 4096
    # temporaries: the gradients and activations; mu and nu alone would be 2 x params
    assert ma.temp_size_in_bytes < 2 * pbytes
    assert after - before < pbytes // 4  # a few scalars, no moments
    p, state = jax.jit(ours, donate_argnums=(0,))(params, state, x)
    jax.block_until_ready(p)
    tsj.close(state)


@pytest.mark.parametrize("mode", ["gpu", "cpu"])
@pytest.mark.parametrize("clip", [None, 1.0], ids=["noclip", "clip"])
def test_train_step_with_gradients_in_the_same_program(mode, clip):
    """Gradients computed in the same jitted program as the update (the usual train step):
    the update must see them (stream order on XLA's stream), so the trajectory follows
    optax's within rounding. A well-conditioned least-squares problem keeps every
    gradient far above rounding noise (Adam's step of a noise-level gradient is +-lr)."""
    dev = _gpu()
    rng = np.random.default_rng(11)
    a = jax.device_put(jnp.asarray(rng.standard_normal((512, 300)).astype(np.float32)), dev)
    y = jax.device_put(jnp.asarray(rng.standard_normal((512, 7)).astype(np.float32)), dev)
    w0 = {"w": jax.device_put(jnp.asarray(rng.standard_normal((300, 7)).astype(np.float32) * 0.1), dev),
          "b": jax.device_put(jnp.asarray(rng.standard_normal((7,)).astype(np.float32)), dev)}

    def loss(p):
        return jnp.mean((a @ p["w"] + p["b"] - y) ** 2)

    ref_tx = optax.chain(optax.clip_by_global_norm(clip), optax.adamw(1e-2)) if clip else optax.adamw(1e-2)

    @jax.jit
    def ref_step(p, s):
        l, g = jax.value_and_grad(loss)(p)
        u, s = ref_tx.update(g, s, p)
        return optax.apply_updates(p, u), s, l

    tx = tsj.offload_adamw(1e-2, max_grad_norm=clip, mode=mode)

    @jax.jit
    def our_step(p, s):
        l, g = jax.value_and_grad(loss)(p)
        p, s = tx.step(g, s, p)
        return p, s, l

    pr, sr = w0, ref_tx.init(w0)
    po, so = jax.tree.map(jnp.copy, w0), tx.init(w0)
    for _ in range(20):
        pr, sr, lr_ = ref_step(pr, sr)
        po, so, lo = our_step(po, so)
    # The two programs compute the gradients with different fusions (last-bit
    # differences), which Adam's sign-like steps turn into differences of a small
    # fraction of lr where a gradient nears zero; a missed or stale gradient would move
    # weights by whole steps (lr each, 20 steps).
    for k in pr:
        r, o = np.asarray(pr[k]), np.asarray(po[k])
        dist = np.abs(r - o).max() / 1e-2
        print(f"mode={mode} clip={clip} {k}: max |ours - optax| = {dist:.3f} lr")
        assert dist < 0.25, k
    assert abs(float(lo) - float(lr_)) <= 1e-3 * abs(float(lr_))
    tsj.close(so)


@pytest.mark.parametrize("mode", ["gpu", "cpu"])
def test_eager_equals_jit_on_gpu(mode):
    dev = _gpu()
    p0 = _params(jnp.float32, dev, seed=3)
    rng = np.random.default_rng(4)
    gs = [_grads(rng, p0, dev) for _ in range(4)]
    tx_a = tsj.offload_adamw(1e-3, max_grad_norm=1.0, mode=mode)
    tx_b = tsj.offload_adamw(1e-3, max_grad_norm=1.0, mode=mode)
    pa, sa = p0, tx_a.init(p0)
    pb, sb = jax.tree.map(jnp.copy, p0), tx_b.init(p0)
    jstep = jax.jit(tx_a.step)
    for g in gs:
        pa, sa = jstep(g, sa, pa)
        pb, sb = tx_b.step(g, sb, pb)
    for k in pa:
        np.testing.assert_array_equal(np.asarray(pa[k]).view(np.uint32), np.asarray(pb[k]).view(np.uint32))
    tsj.close(sa)
    tsj.close(sb)


def test_checkpoint_moves_between_modes_on_gpu():
    dev = _gpu()
    p0 = _params(jnp.bfloat16, dev, seed=5)
    rng = np.random.default_rng(6)
    gs = [_grads(rng, p0, dev) for _ in range(6)]
    kw = dict(weight_decay=1e-2, mask=_mask)
    # gpu -> checkpoint -> gpu resumes bit-identically
    tx = tsj.offload_adamw(1e-3, mode="gpu", **kw)
    p, s = p0, tx.init(p0)
    step = jax.jit(tx.step)
    for g in gs[:3]:
        p, s = step(g, s, p)
    ckpt = jax.tree.map(np.array, tsj.state_dict(s, p))
    p_ck = p
    for g in gs[3:]:
        p, s = step(g, s, p)
    for mode in ("gpu", "cpu"):
        tx2 = tsj.offload_adamw(1e-3, mode=mode, **kw)
        s2 = tx2.load_state_dict(tx2.init(p_ck), ckpt)
        back = tsj.state_dict(s2, p_ck)
        for key in ("master", "exp_avg", "exp_avg_sq"):
            for a, b in zip(jax.tree.leaves(back[key]), jax.tree.leaves(ckpt[key])):
                np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))
        assert int(back["count"]) == 3
        if mode == "gpu":
            p2, step2 = p_ck, jax.jit(tx2.step)
            for g in gs[3:]:
                p2, s2 = step2(g, s2, p2)
            for k in p:
                np.testing.assert_array_equal(np.asarray(p2[k]).view(np.uint16), np.asarray(p[k]).view(np.uint16))
        tsj.close(s2)
    tsj.close(s)


def test_torch_convention_cpu_mode_on_gpu_matches_torch_cuda():
    """convention='torch', mode='cpu', JAX arrays on the GPU: torch.optim.AdamW on CUDA."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    dev = _gpu()
    p0 = _params(jnp.float32, dev, seed=7)
    rng = np.random.default_rng(8)
    tx = tsj.offload_adamw(1e-3, weight_decay=1e-2, convention="torch", mode="cpu")
    p, s = p0, tx.init(p0)
    tp = {k: torch.tensor(np.asarray(v), device="cuda", requires_grad=True) for k, v in p0.items()}
    opt = torch.optim.AdamW(list(tp.values()), lr=1e-3, weight_decay=1e-2)
    step = jax.jit(tx.step)
    for _ in range(20):
        g = _grads(rng, p, dev)
        for k in tp:
            tp[k].grad = torch.tensor(np.asarray(g[k]), device="cuda")
        opt.step()
        p, s = step(g, s, p)
    for k in p:
        np.testing.assert_array_equal(np.asarray(p[k]).view(np.uint32),
                                      tp[k].detach().cpu().numpy().view(np.uint32))
    tsj.close(s)


def test_gpu_mode_reports_an_old_state():
    """In gpu mode the count is checked asynchronously: reusing an old state is reported
    at a later call or at state_dict, and stays reported until a checkpoint is loaded."""
    dev = _gpu()
    p0 = _params(jnp.float32, dev, seed=9)
    rng = np.random.default_rng(10)
    g = _grads(rng, p0, dev)
    tx = tsj.offload_adamw(1e-3, mode="gpu")
    s0 = tx.init(p0)
    step = jax.jit(tx.step)
    p1, s1 = step(g, s0, p0)
    ckpt = jax.tree.map(np.array, tsj.state_dict(s1, p1))
    p2, s2 = step(g, s1, p1)
    p3, s3 = step(g, s0, p2)  # the state of step 0 again: its moments are gone
    with pytest.raises(Exception, match="only the state returned by the previous update"):
        jax.block_until_ready(p3)
        tsj.state_dict(s3, p3)
    with pytest.raises(Exception, match="previous update"):
        tsj.state_dict(s3, p3)  # sticky
    s4 = tx.load_state_dict(s3, ckpt)
    p4, s4 = step(g, s4, p1)
    assert int(tsj.state_dict(s4, p4)["count"]) == 2
    tsj.close(s4)


def test_bad_input_on_gpu():
    dev = _gpu()
    params = _params(jnp.float32, dev)
    cpu_params = jax.tree.map(lambda a: jax.device_put(a, jax.devices("cpu")[0]), params)
    with pytest.raises(ValueError, match="mode='gpu'.*parameters are on the CPU"):
        tsj.offload_adamw(1e-3, mode="gpu").init(cpu_params)
    with pytest.raises(NotImplementedError, match="convention='optax' only"):
        tsj.offload_adamw(1e-3, mode="gpu", convention="torch").init(params)
    tx = tsj.offload_adamw(1e-3, mode="gpu")
    s = tx.init(params)
    with pytest.raises(ValueError, match="gradients are on cpu"):
        tx.step(jax.tree.map(jnp.zeros_like, cpu_params), s, params)
    with pytest.raises(ValueError, match="state_dict.*params"):
        tsj.state_dict(s)
    tsj.close(s)

"""trainstream.jax.offload_adamw against optax.adamw jitted on XLA:CPU (bit for bit)."""

import os
import threading

import numpy as np
import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
jnp = jax.numpy

import trainstream.jax as tsj  # noqa: E402
from _jax_helpers import (  # noqa: E402
    BF16,
    F32,
    MODELS,
    SCHEDULE,
    _copy,
    assert_tree_bits,
    decay_mask,
    mlp_batch,
    mlp_init,
    mlp_loss,
    transformer_batch,
    transformer_init,
    transformer_loss,
)

if jax.default_backend() != "cpu":  # pragma: no cover - the CI runs JAX on the CPU
    pytest.skip("these tests run JAX on the CPU backend", allow_module_level=True)


# -- helpers -------------------------------------------------------------------------------------


def reference_step(opt, loss):
    @jax.jit
    def step(params, state, batch):
        grads = jax.grad(loss)(params, batch)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return step


def offload_step(tx, loss, traces=None):
    def step(params, state, batch):
        if traces is not None:
            traces.append(1)
        grads = jax.grad(loss)(params, batch)
        return tx.step(grads, state, params)

    return jax.jit(step, donate_argnums=(0,))


#: the MLP under every forced ISA level (tests/test_portability.py), the transformer at the host's own level only:
#: the optimizer runs the same element-wise programs for both, and the transformer compiles 3x longer
ISA_MODELS = [pytest.param(m, marks=pytest.mark.isa) if m == "mlp" else m for m in MODELS]

# -- against optax.adamw under jax.jit -------------------------------------------------------------


@pytest.mark.parametrize("model", ISA_MODELS)
def test_jit_matches_optax_adamw_schedule_mask(model):
    """50 steps, warmup-cosine schedule, weight decay masked off the vectors; compiles once."""
    init, loss, batch = MODELS[model]
    rng = np.random.default_rng(1)
    params = init(rng)
    kw = dict(b1=0.9, b2=0.98, eps=1e-8, weight_decay=0.05, mask=decay_mask)
    ref = optax.adamw(SCHEDULE, **kw)
    tx = tsj.offload_adamw(SCHEDULE, **kw)
    p_ref, s_ref = _copy(params), ref.init(params)
    p, s = _copy(params), tx.init(params)
    traces = []
    step, rstep = offload_step(tx, loss, traces), reference_step(ref, loss)
    for t in range(50):
        b = batch(rng)
        p, s = step(p, s, b)
        p_ref, s_ref = rstep(p_ref, s_ref, b)
        assert_tree_bits(p, p_ref, f"{model} params step {t + 1}")
    assert int(s.count) == 50
    assert len(traces) == 1 and step._cache_size() == 1, "the train step must compile once"
    assert_tree_bits(s.mu, optax.tree_utils.tree_get(s_ref, "mu"), "mu")
    assert_tree_bits(s.nu, optax.tree_utils.tree_get(s_ref, "nu"), "nu")


@pytest.mark.parametrize("model", ISA_MODELS)
def test_jit_matches_optax_clip_by_global_norm(model):
    """max_grad_norm == chain(clip_by_global_norm, adamw); the norm is chosen so that
    some steps clip and some do not."""
    init, loss, batch = MODELS[model]
    rng = np.random.default_rng(2)
    params = init(rng)
    norms = [float(optax.tree.norm(jax.grad(loss)(params, batch(np.random.default_rng(i)))))
             for i in range(8)]
    max_norm = float(np.median(norms))
    kw = dict(b1=0.9, b2=0.999, eps=1e-8, weight_decay=1e-4)
    ref = optax.chain(optax.clip_by_global_norm(max_norm), optax.adamw(1e-3, **kw))
    tx = tsj.offload_adamw(1e-3, max_grad_norm=max_norm, **kw)
    p_ref, s_ref = _copy(params), ref.init(params)
    p, s = _copy(params), tx.init(params)
    step, rstep = offload_step(tx, loss), reference_step(ref, loss)
    clipped = 0
    for t in range(50):
        b = batch(rng)
        clipped += float(optax.tree.norm(jax.grad(loss)(p_ref, b))) >= max_norm
        p, s = step(p, s, b)
        p_ref, s_ref = rstep(p_ref, s_ref, b)
        assert_tree_bits(p, p_ref, f"{model} params step {t + 1}")
    assert 0 < clipped < 50


def test_bf16_params_match_fp32_master_reference():
    """bf16 weights: the engine's fp32 master equals optax on fp32 weights fed the upcast
    bf16 gradients, and the returned weights are its rounding to bf16."""
    rng = np.random.default_rng(3)
    master0 = mlp_init(rng)
    params = jax.tree.map(lambda x: x.astype(BF16), master0)
    master = jax.tree.map(lambda x: x.astype(F32), params)  # the master starts as the bf16 weights
    kw = dict(b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01, mask=decay_mask)
    ref = optax.adamw(SCHEDULE, **kw)
    tx = tsj.offload_adamw(SCHEDULE, **kw, master_weights=True)  # the fp32-master scheme (opt-in)
    s_ref, s = ref.init(master), tx.init(params)

    @jax.jit
    def step(params, state, batch):
        grads = jax.grad(mlp_loss)(params, batch)
        new, state = tx.step(grads, state, params)
        return new, state, grads

    @jax.jit
    def rstep(master, state, grads):  # grads: float32, materialised (upcast outside)
        updates, state = ref.update(grads, state, master)
        return optax.apply_updates(master, updates), state

    for t in range(50):
        b = mlp_batch(rng)
        params, s, grads = step(params, s, b)
        assert all(g.dtype == BF16 for g in jax.tree.leaves(grads))
        # upcast in its own program: inside rstep XLA would fuse the convert into the
        # moment update (a "fused gradient", other FMA pairing)
        master, s_ref = rstep(master, s_ref, jax.tree.map(lambda g: g.astype(F32), grads))
        assert_tree_bits(params, jax.tree.map(lambda x: x.astype(BF16), master), f"bf16 weights step {t + 1}")
    assert_tree_bits(s.master, master, "fp32 master")


@pytest.mark.isa
def test_single_leaf_pytree():
    """A bare array as the whole pytree (XLA:CPU compiles optax differently for it)."""
    rng = np.random.default_rng(4)
    w = jnp.asarray(rng.standard_normal((20, 15)).astype(np.float32))
    # a matmul makes the gradient (an element-wise one: tests/test_jax_compose.py)
    loss = lambda w, x: jnp.sum(jnp.tanh(x @ w))  # noqa: E731
    ref, tx = optax.adamw(1e-2, weight_decay=0.1), tsj.offload_adamw(1e-2, weight_decay=0.1)
    p_ref, s_ref, p, s = w, ref.init(w), jnp.array(w, copy=True), tx.init(w)
    step, rstep = offload_step(tx, loss), reference_step(ref, loss)
    for t in range(20):
        x = jnp.asarray(rng.standard_normal((4, 20)).astype(np.float32))
        p, s = step(p, s, x)
        p_ref, s_ref = rstep(p_ref, s_ref, x)
        assert_tree_bits(p, p_ref, f"step {t + 1}")


# -- eager path, optax API, checkpoints -----------------------------------------------------------


def test_eager_equals_jit():
    rng = np.random.default_rng(6)
    params = transformer_init(rng)
    kw = dict(weight_decay=0.02, mask=decay_mask, max_grad_norm=0.5)
    tx_j, tx_e = tsj.offload_adamw(SCHEDULE, **kw), tsj.offload_adamw(SCHEDULE, **kw)
    p_j, s_j = _copy(params), tx_j.init(params)
    p_e, s_e = _copy(params), tx_e.init(params)
    step = jax.jit(tx_j.step)
    grad_fn = jax.jit(jax.grad(transformer_loss))
    for t in range(10):
        b = transformer_batch(rng)
        p_j, s_j = step(grad_fn(p_j, b), s_j, p_j)
        p_e, s_e = tx_e.step(grad_fn(p_e, b), s_e, p_e)  # eager: NumPy views, no jit
        assert_tree_bits(p_e, p_j, f"eager vs jit step {t + 1}")
    assert int(s_e.count) == int(s_j.count) == 10
    assert_tree_bits(s_e, s_j, "eager vs jit state")


def test_update_then_apply_updates_is_optax():
    """optax's usage: update + apply_updates, jitted together and eagerly, equals the same
    program around optax.adamw bit for bit (update returns optax's update, not new - p)."""
    rng = np.random.default_rng(7)
    params = transformer_init(rng)
    kw = dict(weight_decay=0.1, mask=decay_mask)
    ref, tx = optax.adamw(SCHEDULE, **kw), tsj.offload_adamw(SCHEDULE, **kw)

    def make(opt):
        @jax.jit
        def via_update(grads, state, params):
            updates, state = opt.update(grads, state, params)
            return optax.apply_updates(params, updates), state, updates
        return via_update

    f_ref, f = make(ref), make(tx)
    upd_ref = jax.jit(ref.update)
    grad_fn = jax.jit(jax.grad(transformer_loss))
    p, s, p_ref, s_ref = params, tx.init(params), params, ref.init(params)
    for t in range(8):
        b = transformer_batch(rng)
        g = grad_fn(p_ref, b)
        if t % 2:
            p_ref, s_ref, u_ref = f_ref(g, s_ref, p_ref)
            p, s, u = f(g, s, p)
        else:  # update eagerly (its own program), apply_updates eagerly: as optax's jitted update
            u_ref, s_ref = upd_ref(g, s_ref, p_ref)
            p_ref = optax.apply_updates(p_ref, u_ref)
            u, s = tx.update(g, s, p)
            p = optax.apply_updates(p, u)
        assert_tree_bits(u, u_ref, f"updates step {t + 1}")
        assert_tree_bits(p, p_ref, f"params step {t + 1}")
    assert_tree_bits(s.mu, s_ref[0].mu, "mu")
    assert_tree_bits(s.nu, s_ref[0].nu, "nu")


def test_checkpoint_round_trip_resumes_bit_identically():
    """state_dict / load_state_dict (torch.optim.AdamW's names, NumPy only)."""
    rng = np.random.default_rng(8)
    params = mlp_init(rng)
    batches = [mlp_batch(rng) for _ in range(20)]
    kw = dict(weight_decay=0.01, mask=decay_mask, max_grad_norm=1.0)
    tx = tsj.offload_adamw(SCHEDULE, **kw)
    step = offload_step(tx, mlp_loss)
    p, s = _copy(params), tx.init(params)
    for b in batches[:10]:
        p, s = step(p, s, b)
    ckpt = jax.tree.map(np.array, tsj.state_dict(s, p))  # NumPy only, as a checkpointer stores it
    p_ckpt = jax.tree.map(np.array, p)
    assert all(isinstance(x, np.ndarray) for x in jax.tree.leaves(ckpt))
    for b in batches[10:]:
        p, s = step(p, s, b)
    # a fresh optimizer (as in a new process): init, then load the checkpoint
    tx2 = tsj.offload_adamw(SCHEDULE, **kw)
    p2 = jax.tree.map(jnp.asarray, p_ckpt)
    s2 = tx2.load_state_dict(tx2.init(p2), ckpt)
    assert int(s2.count) == 10
    step2 = offload_step(tx2, mlp_loss)
    for b in batches[10:]:
        p2, s2 = step2(p2, s2, b)
    assert_tree_bits(p2, p, "resumed params")


# -- bad input ---------------------------------------------------------------------------------------


def test_bad_input_errors():
    rng = np.random.default_rng(9)
    params = mlp_init(rng)
    tx = tsj.offload_adamw(1e-3)
    with pytest.raises(TypeError, match=r"float32, float16 and bfloat16.*int32"):
        tx.init({"w": jnp.ones(3), "n": jnp.ones(3, jnp.int32)})
    with pytest.raises(RuntimeError, match="mode='gpu'.*needs a CUDA GPU"):
        tsj.offload_adamw(1e-3, mode="gpu").init(params)
    with pytest.raises(ValueError, match="mode must be"):
        tsj.offload_adamw(1e-3, mode="tpu")
    with pytest.raises(ValueError, match="max_grad_norm"):
        tsj.offload_adamw(1e-3, max_grad_norm=-1.0)
    s = tx.init(params)
    grads = jax.grad(mlp_loss)(params, mlp_batch(rng))
    # changed structure between init and update, eagerly and under jit
    other = dict(params, extra=jnp.ones(2))
    other_g = dict(grads, extra=jnp.ones(2))
    with pytest.raises(ValueError, match="differs from the one passed to init"):
        tx.step(other_g, s, other)
    with pytest.raises(ValueError, match="differs from the one passed to init"):
        jax.jit(tx.step)(other_g, s, other)
    with pytest.raises(ValueError, match="different pytree structures"):
        tx.step({"a": grads["scale"]}, s, params)
    with pytest.raises(ValueError, match="must have the parameter's shape and dtype"):
        tx.step(jax.tree.map(lambda g: g.astype(BF16), grads), s, params)
    with pytest.raises(ValueError, match="update needs params"):
        tx.update(grads, s)
    # mismatched checkpoint
    sd = tsj.state_dict(s, params)
    bad = dict(sd, exp_avg={k: v for k, v in sd["exp_avg"].items() if k != "scale"})
    with pytest.raises(ValueError, match="checkpoint 'exp_avg' has pytree structure"):
        tsj.load_state_dict(s, bad)
    bad = dict(sd, exp_avg=jax.tree.map(lambda x: np.zeros(x.size + 1, np.float32), sd["exp_avg"]))
    with pytest.raises(ValueError, match="has shape"):
        tsj.load_state_dict(s, bad)
    with pytest.raises(ValueError, match="lacks"):
        tsj.load_state_dict(s, {"count": 1})


def test_a_kernel_failure_raises_and_training_goes_on(monkeypatch):
    """A failure in the host kernel (run by the engine's workers) comes back through XLA
    with its message; the state passed in (not donated) is intact, and the next step with
    it is exact."""
    from trainstream import _host_kernels as K

    rng = np.random.default_rng(12)
    params = mlp_init(rng)
    b = mlp_batch(rng)
    tx = tsj.offload_adamw(1e-3, threads=2)
    grad = jax.jit(jax.grad(mlp_loss))
    step = jax.jit(tx.step)  # nothing donated
    s = tx.init(params)
    g = grad(params, b)
    want = step(g, s, params)
    real = K.adamw_chunk

    def boom(*a, **k):
        raise MemoryError("simulated kernel failure")

    monkeypatch.setattr(K, "adamw_chunk", boom)
    with pytest.raises(Exception, match="simulated kernel failure"):
        jax.block_until_ready(jax.jit(tx.step)(g, s, params))
    monkeypatch.setattr(K, "adamw_chunk", real)
    assert_tree_bits(jax.jit(tx.step)(g, s, params), want, "after a failure")


def test_one_engine_per_configuration_and_worker_nice():
    """The host updates run on the engine's workers (trainstream.core), one engine per
    configuration and process, shared by every transformation; worker_nice reaches it."""
    from trainstream.jax import _plan

    rng = np.random.default_rng(13)
    params = mlp_init(rng)
    g = jax.grad(mlp_loss)(params, mlp_batch(rng))
    for nice in (5, 19):
        txs = [tsj.offload_adamw(1e-3, threads=2, worker_nice=nice) for _ in range(2)]
        for tx in txs:
            jax.block_until_ready(jax.jit(tx.step)(g, tx.init(params), params))
        engines = [e for k, e in _plan._engines.items() if k == (os.getpid(), 2, nice)]
        assert len(engines) == 1 and engines[0].threads == 2
        tids = [t.native_id for t in threading.enumerate() if t.name.startswith("trainstream-worker")]
        try:
            prios = {os.getpriority(os.PRIO_PROCESS, t) for t in tids}
        except (AttributeError, OSError):
            pytest.skip("no per-thread priorities here")
        assert nice in prios or os.getpriority(os.PRIO_PROCESS, 0) >= nice
    with pytest.raises(ValueError, match="worker_nice must be an int"):
        tsj.offload_adamw(1e-3, worker_nice="19")


def test_scalar_matrix_comes_from_the_contract_in_the_program():
    """One contract function builds every leaf's scalars with jnp inside the program, with
    optax's expressions: Python floats (weak-typed) and float32 arrays (inject_hyperparams)."""
    from trainstream import contract as C

    codes, decays = [0, C.OX_FORM_R], [True, False]
    for b1 in (0.9, jnp.asarray(0.9, jnp.float32)):
        @jax.jit
        def both(count, b1=b1):
            sc = C.optax_scalar_matrix(count, codes, decays, learning_rate=SCHEDULE, b1=b1, b2=0.95,
                                       eps=1e-8, weight_decay=0.1, xp=jnp)
            t = optax.safe_increment(count)
            want = jnp.stack([(1 - b1 ** t).astype(F32), (1 - 0.95 ** t).astype(F32),
                              jnp.asarray(-1 * SCHEDULE(count), F32), jnp.asarray(1 - b1, F32)])
            return sc.scalars, sc.count_inc, want

        for count in (0, 1, 7, 1000):
            mat, t, want = both(jnp.asarray(count, jnp.int32))
            mat = np.asarray(mat)
            assert mat.shape == (2, C.N_SCALARS) and int(t) == count + 1
            got = mat[:, [C.S_BC1, C.S_BC2_OPTAX, C.S_NEG_LR, C.S_OMB1]]
            np.testing.assert_array_equal(got.view(np.uint32), np.broadcast_to(np.asarray(want), got.shape).view(np.uint32))
            assert list(mat[:, C.S_OX_CODE]) == [0.0, float(C.OX_FORM_R)]
            assert mat[0, C.S_WD] == np.float32(0.1) and mat[1, C.S_WD] == 0.0
            assert (mat[:, [C.S_CLIP, C.S_CLIP_DIV]] == 1.0).all()

"""Shared helpers of the JAX adapter's tests (two pure-JAX models, the decay mask, the
schedule, a bit-for-bit tree comparison): imported by test_jax and test_jax_compose (a
helper module, not collected by pytest)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

F32, BF16 = jnp.float32, jnp.bfloat16


# -- models (pure JAX) ------------------------------------------------------------------------


def mlp_init(rng, sizes=(12, 48, 32, 5)):
    params = {}
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        params[f"dense{i}"] = {
            "kernel": (rng.standard_normal((a, b)) / np.sqrt(a)).astype(np.float32),
            "bias": (0.1 * rng.standard_normal(b)).astype(np.float32),
        }
    params["scale"] = np.ones((1,), np.float32)  # a one-element leaf
    return jax.tree.map(jnp.asarray, params)


def mlp_loss(params, batch):
    x, y = batch
    h = x.astype(params["dense0"]["kernel"].dtype)
    n = len([k for k in params if k.startswith("dense")])
    for i in range(n):
        h = h @ params[f"dense{i}"]["kernel"] + params[f"dense{i}"]["bias"]
        if i < n - 1:
            h = jax.nn.gelu(h)
    h = h * params["scale"][0]
    return jnp.mean((h.astype(F32) - y) ** 2)


def mlp_batch(rng):
    return (jnp.asarray(rng.standard_normal((16, 12)).astype(np.float32)),
            jnp.asarray(rng.standard_normal((16, 5)).astype(np.float32)))


VOCAB, D, HEADS, SEQ = 37, 32, 2, 8


def transformer_init(rng):
    def w(*shape, scale=None):
        scale = scale or 1 / np.sqrt(shape[0])
        return jnp.asarray((rng.standard_normal(shape) * scale).astype(np.float32))

    return {
        "embed": w(VOCAB, D, scale=0.1),
        "pos": w(SEQ, D, scale=0.1),
        "block": {
            "ln1": {"g": jnp.ones(D), "b": jnp.zeros(D)},
            "qkv": w(D, 3 * D),
            "proj": w(D, D),
            "ln2": {"g": jnp.ones(D), "b": jnp.zeros(D)},
            "mlp_in": w(D, 4 * D),
            "mlp_in_b": jnp.zeros(4 * D),
            "mlp_out": w(4 * D, D),
            "mlp_out_b": jnp.zeros(D),
        },
        "ln_f": {"g": jnp.ones(D), "b": jnp.zeros(D)},
    }


def _ln(x, p):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / jnp.sqrt(var + 1e-5) * p["g"] + p["b"]


def transformer_loss(params, tokens):
    x = params["embed"][tokens[:, :-1]] + params["pos"][: SEQ - 1]
    b = params["block"]
    h = _ln(x, b["ln1"])
    q, k, v = jnp.split(h @ b["qkv"], 3, axis=-1)
    split = lambda t: t.reshape(t.shape[0], t.shape[1], HEADS, D // HEADS).transpose(0, 2, 1, 3)  # noqa: E731
    q, k, v = split(q), split(k), split(v)
    att = q @ k.transpose(0, 1, 3, 2) / np.sqrt(D // HEADS)
    mask = jnp.tril(jnp.ones((SEQ - 1, SEQ - 1), bool))
    att = jax.nn.softmax(jnp.where(mask, att, -1e9), axis=-1)
    o = (att @ v).transpose(0, 2, 1, 3).reshape(x.shape)
    x = x + o @ b["proj"]
    h = _ln(x, b["ln2"])
    x = x + jax.nn.gelu(h @ b["mlp_in"] + b["mlp_in_b"]) @ b["mlp_out"] + b["mlp_out_b"]
    logits = _ln(x, params["ln_f"]) @ params["embed"].T
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def transformer_batch(rng):
    return jnp.asarray(rng.integers(0, VOCAB, (4, SEQ)), jnp.int32)


MODELS = {
    "mlp": (mlp_init, mlp_loss, mlp_batch),
    "transformer": (transformer_init, transformer_loss, transformer_batch),
}


def decay_mask(params):
    """No weight decay on vectors (biases, norms, the scale)."""
    return jax.tree.map(lambda p: p.ndim > 1, params)


SCHEDULE = optax.warmup_cosine_decay_schedule(0.0, 3e-3, warmup_steps=5, decay_steps=50, end_value=1e-4)


def assert_tree_bits(got, want, what):
    gl, gd = jax.tree.flatten(got)
    wl, wd = jax.tree.flatten(want)
    assert gd == wd, what
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(want)[0]]
    for a, b, path in zip(gl, wl, paths):
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype and a.shape == b.shape, (what, path)
        ua = a.view(np.uint32 if a.itemsize == 4 else np.uint16)
        ub = b.view(ua.dtype)
        if not np.array_equal(ua, ub):
            bad = np.flatnonzero(ua.ravel() != ub.ravel())
            raise AssertionError(f"{what} {path}: {bad.size} of {a.size} elements differ, "
                                 f"first [{bad[0]}] {a.ravel()[bad[0]]!r} != {b.ravel()[bad[0]]!r}")


def _copy(tree):
    return jax.tree.map(lambda x: jnp.array(x, copy=True), tree)

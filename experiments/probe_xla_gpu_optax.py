# Run (GPU machine): python experiments/probe_xla_gpu_optax.py --out $OUT/xla_gpu_optax.npz --hlo $OUT/xla_gpu_optax_hlo.txt
"""Issue 35 item 4's data: what XLA:GPU computes for ``optax.adamw``'s lines that TrainStream's GPU kernels do not
have yet (optax's fp16/bf16 state, ``mu_dtype``, ``nesterov``, ``eps_root``, ``eps == 0``), recorded on a GPU so that
a session without one can derive each line and check a candidate bit for bit against it.

Per configuration (:data:`CONFIGS`): one jitted step as users write it (``opt.update`` then
``optax.apply_updates``, the gradient an argument: materialised, as the adapter's kernel receives it), run at
``count`` 0 and 4 (the bias corrections of steps 1 and 5) on ``--numel`` random elements per leaf (normal weights and
gradients across several magnitudes, moments as a few steps of Adam leave them, zeros, subnormals and a few exact ties
of the moment line). Saved: inputs and outputs as raw bits (``<config>/<count>/<name>``, uint16/uint32 arrays) in
one compressed ``.npz``, and each program's optimised HLO (``compile().as_text()``) in one text file: the fusions and
the operation order the lines must follow. On the CPU (``--device cpu``) it records XLA:CPU's, as a smoke test.
"""

from __future__ import annotations

import argparse
import os
import sys

CONFIGS = {  # name: (leaf dtype, optax.adamw keyword arguments beyond learning_rate=1e-3, weight_decay=1e-4)
    "bf16": ("bfloat16", {}),
    "fp16": ("float16", {}),
    "bf16_mu32": ("bfloat16", {"mu_dtype": "float32"}),
    "bf16_nesterov": ("bfloat16", {"nesterov": True}),
    "fp32_mu16": ("float32", {"mu_dtype": "bfloat16"}),
    "fp32_nesterov": ("float32", {"nesterov": True}),
    "fp32_eps_root": ("float32", {"eps_root": 1e-8}),
    "fp32_eps0": ("float32", {"eps": 0.0}),
}
COUNTS = (0, 4)


def _inputs(rng, n: int, dtype, mu_dtype, count: int):
    """``(p, g, mu, nu)`` as NumPy arrays in their dtypes: magnitudes spread over decades, special values at the
    start (zeros, subnormal-sized gradients, equal moments)."""
    import numpy as np  # noqa: PLC0415

    scale = 10.0 ** rng.integers(-6, 1, n)
    p = rng.normal(0, 0.05, n) * 10.0 ** rng.integers(-2, 1, n)
    g = rng.normal(0, 1, n) * scale
    mu = 0.0 if count == 0 else 0.1 * rng.normal(0, 1, n) * scale
    nu = 0.0 if count == 0 else 0.01 * (rng.normal(0, 1, n) * scale) ** 2
    g[:8] = [0.0, -0.0, 1e-30, -1e-30, 1e-8, 1.0, -1.0, 3.0]
    mu, nu = np.broadcast_to(mu, n).copy(), np.broadcast_to(nu, n).copy()
    return (p.astype(dtype), g.astype(dtype), mu.astype(mu_dtype), nu.astype(dtype))


def program(name: str):
    """``(opt, step)``: configuration ``name``'s ``optax.adamw`` and its jitted step ``(p, s, g) -> (new p, u, s)``."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    import optax  # noqa: PLC0415

    kw = dict(CONFIGS[name][1])
    if "mu_dtype" in kw:
        kw["mu_dtype"] = jnp.dtype(kw["mu_dtype"])
    opt = optax.adamw(1e-3, weight_decay=1e-4, **kw)

    @jax.jit
    def step(p, s, g):
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), u, s

    return opt, step


def record(name: str, numel: int, seed: int, hlo: list) -> dict:
    """One configuration's arrays (raw bits) at each count; its programs' HLO appended to ``hlo``."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415

    leaf, kw = CONFIGS[name]
    dtype = jnp.dtype(leaf)
    mu_dtype = jnp.dtype(kw.get("mu_dtype", dtype))
    opt, step = program(name)
    out, rng = {}, np.random.default_rng(seed)
    for count in COUNTS:
        p, g, mu, nu = _inputs(rng, numel, dtype, mu_dtype, count)
        s0 = opt.init(jnp.asarray(p))
        adam = s0[0]._replace(count=jnp.asarray(count, jnp.int32), mu=jnp.asarray(mu), nu=jnp.asarray(nu))
        s = (adam, *s0[1:])
        if count == COUNTS[0]:
            hlo.append(f"==== {name} ({leaf}, {kw}) ====\n" + step.lower(jnp.asarray(p), s, jnp.asarray(g))
                       .compile().as_text())
        new_p, u, new_s = jax.block_until_ready(step(jnp.asarray(p), s, jnp.asarray(g)))
        arrays = {"p": p, "g": g, "mu": mu, "nu": nu, "new_p": new_p, "u": u, "new_mu": new_s[0].mu,
                  "new_nu": new_s[0].nu}
        for k, a in arrays.items():
            a = np.asarray(a)
            out[f"{name}/{count}/{k}"] = a.view({2: np.uint16, 4: np.uint32}[a.itemsize])
        out[f"{name}/{count}/dtypes"] = np.array([f"{k}:{np.asarray(a).dtype}" for k, a in arrays.items()])
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="the .npz of every configuration's inputs and outputs (raw bits)")
    ap.add_argument("--hlo", required=True, help="the text file of every program's optimised HLO")
    ap.add_argument("--numel", type=int, default=1 << 15,
                    help="elements per leaf (32K: ~9 MiB of .npz, under the device tool's 16 MiB a file)")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", choices=["gpu", "cpu"], default="gpu")
    args = ap.parse_args(argv)
    if args.device == "cpu":
        os.environ["JAX_PLATFORMS"] = "cpu"
    import jax  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415

    if args.device == "gpu" and jax.default_backend() != "gpu":
        print(f"no GPU: JAX's backend is {jax.default_backend()} (--device cpu records XLA:CPU's)", file=sys.stderr)
        return 2
    arrays, hlo = {}, []
    for name in args.configs.split(","):
        if name not in CONFIGS:
            ap.error(f"unknown configuration {name!r}: one of {', '.join(CONFIGS)}")
        arrays.update(record(name, args.numel, args.seed, hlo))
        print(f"{name}: recorded", flush=True)
    np.savez_compressed(args.out, device=np.array([str(jax.devices()[0])]), jax_version=np.array([jax.__version__]),
                        **arrays)
    with open(args.hlo, "w") as f:
        f.write("\n".join(hlo))
    print(f"wrote {args.out} ({os.path.getsize(args.out) / 2**20:.1f} MiB) and {args.hlo}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

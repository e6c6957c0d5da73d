# Run (GPU machine): python experiments/diag_jax_recompile.py --mode gpu
"""Why a jitted step around ``offload_adamw`` compiles again on its second call on a GPU (optax's alias test
``test_optimization`` checks that it does not): the step of that test (a parabola's gradient, update, apply_updates)
called three times with ``jax_explain_cache_misses`` on, printing each argument's sharding, memory kind, weak type
and committedness per call, then whether each call compiled."""

from __future__ import annotations

import argparse
import logging
import sys

import jax
import jax.numpy as jnp
import optax


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", default="gpu", choices=["gpu", "cpu", "optax"])
    args = ap.parse_args(argv)
    jax.config.update("jax_explain_cache_misses", True)
    logging.basicConfig(level=logging.WARNING, stream=sys.stdout)
    import trainstream.jax as tsj  # noqa: PLC0415

    opt = optax.adam(0.1) if args.mode == "optax" else tsj.offload_adam(0.1, mode=args.mode)
    params = jnp.array([-1.0, 10.0, 1.0])
    target = jnp.array([1.0, -1.0, 1.0])

    @jax.jit
    def step(p, s):
        g = jax.grad(lambda x: jnp.sum((x - target) ** 2))(p)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s

    state = opt.init(params)
    for call in range(3):
        for path, x in jax.tree_util.tree_flatten_with_path((params, state))[0]:
            print(f"call {call}: {jax.tree_util.keystr(path)} {x.dtype} weak={getattr(x, 'weak_type', None)} "
                  f"committed={getattr(x, '_committed', None)} sharding={x.sharding}")
        before = step._cache_size()
        params, state = step(params, state)
        print(f"call {call}: compiled={step._cache_size() > before} cache={step._cache_size()}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

# PYTHONPATH=. python experiments/jax_ffi_overhead.py --calls 3000 --big 4000000 --json $OUT/jax_ffi_overhead.json
"""Per-call overhead of calling Python from a jitted XLA:CPU program, old route vs new.

* ``ctypes_ffi``: the typed-FFI handler written in ctypes (``trainstream.jax._xla_ffi``, in
  trees before the array state; run this script from such a tree's root to measure it),
  marked side-effecting in HLO only (``stateful_ffi_call``);
* ``buffer_callback``: ``jax.experimental.buffer_callback`` (a maintained JAX API), pure
  (``has_side_effect=False``, what the adapter uses: its state is arrays) and with
  ``has_side_effect=True`` (an effect in the jaxpr).

Each handler aliases a float32[4] input to its output and adds 1 through a NumPy view; the
jitted program is called ``--calls`` times back to back (blocking on each result), median of
``--repeats`` runs, in microseconds per call. ``--adamw`` also times ``tx.step`` of
``trainstream.jax.offload_adamw`` jitted on the 4-leaf test MLP (2,357 parameters): the
whole route with the engine's work, where the route's overhead dominates. ``--big N``
times ``tx.step`` against ``tx.update`` + ``optax.apply_updates`` (both jitted, state
donated where it is arrays) on 4 x N float32 (whether the ``step`` fast path pays).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time

import jax
import jax.numpy as jnp
import numpy as np


def _time(fn, x, calls: int, repeats: int) -> float:
    for _ in range(20):
        x = fn(x)
    jax.block_until_ready(x)
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            x = jax.block_until_ready(fn(x))
        runs.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(runs)


def route_ctypes():
    try:
        from trainstream.jax import _xla_ffi as xf
    except ImportError:
        return None

    def handler(ctx, args, rets):
        xf.alias_or_copy(ctx, args[0], rets[0])
        xf.as_numpy(rets[0])[...] += 1

    xf.register_python_handler("ts_overhead_probe", handler)
    call = xf.stateful_ffi_call("ts_overhead_probe", jax.ShapeDtypeStruct((4,), jnp.float32),
                                input_output_aliases={0: 0})
    return jax.jit(lambda x: call(x), donate_argnums=0)


def route_buffer_callback(side_effect: bool):
    from jax.experimental.buffer_callback import buffer_callback

    def cb(ctx, out, x):
        np.asarray(out)[...] += 1

    call = buffer_callback(cb, jax.ShapeDtypeStruct((4,), jnp.float32), has_side_effect=side_effect,
                           input_output_aliases={0: 0})
    return jax.jit(lambda x: call(x), donate_argnums=0)


def adamw_step():
    import optax  # noqa: F401

    import trainstream.jax as tsj

    rng = np.random.default_rng(0)
    sizes = (12, 48, 32, 5)
    params = {f"d{i}": {"k": jnp.asarray(rng.standard_normal((a, b)).astype(np.float32) / np.sqrt(a)),
                        "b": jnp.zeros(b, jnp.float32)} for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:]))}
    params["scale"] = jnp.ones((1,), jnp.float32)
    tx = tsj.offload_adamw(1e-3, weight_decay=0.01, threads=1)
    state = tx.init(params)
    grads = jax.tree.map(lambda p: jnp.full_like(p, 1e-3), params)
    step = jax.jit(lambda p, s: tx.step(grads, s, p), donate_argnums=_donate())

    def fn(carry):
        return step(*carry)

    return fn, (params, state)


def _donate():
    """The params, and the state where it is arrays (an old tree's state is a handle)."""
    import trainstream.jax as tsj

    return (0, 1) if "mu" in getattr(tsj.OffloadAdamWState, "_fields", ()) else (0,)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-adamw", dest="adamw", action="store_false")
    ap.add_argument("--big", type=int, default=0)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    out = {"jax": jax.__version__, "commit": commit, "calls": args.calls, "us_per_call": {}}
    x = jnp.zeros(4, jnp.float32)
    routes = {"ctypes_ffi": route_ctypes(), "buffer_callback": route_buffer_callback(False),
              "buffer_callback_side_effect": route_buffer_callback(True)}
    for name, fn in routes.items():
        if fn is None:
            print(f"{name:30s} (not in this tree)")
            continue
        us = _time(fn, jnp.array(x), args.calls, args.repeats)
        out["us_per_call"][name] = us
        print(f"{name:30s} {us:8.1f} us per call")
    if args.adamw:
        fn, carry = adamw_step()
        us = _time(fn, carry, max(1, args.calls // 3), args.repeats)
        out["us_per_call"]["offload_adamw_step_mlp"] = us
        print(f"{'offload_adamw tx.step (MLP)':30s} {us:8.1f} us per call")
    if args.big:
        import optax

        import trainstream.jax as tsj

        params = {f"w{i}": jnp.full((args.big,), 0.5, jnp.float32) for i in range(4)}
        grads = jax.tree.map(lambda p: jnp.full_like(p, 1e-3), params)
        tx = tsj.offload_adamw(1e-3, weight_decay=0.01)
        step = jax.jit(lambda p, s, g: tx.step(g, s, p), donate_argnums=_donate())

        def via_update(p, s, g):
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s

        upd = jax.jit(via_update, donate_argnums=_donate())
        for name, fn in (("step", step), ("update+apply_updates", upd)):
            p, s = jax.tree.map(jnp.copy, params), tx.init(params)
            for _ in range(3):
                p, s = fn(p, s, grads)
            jax.block_until_ready(p)
            runs = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                for _ in range(5):
                    p, s = fn(p, s, grads)
                jax.block_until_ready(p)
                runs.append((time.perf_counter() - t0) / 5 * 1e3)
            out.setdefault("big_ms_per_step", {})[name] = statistics.median(runs)
            print(f"{name:30s} {statistics.median(runs):8.2f} ms per step (4 x {args.big} fp32)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

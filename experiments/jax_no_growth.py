# Run: PYTHONPATH=. python experiments/jax_no_growth.py --cycles 100 --json $OUT/jax_no_growth.json
"""Process growth across cycles of a new ``offload_adamw``, ``init``, one jitted step and
``close`` (XLA:CPU): the resident set size after a warm-up and after ``--cycles`` more,
per cycle. Run it from a tree's root to measure that tree (the old engine-handle adapter
grew by about 3.8 MB per cycle, issue #19).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess

import jax
import jax.numpy as jnp
import numpy as np

import trainstream.jax as tsj


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cycles", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    params = {"w1": jnp.asarray(rng.standard_normal((256, 256)).astype(np.float32)),
              "b1": jnp.zeros(256, jnp.float32),
              "w2": jnp.asarray(rng.standard_normal((256, 10)).astype(np.float32))}
    x = jnp.asarray(rng.standard_normal((32, 256)).astype(np.float32))

    def loss(p, x):
        return jnp.mean(jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"])

    def cycle():
        tx = tsj.offload_adamw(1e-3, weight_decay=0.1)
        step = jax.jit(lambda p, s, x: tx.step(jax.grad(loss)(p, x), s, p))
        s = tx.init(params)
        p, s = step(params, s, x)
        jax.block_until_ready(p)
        tx.close(s)

    for _ in range(args.warmup):
        cycle()
    gc.collect()
    before = rss()
    for _ in range(args.cycles):
        cycle()
    gc.collect()
    after = rss()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    out = {"commit": commit, "jax": jax.__version__, "cycles": args.cycles, "warmup": args.warmup,
           "rss_before_mib": before / 2**20, "rss_after_mib": after / 2**20,
           "growth_kib_per_cycle": (after - before) / args.cycles / 1024}
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

# Run (GPU machine): PYTHONPATH=. python experiments/diag_jax_bf16_donation.py
"""Which step of a jitted step donating offload_adamw(mode="gpu")'s pinned_host state raises XLA's "Donation
requested for buffer with external reference" (session u: every test with bfloat16 state did on an H100, float16 and
float32 did not): the state as init makes it, or its moments made another way (NumPy zeros device_put with
may_alias=False, device_put of a device array, a jitted zeros with pinned_host out_shardings), donated once, then
read with np.asarray and donated again. One line per (dtype, way)."""

import jax
import jax.numpy as jnp
import numpy as np

import trainstream.jax as tsj

dev = jax.devices("gpu")[0]
host = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
ways = {
    "init": None,
    "numpy_put": lambda x: jax.device_put(np.zeros(x.shape, x.dtype), host, may_alias=False),
    "device_put": lambda x: jax.device_put(jnp.zeros(x.shape, x.dtype, device=dev), host),
    "jit_zeros": lambda x: jax.jit(lambda: jnp.zeros(x.shape, x.dtype), out_shardings=host)(),
}
for dt in (jnp.float32, jnp.float16, jnp.bfloat16):
    tx = tsj.offload_adamw(1e-3, mode="gpu")
    step = jax.jit(lambda g, s, p: tx.step(g, s, p), donate_argnums=(1, 2))
    for name, make in ways.items():
        out = []
        try:
            p = {"a": jax.device_put(jnp.ones((1000,), dt), dev), "b": jax.device_put(jnp.ones((7, 9), dt), dev)}
            g = jax.tree.map(lambda x: x * 0.01, p)
            s = tx.init(p)
            if make is not None:
                s = s._replace(mu=jax.tree.map(make, s.mu), nu=jax.tree.map(make, s.nu))
            p, s = step(g, s, p)
            out.append("first donation ok")
            np.asarray(s.mu["a"])
            p, s = step(g, s, p)
            out.append("after np.asarray ok")
            np.array(s.nu["b"], copy=True)
            p, s = step(g, s, p)
            out.append("after np.array(copy=True) ok")
        except Exception as exc:  # noqa: BLE001 - the diagnosis
            out.append(f"FAILED: {type(exc).__name__}: {str(exc)[:100]}")
        print(f"{jnp.dtype(dt).name:9s} {name:10s} " + "; ".join(out), flush=True)

"""Scenarios of offload_adamw on parameters sharded over a mesh of forced XLA:CPU devices,
each bit for bit against the same sharded program around optax.adamw. Run by
tests/test_jax_mesh.py in subprocesses (XLA_FLAGS must be set before JAX initialises):

    python tests/_jax_mesh_scenarios.py [NAME ...]        4 host devices, one process
    python tests/_jax_mesh_scenarios.py --processes 2    jax.distributed, 2 x 2 host devices

Prints ``SCENARIO <name> ok`` or ``SCENARIO <name> FAIL`` and the traceback, per scenario.
"""

import faulthandler
import functools
import os
import socket
import subprocess
import sys
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))

if __name__ == "__main__" and "--processes" in sys.argv:  # the parent of the multi-process run
    nproc = int(sys.argv[sys.argv.index("--processes") + 1])
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    import shutil
    import tempfile

    ckpt_dir = tempfile.mkdtemp()  # the processes' shared checkpoint directory
    procs = [subprocess.Popen([sys.executable, __file__, "--process", str(i), str(nproc), str(port), ckpt_dir])
             for i in range(nproc)]
    try:
        codes = [p.wait(timeout=340) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        shutil.rmtree(ckpt_dir, ignore_errors=True)
    sys.exit(max(codes))

# A hang: stacks and exit, not a stuck CI job. All scenarios run in this one process; with a cold Numba
# cache on CI's 2 loaded cores their kernel compiles alone took more than 120 s.
faulthandler.dump_traceback_later(330, exit=True)
PROCESS = None
if "--process" in sys.argv:
    k = sys.argv.index("--process")
    PROCESS = (*(int(x) for x in sys.argv[k + 1:k + 4]), sys.argv[k + 4])  # (id, count, port, checkpoints)
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
else:
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"

import numpy as np  # noqa: E402
import jax  # noqa: E402

if PROCESS is not None:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{PROCESS[2]}", num_processes=PROCESS[1], process_id=PROCESS[0])

import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sys.path.insert(0, HERE)
import trainstream.jax as tsj  # noqa: E402
from trainstream.jax import _plan  # noqa: E402

F32, BF16 = jnp.float32, jnp.bfloat16

# -- the model: leaves sharded by rows, by columns, replicated, one element per shard --------

SHAPES = {"w1": (16, 8), "b1": (8,), "w2": (8, 4), "b2": (4,), "t": (2,), "s": (1,)}
SPECS_1D = {"w1": P("x", None), "b1": P(), "w2": P(None, "x"), "b2": P("x"), "t": P("x"), "s": P()}
SPECS_2D = {"w1": P("fsdp", "dp"), "b1": P(("dp", "fsdp")), "w2": P(None, "fsdp"), "b2": P("dp"),
            "t": P("fsdp"), "s": P()}


def loss(p, x):
    h = jnp.tanh(x.astype(p["w1"].dtype) @ p["w1"] + p["b1"])
    out = (h @ p["w2"] + p["b2"]).astype(F32)
    return jnp.mean(out ** 2) * p["s"][0].astype(F32) + jnp.sum(jnp.sin(p["t"] * h[:, :2]).astype(F32))


def mesh_1d():
    return Mesh(np.array(jax.devices()[:2]), ("x",))


def mesh_2d():
    return Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("dp", "fsdp"))


def params_on(mesh, specs, dtype=F32, seed=0):
    rng = np.random.default_rng(seed)
    host = {k: rng.standard_normal(v).astype(np.float32) for k, v in SHAPES.items()}
    out = {k: jnp.asarray(v, dtype) for k, v in host.items()}
    return jax.device_put(out, {k: NamedSharding(mesh, specs[k]) for k in out})


def batches(n, seed=1):
    rng = np.random.default_rng(seed)
    return [jnp.asarray(rng.standard_normal((6, 16)).astype(np.float32)) for _ in range(n)]


GRAD = jax.jit(jax.grad(loss))
_STEPS: dict = {}


def train(opt, params, xs, via="update", state=None):
    """``via``: update + apply_updates, step, or update called eagerly (its own program).
    The new params keep their shardings (left to the compiler, optax's would change, and
    with them the gradient program of the next step). One jitted step per optimizer, way
    and shardings (compiled once)."""
    shardings = jax.tree.map(lambda a: a.sharding, params)
    key = (opt, via, tuple(jax.tree.leaves(shardings)))
    if key not in _STEPS:
        @functools.partial(jax.jit, out_shardings=(shardings, None), donate_argnums=(0, 1) if via == "step" else ())
        def step(p, s, x):
            g = jax.grad(loss)(p, x)
            if via == "step":
                return opt.step(g, s, p)
            u, s = opt.update(g, s, p)
            return optax.apply_updates(p, u), s

        _STEPS[key] = step
    step = _STEPS[key]
    p, s = params, opt.init(params) if state is None else state
    if via == "step":  # donated: copies (of the same shardings)
        p, s = jax.tree.map(lambda a: jnp.array(a, copy=True), (p, s))
    out = []
    for x in xs:
        if via == "eager":  # optax's update jitted alone, as ours runs outside jit
            u, s = (opt.update if isinstance(opt, tsj.OffloadTransformation) else jax.jit(opt.update))(GRAD(p, x), s, p)
            p = optax.apply_updates(p, u)
        else:
            p, s = step(p, s, x)
        out.append(jax.tree.map(lambda a: jnp.array(a, copy=True), p) if via == "step" else p)  # p is donated next
    return jax.block_until_ready((out, s))


def bits(a):
    a = np.asarray(a)
    return a.view(np.uint32 if a.itemsize == 4 else np.uint16)


def full(x):
    """The whole array on this process (gathered from the other processes' devices)."""
    if x.is_fully_addressable:
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def same_bits(got, want, what):
    gl, gd = jax.tree.flatten(got)
    wl, wd = jax.tree.flatten(want)
    assert gd == wd, (what, gd, wd)
    for i, (a, b) in enumerate(zip(gl, wl)):
        a, b = bits(full(a)), bits(full(b))
        if not np.array_equal(a, b):
            bad = np.flatnonzero(a.ravel() != b.ravel())
            raise AssertionError(f"{what}: leaf {i}: {bad.size} of {a.size} elements differ")


def same_runs(got, want, what):
    for t, (a, b) in enumerate(zip(got, want)):
        same_bits(a, b, f"{what} step {t + 1}")


def ulp_runs(got, want, what, max_ulp):
    """At most ``max_ulp`` float32 ULP apart, every leaf at every step."""
    for t, (ga, wa) in enumerate(zip(got, want)):
        for i, (a, b) in enumerate(zip(jax.tree.leaves(ga), jax.tree.leaves(wa))):
            d = np.abs(bits(full(a)).astype(np.int64) - bits(full(b)).astype(np.int64)).max(initial=0)
            assert d <= max_ulp, f"{what} step {t + 1}: leaf {i}: {d} ULP apart"


def has_specs(tree, specs, memory_kind=None):
    """Every leaf sharded as ``specs`` says (over its own mesh), in ``memory_kind``."""
    return all(v.sharding.is_equivalent_to(NamedSharding(v.sharding.mesh, specs[k], memory_kind=memory_kind), v.ndim)
               for k, v in tree.items())


class CallbackShapes:
    """Records the leaf shapes each host update callback receives (the local shards)."""

    def __enter__(self):
        self.shapes = []
        self._orig = _plan.Plan.__call__
        rec = self.shapes

        def call(plan, ctx, outs, scal, count, *ins):
            rec.append(tuple(np.shape(x) for x in ins[plan.n:2 * plan.n]))
            return self._orig(plan, ctx, outs, scal, count, *ins)

        _plan.Plan.__call__ = call
        return self

    def __exit__(self, *exc):
        _plan.Plan.__call__ = self._orig


SCHEDULE = optax.warmup_cosine_decay_schedule(0.0, 3e-2, warmup_steps=2, decay_steps=20, end_value=1e-3)


def decay_mask(p):
    return {k: v.ndim > 1 for k, v in p.items()}


# -- scenarios ----------------------------------------------------------------------------------


def scenario_fp32():
    """update + apply_updates, step, and eager update; schedule and decay mask; the state
    keeps the params' shardings and each callback gets its device's shards."""
    mesh = mesh_1d()
    params = params_on(mesh, SPECS_1D)
    xs = batches(4)
    kw = dict(weight_decay=0.1, mask=decay_mask)
    refs = {v: train(optax.adamw(SCHEDULE, **kw), params, xs, v) for v in ("update", "eager")}
    for via in ("update", "step", "eager"):
        want, s_ref = refs["eager" if via == "eager" else "update"]
        with CallbackShapes() as cb:
            got, s = train(tsj.offload_adamw(SCHEDULE, **kw), params, xs, via)
        same_runs(got, want, via)
        # the moments, but of s: its gradient (a full reduction) is fused into the moment
        # outputs of the reference program, which XLA:CPU then computes apart from the
        # weights' update, in another pairing ("Fused gradients" in trainstream.contract;
        # with the gradients given to the update, every moment is optax's)
        same_bits({k: v for k, v in s.mu.items() if k != "s"}, {k: v for k, v in s_ref[0].mu.items() if k != "s"},
                  f"{via} mu")
        same_bits({k: v for k, v in s.nu.items() if k != "s"}, {k: v for k, v in s_ref[0].nu.items() if k != "s"},
                  f"{via} nu")
        assert has_specs(s.mu, SPECS_1D) and has_specs(s.nu, SPECS_1D), via
        assert s.count.sharding.is_fully_replicated and s.count.committed and int(s.count) == len(xs)
        assert all(has_specs(p, SPECS_1D) for p in got), via
        local = ((8,), (2,), (1,), (1,), (8, 8), (8, 2))  # b1 b2 s t w1 w2: one device's shards
        assert set(cb.shapes) == {local}, (via, set(cb.shapes))
        assert len(cb.shapes) == 2 * len(xs), (via, len(cb.shapes))  # one call per device and step


def scenario_resident():
    """gpu_state_bytes per device: the shards' state counts (w1's half fits, the whole would not); the host callback
    gets w2's shards alone, its state keeps w2's sharding, the resident leaves' state is sharded as optax.adamw's
    in the same program; update, step and eager update bit for bit; bf16 leaves with fp32 masters and clipping as
    the host path's."""
    mesh = mesh_1d()
    params = params_on(mesh, SPECS_1D)
    xs = batches(3)
    kw = dict(weight_decay=0.1, mask=decay_mask)
    refs = {v: train(optax.adamw(SCHEDULE, **kw), params, xs, v) for v in ("update", "eager")}
    # per device, fp32 state 8 bytes per element: b1 8, b2 2, s 1, t 1, w1 64 (of 128), w2 16 (of 32)
    budget = 8 * (8 + 2 + 1 + 1 + 64)
    for via in ("update", "step", "eager"):
        tx = tsj.offload_adamw(SCHEDULE, gpu_state_bytes=budget, **kw)
        assert tx.host_memory_plan(params)["gpu_state_leaves"] == 5
        with CallbackShapes() as cb:
            got, s = train(tx, params, xs, via)
        want, s_ref = refs["eager" if via == "eager" else "update"]
        same_runs(got, want, via)
        assert set(cb.shapes) == {((8, 2),)} and len(cb.shapes) == 2 * len(xs), (via, set(cb.shapes))
        mu_ref = optax.tree_utils.tree_get(s_ref, "mu")
        assert has_specs({"w2": s.mu["w2"]}, SPECS_1D) and has_specs({"w2": s.nu["w2"]}, SPECS_1D), via
        assert all(s.mu[k].sharding.is_equivalent_to(mu_ref[k].sharding, mu_ref[k].ndim) for k in s.mu if k != "w2")
        assert all(a[k].sharding.is_equivalent_to(b[k].sharding, b[k].ndim) for a, b in zip(got, want) for k in a), via
    # bf16 leaves with fp32 masters (12 bytes per element) and max_grad_norm: the host path's bits over all of them
    params = params_on(mesh, SPECS_1D, BF16)
    kw = dict(weight_decay=0.1, master_weights=True, max_grad_norm=1.0)
    want, s_ref = train(tsj.offload_adamw(SCHEDULE, **kw), params, xs)
    got, s = train(tsj.offload_adamw(SCHEDULE, gpu_state_bytes=12 * (8 + 2 + 1 + 1 + 64), **kw), params, xs)
    same_runs(got, want, "bf16 masters")
    same_bits(s.master, s_ref.master, "bf16 masters: the masters")


def scenario_bf16():
    """bf16 leaves sharded: the fp32 masters (sharded as the params) equal optax on fp32
    weights fed the upcast gradients; the weights are their rounding."""
    mesh = mesh_1d()
    params = params_on(mesh, SPECS_1D, BF16)
    xs = batches(3, seed=3)
    tx = tsj.offload_adamw(1e-2, weight_decay=0.1, max_grad_norm=1.0, master_weights=True)
    ref = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2, weight_decay=0.1))
    s = tx.init(params)
    assert has_specs(s.master, SPECS_1D) and all(x.dtype == F32 for x in jax.tree.leaves(s.master))
    master = jax.tree.map(lambda x: x.astype(F32), params)
    s_ref = ref.init(master)

    @jax.jit
    def step(p, s, x):
        g = jax.grad(loss)(p, x)
        p, s = tx.step(g, s, p)
        return p, s, g

    @jax.jit
    def rstep(master, s, g):
        u, s = ref.update(g, s, master)
        return optax.apply_updates(master, u), s

    upd = jax.jit(lambda p, s, g: optax.apply_updates(p, tx.update(g, s, p)[0]))
    p = params
    for t, x in enumerate(xs):
        p_before, s_before = p, s
        p, s, g = step(p, s, x)
        master, s_ref = rstep(master, s_ref, jax.tree.map(lambda a: a.astype(F32), g))
        same_bits(s.master, master, f"bf16 master step {t + 1}")
        same_bits(p, jax.tree.map(lambda a: a.astype(BF16), master), f"bf16 weights step {t + 1}")
        same_bits(upd(p_before, s_before, g), p, f"bf16 update + apply_updates step {t + 1}")


def scenario_bf16_state():
    """bf16 leaves sharded with optax's default state (bf16 mu and nu, sharded as the params, no master): update +
    apply_updates and step equal optax.adamw's program, bit for bit."""
    mesh = mesh_1d()
    params = params_on(mesh, SPECS_1D, BF16)
    xs = batches(3, seed=3)
    tx, ref = tsj.offload_adamw(1e-2, weight_decay=0.1), optax.adamw(1e-2, weight_decay=0.1)
    s = tx.init(params)
    assert has_specs(s.mu, SPECS_1D) and all(x.dtype == BF16 for x in jax.tree.leaves((s.mu, s.nu)))
    grad = jax.jit(jax.grad(loss))
    step = jax.jit(lambda p, s, g: tx.step(g, s, p))

    def upd(opt):
        return jax.jit(lambda p, s, g: (lambda u, s: (optax.apply_updates(p, u), s))(*opt.update(g, s, p)))

    ours_u, ref_u = upd(tx), upd(ref)
    p, pu, pr, su, sr = params, params, params, s, ref.init(params)
    for t, x in enumerate(xs):
        g = grad(pr, x)
        p, s = step(p, s, g)
        pu, su = ours_u(pu, su, g)
        pr, sr = ref_u(pr, sr, g)
        same_bits(pu, pr, f"bf16 state update step {t + 1}")
        same_bits(p, pr, f"bf16 state step {t + 1}")
        same_bits((su.mu, su.nu), (sr[0].mu, sr[0].nu), f"bf16 moments step {t + 1}")


def scenario_clip_2d():
    """A 2 x 2 mesh (leaves sharded over one axis, both, a tuple of axes, and replicated):
    max_grad_norm == chain(clip_by_global_norm, adamw) (the norm in the global view), some
    steps clipped and some not, update and step; chain(clip_by_global_norm, ours)."""
    mesh = mesh_2d()
    params = params_on(mesh, SPECS_2D)
    xs = batches(4, seed=4)
    norm = jax.jit(lambda p, x: optax.tree.norm(jax.grad(loss)(p, x)))
    m = float(np.median([float(norm(params, x)) for x in xs]))
    ref = optax.chain(optax.clip_by_global_norm(m), optax.adamw(1e-2, weight_decay=0.1))
    want, _ = train(ref, params, xs)
    clipped = [float(norm(p, x)) >= m for p, x in zip([params] + want[:-1], xs)]
    assert any(clipped) and not all(clipped), clipped
    tx = tsj.offload_adamw(1e-2, weight_decay=0.1, max_grad_norm=m)
    for via in ("update", "step"):
        got, s = train(tx, params, xs, via)
        same_runs(got, want, f"max_grad_norm {via}")
        assert has_specs(s.mu, SPECS_2D)
    chained = optax.chain(optax.clip_by_global_norm(m),
                          tsj.offload_adamw(1e-2, weight_decay=0.1))
    got, _ = train(chained, params, xs)
    same_runs(got, want, "chain")


def scenario_explicit_axes():
    """A mesh of Explicit axes, under jax.set_mesh (the avals carry the specs)."""
    from jax.sharding import AxisType

    mesh = jax.make_mesh((2,), ("x",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:2])
    params = params_on(mesh, SPECS_1D)
    xs = batches(3, seed=9)
    with jax.set_mesh(mesh):
        want, _ = train(optax.adamw(1e-2, weight_decay=0.1), params, xs)
        got, s = train(tsj.offload_adamw(1e-2, weight_decay=0.1), params, xs)
    same_runs(got, want, "explicit axes")
    assert has_specs(s.mu, SPECS_1D)


def scenario_orbax():
    """orbax saves the sharded state and restores it into an abstract target with the
    shardings of tx.init(params); the resumed run is the uninterrupted one, bit for bit."""
    import shutil
    import tempfile

    import orbax.checkpoint as ocp

    mesh = mesh_1d()
    params = params_on(mesh, SPECS_1D, BF16)
    xs = batches(6, seed=5)
    tx = tsj.offload_adamw(SCHEDULE, weight_decay=0.1, max_grad_norm=1.0, master_weights=True)
    full, s_full = train(tx, params, xs)
    half, s_half = train(tx, params, xs[:3])
    d = tempfile.mkdtemp()
    try:
        ck = ocp.StandardCheckpointer()
        ck.save(os.path.join(d, "ck"), {"params": half[-1], "opt": s_half})
        ck.wait_until_finished()
        target = jax.tree.map(ocp.utils.to_shape_dtype_struct, {"params": params, "opt": tx.init(params)})
        r = ck.restore(os.path.join(d, "ck"), target)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    assert isinstance(r["opt"], tsj.OffloadAdamWState) and int(r["opt"].count) == 3
    for a, b in zip(jax.tree.leaves(r["opt"]), jax.tree.leaves(s_half)):
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim), (a.sharding, b.sharding)
    rest, s_rest = train(tx, r["params"], xs[3:], state=r["opt"])
    same_runs(rest, full[3:], "resumed")
    same_bits(s_rest, s_full, "resumed state")


def scenario_user_shard_map():
    """Inside the user's own shard_map the arrays are local and the program is the
    per-device one: offload_adamw equals optax.adamw (with clip_by_global_norm, the norm of
    the local shards, as optax computes there) in the same shard_map."""
    mesh = mesh_1d()
    params = params_on(mesh, SPECS_1D)
    rng = np.random.default_rng(6)
    gs = [jax.device_put({k: jnp.asarray(rng.standard_normal(v).astype(np.float32)) for k, v in SHAPES.items()},
                         {k: NamedSharding(mesh, SPECS_1D[k]) for k in SHAPES}) for _ in range(4)]
    host = jax.tree.map(np.asarray, params)
    none = {k: None for k in SHAPES}
    runs = []
    for opt, sspec in (
        (optax.chain(optax.clip_by_global_norm(0.3), optax.adamw(1e-2, weight_decay=0.1)),
         (optax.EmptyState(), (optax.ScaleByAdamState(P(), SPECS_1D, SPECS_1D), optax.EmptyState(),
                               optax.EmptyState()))),
        (tsj.offload_adamw(1e-2, weight_decay=0.1, max_grad_norm=0.3),
         tsj.OffloadAdamWState(P(), SPECS_1D, SPECS_1D, none)),
    ):
        def body(p, s, g, opt=opt):
            u, s = opt.update(g, s, p)
            return optax.apply_updates(p, u), s

        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(SPECS_1D, sspec, SPECS_1D),
                                  out_specs=(SPECS_1D, sspec), check_vma=False))
        p, s, out = params, opt.init(host), []
        for g in gs:
            p, s = f(p, s, g)
            out.append(p)
        runs.append(out)
    same_runs(runs[1], runs[0], "inside shard_map")


def scenario_errors():
    """Clear errors: leaves on different placements, an update whose init never saw the
    sharded params, a traced init, a partly manual shard_map."""
    mesh = mesh_1d()
    params = params_on(mesh, SPECS_1D)
    g = jax.jit(jax.grad(loss))(params, batches(1)[0])
    tx = tsj.offload_adamw(1e-2)

    def raises(exc, match, fn, *args):
        import re
        try:
            fn(*args)
        except exc as e:
            assert re.search(match, str(e)), (match, str(e))
            return
        raise AssertionError(f"no {exc.__name__} matching {match!r}")

    mixed = dict(params, s=jnp.ones((1,), F32))
    raises(ValueError, r"leaf \['s'\] is a SingleDeviceSharding array while other leaves are sharded",
           tx.init, mixed)
    other = dict(params, s=jax.device_put(jnp.ones((1,), F32), NamedSharding(mesh_2d(), P())))
    raises(ValueError, "every leaf must be on one mesh", tx.init, other)
    s = tx.init(params)
    fresh = tsj.offload_adamw(1e-2)
    raises(ValueError, "never saw these parameters as arrays", jax.jit(fresh.step), g, s, params)
    raises(ValueError, "a traced array carries none", jax.jit(fresh.init), params)
    m2 = mesh_2d()
    p2 = params_on(m2, SPECS_2D)
    s2 = tx.init(p2)
    g2 = jax.device_put(g, {k: NamedSharding(m2, SPECS_2D[k]) for k in g})
    part = jax.shard_map(lambda p, s, g: tx.step(g, s, p), mesh=m2, axis_names={"dp"},
                         in_specs=(P(), P(), P()), out_specs=(P(), P()), check_vma=False)
    raises(NotImplementedError, r"leaves the mesh axes \['fsdp'\] automatic", jax.jit(part), p2, s2, g2)


def scenario_gpu_path():
    """The GPU code path (pinned_host state, the own/update/order callbacks) inside the
    shard_map, its CUDA calls simulated on XLA:CPU (tests/test_jax_gpu_plumbing.py): the
    state is sharded pinned_host memory and the weights equal the single-device run's
    (the same gradients given to both), with an fp32 master and with optax's own bf16 state."""
    import pytest

    from _jax_gpu_sim import simulate_gpu

    mesh = mesh_1d()
    rng = np.random.default_rng(7)
    gs = [{k: rng.standard_normal(v).astype(np.float32) for k, v in SHAPES.items()} for _ in range(2)]
    for mode in ("gpu", "cpu"):
        with pytest.MonkeyPatch.context() as mp:
            sim = simulate_gpu(mp)
            next(sim)
            try:
                # bf16: an fp32 master, and optax's own bf16 state (its weights and u staged in bf16 in cpu mode)
                for dtype, master, vias in ((F32, True, ("update",)), (BF16, True, ("step",)),
                                            (BF16, False, ("step", "update"))):
                    results = {}
                    for sharded in (True, False):
                        params = params_on(mesh, SPECS_1D, dtype)
                        if not sharded:
                            params = {k: jnp.asarray(np.asarray(v)) for k, v in params.items()}
                        put = (lambda t, like=params, dt=dtype: {k: jax.device_put(jnp.asarray(v, dt), like[k].sharding)
                                                                 for k, v in t.items()})
                        tx = tsj.offload_adamw(1e-2, weight_decay=0.1, mode=mode, threads=2, master_weights=master)
                        for via in vias:
                            def body(p, s, g, via=via, tx=tx):
                                if via == "step":
                                    return tx.step(g, s, p)
                                u, s = tx.update(g, s, p)
                                return optax.apply_updates(p, u), s

                            step = jax.jit(body, donate_argnums=(0, 1))
                            p, s = jax.tree.map(lambda x: jnp.array(x, copy=True), params), tx.init(params)
                            for g in gs:
                                p, s = step(p, s, put(g))
                            p, s = jax.block_until_ready((p, s))
                            kinds = {x.sharding.memory_kind for x in jax.tree.leaves((s.mu, s.nu, s.master))}
                            assert kinds == {"pinned_host"}, (mode, kinds)
                            if sharded:
                                assert has_specs(s.mu, SPECS_1D, "pinned_host") and has_specs(p, SPECS_1D)
                            results[sharded, via] = (p, s.mu, s.nu, s.master)
                    for via in vias:
                        for a, b in zip(jax.tree.leaves(results[True, via]), jax.tree.leaves(results[False, via])):
                            assert np.array_equal(bits(a), bits(b)), (mode, dtype, master, via)
            finally:
                next(sim, None)


SCENARIOS = {name[len("scenario_"):]: fn for name, fn in globals().items() if name.startswith("scenario_")}


# -- jax.distributed: 2 processes x 2 devices ---------------------------------------------------


def multi_process():
    """4 global devices over 2 processes: each process's callbacks get only its own
    devices' shards; clipped updates against optax on every process, across an orbax save
    and restore: bit for bit as ``chain(clip_by_global_norm(M), offload_adamw(...))``; with ``max_grad_norm=M`` within 1 ULP: on an AVX2 host,
    over processes only, XLA:CPU computes w2's gradient for our callback in other roundings
    than in optax's program (w2's moments after one step: optax's equal C1 * the gradient
    jitted alone, ours differ in 5 of 32), and 1 weight of 190 ends 1 ULP off after 3 steps."""
    from jax.experimental import multihost_utils

    import orbax.checkpoint as ocp

    pid, _, _, ckpt_dir = PROCESS
    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("dp", "fsdp"))
    specs = SPECS_2D
    rng = np.random.default_rng(0)
    host = {k: rng.standard_normal(v).astype(np.float32) for k, v in SHAPES.items()}
    params = jax.jit(lambda t: t, out_shardings={k: NamedSharding(mesh, specs[k]) for k in host})(
        {k: multihost_utils.host_local_array_to_global_array(v, mesh, P()) for k, v in host.items()})
    xs = [multihost_utils.host_local_array_to_global_array(x, mesh, P()) for x in batches(3, seed=8)]
    ref = optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2, weight_decay=0.1))
    want, _ = train(ref, params, xs)
    mgn, _ = train(tsj.offload_adamw(1e-2, weight_decay=0.1, max_grad_norm=0.5), params, xs)
    tx = optax.chain(optax.clip_by_global_norm(0.5),
                     tsj.offload_adamw(1e-2, weight_decay=0.1))
    with CallbackShapes() as cb:
        got, s = train(tx, params, xs[:2])
    ck = ocp.StandardCheckpointer()  # every process writes its shards
    ck.save(os.path.join(ckpt_dir, "ck"), {"params": got[-1], "opt": s})
    ck.wait_until_finished()
    target = jax.tree.map(ocp.utils.to_shape_dtype_struct, {"params": params, "opt": tx.init(params)})
    r = ck.restore(os.path.join(ckpt_dir, "ck"), target)
    rest, s = train(tx, r["params"], xs[2:], state=r["opt"])
    ok = True
    try:
        same_runs(got + rest, want, f"process {pid}")
        ulp_runs(mgn, want, f"process {pid} max_grad_norm", 1)
        assert len(cb.shapes) == 2 * 2, len(cb.shapes)  # this process's 2 devices only
        s = s[1]  # chain's: (clip's EmptyState, ours)
        assert has_specs(s.mu, specs) and not s.mu["w1"].is_fully_addressable
        from trainstream.jax import _sharding

        assert _sharding._local_processes() == 2  # both on this host: the default threads split the cores
        try:
            tsj.state_dict(s, got[-1])
            raise AssertionError("state_dict of another process's shards did not raise")
        except ValueError as e:
            assert "other processes' devices" in str(e), e
    except AssertionError:
        traceback.print_exc()
        ok = False
    flags = multihost_utils.process_allgather(np.array([int(ok)]))
    print(f"SCENARIO multi_process[{pid}] {'ok' if flags.all() else 'FAIL'}", flush=True)
    jax.distributed.shutdown()
    return bool(flags.all())


if __name__ == "__main__":
    if PROCESS is not None:
        sys.exit(0 if multi_process() else 1)
    names = sys.argv[1:] or list(SCENARIOS)
    failed = 0
    for name in names:
        try:
            SCENARIOS[name]()
            print(f"SCENARIO {name} ok", flush=True)
        except BaseException:  # noqa: BLE001 - reported per scenario
            failed += 1
            print(f"SCENARIO {name} FAIL", flush=True)
            traceback.print_exc(file=sys.stdout)
            sys.stdout.flush()
    # exit with updates in flight: they finish while the host workers are alive (no hang,
    # no error at exit)
    params = params_on(mesh_1d(), SPECS_1D)
    tx = tsj.offload_adamw(1e-2)
    step = jax.jit(lambda p, s, x: tx.step(jax.grad(loss)(p, x), s, p))
    p, s = params, tx.init(params)
    for x in batches(3):
        p, s = step(p, s, x)
    print("EXITING with updates in flight", flush=True)
    sys.exit(1 if failed else 0)

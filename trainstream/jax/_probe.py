"""The pairing probe of :mod:`._detect`: a gradient's producer graph compiled feeding optax's reference (this
configuration's ``optax.adamw``) and alone (the gradient as the adapter's callback receives it), run on random
inputs; per leaf, the pairing bits of the contract's optax/cpu lines that reproduce the reference bit for bit.

The random inputs span six decades (float16 ones two and a half, scaled down in large arrays, so that a global
norm of squares stays finite); a leaf's pairing is settled once its elements include :data:`_MIN_TELLING` where
the candidate pairings disagree (none needed where the candidates' lines read no pairing bit: no FMA, ``b == 0.5``).
A leaf whose candidates the inputs never told apart (every one exact: e.g. its gradient 0 on every input) gets the
default pairing and :data:`UNTOLD`, which :mod:`._detect` warns (unless its gradient is a constant of the
program).

Every family of optax's own state is probed with the lines of :func:`trainstream.contract.optax_reference_update`
in the leaf's dtype; the candidates are the valid codes that differ from the leaf's in the pairing bits only
(fp16/bf16 state without ``mu_dtype`` has no FMA: its one candidate is checked, not chosen). :func:`trusted`: the
families whose probed pairing held bit for bit over the tests' programs (tests/test_jax_compose.py): optax's float32
lines (any ``eps > 0``, ``eps_root``, schedule, mask, clip) and optax's fp16/bf16 state (``nesterov`` and
``mu_dtype=float32`` too). Elsewhere (the lines of ``nesterov``, ``eps == 0`` (``rsqrt``) and ``mu_dtype=bfloat16``
with an FMA, and ``b == 0.5``) a fused gradient changes more than the moments' pairing: the probe's pick is the
closest it finds (seen exact for most leaves, but under ``MultiSteps`` and on small element-wise problems the
program's own values later differed) and :mod:`._detect` warns once. Leaves with an fp32 master
(``master_weights=True``) are not probed: their reference is optax.adamw on the float32 master fed the upcast
gradients materialised (the contract's default pairing), not a program around optax.adamw on the fp16/bf16 leaves.
"""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax

from .. import contract as C

__all__ = ["PAIRING", "UNTOLD", "UNTRUSTED", "Probe", "hyper_key", "hyper_of", "trusted"]

#: The pairing bits calibrated (the contract's moment lines' two pairings each).
PAIRING = C.OX_NU_SWAP | C.OX_MU_SWAP
#: The bound :meth:`Probe.calibrate` gives a leaf whose pairings its random inputs never told apart (every candidate
#: exact on every element, e.g. gradients all 0): not a distance; :mod:`._detect` warns its own bound.
UNTOLD = -1.0
#: Family bits whose probed pairing is not trusted in lines with an FMA (see the module docstring).
UNTRUSTED = C.OX_NESTEROV | C.OX_RSQRT | C.OX_MU_BF16


def trusted(code: int) -> bool:
    """Whether the probe's pairing for a leaf of optax/cpu ``code`` held bit for bit in the tests' programs (else
    it is a best guess, warned)."""
    if code & (C.OX_B1_HALF | C.OX_B2_HALF):
        return False
    no_fma = code & C.OX_HALF and not code & C.OX_MU_F32  # fp16/bf16 state: every operation rounded
    return bool(no_fma) or not code & UNTRUSTED
_MIN_ELEMS = 48  # elements seen per leaf before its pairing is settled (a one-element leaf: 48 trials)
_MIN_TELLING = 8  # ... of which elements where the candidate pairings disagree (else more trials, to _MAX_TRIALS)
_MAX_TRIALS = 64


def _replay(graph, vals, p_leaves):
    """The leaves of ``graph`` (a :class:`._detect.Graph`), re-evaluated from its boundary values (``p_leaves`` for
    the params it aliases)."""
    env = {}
    for (r, _, _, a), v in zip(graph.inputs, vals):
        env[r] = p_leaves[a] if a is not None else v

    def get(atom):
        kind, i = atom
        return graph.consts[i] if kind == "c" else env[i]

    for e in graph.eqns:
        res = e.primitive.bind(*map(get, e.ins), **e.params)
        for r, v in zip(e.outs, res if e.primitive.multiple_results else [res]):
            env[r] = v
    return [get(o) for o in graph.outs]


_ADAMW_ARGS = frozenset(inspect.signature(optax.adamw).parameters) - {"mask"}
_ADAM_ARGS = frozenset(inspect.signature(optax.adam).parameters)
_SCALAR_ARGS = frozenset(inspect.signature(C.optax_scalar_matrix).parameters) - {
    "count", "codes", "decays", "global_norm", "max_norm", "xp"}
# a stand-in value per hyper-parameter that is traced in the user's program (optax.inject_hyperparams): an argument
# of the probe, as in the program, so XLA folds nothing of it
_STAND_IN = {"learning_rate": 1e-3, "b1": 0.9, "b2": 0.999, "eps": 1e-8, "eps_root": 0.0, "weight_decay": 1e-4}


def hyper_of(cfg) -> dict:
    """The configuration's arguments of optax.adamw (those ``cfg`` has)."""
    return {k: getattr(cfg, k) for k in sorted(_ADAMW_ARGS | _SCALAR_ARGS) if hasattr(cfg, k)}


def hyper_key(hyper: dict) -> tuple:
    """A cache key of ``hyper`` (a traced value by its type, an array by its bytes)."""
    out = []
    for k, v in hyper.items():
        if isinstance(v, jax.core.Tracer):
            out.append((k, "traced", str(v.aval)))
        elif hasattr(v, "dtype") and not isinstance(v, np.generic):
            a = np.asarray(v)
            out.append((k, "array", str(a.dtype), a.tobytes()))
        else:
            out.append((k, v))
    return tuple(out)


class Probe:
    """The two probe programs of one graph and configuration, and the calibration."""

    def __init__(self, graph, p_avals, codes, decays, hyper, max_norm, dtypes=None, skip=None, alone=False):
        self.graph, self.p_avals, self.codes, self.decays, self.max_norm = graph, p_avals, codes, decays, max_norm
        # one leaf of a larger tree (trainstream.jax._resident): the reference gets a second leaf, as XLA compiles
        # optax's update of one leaf otherwise (contract.OX_FORM_R)
        self.alone = alone
        n = len(p_avals)
        self.dtypes = list(dtypes) if dtypes is not None else ["float32"] * n
        self.skip = list(skip) if skip is not None else [False] * n  # leaves not probed (fp32 masters): their code's
        self.traced = [k for k, v in hyper.items() if isinstance(v, jax.core.Tracer)]
        self.traced_avals = [(np.dtype(hyper[k].aval.dtype), tuple(hyper[k].aval.shape)) for k in self.traced]
        self.fixed = {k: v for k, v in hyper.items() if k not in self.traced}

    def _hyper(self, hyp):
        h = dict(self.fixed)
        h.update(zip(self.traced, hyp))
        return h

    def _tx(self, h):
        """optax's reference of this configuration: ``optax.adamw`` (``optax.adam`` for a factory without
        ``weight_decay``), chained after ``clip_by_global_norm`` for ``max_grad_norm``."""
        if "weight_decay" in h:
            mask = None if all(self.decays) else list(self.decays) + [True] * self.alone
            tx = optax.adamw(**{k: v for k, v in h.items() if k in _ADAMW_ARGS}, mask=mask)
        else:
            tx = optax.adam(**{k: v for k, v in h.items() if k in _ADAM_ARGS})
        return optax.chain(optax.clip_by_global_norm(self.max_norm), tx) if self.max_norm is not None else tx

    def reference(self, bvals, hyp, p, m, v, count):
        g = _replay(self.graph, bvals, p)
        if self.alone:  # a zero gradient: the norm stays the leaf's (its outputs are returned: XLA keeps it)
            p, g, m, v = ([*x, jnp.zeros((2,), jnp.float32)] for x in (p, g, m, v))
        tx = self._tx(self._hyper(hyp))
        s = optax.tree_utils.tree_set(tx.init(p), count=count, mu=m, nu=v)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), optax.tree_utils.tree_get(s, "mu"), optax.tree_utils.tree_get(s, "nu")

    def ours(self, bvals, hyp, p, count):
        """What the adapter's callback receives: the gradient materialised and the scalar matrix."""
        g = _replay(self.graph, bvals, p)
        h = self._hyper(hyp)
        norm = optax.tree.norm([x.astype(jnp.float32) for x in g]) if self.max_norm is not None else None
        sc = C.optax_scalar_matrix(count, self.codes, self.decays, global_norm=norm, max_norm=self.max_norm, xp=jnp,
                                   dtypes=self.dtypes, **{k: v for k, v in h.items() if k in _SCALAR_ARGS})
        return g, sc.scalars

    def calibrate(self) -> list[tuple[int, float]]:
        """Per leaf: (the pairing bits to use, the largest per-step ULP distance measured with them: 0 when exact,
        :data:`UNTOLD` where the inputs never told the candidate pairings apart)."""
        n = len(self.p_avals)
        state = jax.eval_shape(lambda p: self._tx(self._hyper(
            [np.zeros(s, d) for d, s in self.traced_avals])).init(p), [jax.ShapeDtypeStruct(s, d) for s, d in
                                                                      self.p_avals])
        mu_dt = [np.dtype(a.dtype) for a in optax.tree_utils.tree_get(state, "mu")]
        nu_dt = [np.dtype(a.dtype) for a in optax.tree_utils.tree_get(state, "nu")]
        hyp = [np.asarray(_STAND_IN.get(k, 0.5), d).reshape(s) for k, (d, s) in zip(self.traced, self.traced_avals)]
        # compiled ahead of time: their calls run now, not staged into the program being traced
        sds = jax.ShapeDtypeStruct
        args = ([sds(s, d) for _, s, d, _ in self.graph.inputs], [sds(s, d) for d, s in self.traced_avals],
                [sds(s, d) for s, d in self.p_avals])
        count_s = sds((), np.int32)
        ours_c = jax.jit(self.ours).lower(*args, count_s).compile()
        ref_c = jax.jit(self.reference).lower(*args, [sds(s, d) for (s, _), d in zip(self.p_avals, mu_dt)],
                                              [sds(s, d) for (s, _), d in zip(self.p_avals, nu_dt)], count_s).compile()
        h = self._hyper(hyp)
        b1, b2 = float(np.asarray(h.get("b1", 0.9))), float(np.asarray(h.get("b2", 0.999)))
        f32 = np.float32
        calibrated = [self.graph.fused[i] and not self.skip[i] for i in range(n)]
        # the leaf's code first, then the other valid pairings (a family whose lines read no pairing: itself only)
        cands = [[(c & ~PAIRING) | sw for sw in sorted({c & PAIRING, 0, C.OX_NU_SWAP, C.OX_MU_SWAP, PAIRING},
                                                       key=lambda s, c=c: s != c & PAIRING)
                  if C.optax_code_valid((c & ~PAIRING) | sw)] for c in self.codes]
        estimate = None
        if any(calibrated[i] and self.codes[i] & C.OX_RSQRT and not self.codes[i] & C.OX_RSQRT_DIV for i in range(n)):
            from .._host_kernels import rsqrt_estimate_array as estimate  # noqa: PLC0415 (this CPU's rsqrtss)
        bad = [np.zeros(len(c), np.int64) for c in cands]
        worst = [np.zeros(len(c)) for c in cands]
        seen = np.zeros(n, np.int64)
        # elements where the candidates' results differ: only these tell the pairings apart (random inputs can make
        # every gradient 0, e.g. a global norm overflowing in float16, where every pairing is exact)
        telling = np.array([0 if len(c) > 1 else _MIN_TELLING for c in cands], np.int64)
        rng = np.random.default_rng(0)
        trials = 0
        unsettled = lambda i: calibrated[i] and (seen[i] < _MIN_ELEMS or telling[i] < _MIN_TELLING)  # noqa: E731
        while trials < _MAX_TRIALS and any(unsettled(i) for i in range(n)):
            trials += 1
            bvals = [_random(rng, s, d) for _, s, d, _ in self.graph.inputs]
            p = [_random(rng, s, d, spread=False) for s, d in self.p_avals]
            count = np.int32(rng.integers(0, 60))
            G, S = ours_c(bvals, hyp, p, count)
            G, S = [np.asarray(x) for x in G], np.asarray(S)
            # moments of the gradient's size, so that both products of each moment line weigh alike (where the
            # pairings differ most often)
            m = [(np.asarray(g, np.float64) * (1 - b1) / b1 * _factor(rng, g.shape, signed=True)).astype(mu_dt[i])
                 for i, g in enumerate(G)]
            v = [(np.square(np.asarray(g, np.float64)) * (1 - b2) / b2 * _factor(rng, g.shape)).astype(nu_dt[i])
                 for i, g in enumerate(G)]
            P, M, V = ref_c(bvals, hyp, p, m, v, count)
            for i in range(n):
                if not unsettled(i):
                    continue
                if trials == 1 and not _distinct(cands[i], S[i], self.dtypes[i], mu_dt[i], nu_dt[i], b1, b2, estimate):
                    telling[i] = _MIN_TELLING  # lines that read none of the pairing bits (no FMA, b == 0.5, ...)
                seen[i] += G[i].size
                want = [np.asarray(x, f32).ravel() for x in (P[i], M[i], V[i])]
                prev = [np.asarray(x, f32).ravel() for x in (p[i], m[i], v[i])]
                results = []
                for j, code in enumerate(cands[i]):
                    s = S[i].copy()
                    s[C.S_OX_CODE] = code
                    got = C.optax_reference_update(*prev, np.asarray(G[i], f32).ravel(), s, self.dtypes[i],
                                                   rsqrt_estimate=estimate)[:3]
                    results.append(np.stack([a.view(np.uint32) for a in got]))
                    for a, w, pv in zip(got, want, prev):
                        same = (a.view(np.uint32) == w.view(np.uint32)) | (np.isnan(a) & np.isnan(w))
                        bad[i][j] += int(np.count_nonzero(~same))
                        if not same.all():
                            worst[i][j] = max(worst[i][j], float(np.nanmax(C.update_ulps(a, w, pv))))
                if len(results) > 1:
                    telling[i] += int(np.count_nonzero((np.stack(results) != results[0]).any(axis=(0, 1))))
        out, varies = [], _varying(self.graph)
        for i in range(n):
            if not calibrated[i]:
                out.append((self.codes[i] & PAIRING, 0.0))
                continue
            exact = [j for j in range(len(cands[i])) if bad[i][j] == 0]
            j = exact[0] if exact else int(np.argmin(worst[i]))
            # several pairings exact on inputs that never told them apart: not read (warned), unless the gradient is
            # a constant of the program (a frozen leaf's zeros: every pairing gives its bits)
            untold = len(exact) > 1 and telling[i] == 0 and varies[i]
            out.append((cands[i][j] & PAIRING, UNTOLD if untold else 0.0 if exact else max(float(worst[i][j]), 1.0)))
        self.trials, self.telling = trials, telling
        return out


def _distinct(cands, s_row, dtype, mu_dt, nu_dt, b1, b2, estimate, n=512) -> bool:
    """Whether the lines of the candidate codes ``cands`` (a leaf's scalars ``s_row``) differ anywhere on inputs
    made to tell pairings apart: else they read none of the pairing bits (no FMA, ``b == 0.5``'s factored lines, a
    half mu line...) and no input can tell them apart."""
    if len(cands) < 2:
        return False
    rng = np.random.default_rng(1)
    f32 = np.float32
    g = C.round_xla((rng.standard_normal(n) * np.exp(rng.uniform(-3, 3, n))).astype(f32), dtype)
    m = (g.astype(np.float64) * (1 - b1) / b1 * _factor(rng, n, signed=True)).astype(mu_dt).astype(f32)
    v = (np.square(g.astype(np.float64)) * (1 - b2) / b2 * _factor(rng, n)).astype(nu_dt).astype(f32)
    p = C.round_xla(rng.standard_normal(n).astype(f32), dtype)
    first = None
    for code in cands:
        s = np.array(s_row, f32)
        s[C.S_OX_CODE] = code
        got = np.stack([a.view(np.uint32) for a in
                        C.optax_reference_update(p, m, v, g, s, dtype, rsqrt_estimate=estimate)[:3]])
        if first is None:
            first = got
        elif not np.array_equal(got, first):
            return True
    return False


def _varying(graph) -> list[bool]:
    """Per leaf of ``graph``: whether its gradient depends on some input of the graph (else a constant)."""
    dep = {r: True for r, _, _, _ in graph.inputs}
    for e in graph.eqns:
        d = any(kind == "v" and dep.get(r, False) for kind, r in e.ins)
        dep.update((r, d) for r in e.outs)
    return [kind == "v" and dep.get(r, False) for kind, r in graph.outs]


def _random(rng, shape, dtype, spread=True):
    dt = np.dtype(dtype)
    if dt == np.bool_:
        return rng.random(shape) < 0.5
    if np.issubdtype(dt, np.integer):
        return rng.integers(0, 7, shape).astype(dt)
    x = rng.standard_normal(shape)
    if spread and dt == np.float16:  # over two and a half decades, so that a sum of squares (a norm) stays finite
        x = x * np.exp(rng.uniform(-3, 2.5, shape)) / max(1.0, np.sqrt(x.size) / 8)
    elif spread:  # over six decades
        x = x * np.exp(rng.uniform(-7, 7, shape))
    return np.asarray(x).astype(dt)


def _factor(rng, shape, signed=False):
    f = np.exp(rng.uniform(-1.5, 1.5, shape))
    return f * rng.choice([-1.0, 1.0], shape) if signed else f

"""The JAX adapter's differential fuzzer (issue 40 item 5): ``offload_adamw`` / ``offload_adam`` against
``optax.adamw`` / ``optax.adam`` on random pytrees (nesting, shapes from a small fixed set so that compile caches
hit, float32/bfloat16/float16 leaves), hyper-parameters (``mu_dtype``, ``nesterov``, ``eps_root``, ``weight_decay``,
``mask``), compositions (``chain`` with ``clip_by_global_norm``, ``masked``, ``MultiSteps``, ``inject_hyperparams``),
jitted or eager steps, the gradient passed in or computed from it in the step (:data:`PRODUCERS`: what XLA:CPU may
fuse into optax's moment loops, which ours must read from the program). After every step params and updates are bitwise equal, or both raised, or ours refused naming
why (``NotImplementedError`` / ``ValueError`` / ``TypeError`` with a message), or ours warned the documented
``RuntimeWarning`` (a bound in ULPs instead of the bits; counted apart). A last step may feed an update whose tree
structure, shape or dtype differs from ``init``'s: ours raises a clear error (never a result that is not optax's).

Used by tests/test_fuzz_jax.py (derandomized, in CI) and experiments/fuzz.py (the longer run, with counts). A helper
module, not collected by pytest.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import re
import warnings
from collections import Counter
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from hypothesis import strategies as st

import trainstream.jax as tsj
from trainstream.jax import _detect

#: the leaf shapes (a small fixed set: XLA compiles per shape)
SHAPES = [(3, 4), (5,), (1,), (2, 3, 2), (64, 128)]  # the last large enough for FMA pairings to show
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@functools.cache
def xla_float16() -> bool:
    """Whether XLA:CPU compiles float16 arithmetic in this process: under ``--xla_cpu_max_isa=SSE4_2`` (the
    portability job's narrowest level) it cannot link its float16 conversions (``__extendhfsf2``,
    ``__truncsfhf2``), optax.adamw's programs included, so there is no reference to compare with."""
    try:
        jax.block_until_ready(jax.jit(lambda x: (x.astype(jnp.float32) * 3).astype(jnp.float16))(
            jnp.ones(3, jnp.float16)))
    except Exception:  # noqa: BLE001 - XLA's JaxRuntimeError (INTERNAL: Failed to materialize symbols)
        return False
    return True


def leaf_dtypes() -> tuple[str, ...]:
    """The leaf dtypes the fuzzer draws: :data:`DTYPES`, without float16 where XLA:CPU cannot compile it."""
    return tuple(d for d in DTYPES if d != "float16" or xla_float16())
LAYOUTS = ["leaf", "dict", "nested", "list", "tuple_in_dict"]
COMPOSITIONS = ["plain", "clip", "masked", "multisteps", "inject", "clip_masked"]
PAIRS = {"adamw": (optax.adamw, tsj.offload_adamw), "adam": (optax.adam, tsj.offload_adam)}
#: how the step computes the gradient it updates with from the one passed in (and the parameters), in the same jit:
#: as is; element-wise in both; a bf16 rounding inside ``jax.checkpoint`` (flax's remat with bf16 compute); a nested jit
PRODUCERS = ("given", "elementwise", "checkpoint_cast", "nested_jit")
#: ours' clear refusals (with a message); a RuntimeWarning naming TrainStream is the documented bound's warning
REFUSALS = (NotImplementedError, ValueError, TypeError)


#: what :func:`run_sequence` returns (anything else raises a :class:`Finding`)
OUTCOMES = ("identical", "both raised", "refused", "warned", "warned identical", "mismatch refused",
            "mismatch identical")


class Finding(AssertionError):
    """A sequence whose two sides part in a way the contract does not allow."""


class SilentDifference(Finding):
    """Both stepped without an error or a warning and the results differ."""


@dataclasses.dataclass(frozen=True)
class Config:
    """The transformation (the same arguments to both) and the composition around it."""

    name: str = "adamw"
    lr: float = 1e-2
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    eps_root: float = 0.0
    weight_decay: float = 1e-4
    mu_dtype: str | None = None
    nesterov: bool = False
    mask: str | None = None  # None, "matrices" (a callable), "first" (a pytree prefix)
    composition: str = "plain"
    jit: bool = True
    producer: str = "given"

    def kwargs(self) -> dict[str, Any]:
        kw = dict(learning_rate=self.lr, b1=self.b1, b2=self.b2, eps=self.eps, eps_root=self.eps_root,
                  mu_dtype=None if self.mu_dtype is None else DTYPES[self.mu_dtype], nesterov=self.nesterov)
        if self.name == "adamw":
            kw["weight_decay"] = self.weight_decay
            kw["mask"] = _mask(self.mask)
        return kw


def _matrices(params):
    return jax.tree.map(lambda p: p.ndim > 1, params)


def _first_only(params):
    leaves, treedef = jax.tree.flatten(params)
    return jax.tree.unflatten(treedef, [i == 0 for i in range(len(leaves))])


def _mask(kind):
    return {None: None, "matrices": _matrices, "first": _first_only}[kind]


@dataclasses.dataclass(frozen=True)
class Tree:
    """A parameter pytree: ``layout`` over leaves of ``shapes`` (indices into SHAPES) and ``dtypes``."""

    layout: str
    shapes: tuple[int, ...]
    dtypes: tuple[str, ...]
    seed: int = 0

    def build(self, rng: np.random.Generator, scale: float = 1.0, shapes=None, dtypes=None):
        shapes = self.shapes if shapes is None else shapes
        dtypes = self.dtypes if dtypes is None else dtypes
        leaves = [jnp.asarray(rng.standard_normal(SHAPES[s]) * scale, DTYPES[d]) for s, d in zip(shapes, dtypes)]
        return nest(self.layout, leaves)


def nest(layout: str, leaves: list):
    """The pytree of ``layout`` over ``leaves``."""
    n = len(leaves)
    if layout == "leaf" and n == 1:
        return leaves[0]
    if layout == "list":
        return list(leaves)
    if layout == "nested" and n >= 2:
        return {"a": leaves[0], "b": {f"c{i}": x for i, x in enumerate(leaves[1:])}}
    if layout == "tuple_in_dict" and n >= 2:
        return {"w": tuple(leaves[:-1]), "z": leaves[-1]}
    return {f"p{i}": x for i, x in enumerate(leaves)}


@dataclasses.dataclass(frozen=True)
class Mismatch:
    """A last update whose gradients differ from the parameters given to init: ``kind`` "structure" (one leaf more),
    "shape" (leaf ``leaf``'s shape another of SHAPES), "dtype" (leaf ``leaf`` in another dtype) or "params" (the
    parameters themselves another tree than init's)."""

    kind: str
    leaf: int = 0
    other: int = 1


# -- the transformations ---------------------------------------------------------------------------------------------


def _jit_factory(factory):
    """``factory`` (optax.adam/adamw) whose ``update`` is jitted on its own: optax's reference for a call outside jit,
    whose bits ours keeps there (docs/jax.md: "Outside jit either runs as a program of its own, with the bits of the
    jitted one"). Array hyper-parameters (inject_hyperparams') are arguments of that program, as in a jitted step
    (a closure's arrays would be constants XLA folds); numbers are constants, as in the user's program."""

    @functools.wraps(factory)
    def make(*args, **kwargs):
        bound = inspect.signature(factory).bind(*args, **kwargs).arguments
        arrays = {k: v for k, v in bound.items() if isinstance(v, jax.Array)}
        static = {k: v for k, v in bound.items() if k not in arrays}
        tx = factory(**static, **arrays)
        update = jax.jit(lambda g, s, p, arr: factory(**static, **arr).update(g, s, p))
        def jitted(g, s, params=None, **extra):
            return update(g, s, params, arrays)

        return optax.GradientTransformationExtraArgs(tx.init, jitted)

    return make


def transformation(cfg: Config, ours: bool):
    """One side's optax transformation (the same composition around each; outside jit optax's adam/adamw jitted on
    its own, :func:`_jit_factory`)."""
    factory = PAIRS[cfg.name][1 if ours else 0]
    if not cfg.jit and not ours:
        factory = _jit_factory(factory)
    kw = cfg.kwargs()
    if cfg.composition == "inject":
        return optax.inject_hyperparams(factory)(**kw)
    tx = factory(**kw)
    if cfg.composition == "clip":
        return optax.chain(optax.clip_by_global_norm(0.5), tx)
    if cfg.composition == "masked":
        return optax.masked(tx, _first_only)
    if cfg.composition == "clip_masked":
        return optax.chain(optax.clip_by_global_norm(1.0), optax.masked(tx, _matrices))
    if cfg.composition == "multisteps":
        return optax.MultiSteps(tx, 2)
    return tx


@functools.lru_cache(maxsize=256)
def _programs(cfg: Config, ours: bool):
    """(tx, init, step): jitted where ``cfg.jit`` (cached per configuration: XLA's cache then hits across sequences
    of equal trees)."""
    tx = transformation(cfg, ours)

    def step(p, s, g):
        u, s = tx.update(_produce(cfg.producer, g, p), s, p)
        return optax.apply_updates(p, u), s, u

    return tx, tx.init, (jax.jit(step) if cfg.jit else step)


_PRODUCE = {
    "elementwise": lambda g, p: g * 1.5 + p * 0.01,
    "checkpoint_cast": jax.checkpoint(lambda g, p: (g * 2.0).astype(jnp.bfloat16).astype(g.dtype)),
    "nested_jit": jax.jit(lambda g, p: jnp.tanh(g) * 0.5 + p * 1e-3),
}


def _produce(producer: str, g, p):
    """The gradient the step updates with (:data:`PRODUCERS`); ``g`` itself where its leaves do not match the
    parameters' (a mismatched update: ours must see it as it is)."""
    if producer == "given" or _types(g) != _types(p):
        return g
    return jax.tree.map(_PRODUCE[producer], g, p)


def _bits(x) -> np.ndarray:
    a = np.asarray(x)
    return a.view({4: np.uint32, 2: np.uint16, 1: np.uint8, 8: np.uint64}[a.itemsize])


def compare(a, b, where: str) -> None:
    """Two pytrees bit for bit (structure, dtypes and shapes included)."""
    la, da = jax.tree.flatten(a)
    lb, db = jax.tree.flatten(b)
    if da != db:
        raise SilentDifference(f"{where}: tree structures differ: {db} (ours) vs {da} (optax)")
    for i, (x, y) in enumerate(zip(la, lb)):
        x, y = np.asarray(x), np.asarray(y)
        if x.dtype != y.dtype or x.shape != y.shape:
            raise SilentDifference(f"{where}: leaf {i} is {y.dtype}{y.shape} (ours), {x.dtype}{x.shape} (optax)")
        if not np.array_equal(_bits(x), _bits(y)):
            bad = np.flatnonzero(_bits(x).ravel() != _bits(y).ravel())
            raise SilentDifference(f"{where}: leaf {i} {x.dtype}{x.shape}: {bad.size} of {x.size} elements differ, "
                                   f"first [{bad[0]}] ours {y.ravel()[bad[0]]!r}, optax {x.ravel()[bad[0]]!r}")


def _refusal(exc: BaseException) -> str | None:
    msg = str(exc).strip()
    if isinstance(exc, REFUSALS) and msg:
        return f"{type(exc).__name__}: {msg}"
    return None


def reason_key(reason: str, width: int = 110) -> str:
    """A refusal's message shortened for counting (which leaf left out)."""
    reason = re.sub(r"leaf \S+", "leaf X", reason.splitlines()[0] if reason else reason)
    reason = re.sub(r"gradient \S+ is .*?, its parameter .*?:", "gradient X is (shape, dtype), its parameter (...):",
                    reason)
    return reason if len(reason) <= width else reason[: width - 3] + "..."


#: (config, side, the step's input types) -> the TrainStream warnings its first call gave. The adapter warns when a
#: program is traced; a later sequence that runs the same program (JAX's cache) gets none, but they hold for it.
_TRACE_WARNINGS: dict = {}


def _ours_warnings(msgs: list, key) -> list:
    """The TrainStream warnings of one call: those it gave, else those the first call of the same program gave."""
    msgs = [str(w.message) for w in msgs if issubclass(w.category, RuntimeWarning) and "TrainStream" in str(w.message)]
    if msgs:
        _TRACE_WARNINGS[key] = msgs
        return msgs
    return _TRACE_WARNINGS.get(key, [])


def _types(*trees) -> tuple:
    return str(jax.tree.structure(trees)), tuple((np.shape(x), str(np.result_type(x))) for x in jax.tree.leaves(trees))


def _side(cfg: Config, ours: bool, tree: Tree, grads: list, mismatch: Mismatch | None, warned: list | None = None):
    """Run one side: ``(results per step, the exception of the step it stopped at or None, its step index)``; the
    TrainStream warnings of ours' steps (their programs', see ``_TRACE_WARNINGS``) appended to ``warned``."""
    tx, init, step = _programs(cfg, ours)
    p = tree.build(np.random.default_rng(tree.seed))
    out = []
    try:
        s = init(p)
    except Exception as exc:  # noqa: BLE001
        return out, exc, -1
    for k, g in enumerate(grads):
        try:
            q = p
            if mismatch is not None and k == len(grads) - 1 and mismatch.kind == "params":
                q = g  # parameters of another tree than init's (g is that tree, see sequence_grads)
            try:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    res = step(q, s, g)
                    jax.block_until_ready(res)
            finally:
                for w in caught:  # to the caller's record too
                    warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
            if warned is not None:
                warned.extend(_ours_warnings(caught, (cfg, ours, _types(q, s, g))))
        except Exception as exc:  # noqa: BLE001
            return out, exc, k
        p, s, u = res
        out.append((p, u))
    return out, None, len(grads)


def sequence_grads(tree: Tree, steps: int, scales: tuple[float, ...], mismatch: Mismatch | None, seed: int) -> list:
    """The gradients of each step (the last one mismatched where asked)."""
    rng = np.random.default_rng(10_000 + seed)
    grads = [tree.build(rng, scale=scales[k % len(scales)]) for k in range(steps)]
    if mismatch is None:
        return grads
    n = len(tree.shapes)
    i = mismatch.leaf % n
    if mismatch.kind == "structure":
        bad = Tree(tree.layout, (*tree.shapes, mismatch.other % len(SHAPES)), (*tree.dtypes, tree.dtypes[0]))
        grads.append(bad.build(rng))
    elif mismatch.kind == "shape":
        shapes = list(tree.shapes)
        shapes[i] = (shapes[i] + 1 + mismatch.other % (len(SHAPES) - 1)) % len(SHAPES)
        grads.append(tree.build(rng, shapes=tuple(shapes)))
    elif mismatch.kind == "dtype":
        dts = list(tree.dtypes)
        names = list(leaf_dtypes())
        dts[i] = names[(names.index(dts[i]) + 1 + mismatch.other % (len(names) - 1)) % len(names)]
        grads.append(tree.build(rng, dtypes=tuple(dts)))
    elif mismatch.kind == "params":  # a tree of one leaf fewer or more (used as params and grads)
        shapes = tree.shapes[:-1] if n > 1 else (*tree.shapes, 0)
        other = Tree(tree.layout, shapes, tree.dtypes[:len(shapes)] + (tree.dtypes[0],) * (len(shapes) - n))
        grads.append(other.build(rng))
    return grads


def run_sequence(cfg: Config, tree: Tree, steps: int, scales: tuple[float, ...] = (1.0,),
                 mismatch: Mismatch | None = None) -> tuple[str, str]:
    """Run both sides. Returns ``(outcome, detail)``: "identical", "both raised", "refused", "warned" (ours warned the
    documented bound and the bits differ), "mismatch refused" (the mismatched last update: ours raised clearly).
    Raises :class:`Finding` otherwise."""
    grads = sequence_grads(tree, steps, scales, mismatch, tree.seed)
    _detect._warned.clear()  # each sequence gets the warnings it would get first in a process
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ref, e_ref, k_ref = _side(cfg, False, tree, grads, mismatch)
        ours, e_ours, k_ours = _side(cfg, True, tree, grads, mismatch, stepped := [])
    warned = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning) and "TrainStream" in
              str(w.message)] + stepped
    last_mismatched = mismatch is not None
    n_ok = min(len(ref), len(ours))
    try:
        for k in range(n_ok):
            compare(ref[k], ours[k], f"step {k}")
    except SilentDifference as exc:
        if warned:
            return "warned", reason_key(warned[0])
        raise
    if last_mismatched and k_ours == len(grads) - 1:
        reason = _refusal(e_ours)
        if reason is None:
            raise Finding(f"the mismatched update ({mismatch}): ours raised {e_ours!r}, not a clear error") from e_ours
        return "mismatch refused", reason
    if last_mismatched and e_ours is None:
        if e_ref is not None or len(ref) < len(ours):
            raise Finding(f"the mismatched update ({mismatch}): ours returned a result where optax raised {e_ref!r}")
        return "mismatch identical", ""  # compared above, bit for bit (e.g. optax's own result)
    if e_ref is not None and e_ours is not None and k_ref == k_ours:
        return "both raised", f"{type(e_ref).__name__}/{type(e_ours).__name__}"
    if e_ours is not None and k_ours <= k_ref:
        reason = _refusal(e_ours)
        if reason is None:
            raise Finding(f"step {k_ours}: ours raised {e_ours!r} where optax did not") from e_ours
        return "refused", reason
    if e_ref is not None:
        raise Finding(f"step {k_ref}: optax raised {e_ref!r}, ours went on") from e_ref
    return ("warned identical", reason_key(warned[0])) if warned else ("identical", "")


# -- strategies -----------------------------------------------------------------------------------------------------


def configs(full: bool | None = None):
    """A configuration. ``full`` (default: ``TRAINSTREAM_FUZZ_FULL=1``): every hyper-parameter the adapter has code
    families for (each family a Numba kernel compiled once, 5-50 s on a cold cache); else those the CI's other JAX
    tests compile anyway plus a few."""
    full = os.environ.get("TRAINSTREAM_FUZZ_FULL") == "1" if full is None else full
    rare = st.booleans() if full else st.just(False)
    return st.builds(
        Config,
        name=st.sampled_from(list(PAIRS)),
        lr=st.sampled_from([1e-3, 1e-2, 0.1]),
        b1=st.sampled_from([0.9, 0.8, 0.5] if full else [0.9, 0.8]),
        b2=st.sampled_from([0.999, 0.99, 0.5] if full else [0.999, 0.99]),
        eps=st.sampled_from([1e-8, 1e-6, 0.0] if full else [1e-8, 1e-6]),
        eps_root=st.sampled_from([0.0, 1e-8]) if full else st.just(0.0),
        weight_decay=st.sampled_from([0.0, 1e-4, 0.1]),
        mu_dtype=st.sampled_from([None, "float32", "bfloat16"]) if full else st.just(None),
        nesterov=rare,
        mask=st.sampled_from([None, "matrices", "first"]),
        composition=st.sampled_from(COMPOSITIONS),
        jit=st.booleans(),
        producer=st.sampled_from(PRODUCERS),
    )


@st.composite
def trees(draw, dtypes=None):
    dtypes = leaf_dtypes() if dtypes is None else dtypes
    n = draw(st.integers(1, 3))
    shapes = tuple(draw(st.sampled_from(range(len(SHAPES)))) for _ in range(n))
    one = draw(st.sampled_from(dtypes))
    mixed = draw(st.booleans())
    dts = tuple(draw(st.sampled_from(dtypes)) if mixed else one for _ in range(n))
    return Tree(draw(st.sampled_from(LAYOUTS)), shapes, dts, seed=draw(st.integers(0, 3)))


def mismatches():
    return st.one_of(st.none(), st.none(), st.none(), st.none(), st.builds(
        Mismatch, kind=st.sampled_from(["structure", "shape", "dtype", "params"]), leaf=st.integers(0, 2),
        other=st.integers(0, 3)))


def scales():
    return st.lists(st.sampled_from([1.0, 1e-3, 30.0]), min_size=1, max_size=3).map(tuple)


def tally(counts: Counter, outcome: str, detail: str) -> None:
    counts[outcome] += 1
    if detail:
        counts[f"{outcome}: {reason_key(detail)}"] += 1

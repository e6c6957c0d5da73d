"""Which FMA pairing XLA:CPU gives optax's moment lines in the user's program: read from XLA at trace time.

In a step jitted whole, XLA:CPU copies the element-wise producer of a gradient (``clip_by_global_norm``'s select,
``MultiSteps``' running mean, ``lax.pmean``'s ``/ n``, a gradient element-wise in the parameters, a reduction) into
each of optax's moment loops. The values stay the same, but LLVM then contracts the other product of
``C1*g + B1*m`` (``C2*g*g + B2*v``) into its FMA, per leaf ("Fused gradients" in :mod:`trainstream.contract`). A buffer
handed to a callback cannot tell; the program being traced can:

1. :func:`_trace_graph` walks back from each gradient leaf, within the trace, through what XLA:CPU fuses into a
   consumer loop (element-wise operations, broadcasts, reshapes, slices, reductions, ...) to the values XLA
   materialises anyway (the program's arguments, collectives, control flow, calls, random bits), taking a
   non-fusible producer (``dot_general``, ``scatter-add``, a nested ``jit``, ...) with its inputs as boundaries,
   since XLA fuses consumers *into* it; literals and captured constants stay constants (XLA folds them).
2. If some leaf is computed by a fusible operation (not merely a reshape of a buffer, as ``pmap``'s squeeze of
   each replica's argument), :class:`._probe.Probe` compiles that graph (the boundaries as arguments) twice:
   feeding optax's reference (this configuration: hyper-parameters, schedule, mask, ``clip_by_global_norm`` for
   ``max_grad_norm``) and ``apply_updates``; and alone with the adapter's scalars, the gradient as our callback
   receives it. It runs both on random inputs and keeps, per leaf, the pairing bits whose contract lines
   reproduce the reference's new weights and moments bit for bit. Once per graph structure and configuration
   (cached for the process): two compilations of the graph at the first trace (about 1 s for a small MLP, 3-8 s
   for a small transformer under ``clip_by_global_norm``, whose norm takes every gradient into the graph).
3. A leaf no pairing reproduces (XLA folded a constant of its gradient with the moment line's): the closest
   pairing and one warning with the per-step distance the probe measured. A graph over :data:`MAX_EQNS`
   equations (a model of several layers under ``clip_by_global_norm``, whose norm takes in every gradient): read
   from the :data:`MAX_EQNS` nearest the gradients (breadth first), with one warning naming :data:`FUSED_MAX_ULP`
   (the cut can change XLA's fusion: seen in 2 of 6 test programs cut far below their size). A probe that fails,
   or a JAX whose tracers do not expose their producers: the contract's default code and one warning naming
   :data:`FUSED_MAX_ULP`.

Private JAX API: only :func:`_trace_graph` uses it (``DynamicJaxprTracer.parent``, a ``TracingEqn`` with
``primitive``/``params``/``in_tracers``/``outvars``; ``tracer.val``, a ``Var`` or ``core.Literal``;
``trace.frame.constvar_to_val``), written against and tested with jax :data:`TESTED_JAX`. On a JAX without them
it raises :class:`Unavailable` and the adapter falls back as in 3.
"""

from __future__ import annotations

import hashlib
import threading
import time
import warnings
from typing import Any, NamedTuple

import jax
import numpy as np

from .. import contract as C
from ._probe import PAIRING, UNTOLD, Probe, hyper_key, hyper_of, trusted

__all__ = ["FUSED_MAX_ULP", "MAX_EQNS", "TESTED_JAX", "Unavailable", "fused_codes", "stats", "warn_output_pairing"]

#: The jax versions :func:`_trace_graph` was written against and tested with.
TESTED_JAX = ("0.10.2",)
#: Per-step distance (``contract.update_ulps`` of the weights and moments) of a wrong pairing, the largest the
#: probe measured over the compositions of tests/test_jax_compose.py (1-3 ULP typical; MultiSteps' running mean
#: the largest). It compounds over steps. The bound of every fallback warning.
FUSED_MAX_ULP = 10.0
#: Beyond this many equations in a producer graph the probe is not run (default code, warned).
MAX_EQNS = 400
# what XLA:CPU may fuse into (copy into) the moment update's loops: element-wise, layout and reduction operations
FUSIBLE = frozenset((
    "add", "add_any", "sub", "mul", "div", "rem", "neg", "max", "min", "abs", "sign", "pow", "integer_pow", "square",
    "sqrt", "rsqrt", "cbrt", "exp", "exp2", "log", "log1p", "expm1", "tanh", "logistic", "erf", "erfc", "erf_inv",
    "sin", "cos", "tan", "atan2", "floor", "ceil", "round", "is_finite", "nextafter", "clamp", "select_n",
    "convert_element_type", "reduce_precision", "real", "imag", "conj", "copy", "copy_p", "device_put",
    "eq", "ne", "lt", "le", "gt", "ge", "and", "or", "not", "xor",
    "broadcast_in_dim", "reshape", "squeeze", "expand_dims", "rev", "pad", "slice", "concatenate", "transpose",
    "split", "iota", "reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or",
    "argmax", "argmin",
))
# materialised by XLA (never fused into a consumer), and not re-run by the probe: boundaries at their outputs
OPAQUE = frozenset((
    "psum", "pmax", "pmin", "pmean", "all_gather", "all_to_all", "ppermute", "reduce_scatter", "psum_scatter",
    "psum_invariant", "pbroadcast", "pvary", "axis_index", "cond", "while", "scan", "shard_map", "xla_pmap",
    "pure_callback", "io_callback", "debug_callback", "buffer_callback", "callback", "rng_bit_generator",
    "random_bits", "random_seed", "random_wrap", "random_unwrap", "random_fold_in", "random_split",
    "threefry2x32", "optimization_barrier", "sharding_constraint", "mesh_cast", "reshard", "custom_linear_solve",
))
# calls XLA inlines (walked through)
CALLS = frozenset(("pjit", "jit", "closed_call", "core_call", "remat", "remat2", "checkpoint", "custom_jvp_call",
                   "custom_vjp_call"))
# reshapes that leave a buffer as it is (a materialised value stays materialised through them)
BITCASTS = frozenset(("reshape", "squeeze", "expand_dims", "copy", "copy_p", "device_put"))


class Unavailable(RuntimeError):
    """This JAX's tracers do not expose their producers (the private API of :func:`_trace_graph`)."""


class _Eqn(NamedTuple):
    primitive: Any
    params: dict
    ins: tuple  # ("v", ref) or ("c", index into Graph.consts)
    outs: tuple  # refs of its results


class Graph(NamedTuple):
    """The producer graph of the gradient leaves, with no tracer in it."""
    eqns: tuple  # _Eqn, in topological order
    inputs: tuple  # (ref, shape, dtype, alias): the boundary values; alias: the params leaf it is, or None
    consts: tuple  # constant values (literals, captured arrays)
    outs: tuple  # per leaf: ("v", ref) or ("c", index)
    fused: tuple  # per leaf: computed by a fusible operation (XLA may copy it into the update's loops): calibrated
    complete: bool  # False: cut to the MAX_EQNS operations nearest the leaves

    def key(self) -> str:
        h = hashlib.sha1()
        for e in self.eqns:
            h.update(f"{e.primitive.name}|{sorted((k, repr(v)) for k, v in e.params.items())}|{e.ins}|{e.outs};"
                     .encode())
        h.update(repr([(r, s, str(d), a) for r, s, d, a in self.inputs]).encode())
        for c in self.consts:
            a = np.asarray(c)
            h.update(f"{a.dtype}{a.shape}".encode() + a.tobytes())
        h.update(repr(self.outs).encode())
        return h.hexdigest()


def _trace_graph(g_leaves, p_leaves) -> Graph:
    """The producer graph of ``g_leaves`` within their trace. The only use of JAX's private API (jax 0.10.2:
    ``DynamicJaxprTracer.parent``/``.val``, ``TracingEqn``, ``core.Literal``, ``frame.constvar_to_val``); raises
    :class:`Unavailable` where they are missing or differ."""
    try:
        from jax._src import core as jcore  # noqa: PLC0415
        from jax._src.interpreters import partial_eval as pe  # noqa: PLC0415
        literal, tracer_type = jcore.Literal, pe.DynamicJaxprTracer
        if "parent" not in getattr(tracer_type, "__slots__", ()):
            raise Unavailable(f"jax {jax.__version__}: DynamicJaxprTracer has no 'parent'")
        return _walk(g_leaves, p_leaves, literal, tracer_type)
    except Unavailable:
        raise
    except (ImportError, AttributeError, KeyError, TypeError) as e:
        raise Unavailable(f"jax {jax.__version__}: {type(e).__name__}: {e}") from None


def _walk(g_leaves, p_leaves, literal, tracer_type) -> Graph:
    refs: dict[int, int] = {}  # id(Var) -> ref
    keep = []  # the Vars behind refs, alive while walking (ids stay unique)
    consts, const_ids = [], {}
    inputs, eqns, eqn_done = [], [], set()
    alias = {id(p.val): i for i, p in enumerate(p_leaves) if isinstance(p, tracer_type)}
    allowed, complete = _nearest(g_leaves, tracer_type)

    def ref_of(var):
        if id(var) not in refs:
            refs[id(var)] = len(refs)
            keep.append(var)
        return refs[id(var)]

    def const_of(t):
        """("c", index) for a literal or a captured constant, else None."""
        val = t.val
        if isinstance(val, literal):
            c = val.val
        else:
            c = t._trace.frame.constvar_to_val.get(val)
            if c is None:
                return None
        if id(val) not in const_ids:
            const_ids[id(val)] = len(consts)
            consts.append(c)
            keep.append(val)
        return ("c", const_ids[id(val)])

    def as_input(t):
        r = ref_of(t.val)
        if r not in seen_inputs:
            seen_inputs.add(r)
            inputs.append((r, tuple(t.aval.shape), np.dtype(t.aval.dtype), alias.get(id(t.val))))
        return ("v", r)

    seen_inputs: set[int] = set()
    visited: dict[int, tuple] = {}  # id(Var) -> its atom
    stack = [("visit", t) for t in reversed(g_leaves)]
    while stack:
        op, x = stack.pop()
        if op == "emit":
            par = x
            ins = tuple(visited[id(t.val)] for t in par.in_tracers)
            eqns.append(_Eqn(par.primitive, dict(par.params), ins, tuple(ref_of(v) for v in par.outvars)))
            continue
        t = x
        if not isinstance(t, tracer_type):  # a concrete leaf: a constant to the program
            if id(t) not in visited:
                visited[id(t)] = ("c", len(consts))
                consts.append(t)
                keep.append(t)
            continue
        if id(t.val) in visited:
            continue
        c = const_of(t)
        if c is not None:
            visited[id(t.val)] = c
            continue
        par = t.parent
        name = par.primitive.name if par is not None else None
        if par is None or id(par) not in allowed:
            visited[id(t.val)] = as_input(t)
            continue
        if id(par) in eqn_done:  # another result of an equation already taken
            visited[id(t.val)] = ("v", ref_of(t.val))
            continue
        eqn_done.add(id(par))
        for v in par.outvars:
            visited[id(v)] = ("v", ref_of(v))
        stack.append(("emit", par))
        if name in FUSIBLE or name in CALLS:  # XLA inlines calls: their inputs' producers may fuse through them
            stack.extend(("visit", x) for x in reversed(par.in_tracers))
        else:  # materialised by XLA, but XLA fuses its consumers into it: taken one level deep
            for x in par.in_tracers:
                if id(x.val) not in visited:
                    visited[id(x.val)] = const_of(x) or as_input(x)
    outs = tuple(visited[id(t.val) if isinstance(t, tracer_type) else id(t)] for t in g_leaves)
    return Graph(tuple(eqns), tuple(inputs), tuple(consts), outs, tuple(_computed(t, tracer_type) for t in g_leaves),
                 complete)


def _taken(par) -> bool:
    """Whether the graph takes equation ``par`` (else its results are the graph's inputs)."""
    name = par.primitive.name
    return name not in OPAQUE and (not par.primitive.multiple_results or name in FUSIBLE or name in CALLS)


def _nearest(g_leaves, tracer_type) -> tuple[set, bool]:
    """The ids of the :data:`MAX_EQNS` equations nearest the leaves (breadth first: the operations XLA fuses into
    the update's loops first), and whether that is all of the graph."""
    allowed, seen, frontier = set(), set(), list(g_leaves)
    while frontier:
        nxt = []
        for t in frontier:
            if not isinstance(t, tracer_type) or id(t.val) in seen:
                continue
            seen.add(id(t.val))
            par = t.parent
            if par is None or id(par) in allowed or not _taken(par):
                continue
            if len(allowed) >= MAX_EQNS:
                return allowed, False
            allowed.add(id(par))
            if par.primitive.name in FUSIBLE or par.primitive.name in CALLS:  # XLA inlines calls
                nxt.extend(par.in_tracers)
        frontier = nxt
    return allowed, True


def _computed(t, tracer_type) -> bool:
    """Whether XLA computes leaf ``t`` in the consumer's loop: its producer, past reshapes of a buffer (XLA's
    bitcasts: ``pmap``'s squeeze of each replica's argument) and into the calls XLA inlines (``jnp.clip``,
    ``jnp.where``: nested jits), is a fusible operation."""
    while isinstance(t, tracer_type) and t.parent is not None:
        par = t.parent
        name = par.primitive.name
        if name in BITCASTS and len(par.in_tracers) == 1:
            t = par.in_tracers[0]
            continue
        if name in CALLS:
            inner = _jaxpr_computed(par.params, [id(v) for v in par.outvars].index(id(t.val)))
            if isinstance(inner, bool):
                return inner
            t = par.in_tracers[inner]
            continue
        return name in FUSIBLE
    return False


def _jaxpr_computed(params, k: int) -> bool | int:
    """:func:`_computed` of the ``k``-th result of a call (its ``params``): a bool, or the index of the call's
    argument that result is (through bitcasts)."""
    closed = next(params[n] for n in ("jaxpr", "call_jaxpr", "fun_jaxpr") if n in params)
    jaxpr = getattr(closed, "jaxpr", closed)
    producer = {id(v): e for e in jaxpr.eqns for v in e.outvars}
    v = jaxpr.outvars[k]
    while id(v) in producer:
        e = producer[id(v)]
        name = e.primitive.name
        if name in BITCASTS and len(e.invars) == 1:
            v = e.invars[0]
        elif name in CALLS:
            inner = _jaxpr_computed(e.params, [id(o) for o in e.outvars].index(id(v)))
            if isinstance(inner, bool):
                return inner
            v = e.invars[inner]
        else:
            return name in FUSIBLE
    ids = [id(x) for x in jaxpr.invars]
    return ids.index(id(v)) if id(v) in ids else False


# -- the adapter's hook ---------------------------------------------------------------------------------------

_cache: dict = {}
_CACHE_KEPT = 256
_lock = threading.Lock()
_warned: set = set()
#: Counters for tests and the first-trace cost: probes run, cache hits, seconds spent probing, graphs seen.
stats = {"probes": 0, "hits": 0, "seconds": 0.0, "materialised": 0, "fallbacks": 0}


def _warn_once(key, msg: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(msg, RuntimeWarning, stacklevel=5)


_FALLBACK = ("TrainStream offload_adamw: {why}; leaves whose gradient XLA:CPU computes inside optax's update in the "
             "reference program (a gradient made in the same jit: clip_by_global_norm, MultiSteps, pmean, "
             "element-wise or reduced gradients) get the contract's default FMA pairing and can differ from the same "
             "program around optax.adamw by up to {bound:g} ULP per step (compounding over steps)")


_TRUNCATED = ("TrainStream offload_adamw: the gradients' producer graph in this program has over {n} operations; "
              "the FMA pairing XLA:CPU gives optax's update is read from the {n} nearest the gradients (the rest as "
              "inputs). Where XLA fuses the whole program otherwise, leaves can differ from the same program around "
              "optax.adamw by up to {bound:g} ULP per step (compounding over steps)")
_INEXACT = ("TrainStream offload_adamw: {k} of {n} leaves' gradients are computed by XLA:CPU inside optax's update in "
            "the reference program in a way that matches no FMA pairing of the contract (e.g. a constant of the "
            "gradient folded with the moment line's): they get the closest pairing and can differ from the same "
            "program around optax.adamw by up to {bound:g} ULP per step, as the probe measured (compounding "
            "over steps); computing the gradient in a jit of its own makes them exact")


_UNTOLD = ("TrainStream offload_adamw: {k} of {n} leaves' gradients are computed by XLA:CPU inside optax's update in "
           "the reference program, and the pairing probe's random inputs never told their FMA pairings apart (e.g. "
           "gradients that came out all 0): they get the contract's default pairing and can differ from the same "
           "program around optax.adamw by up to {bound:g} ULP per step (compounding over steps); computing the "
           "gradient in a jit of its own makes them exact")


_GUESSED = ("TrainStream offload_adamw: {k} leaves (nesterov, eps == 0, mu_dtype=bfloat16 or b == 0.5 with FMA lines) "
            "have a gradient XLA:CPU computes inside optax's update in the reference program; the FMA pairing read "
            "from XLA is a best guess for these lines (trainstream.jax._probe.trusted): they can differ from the "
            "same program around optax.adamw by up to {bound:g} ULP per step (compounding over steps); computing "
            "the gradient in a jit of its own makes them exact")


_OUTPUTS = ("TrainStream offload_adamw: {k} leaves with eps == 0, weight decay and mu_dtype=bfloat16 or "
            "b1 == b2 == 0.5: XLA:CPU contracts optax's m * rsqrt(v) + weight_decay * p into an FMA by what the rest "
            "of the program outputs (the new weights or the update array alone, or both); the contract follows a "
            "program that outputs one of them, one that outputs both can differ from the same program around "
            "optax.adamw by up to {bound:g} ULP per step (compounding over steps)")


def warn_output_pairing(codes, decays, weight_decay) -> None:
    """One warning (:data:`_OUTPUTS`) where a leaf's update line pairs by what the program outputs, which an update
    traced before its consumers cannot see (:func:`trainstream.contract.optax_rsqrt_decay_varies`)."""
    if isinstance(weight_decay, (int, float)) and weight_decay == 0:
        return
    k = sum(bool(d) and C.optax_rsqrt_decay_varies(c) for c, d in zip(codes, decays))
    if k:
        _warn_once("outputs", _OUTPUTS.format(k=k, bound=FUSED_MAX_ULP))


def fused_codes(codes, g_leaves, p_leaves, decays, cfg, dtypes=None, masters=None, n_tree=None) -> list[int]:
    """``codes`` (each leaf's :func:`trainstream.contract.optax_cpu_code`) with the pairing bits XLA:CPU compiles
    for optax's update of this program's gradients (see the module docstring); the other bits (the family) stay.
    ``decays``: False for a leaf masked out of weight decay; ``cfg``: offload_adamw's checked arguments (its
    optax.adamw arguments and ``max_grad_norm``); ``dtypes``: each leaf's dtype name (default float32);
    ``masters``: True for a leaf with an fp32 master: not probed, its code's pairing (its reference is optax.adamw
    on the float32 master fed the upcast gradients materialised, which no program around optax.adamw on the
    fp16/bf16 leaves computes); ``n_tree``: the leaves of the tree these are part of (default: these). Where a
    gradient of a family the probe does not :func:`._probe.trusted` is computed in the program: one warning naming
    :data:`FUSED_MAX_ULP`."""
    codes = [int(c) for c in codes]
    n = len(codes)
    dtypes = tuple(dtypes) if dtypes is not None else ("float32",) * n
    masters = tuple(bool(m) for m in masters) if masters is not None else (False,) * n
    if not any(isinstance(g, jax.core.Tracer) for g in g_leaves):
        return codes
    try:
        graph = _trace_graph(g_leaves, p_leaves)
    except Unavailable as e:
        stats["fallbacks"] += 1
        _warn_once("unavailable", _FALLBACK.format(
            why=f"this JAX does not show a gradient's producer at trace time ({e}; tested with jax "
                f"{', '.join(TESTED_JAX)})", bound=FUSED_MAX_ULP))
        return codes
    if not any(graph.fused):
        stats["materialised"] += 1
        return codes
    skip = masters
    guessed = sum(f and not m and not trusted(c) for f, m, c in zip(graph.fused, masters, codes))
    if guessed:
        _warn_once("guessed", _GUESSED.format(k=guessed, bound=FUSED_MAX_ULP))
    if all(skip[i] for i in range(n) if graph.fused[i]):
        return codes
    if not graph.complete:
        _warn_once("large", _TRUNCATED.format(n=MAX_EQNS, bound=FUSED_MAX_ULP))
    hyper = hyper_of(cfg)
    max_norm = getattr(cfg, "max_grad_norm", None)
    p_avals = tuple((tuple(np.shape(p)), np.dtype(p.dtype)) for p in p_leaves)
    alone = n == 1 and (n_tree or n) > 1  # one leaf of a larger tree: optax's program over it needs a companion
    key = (graph.key(), p_avals, tuple(codes), tuple(bool(d) for d in decays), hyper_key(hyper), max_norm, dtypes,
           skip, alone)
    with _lock:
        res = _cache.get(key)
        if res is not None:
            stats["hits"] += 1
        else:
            t0 = time.perf_counter()
            try:
                res = Probe(graph, p_avals, codes, list(decays), hyper, max_norm, dtypes, skip, alone).calibrate()
            except Exception as e:  # noqa: BLE001 - the user's program must not fail for the probe's sake
                stats["fallbacks"] += 1
                _warn_once(("probe", type(e).__name__), _FALLBACK.format(
                    why=f"the pairing probe failed ({type(e).__name__}: {str(e)[:200]})", bound=FUSED_MAX_ULP))
                return codes
            finally:
                stats["seconds"] += time.perf_counter() - t0
            stats["probes"] += 1
            _cache[key] = res
            while len(_cache) > _CACHE_KEPT:
                _cache.pop(next(iter(_cache)))
    untold = [bound for _, bound in res if bound == UNTOLD]
    inexact = [bound for _, bound in res if bound > 0]
    if inexact:
        _warn_once(("inexact", key[0]), _INEXACT.format(k=len(inexact), n=len(res), bound=max(inexact)))
    if untold:
        _warn_once(("untold", key[0]), _UNTOLD.format(k=len(untold), n=len(res), bound=FUSED_MAX_ULP))
    return [(c & ~PAIRING) | sw for c, (sw, _) in zip(codes, res)]

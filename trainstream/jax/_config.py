"""The arguments of :func:`trainstream.jax.offload_adamw`, checked (:class:`Config`), and the state each leaf keeps
as optax does (:func:`family`): the dtype names of its moments, whether it has an fp32 master (``master_weights``).
"""

from __future__ import annotations

import collections
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from .. import contract as C
from ._plan import is_number as _is_number

__all__ = ["DTYPES", "Config", "Family", "check_array_hyper", "cuda_codes", "family", "leaf_dtype_name",
           "mu_dtype_name", "static_arg", "warn_cpu_mode_on_gpu"]

DTYPES = {np.dtype(np.float32): "float32", np.dtype(np.float16): "float16", np.dtype(jnp.bfloat16): "bfloat16"}

# offload_adamw's checked arguments (threads None: decided when the first update is traced)
Config = collections.namedtuple("Config", "learning_rate b1 b2 eps eps_root mu_dtype weight_decay mask nesterov "
                                "max_grad_norm master_weights mode threads worker_nice host_margin")
# one leaf's state: mu's and nu's dtype names, whether it has an fp32 master
Family = collections.namedtuple("Family", "mu nu master")


def leaf_dtype_name(x, path: str) -> str:
    """The name of leaf ``x``'s dtype; ``TypeError`` for any but float32, float16 and bfloat16."""
    dt = np.dtype(x.dtype)
    if dt not in DTYPES:
        raise TypeError(f"TrainStream offload_adamw supports float32, float16 and bfloat16 parameters; "
                        f"leaf {path} has dtype {dt}")
    return DTYPES[dt]


def family(cfg: Config, dtype: str, path: str) -> Family:
    """The state of a leaf of ``dtype`` as optax keeps it: mu in ``mu_dtype`` (default the leaf's), nu in the leaf's
    dtype; with ``master_weights`` an fp16/bf16 leaf's fp32 master and float32 moments."""
    if dtype != "float32" and cfg.master_weights:
        if cfg.mu_dtype not in (None, "float32"):
            raise NotImplementedError(f"TrainStream offload_adamw: master_weights=True keeps mu in float32 (the fp32 "
                                      f"master's lines), not mu_dtype={cfg.mu_dtype} (leaf {path})")
        return Family("float32", "float32", True)
    mu = cfg.mu_dtype or dtype
    allowed = ("float32", "bfloat16") if dtype == "float32" else (dtype, "float32")
    if mu not in allowed:
        raise NotImplementedError(f"TrainStream offload_adamw: mu_dtype={mu} on the {dtype} leaf {path}: the host "
                                  f"kernels reproduce optax's lines for mu in {' or '.join(allowed)} there")
    return Family(mu, dtype, False)


def check_array_hyper(cfg: Config, kinds, fams, paths) -> None:
    """Array hyper-parameters (``optax.inject_hyperparams``' or a user's ``jnp`` scalars) with a float16/bfloat16 leaf
    whose state is in its dtype: refused. optax's lines there are the array's dtype's (``inject_hyperparams`` casts to
    the tree's highest float dtype; a float32 array promotes the leaf's update to float32), not the leaf's, and no
    lines are built for them (the fuzzer measured up to a sign flip of the update)."""
    arrays = [k for k in ("learning_rate", "b1", "b2", "eps", "eps_root", "weight_decay")
              if not (_is_number(getattr(cfg, k)) or callable(getattr(cfg, k)))]
    half = [p for kind, f, p in zip(kinds, fams, paths) if kind != "float32" and not f.master]
    if arrays and half:
        raise NotImplementedError(
            f"TrainStream offload_adamw: {', '.join(arrays)} given as arrays (optax.inject_hyperparams, jnp scalars) "
            f"with the {kinds[paths.index(half[0])]} leaf {half[0]} and its state in its dtype: optax computes that "
            "leaf in the arrays' dtype, lines not built. Pass Python floats (a schedule for the learning rate), or "
            "master_weights=True, or float32 parameters")


def cuda_codes(cfg: Config, kinds, fams, paths, numels) -> list[int]:
    """Each leaf's optax/cuda code (:func:`trainstream.contract.optax_cuda_code`: XLA:GPU's lines for its dtype,
    state, element count (``numels``: the whole leaf's) and ``optax.adamw``'s arguments); both modes run them
    (``mode="cpu"`` in IEEE arithmetic). ``NotImplementedError`` naming the leaf where those lines are not derived."""
    codes = []
    for kind, f, path, numel in zip(kinds, fams, paths, numels):
        own = kind != "float32" and not f.master  # the update adds eps in the leaf's dtype
        eps_zero = _is_number(cfg.eps) and float(C.round_to(np.float32(cfg.eps), kind if own else "float32")) == 0
        eps_root = not (_is_number(cfg.eps_root) and cfg.eps_root == 0.0)  # (an array: maybe not)
        # XLA factors (1-b)*x + b*y into (x+y)*b where both constants round alike (b near 0.5): not derived for
        # 16-bit state (the optax/cpu lines' OX_B1_HALF, OX_B2_HALF)
        b_half = own and any(_is_number(b) and float(C.round_to(np.float32(1 - b), kind)) ==
                             float(C.round_to(np.float32(b), kind)) for b in (cfg.b1, cfg.b2))
        try:
            code = C.optax_cuda_code(kind, f.mu, f.nu, f.master, nesterov=bool(cfg.nesterov), eps_zero=eps_zero,
                                     eps_root=eps_root, clip=cfg.max_grad_norm is not None, numel=int(numel),
                                     b_half=b_half)
        except NotImplementedError as exc:
            raise NotImplementedError(f"TrainStream offload_adamw on a GPU, leaf {path} ({kind}): {exc}") from None
        codes.append(code)
    return codes


_warned = [False]


def warn_cpu_mode_on_gpu() -> None:
    """Once per process: ``mode="cpu"`` on a GPU is not bit-identical to ``optax.adamw`` jitted there (the contract's
    bound, :data:`trainstream.contract.OPTAX_CUDA_HOST_MAX_ULP`)."""
    if not _warned[0]:
        _warned[0] = True
        warnings.warn("TrainStream offload_adamw(mode='cpu') on a GPU is not bit-identical to optax.adamw jitted on the "
                      "GPU: the host computes XLA:GPU's lines in IEEE arithmetic where XLA:GPU approximates the square "
                      f"root and division; the moments stay within {C.OPTAX_CUDA_HOST_MAX_ULP} ULP per step, the "
                      "weights differ where Adam's first moment nearly cancels. mode='gpu' is bit-identical",
                      RuntimeWarning, stacklevel=4)


def static_arg(name: str, x, default, positive: bool = True):
    """An argument that changes no bit: an int checked here, or ``host_margin`` (checked by ``_budget.plan``).
    optax.inject_hyperparams passes every number as an array too (a tracer in the update): a traced one falls back
    to its default (name it in static_args to keep another)."""
    if isinstance(x, jax.core.Tracer):
        x = default
    elif hasattr(x, "dtype") and np.ndim(x) == 0:
        x = x.item()
    if name == "host_margin" or (x is None and default is None):  # threads None: decided at the first update
        return x
    if isinstance(x, bool) or not isinstance(x, int) or (positive and x < 1):
        what = "a positive int" if positive else "an int"
        raise ValueError(f"{name} must be {what}{' or None' if default is None else ''}, got {x!r}")
    return x


def mu_dtype_name(mu_dtype) -> str | None:
    """``mu_dtype`` as optax canonicalises it (None: the leaf's), by name; float64 and complex refused."""
    if mu_dtype is None:
        return None
    try:
        dt = np.dtype(jax.dtypes.canonicalize_dtype(mu_dtype))
    except TypeError as exc:
        raise TypeError(f"TrainStream offload_adamw: mu_dtype {mu_dtype!r} is not a dtype: {exc}") from None
    if dt not in DTYPES:
        raise NotImplementedError(f"TrainStream offload_adamw: mu_dtype={dt}: the host kernels keep state in float32, "
                                  "float16 or bfloat16 only")
    return DTYPES[dt]

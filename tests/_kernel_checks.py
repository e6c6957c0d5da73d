"""Shared helpers of the host kernels' tests (bit-for-bit comparisons, fp16/bf16 bits as torch rounds them,
gradients over many magnitudes, uneven chunks): imported by test_host_kernels and test_host_kernels_codes (a helper
module, not collected by pytest)."""

import numpy as np

from trainstream import contract as C
from trainstream import _host_kernels as K

try:
    import torch
except ImportError:  # the kernels do not need torch; only some comparisons use it
    torch = None

HP_A = C.AdamWHyperParams(1e-3, 0.9, 0.999, 1e-8, 0.01)
HP_B = C.AdamWHyperParams(3e-2, 0.3, 0.95, 1e-6, 0.1)  # lerp weight >= 0.5


def assert_bits_equal(got, want, what=""):
    """Same bits, element for element; NaN matches NaN (any payload)."""
    got = np.asarray(got)
    want = np.asarray(want)
    assert got.shape == want.shape, what
    if got.dtype == np.uint16:  # half-precision bit patterns of `kind` given by caller
        np.testing.assert_array_equal(got, want, err_msg=what)
        return
    gn, wn = np.isnan(got), np.isnan(want)
    np.testing.assert_array_equal(gn, wn, err_msg=f"{what}: NaN positions")
    bad = (got.view(np.uint32) != want.view(np.uint32)) & ~gn
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise AssertionError(f"{what}: {bad.sum()} elements differ, first at {i}: {got[i]!r} != {want[i]!r}")



def half_to_f32(bits, kind):
    bits = np.asarray(bits, np.uint16)
    if kind == K.KIND_F16:
        return bits.view(np.float16).astype(np.float32)
    return C.bf16_bits_to_f32(bits)


def round_bits_torch(x, kind):
    """float32 -> uint16 bits of ``kind`` as torch rounds (numpy where torch is absent)."""
    x = np.ascontiguousarray(x, np.float32)
    if torch is not None:
        dt = torch.float16 if kind == K.KIND_F16 else torch.bfloat16
        return torch.from_numpy(x).to(dt).view(torch.int16).numpy().view(np.uint16)
    if kind == K.KIND_F16:
        with np.errstate(over="ignore"):
            return x.astype(np.float16).view(np.uint16)
    return C.f32_to_bf16_bits(x)


def make_grad(rng, n, kind, t=0):
    """A gradient as the kernel reads it (float32 or uint16 bits) and its exact fp32 upcast."""
    scale = np.float32(10.0 ** rng.uniform(-4, 1))
    g = (rng.standard_normal(n) * scale).astype(np.float32)
    # a spread of magnitudes (fp16 subnormals included) and exact zeros
    g *= (10.0 ** rng.integers(-6, 2, n)).astype(np.float32)
    g[rng.random(n) < 0.01] = 0.0
    if kind == K.KIND_F32:
        return g, g
    bits = round_bits_torch(g, kind)
    return bits, half_to_f32(bits, kind)


def uneven_chunks(rng, n, pieces=7):
    cuts = np.unique(np.concatenate([[0, n], rng.integers(0, n + 1, pieces)]))
    return list(zip(cuts[:-1].tolist(), cuts[1:].tolist()))


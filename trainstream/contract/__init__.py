"""The AdamW arithmetic contract, defined once.

Every kernel (Numba host kernels, the CUDA kernels of the top-level ``kernels/``) implements the
per-element arithmetic written here. ``_reference.py`` and ``_torch_reference.py`` are its executable form in
NumPy, which the tests hold to every kernel and to the real references; ``_scalars.py`` lays out the per-step
scalar vector (one index per meaning) and forms optax's, ``_torch.py`` names a torch slot's recipe
(:class:`TorchRecipe`) and forms its scalars as torch does. Import every name from this package
(``from trainstream import contract as C``), not from those modules.

====================  =====================================================================
``p``                 the weights as updated: the fp32 master, or the parameter's own values
``m``, ``v``, ``vmax``  ``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq`` (their state dtype's values)
``g``                 gradient, upcast to fp32 exactly (fp16/bf16 -> fp32 is exact), or an fp32 sum
``c``                 the gradient's multiplier (clip coefficient, ``GradScaler``'s inverse scale; 1)
``lr``                ``lr`` / ``learning_rate`` (a Tensor ``lr``: its float32 value)
``b1``, ``b2``        ``betas`` / ``b1``, ``b2``
``eps``, ``wd``       ``eps``, ``weight_decay``
``t``                 the step number after increment (1 on the first update)
``f(x)``              ``x`` rounded to the nearest float32 (a host scalar)
``RN(x)``             one float32 operation's rounding (written where the order matters)
``r(x)``              a float32 value rounded to the *math dtype* (RN-even; identity for float32)
``R(x)``              a host scalar cast to the math dtype, ``r(f(x))`` (exact in float32)
``fma(a, b, c)``      ``a*b + c`` rounded once (the FMA instruction)
====================  =====================================================================

All element operations are float32, round-to-nearest-even; ``a*b + c`` without ``fma`` is
two roundings, never contracted (no fast-math; CUDA code uses ``__fmul_rn``/``__fadd_rn``).
Per-step scalars are computed once on the host in float64 (Python floats) as the reference
computes them, rounded to float32 where it rounds them (optax: but for the inputs only XLA
reproduces), and reach a kernel as a float32 vector indexed by the ``S_*`` constants.

Conventions
-----------
``torch`` reproduces ``torch.optim.AdamW`` and ``torch.optim.Adam`` (torch 2.13 on the CPU, measured bit for bit;
CUDA as noted per line), one :class:`TorchRecipe` per slot: ``impl`` (``single``, ``foreach``, ``fused``, resolved
as torch resolves it), ``platform`` (the parameters' device: whose arithmetic), ``dtype``, ``master``, ``amsgrad``,
``maximize``, ``decoupled`` (AdamW's decay; False: Adam's L2), ``lr_tensor``. The state has :func:`state_dtype`:
the parameter's dtype, as torch keeps it (``zeros_like(param)``), or float32 with ``master`` (``master_weights=True``,
TrainStream 0.1.1's scheme: the recipe's float32 lines applied to an fp32 master, the weights ``r(p)`` in the
parameter's dtype; its reference is torch's optimizer on fp32 master copies). The *math dtype* that ``r`` rounds to
is the state dtype. :func:`torch_scalars` forms every scalar below (``S_*`` in brackets) as torch forms it, from
Python floats: ``bc1 = 1 - b1**t``, ``bc2 = 1 - b2**t`` (C ``pow``; ``t`` stops at ``2**24``, torch's float32 step).

The gradient, every recipe: ``g = r_g(g * c)`` (``r_g``: to the gradient's dtype; ``c`` stands for torch's
in-place multiplications of ``param.grad`` before ``step()``: ``clip_grad_norm_``'s by the coefficient cast to the
gradient's dtype, ``GradScaler.unscale_``'s by the float32 inverse scale) [``S_CLIP``]; ``maximize``: ``g = -g``,
folded in as ``-c`` (exact; NaN's own bits are not part of the contract: a NaN stays a NaN, its sign and payload are
the compiler's choice of operand). Fused kernels under ``GradScaler``: ``g = RN(g / f(scale))`` in float, unrounded
[``S_GRAD_DIV``; 1: none] (``found_inf``: no update and no step, the adapter's). Adam's L2 (``decoupled`` False,
``wd != 0``) adds ``p * alpha`` [``S_L2``, 0 for AdamW]; AdamW multiplies by ``decay`` [``S_DECAY``, 1 for Adam].

* ``cpu`` single/foreach (ATen's per-tensor ops; CPU foreach falls back to them): **every op rounds** to the math
  dtype (for float32, ``r`` is the identity and these are TrainStream's long-standing torch/cpu lines)::

      g  = r(fma(p, alpha, g))                    # grad.add(param, alpha=wd); alpha = f(wd), R(wd) for fp16/bf16
         = r(g + r(alpha * p))                    #   fp16/bf16 elements of a scalar tail (below)
      p1 = r(p * decay)                           # param.mul_(1 - lr*wd): f(1-lr*wd), R(.) for fp16/bf16 foreach
      m  = r(fma(w, g - m, m))                    # exp_avg.lerp_(g, w), w = f(1-b1) < 0.5    [S_OMB1, S_LERP_SMALL]
         = r(fma(w - 1, g - m, g))                #   ... w >= 0.5
      v  = r(fma(RN(f(1-b2) * g), g, r(v * B2)))  # mul_(b2).addcmul_(g, g, 1-b2); B2 = f(b2), R(b2) fp16/bf16 foreach
      vmax = max(vmax, v)                         # torch.maximum: NaN propagates; s = vmax with amsgrad, else v
      d  = RN(msqrt(s) / f(sqrt(bc2))) + E        # float32: MKL's root (below), true division   [S_SQRT_BC2, S_EPS]
         = r(r(r(sqrt(s)) / f(sqrt(bc2))) + E)    # fp16/bf16: IEEE root; E = f(eps), R(eps) for fp16/bf16
      p  = r(p1 + RN(RN(f(-lr/bc1) * m) / d))     # param.addcdiv_(m, d, -lr/bc1)                 [S_NEG_STEP]

  ``lr_tensor`` (a 0-dim float32 CPU tensor, single only): ``decay = f(1 - f(f(lr)*f(wd)))``,
  ``-f(f(lr)/f(bc1))``: tensor arithmetic in float32.

* ``cpu`` fused (ATen's ``FusedAdamKernel``): the same arithmetic in float on **unrounded** values, each state
  rounded **once**, at the store: ``r`` is the identity in these lines, the stores are ``r(p), r(m), r(v),
  r(vmax)``; the root is IEEE; every scalar ``f(.)`` from double (``sqrt(bc2)`` by ``std::sqrt``; a Tensor
  ``lr`` is ``f(lr)``)::

      g  = fma(p, f(wd), g)   p1 = RN(p * f(1-lr*wd))   m = lerp as above
      v  = fma(RN(f(1-b2) * g), g, RN(v * f(b2)))      # vector loop
         = fma(v, f(b2), RN(RN(f(1-b2) * g) * g))      # scalar tail: the last numel % lanes elements
      vmax = max(vmax, v) (vector: NaN propagates)  |  (vmax < v) ? v : vmax (tail)
      d  = RN(RN(sqrt(s) / f(sqrt(bc2))) + f(eps))      p = RN(p1 + RN(RN(f(-lr/bc1) * m) / d))

* ``cuda`` foreach (CUDA's default; verified on the H100, torch 2.11): per-op rounding, every scalar ``f(.)``
  (never ``R``), nvcc's contractions, IEEE root::

      g  = r(fma(f(wd), p, g))     p1 = r(p * f(1-lr*wd))     m = r(fma-lerp as above)
      v  = r(fma(f(1-b2), RN(g * g), r(v * f(b2))))          vmax = max(vmax, v) (NaN propagates)
      d  = r(r(r(sqrt(s)) / f(sqrt(bc2))) + f(eps))
      p  = r(fma(f(-lr/bc1), RN(m / d), p1))

* ``cuda`` single (``foreach=False``; CUDA's default for a Tensor ``lr``): as foreach but the division by the CPU
  scalar is a multiply by its reciprocal, computed in double (verified on the H100 for float32, where it differs
  from ``RN(1/f(.))``), ``d = r(r(r(sqrt(s)) * f(1/sqrt(bc2))) + f(eps))`` [``S_INV_SQRT_BC2``]; a Tensor ``lr`` on
  the CPU as on ``cpu``. (A Tensor ``lr`` on the CUDA device: not reproduced.)

* ``cuda`` fused (2.13's ``FusedAdamMathFunctor``, opmath float; verified on the H100 with torch 2.11):
  ``LR, B1, B2, WD, EPS = f(.)``,
  ``bc1 = RN(1 - powf(B1, t))``, ``bc2 = RN(1 - powf(B2, t))`` with CUDA's ``powf`` (the host cannot reproduce it:
  the caller passes both from the device to :func:`torch_scalars`), each state rounded once at the store::

      g  = fma(p, WD, g)                          # Adam L2 (see below)                       [S_L2]
      p1 = fma(-RN(LR * WD), p, p)                # AdamW: param -= lr*wd*param                [S_NEG_LR_WD]
      m  = fma(B1, m, fma(-B1, g, g))             # std::fma, no lerp                          [S_BETA1]
      v  = fma(B2, v, fma(-B2, RN(g*g), RN(g*g))) vmax = (vmax < v) ? v : vmax
      d  = RN(RN(sqrt(s) / sqrtf(bc2)) + EPS)     p = RN(p1 + RN(RN(-RN(LR/bc1) * m) / d))

  Adam's L2 line is ``RN(g + RN(p*WD))`` instead where nvcc did not contract it (SASS of torch 2.11's kernel):
  every element with ``maximize``, and without ``maximize`` the first of each 4-element group of torch's unrolled
  loop, a position that depends on the tensors' alignment on the GPU; never with amsgrad or a GradScaler. The host
  reproduces the ``maximize`` case and refuses the positional one (the device kernels reproduce both:
  ``kernels/adamw_torch.cu``).

CPU: the ISA-dependent pieces. ATen's ``DEFAULT`` level (no AVX2, or ``ATEN_CPU_CAPABILITY=default``;
:data:`TC_NO_FMA`) has no FMA: every ``fma`` of the CPU lines is two roundings, ``RN(RN(a*b) + c)`` (the CUDA lines
keep theirs). ``msqrt`` is ``Tensor.sqrt()`` of float32 state, *not* IEEE ``sqrt``: MKL's ``vsSqrt``, whose path
depends on the CPU (vendor, vector width) and on ``MKL_ENABLE_INSTRUCTIONS`` (AMD EPYC kept the SSE path at every
setting), not on ATen's level; :mod:`trainstream._cpu_sqrt` reproduces the three paths (its modes). fp16/bf16
state and the fused kernel take IEEE roots. The scalar tails (:func:`torch_cpu_tails`; vectors of 32 bytes, 64 at
AVX-512, :data:`TC_VEC512`): fused, the last ``numel % (vector bytes / itemsize of the math dtype)`` elements of the
tensor; single/foreach fp16/bf16 Adam-L2, each thread chunk's last ``len % (vector bytes)`` elements, the chunks
those of ``at::parallel_for``: one ``[0, n)`` below 32768 elements or with one thread, else
``min(torch.get_num_threads(), ceil(n/32768))`` chunks of ``ceil(n/k)``: these bits depend on the thread count at
step time (every element takes the tail form at DEFAULT). The torch/cpu *code*, the mode (bits 0-1)
``| TC_NO_FMA | TC_VEC512``, is probed once per process from ``torch.sqrt``, ``Tensor.lerp_`` and a bf16
``Tensor.add(alpha=)`` (:func:`trainstream.backends.torch.torch_cpu_code`). Where no mode Numba's target can compile
reproduces torch's root (e.g. MKL's AVX-512 path, Numba forced below AVX-512), the correctly rounded one is used with
a warning (:data:`TORCH_CPU_SQRT_MAX_ULP`). aarch64 (read from ATen's ``vml.h`` and ``vec128``, not yet run): no MKL;
NEON ``vsqrtq_f32`` (correctly rounded), a ``vfmaq_f32`` lerp: probed ``IEEE``, fused.

Numerical hazards (torch's own, reproduced): ``R(1e-8) == 0`` in fp16, so fp16 single/foreach with the default
``eps`` divides ``0/0 = NaN`` where every gradient of an element was zero (torch's fp16 test inputs set
``eps=0.1``); the fp16/bf16 per-op roundings lose small updates (``p1 = r(p * decay) == p`` for bf16 and
``lr*wd < 2**-9``); Inf/NaN gradients propagate to the state and weights (no guard); ``std::max`` in the fused tails
keeps ``vmax`` where ``v`` is NaN.

``optax`` reproduces ``optax.adamw`` (optionally ``optax.chain(optax.clip_by_global_norm(M),
optax.adamw(...))`` and ``mask=``) as ``jax.jit`` compiles it, update and ``apply_updates`` in
one program. The per-step inputs are XLA's: the JAX adapter computes them in the jitted step
with optax's own jnp expressions (:func:`optax_scalar_matrix`) and passes the float32 results:

* ``t = safe_increment(count)`` (int32), ``d1 = 1 - b1**t``, ``d2 = 1 - b2**t`` in float32
  (XLA:CPU calls glibc ``powf``, which is not correctly rounded: a NumPy or float64 power
  differs in the last bit for thousands of ``t``);
* ``lr``: the constant ``f(lr)``, or ``schedule(t - 1)`` evaluated by XLA in float32 (XLA's
  constant folding changes a schedule's arithmetic; only XLA reproduces XLA);
* the global norm ``n`` of ``optax.tree.norm(grads)`` (XLA's reduction order, which on
  XLA:CPU depends on leaf sizes, and for large leaves on the thread count).

platform ``cpu`` (XLA:CPU, jax/jaxlib 0.10.2, optax 0.2.8, x86-64 with FMA3, glibc libm; read
from the optimized HLO and machine code, verified bit for bit). XLA:CPU runs with FTZ and DAZ:
every operand below is read, and every result (``RN``, ``fma``) flushed, with denormals as
signed zeros. LLVM contracts ``a*b + c`` into FMAs; the pairing it picks is part of the contract::

      B1, B2, C1, C2 = f(b1), f(b2), f(1-b1), f(1-b2)   # 1-b in float64, rounded once
      g  = RN(RN(g / s[S_CLIP_DIV]) * s[S_CLIP])            # OX_CLIP: IEEE division, multiply
      g  = RN(g * s[S_CLIP])                                # without OX_CLIP
      m  = fma(C1, g, RN(B1*m))                             # default pairing
      m  = fma(B1, m, RN(C1*g))                             # OX_MU_SWAP
      gg = RN(g*g)
      v  = fma(C2, gg, RN(B2*v))                            # default pairing
      v  = fma(B2, v, RN(C2*gg))                            # OX_NU_SWAP
      q  = RN(m / RN(d1 * RN(sqrt(RN(v/d2)) + f(eps))))     # form D (default)
      q  = RN(RN(m*r1) / RN(sqrt(RN(v*r2)) + f(eps)))       # OX_FORM_R, r = RN(1/d)
      u  = fma(f(wd), p, q)        (u = q when wd == 0 or the leaf is masked out)
      p  = fma(f(-lr), u, p)       # scale_by_learning_rate and apply_updates: one rounding

  The pairing and form depend on the program, not the values: a leaf's *code* (bits :data:`OX_FORM_R`,
  :data:`OX_NU_SWAP`, :data:`OX_MU_SWAP`, :data:`OX_CLIP`) is :func:`optax_cpu_code`'s. Form R (leaves with a
  float32 mu: these lines, and ``mu_dtype=float32`` on fp16/bf16 leaves below): only in a pytree of one leaf of
  more than one element (XLA's ``A / broadcast(B) -> A * (1/B)`` rewrite fires only
  when ``1 - b**t`` has one use), but in x64 mode for every leaf of more than one element
  (``jax_enable_x64``: ``1 - b**t`` is a float64 power cast to float32 per leaf). With
  ``clip_by_global_norm`` in the chain LLVM swaps the ``v`` pairing of every leaf, and the ``m`` pairing
  of one-element leaves too (except in a multi-leaf tree with ``M == 1``). With ``b2`` an array (an argument of the
  program: ``optax.inject_hyperparams``' state) it swaps the ``v`` pairing of one-element leaves of rank >= 1 (its
  vector ``(1-b2) * g*g`` beside a scalar ``b2 * v``), not of rank-0 leaves, nor with ``b1``, ``lr``, ``eps`` or
  ``weight_decay`` arrays alone. Clipping's ``(S_CLIP_DIV,
  S_CLIP)`` is ``(n, f(M))``, or ``(1, 1)`` when ``n < f(M)`` (as without clipping; both exact on ``g``);
  ``RN(g / n)`` is a true division (a multiply by ``1/n`` differs for 60% of elements), ``* M`` a second
  rounding (exact, and removed by XLA, when ``M == 1``).

  *Fused gradients* (a limit of any optimizer outside XLA): these pairings hold for a gradient
  that reaches the moment-update fusion materialised: always when ``update`` is jitted apart,
  and in a step jitted whole for gradients of matmuls and multi-element reductions. XLA:CPU
  may instead recompute a gradient's element-wise producer inside each moment loop
  (``clip_by_global_norm``'s select, ``MultiSteps``' running mean, ``lax.pmean``'s ``* 0.5``
  folded into the moment's constants, a gradient element-wise in the parameters, a full
  reduction for a ``(1,)`` leaf); the values are the same, but LLVM then contracts the other
  product: :data:`OX_NU_SWAP`, :data:`OX_MU_SWAP` or both, per leaf, depending on the pattern,
  the leaf's size and the constants XLA folds. A buffer does not tell: the JAX adapter reads
  the pairing from XLA when the step is traced (``trainstream.jax._detect``: the gradient's
  producer graph compiled feeding optax's update, each leaf given the bits that reproduce it
  bit for bit). Bound where no pairing reproduces XLA's program (XLA folds a gradient's
  constant into the moment line, e.g. ``sum(x ** 3)``'s ``3 * x ** 2``; x64 mode's float64
  gradients cast in the update's program): the per-step distance the probe measured, warned
  once (1-3 ULP of ``update_ulps`` seen, up to 10 under ``MultiSteps``: the bound stated
  where it is not measured); it compounds over steps. Per family: the pairing read held bit for
  bit for the float32 lines (``eps > 0``, ``eps_root``, clip) and for fp16/bf16 state
  (:data:`OX_HALF`, with :data:`OX_MU_F32` or :data:`OX_NESTEROV` too; without :data:`OX_MU_F32`
  its lines have no FMA and no pairing bit). With :data:`OX_NESTEROV`, :data:`OX_RSQRT` or
  :data:`OX_MU_BF16` in the float32 lines, and :data:`OX_B1_HALF`/:data:`OX_B2_HALF`, a fused
  gradient changes more than the moments' pairing: the closest pairing, warned once with the
  10 ULP bound. fp32-master leaves keep the default pairing: their reference is optax on the
  float32 master fed the upcast gradients materialised (an upcast fused into it pairs otherwise).

  A custom call hands ``u`` back to the program, where ``scale_by_learning_rate`` and
  ``apply_updates`` fuse into the same ``fma(f(-lr), u, p)``. ``apply_updates`` jitted *apart*
  from ``update`` rounds ``RN(-lr*u)`` before ``p + that``: not a convention here.

  *Without FMA* (XLA:CPU targeting an ISA without FMA3: ``--xla_cpu_max_isa=SSE4_2`` or ``AVX``,
  or such a host; :data:`OX_NO_FMA`): every ``fma(a, b, c)`` above is ``RN(RN(a*b) + c)`` (each
  result flushed), whatever the pairing bits. Verified bit for bit at ``SSE4_2`` and ``AVX``
  (3- and 7-leaf MLPs, a single leaf, with and without clipping); at ``AVX2`` and ``AVX512`` the
  fused lines hold. The adapter probes XLA:CPU with one jitted ``a*b + c`` (``powf`` and the bias
  corrections did not change).

  *Every argument and dtype of optax.adam/adamw* (:func:`optax_family`, the lines one for one in
  :func:`optax_reference_update`, NumPy): ``eps_root`` (``vh = RN(RN(v/d2) + eps_root)``; float32 lines in form R:
  ``fma(v, r2, eps_root)``, LLVM's contraction), ``nesterov`` (:data:`OX_NESTEROV`, ``d1n = 1 - b1**(t+1)`` in
  :data:`S_BC1_NEXT`), ``eps`` that is 0 in the math dtype
  (:data:`OX_RSQRT`: XLA's ``q = RN(mh * rsqrt(v))``, this CPU's ``rsqrtss`` estimate and one Newton step, or
  with :data:`OX_RSQRT_DIV` ``1/sqrt``; with weight decay ``u = fma(mh, rsqrt(v), RN(wd * p))``, but ``fma(wd, p,
  q)`` as above with :data:`OX_MU_BF16` and in form D with ``b1 == b2 == 0.5`` (:func:`optax_rsqrt_decay_last`);
  in those two in form D a program that outputs the update array as well as the new weights pairs the other way:
  :func:`optax_rsqrt_decay_varies`, warned by the JAX adapter), ``b == 0.5`` in the dtype (:data:`OX_B1_HALF`,
  :data:`OX_B2_HALF`: XLA factors ``(g + m) * b``; with nesterov in the float32 lines also ``num = RN((mn + gn) *
  b1)``, in form R the sum ``fma(g, r1, mn)``), nesterov's ``b1 * mn + (1-b1) * gn`` otherwise ``fma(b1, mn,
  RN((1-b1) * gn))``, but ``fma(1-b1, gn, RN(b1 * mn))`` with :data:`OX_NUM_SWAP` (:func:`optax_cpu_code`: with
  :data:`OX_MU_BF16`, and with :data:`OX_B2_HALF` on leaves of more than one element),
  ``mu_dtype=bfloat16`` on float32 leaves (:data:`OX_MU_BF16`: mu computed unrounded, stored
  rounded); fp16/bf16 leaves keep optax's fp16/bf16 state (:data:`OX_HALF`: every operation rounded to the dtype,
  no FMA, the corrections' reciprocals in float32 for bf16 and in half for fp16, divisions on one-element leaves,
  :data:`OX_HALF_DIV`; fp16 with ``b == 0.5`` recomputes ``m`` and ``v`` in the update's loop), or with
  ``mu_dtype=float32`` (:data:`OX_MU_F32`) a float32 mu, whose divisions by the float32 ``d1`` (nesterov: ``d1n``)
  take :data:`OX_FORM_R` where the float32 lines do (``RN(RN(m * RN(1/d1)) / den)``, else ``RN(m / RN(d1 * den))``;
  nu's ``v / d2`` is a multiply by the reciprocal in both forms, as for fp16/bf16 state, but with
  :data:`OX_HALF_DIV`). Each constant is optax's in its dtype (weak-typed Python floats rounded to the array's
  dtype; :func:`optax_scalar_matrix`). Not covered (no lines): clipping of fp16/bf16 state, ``mu_dtype=bfloat16`` on
  fp16 leaves, ``eps == 0`` on bf16 leaves with ``mu_dtype=float32`` (refused), ``b == 0.5`` on one-element
  fp16/bf16 leaves, nesterov with ``OX_RSQRT`` on float32 leaves.

platform ``cuda`` (XLA:GPU, measured on the H200; no FMA contraction was seen there)::

      g  = g * c                                   # c: the clip coefficient, S_CLIP
      g  = (g / n) * M                             # instead, with OX_CLIP (clip_by_global_norm)
      m  = f(1-b1) * g + f(b1) * m                 # two roundings each, no FMA
      v  = f(1-b2) * (g * g) + f(b2) * v
      u  = m / (d1 * (sqrt(v / d2) + f(eps)))      # XLA folds (m/d1)/(...) into one divide
      u  = u + f(wd) * p                           # add_decayed_weights
      p  = p + u * f(-lr)                          # scale_by_learning_rate, apply_updates

  ``sqrt`` is the approximate ``sqrt.approx.f32`` (division ``div.full.f32``), which a host
  cannot reproduce: the host kernels use IEEE operations (:data:`OPTAX_CUDA_MAX_ULP`). The
  device kernel runs XLA:GPU's instructions and matched jitted ``optax.adamw`` on the H200 bit
  for bit per step (warmup-cosine schedule, decay mask, five leaves, fp32 and bf16 with an fp32
  master, with and without clipping; tests/test_jax_gpu.py). ``d1``, ``d2``, ``-lr``
  (``__nv_powf``/``__nv_cosf``) and the norm come from the user's program: with clipping the
  weights equal optax's when both programs compute the same norm. XLA:GPU keeps denormals (no
  FTZ unless ``xla_gpu_ftz``) and never rewrites to reciprocals (form D). fp16/bf16 state,
  ``mu_dtype``, ``nesterov``, ``eps_root`` and ``eps == 0`` have lines of their own, named by
  :func:`optax_cuda_code` (the rows' corrections float32: ``optax_scalar_matrix(..., platform="cuda")``)
  and written out in :mod:`trainstream.contract._optax_cuda` (:func:`optax_cuda_reference_update`).

Numerical hazards (every convention): ``1 - lr*wd`` and ``-lr/bc1`` are rounded to float32 once (not per element);
``d`` is never zero for ``eps > 0``, but an Inf/NaN gradient propagates to ``m``, ``v`` and ``p``
exactly as in the references (no guard); ``bc2`` underflows (``b2`` very close to 1, tiny ``t``)
only below float64 precision, far from any practical setting.
"""

from ._optax_cuda import OX_CUDA_BITS, OX_CUDA_LINES, optax_cuda_code, optax_cuda_reference_update
from ._optax_reference import optax_reference_update, round_xla, xla_rsqrt
from ._reference import (OPTAX_CUDA_HOST_MAX_ULP, OPTAX_CUDA_MAX_ULP, TORCH_CPU_SQRT_MAX_ULP, bf16_bits_to_f32,
                         f32_to_bf16_bits, fma_f32, ftz, master_of_weights, merge_master, reference_update, round_to,
                         update_ulps)
from ._scalars import (CONVENTIONS, ITEMSIZE, N_SCALARS, OX_B1_HALF, OX_B2_HALF, OX_CLIP, OX_CODES, OX_FORM_R, OX_HALF,
                       OX_HALF_DIV,
                       OX_MU_BF16, OX_MU_F32, OX_MU_SWAP, OX_NESTEROV, OX_NO_FMA, OX_NU_SWAP, OX_NUM_SWAP, OX_RSQRT,
                       OX_RSQRT_DIV,
                       PLATFORMS, S_BC1, S_BC1_NEXT, S_BC2_OPTAX, S_BETA1, S_BETA1_MU, S_BETA2, S_CLIP, S_CLIP_DIV,
                       S_DECAY, S_EPS, S_EPS_ROOT, S_GRAD_DIV, S_INV_SQRT_BC2, S_L2, S_LERP_SMALL, S_NEG_LR,
                       S_NEG_LR_WD, S_NEG_STEP, S_OMB1, S_OMB2, S_OX_CODE, S_SQRT_BC2, S_STEP, S_WD, TC_CODES, TC_NO_FMA,
                       TC_VEC512, VARIANT_OPTAX_CPU, VARIANT_OPTAX_CUDA, VARIANT_TORCH_CPU, VARIANT_TORCH_CUDA,
                       AdamWHyperParams, OptaxStepScalars, clip_coefficient, optax_bias_corrections,
                       optax_clip_scalars, optax_code_valid, optax_cpu_code, optax_family, optax_rsqrt_decay_last,
                       optax_rsqrt_decay_varies, optax_scalar_matrix,
                       optax_step_scalars, step_scalars, torch_step_scalars, validate_hyperparams, variant_id)
from ._torch import (FAMILIES, IMPLS, TORCH_MAX_STEP, TorchRecipe, check_recipe, default_recipe, math_dtype,
                     resolve_impl, state_dtype, tail_mask, tails_follow_threads, torch_cpu_tails, torch_family,
                     torch_scalars)
from ._torch_reference import torch_reference_update

__all__ = [
    "CONVENTIONS", "PLATFORMS", "ITEMSIZE", "AdamWHyperParams", "validate_hyperparams", "variant_id",
    "torch_step_scalars", "optax_bias_corrections", "optax_clip_scalars", "optax_cpu_code", "optax_step_scalars",
    "optax_scalar_matrix", "OptaxStepScalars", "optax_code_valid", "optax_family", "optax_reference_update",
    "optax_rsqrt_decay_last", "optax_rsqrt_decay_varies", "OX_CUDA_BITS", "OX_CUDA_LINES", "optax_cuda_code",
    "optax_cuda_reference_update",
    "xla_rsqrt", "round_xla", "master_of_weights", "step_scalars", "clip_coefficient", "merge_master",
    "fma_f32", "ftz", "f32_to_bf16_bits", "bf16_bits_to_f32", "round_to", "reference_update",
    "TorchRecipe", "IMPLS", "FAMILIES", "TORCH_MAX_STEP", "check_recipe", "default_recipe", "resolve_impl",
    "state_dtype", "math_dtype", "torch_family", "torch_scalars", "torch_cpu_tails", "tail_mask",
    "tails_follow_threads",
    "torch_reference_update",
]

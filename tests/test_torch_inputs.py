"""torch's own test inputs for Adam and AdamW (``torch.testing._internal.common_optimizers``, as the installed
torch has them) run against OffloadAdam / OffloadAdamW on the CPU: every configuration bit-identical to torch's
optimizer with the same arguments over several steps, or refused with ``NotImplementedError`` naming why
(reported as a skip whose reason is that message: ``pytest -rs`` lists them); every error input raising torch's
exception type and message (a warning: torch's warning)."""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("expecttest")  # common_optimizers imports it (the `test` extra installs it)
from torch.testing._internal import common_optimizers as co  # noqa: E402

from trainstream.torch import OffloadAdam, OffloadAdamW  # noqa: E402

INFO = {o.optim_cls.__name__: o for o in co.optim_db}
OURS = {"Adam": OffloadAdam, "AdamW": OffloadAdamW}
STEPS = 6


def _configs():
    """(torch class name, dtype, description, kwargs): torch's CPU inputs with its global flags (differentiable, fused
    each on; 15 per class), for float32 and for bf16/fp16 (whose inputs torch gives eps=0.1 for fp16); plus
    ``foreach=True`` (torch runs it on the CPU in test_foreach_matches_forloop)."""
    out = []
    for name in ("Adam", "AdamW"):
        info = INFO[name]
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            for inp in co._get_optim_inputs_including_global_cliquey_kwargs("cpu", dtype, info):
                kwargs = dict(inp.kwargs)
                if dtype == torch.float16:
                    kwargs.setdefault("eps", 0.1)  # optim_inputs_func(dtype=float16)'s
                out.append((name, dtype, inp.desc, kwargs))
            for inp in info.optim_inputs_func("cpu"):
                out.append((name, dtype, f"{inp.desc} & foreach", {**inp.kwargs, "foreach": True}))
    return out


CONFIGS = _configs()


_BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def _same(a, b):
    """Bit for bit, but for NaN payloads: NaN exactly where torch has NaN (fp16's ``R(eps) == 0`` with the default
    eps divides 0/0). torch's vectorised ``maximum`` writes all-ones NaNs into ``max_exp_avg_sq`` where ours keeps the
    NaN operand's bits (the one difference seen: Adam fp16 amsgrad & foreach)."""
    a, b = a.detach(), b.detach()
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(a.view(_BITS[a.dtype])[~nan], b.view(_BITS[b.dtype])[~nan])


def _ours_or_skip(name, params, **kwargs):
    """Ours on ``params`` (one worker thread), or the test skipped where it refuses the input as documented."""
    try:
        return OURS[name](params, threads=1, **kwargs)
    except NotImplementedError as exc:
        assert "not offered" in str(exc) or "not built yet" in str(exc), exc
        pytest.skip(f"refused: {exc}")


def _params(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(10, 5), (10,), (), (3, 7, 2), (129,)]  # a 0-dim one, as torch's fused tests add
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in shapes]


def _grads(params, step):
    g = torch.Generator().manual_seed(100 + step)
    out = [torch.randn(p.shape, generator=g).to(p.dtype) for p in params]
    if step == 2:
        out[1] = None  # a parameter without a gradient this step
    if step == 3:
        out[0] = torch.zeros_like(out[0])  # zero gradients
    return out


@pytest.mark.parametrize("name,dtype,desc,kwargs", CONFIGS,
                         ids=[f"{n}-{str(d)[6:]}-{desc}" for n, d, desc, _ in CONFIGS])
def test_configuration_bit_identical_or_refused(name, dtype, desc, kwargs):
    ref_params, our_params = _params(dtype), _params(dtype)
    ref = INFO[name].optim_cls(ref_params, **kwargs)
    ours = _ours_or_skip(name, our_params, **kwargs)
    try:
        for step in range(STEPS):
            for ps in (ref_params, our_params):
                for p, g in zip(ps, _grads(ps, step)):
                    p.grad = g
            ref.step()
            ours.step()
            for i, (a, b) in enumerate(zip(ref_params, our_params)):
                assert _same(a, b), f"parameter {i} differs after step {step + 1}"
        ours_sd, ref_sd = ours.state_dict(), ref.state_dict()
        assert ours_sd["param_groups"] == ref_sd["param_groups"]
        for i, st in ref_sd["state"].items():
            for key, value in st.items():
                assert _same(value, ours_sd["state"][i][key]), (i, key)
    finally:
        ours.close()


# -- the same on CUDA (GPU tests) ----------------------------------------------------------------


def _cuda_configs():
    """torch's CUDA inputs (its ``fused``, ``capturable`` and Tensor-``lr``/``betas`` cases among them), per dtype, for
    both placements; torch's optimizer runs on the same CUDA parameters as the reference."""
    out = []
    for name in ("Adam", "AdamW"):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            for inp in co._get_optim_inputs_including_global_cliquey_kwargs("cuda", dtype, INFO[name]):
                kwargs = dict(inp.kwargs)
                if dtype == torch.float16:
                    kwargs.setdefault("eps", 0.1)
                for mode in ("cpu", "gpu"):
                    out.append((name, dtype, inp.desc, kwargs, mode))
    return out


CUDA_CONFIGS = _cuda_configs()


def _on_cuda(kwargs):
    """torch's CUDA inputs with their Tensor ``lr``/``betas`` on the GPU, as torch's CUDA tests pass them."""
    move = lambda v: v.cuda() if isinstance(v, torch.Tensor) else v  # noqa: E731
    return {k: (tuple(move(b) for b in v) if k == "betas" else move(v)) for k, v in kwargs.items()}


@pytest.mark.gpu
@pytest.mark.parametrize("name,dtype,desc,kwargs,mode", CUDA_CONFIGS,
                         ids=[f"{n}-{str(d)[6:]}-{desc}-{m}" for n, d, desc, _, m in CUDA_CONFIGS])
def test_cuda_configuration_bit_identical_or_refused(name, dtype, desc, kwargs, mode):
    """Each of torch's CUDA inputs on CUDA parameters, ``mode="cpu"`` and ``"gpu"``: bit-identical to torch's optimizer
    on the same parameters over several steps (its fused CUDA kernel where ``fused=True``), or refused naming why."""
    ref_params = [torch.nn.Parameter(p.detach().cuda()) for p in _params(dtype)]
    our_params = [torch.nn.Parameter(p.detach().cuda()) for p in _params(dtype)]
    try:
        ref = INFO[name].optim_cls(ref_params, **_on_cuda(kwargs))
    except Exception as exc:  # noqa: BLE001 - ours must refuse the same input with the same type
        with pytest.raises(type(exc)):
            OURS[name](our_params, threads=1, mode=mode, **_on_cuda(kwargs)).close()
        return
    ours = _ours_or_skip(name, our_params, mode=mode, **_on_cuda(kwargs))
    try:
        for step in range(STEPS):
            for ps in (ref_params, our_params):
                for p, g in zip(ps, _grads(ps, step)):
                    p.grad = None if g is None else g.cuda()
            ref.step()
            try:
                ours.step()
            except NotImplementedError as exc:  # CUDA fused Adam + L2 on the host: refused at the first step
                assert step == 0 and "not reproduced on the host" in str(exc) and mode == "cpu", exc
                pytest.skip(f"refused: {exc}")
            for i, (a, b) in enumerate(zip(ref_params, our_params)):
                assert _same(a, b), f"parameter {i} differs after step {step + 1}"
        ours_sd, ref_sd = ours.state_dict(), ref.state_dict()
        for i, st in ref_sd["state"].items():  # torch keeps a CUDA ``step`` where capturable or fused
            for key, value in st.items():
                assert _same(value.cpu() if isinstance(value, torch.Tensor) else value,
                             ours_sd["state"][i][key].cpu()), (i, key)
    finally:
        ours.close()


# -- error inputs ------------------------------------------------------------------------------


def _outcome(fn):
    """What ``fn()`` does: ("raises", type, message), ("warns", category, message) or ("ok",)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            opt = fn()
        except Exception as exc:  # noqa: BLE001 - the type is what is compared
            return ("raises", type(exc), str(exc))
    if hasattr(opt, "close"):
        opt.close()
    for w in caught:
        if issubclass(w.category, UserWarning) and "duplicate" in str(w.message):
            return ("warns", w.category, str(w.message))
    return ("ok",)


ERROR_INPUTS = [(name, i) for name in ("Adam", "AdamW")
                for i in range(len(INFO[name].optim_error_inputs_func(device="cpu", dtype=torch.float32)))]


@pytest.mark.parametrize("name,index", ERROR_INPUTS, ids=[f"{n}-{i}" for n, i in ERROR_INPUTS])
def test_error_input_matches_torch(name, index):
    """Each of torch's error inputs (all at construction): ours raises (or warns) what torch does, with the same
    type and message; and what the input names (its error type and regex) holds for ours."""
    def build(cls):
        err = INFO[name].optim_error_inputs_func(device="cpu", dtype=torch.float32)[index]
        inp = err.optimizer_error_input
        return err, (lambda: cls(inp.params, **inp.kwargs))

    err, torch_build = build(INFO[name].optim_cls)
    _, our_build = build(OURS[name])
    assert err.error_on == co.OptimizerErrorEnum.CONSTRUCTION_ERROR
    theirs, ours = _outcome(torch_build), _outcome(our_build)
    assert ours == theirs
    assert issubclass(ours[1], err.error_type)
    assert pytest.importorskip("re").search(err.error_regex, ours[2])


@pytest.mark.parametrize("cls", [OffloadAdam, OffloadAdamW])
@pytest.mark.parametrize("kwargs", [dict(fused=True, foreach=True), dict(fused=True, differentiable=True)],
                         ids=["fused+foreach", "fused+differentiable"])
def test_cuda_error_inputs_on_cpu_params(cls, kwargs):
    """torch's two CUDA error inputs raise the same on CPU parameters (the checks do not look at the device)."""
    ref_cls = torch.optim.Adam if cls is OffloadAdam else torch.optim.AdamW
    theirs = _outcome(lambda: ref_cls([torch.nn.Parameter(torch.zeros(()))], **kwargs))
    ours = _outcome(lambda: cls([torch.nn.Parameter(torch.zeros(()))], **kwargs))
    assert theirs[:2] == ("raises", RuntimeError)
    assert ours == theirs


@pytest.mark.parametrize("kwargs", [
    dict(lr=-1.0), dict(eps=-1e-8), dict(betas=(0.9, 1.0)), dict(betas=(-0.1, 0.9)), dict(weight_decay=-1e-2),
    dict(betas=(0, 0.99)), dict(lr=torch.tensor([[0.1]]), foreach=True),
    dict(betas=(torch.tensor([0.9, 0.8]), torch.tensor(0.99))),
    dict(betas=(torch.tensor(0.9), torch.tensor([0.9, 0.8]))),
    dict(lr=float("nan")), dict(decoupled_weight_decay=True),
])
@pytest.mark.parametrize("ours,ref", [(OffloadAdam, torch.optim.Adam), (OffloadAdamW, torch.optim.AdamW)],
                         ids=["Adam", "AdamW"])
def test_more_validation_as_torch(ours, ref, kwargs):
    """Beyond torch's inputs: torch's other checks (betas both floats, 1-element Tensor betas, NaN lr,
    ``AdamW(decoupled_weight_decay=...)`` a TypeError), same type and message."""
    theirs = _outcome(lambda: ref([torch.nn.Parameter(torch.zeros(3))], **kwargs))
    got = _outcome(lambda: ours([torch.nn.Parameter(torch.zeros(3))], **kwargs))
    if theirs[0] == "raises" and theirs[1] is TypeError:  # the class name in the message
        assert got[:2] == theirs[:2] and "decoupled_weight_decay" in got[2]
    else:
        assert got == theirs

"""The generic optimizer behaviours of torch's test/test_optim.py (TestOptimRenewed) that apply to a drop-in, run
against OffloadAdam / OffloadAdamW as a user would write them, over torch's CPU configurations for Adam and AdamW
(common_optimizers' inputs with the global flags): where torch's test checks a direction or a tolerance, here the
weights are compared bit for bit with torch's optimizer given the same arguments. A configuration we refuse at
construction (``NotImplementedError``, listed by test_torch_inputs) is skipped with that reason. Also: what a loop
does to param groups (issue 40 item 3: every group key honoured or refused where it is set)."""

from __future__ import annotations

import copy
import io
import pickle

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("expecttest")  # common_optimizers imports it (the `test` extra installs it)
from torch.nn import Parameter  # noqa: E402
from torch.optim.lr_scheduler import ReduceLROnPlateau  # noqa: E402
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook  # noqa: E402
from torch.testing._internal import common_optimizers as co  # noqa: E402

from trainstream.torch import OffloadAdam, OffloadAdamW  # noqa: E402

INFO = {o.optim_cls.__name__: o for o in co.optim_db}
PAIRS = {"Adam": (OffloadAdam, torch.optim.Adam), "AdamW": (OffloadAdamW, torch.optim.AdamW)}
CONFIGS = [(name, inp.desc, inp.kwargs) for name in ("Adam", "AdamW")
           for inp in co._get_optim_inputs_including_global_cliquey_kwargs("cpu", torch.float32, INFO[name])]
IDS = [f"{n}-{d}" for n, d, _ in CONFIGS]
DEFAULTS = [c for c in CONFIGS if c[1] == "default"]


def configs(only=None):
    chosen = CONFIGS if only is None else only
    return pytest.mark.parametrize("name,desc,kwargs", chosen, ids=[f"{n}-{d}" for n, d, _ in chosen])


def build(name, params, **kwargs):
    """Ours over ``params`` (threads=1), or skip with the refusal's reason."""
    try:
        return PAIRS[name][0](params, threads=1, **kwargs)
    except NotImplementedError as exc:
        pytest.skip(f"refused: {exc}")


def weight_bias(seed=0, requires_grad=True):
    g = torch.Generator().manual_seed(seed)
    return (Parameter(torch.randn(10, 5, generator=g), requires_grad=requires_grad),
            Parameter(torch.randn(10, generator=g), requires_grad=requires_grad), torch.randn(5, generator=g))


def twins(seed=0):
    """Two equal (weight, bias, input) triples: torch's and ours."""
    return weight_bias(seed), weight_bias(seed)


def loss_of(w, b, x):
    return (w.mv(x) + b).pow(2).sum()


def assert_bitwise(a, b):
    for i, (p, q) in enumerate(zip(a, b)):
        assert torch.equal(p.detach(), q.detach()), f"parameter {i} differs"


def assert_sd_equal(a, b):
    """Two state dicts equal: the same groups, the same state keys, tensors bit for bit."""
    assert set(a) == set(b) and a["param_groups"] == b["param_groups"]
    assert list(a["state"]) == list(b["state"]) or set(a["state"]) == set(b["state"])
    for k, st in a["state"].items():
        other = b["state"][k]
        if not isinstance(st, dict):
            assert st == other
            continue
        assert set(st) == set(other), k
        for key, v in st.items():
            assert torch.equal(v, other[key]) if isinstance(v, torch.Tensor) else v == other[key], (k, key)


def closure_for(opt, w, b, x):
    def closure():
        opt.zero_grad()
        loss = loss_of(w, b, x)
        loss.backward()
        return loss
    return closure


# -- updates: bit for bit with torch's optimizer ------------------------------------------------


@pytest.mark.parametrize("sched", range(len(INFO["AdamW"].scheduler_inputs) + 1))
@configs()
def test_forloop_with_lr_schedulers_bitwise(name, desc, kwargs, sched):
    """test_forloop_goes_right_direction (foreach=False forced; contiguous parameters) with torch's scheduler
    chains, ReduceLROnPlateau included: every step bit-identical, the loss going the right way."""
    kwargs = {**kwargs, "foreach": False}
    (w0, b0, x), (w1, b1, _) = twins()
    ours = build(name, [w1, b1], **kwargs)
    ref = PAIRS[name][1]([w0, b0], **kwargs)
    chains = [[], *INFO[name].scheduler_inputs]
    scheds = [[s(o) for s in chains[sched]] for o in (ref, ours)]
    first = loss_of(w0, b0, x).item()
    for _ in range(20):
        for o, (w, b), ss in ((ref, (w0, b0), scheds[0]), (ours, (w1, b1), scheds[1])):
            loss = o.step(closure_for(o, w, b, x))
            for s in ss:
                s.step(loss) if isinstance(s, ReduceLROnPlateau) else s.step()
        assert_bitwise([w0, b0], [w1, b1])
    assert [g["lr"] for g in ours.param_groups] == [g["lr"] for g in ref.param_groups]
    if kwargs.get("maximize"):  # torch's test: the other direction
        assert loss_of(w1, b1, x).item() > first
    else:
        assert loss_of(w1, b1, x).item() < first
    ours.close()


def test_non_contiguous_parameters_are_refused_clearly():
    """test_forloop_goes_right_direction's non-contiguous parameters (``[..., 0]``): refused at construction."""
    w = Parameter(torch.randn(10, 5, 2)[..., 0])
    with pytest.raises(ValueError, match="not contiguous; make it contiguous first"):
        OffloadAdamW([w])


@configs(DEFAULTS)
def test_param_group_with_lrscheduler_bitwise(name, desc, kwargs):
    (w0, b0, x), (w1, b1, _) = twins()
    ref = PAIRS[name][1]([{"params": [w0]}, {"params": [b0], "lr": 0.01}])
    ours = build(name, [{"params": [w1]}, {"params": [b1], "lr": 0.01}])
    scheds = [[s(o) for s in INFO[name].scheduler_inputs[0]] for o in (ref, ours)]
    for _ in range(20):
        for o, (w, b), ss in ((ref, (w0, b0), scheds[0]), (ours, (w1, b1), scheds[1])):
            loss = o.step(closure_for(o, w, b, x))
            for s in ss:
                s.step(loss) if isinstance(s, ReduceLROnPlateau) else s.step()
    assert_bitwise([w0, b0], [w1, b1])
    ours.close()


@configs()
def test_tensor_lr_bitwise_or_refused(name, desc, kwargs):
    """test_tensor_lr: a Tensor lr gives the float lr's training (torch: within tolerance; here bit for bit with
    torch's Tensor-lr run), or is refused where set."""
    if kwargs.get("differentiable"):
        pytest.skip("torch's test skips differentiable")
    kwargs = {**kwargs, "lr": torch.tensor(1e-3)}
    (w0, b0, x), (w1, b1, _) = twins()
    ref = PAIRS[name][1]([w0, b0], **kwargs)
    ours = build(name, [w1, b1], **kwargs)
    for _ in range(5):
        ref.step(closure_for(ref, w0, b0, x))
        ours.step(closure_for(ours, w1, b1, x))
        assert_bitwise([w0, b0], [w1, b1])
    ours.close()


@configs()
def test_param_groups_weight_decay_and_lr_bitwise(name, desc, kwargs):
    """test_param_groups_weight_decay and test_param_groups_lr: per-group keys over outer defaults (outer
    ``lr=1e-28``, an untouched group), bit for bit; the nearly-zero-lr group moves as torch's does."""
    if kwargs.get("differentiable"):
        pytest.skip("torch's test skips differentiable")
    bias_kwargs = {**kwargs, "weight_decay": 0.0}
    (w0, b0, x), (w1, b1, _) = twins()
    irr0, irr1 = Parameter(torch.ones(2)), Parameter(torch.ones(2))

    def groups(w, b, irr):
        return [dict(params=[w], **{**kwargs, "lr": kwargs.get("lr", 1e-3)}), dict(params=[b], **bias_kwargs),
                dict(params=[irr])]
    ref = PAIRS[name][1](groups(w0, b0, irr0), lr=1e-28)
    ours = build(name, groups(w1, b1, irr1), lr=1e-28)
    g = torch.Generator().manual_seed(3)
    for _ in range(20):
        grad = torch.rand(2, generator=g)
        for o, (w, b, irr) in ((ref, (w0, b0, irr0)), (ours, (w1, b1, irr1))):
            o.zero_grad()
            loss_of(w, b, x).backward()
            irr.grad = grad.clone()
            o.step()
    assert_bitwise([w0, b0, irr0], [w1, b1, irr1])
    ours.close()


@configs()
def test_step_is_noop_when_params_have_no_grad(name, desc, kwargs):
    params = [torch.randn(2, 3, requires_grad=False) for _ in range(2)]
    before = [p.clone() for p in params]
    ours = build(name, params, **kwargs)
    assert ours.step(lambda: torch.tensor([1.0])).item() == 1.0  # the closure's loss comes back
    assert_bitwise(before, params)
    assert len(ours.state) == 0
    ours.close()


@configs()
def test_step_with_zero_grads_bitwise(name, desc, kwargs):
    """test_step_is_noop_for_zero_grads (wd=0 configs; AdamW at lr=1e-5): torch's bits, also where the decay moves
    the weights."""
    kwargs = dict(kwargs)
    if name == "AdamW":
        kwargs["lr"] = 1e-5
    p0 = torch.randn((5, 1), generator=torch.Generator().manual_seed(0)).requires_grad_()
    p1 = p0.detach().clone().requires_grad_()
    ref = PAIRS[name][1]([p0], **kwargs)
    ours = build(name, [p1], **kwargs)
    for o, p in ((ref, p0), (ours, p1)):
        p.grad = torch.zeros_like(p)
        o.step(lambda: torch.tensor([1.0]))
    assert_bitwise([p0], [p1])
    ours.close()


# -- printing, state dicts ------------------------------------------------------------------------


@configs()
def test_optimizer_can_be_printed_as_torch(name, desc, kwargs):
    params = [Parameter(torch.randn(2, 3)) for _ in range(2)]
    ours = build(name, params, **kwargs)
    ref = PAIRS[name][1](params, **kwargs)
    assert repr(ours) == repr(ref).replace(name + " (", "Offload" + name + " (", 1)
    ours.close()


@pytest.mark.parametrize("named0,named1", [(False, False), (False, True), (True, False), (True, True)])
@configs()
def test_state_dict_deterministic(name, desc, kwargs, named0, named1):
    """test_state_dict_deterministic: a state dict loaded into a new optimizer over cloned weights continues bit for
    bit; the two state dicts are equal (names aside) and equal torch's; repeated groups pack as torch's."""
    if kwargs.get("differentiable"):
        pytest.skip("torch's test skips differentiable")

    def named(ps, on):
        return [(f"name{i}", p) for i, p in enumerate(ps)] if on else ps

    def no_names(sd):
        sd = copy.deepcopy(sd)
        for g in sd["param_groups"]:
            g.pop("param_names", None)
        return sd
    (w, b, x), (rw, rb, _) = twins()
    ours = build(name, named([w, b], named0), **kwargs)
    ref = PAIRS[name][1](named([rw, rb], named0), **kwargs)
    for _ in range(10):
        ours.step(closure_for(ours, w, b, x))
        ref.step(closure_for(ref, rw, rb, x))
    with torch.no_grad():
        wc, bc = Parameter(w.clone()), Parameter(b.clone())
    ours_c = build(name, named([wc, bc], named1), **kwargs)
    ours_c.load_state_dict(copy.deepcopy(ours.state_dict()))
    for _ in range(10):
        for o, ps in ((ours, (w, b)), (ours_c, (wc, bc)), (ref, (rw, rb))):
            o.step(closure_for(o, *ps, x))
        assert_bitwise([w, b], [wc, bc])
        assert_bitwise([w, b], [rw, rb])
    sd, sd_c = no_names(ours.state_dict()), no_names(ours_c.state_dict())
    assert_sd_equal(sd, sd_c)
    assert_sd_equal(sd, no_names(ref.state_dict()))
    ours_c.param_groups.extend(ours_c.param_groups)
    ref.param_groups.extend(ref.param_groups)
    assert no_names(ours_c.state_dict())["param_groups"] == no_names(ref.state_dict())["param_groups"]
    assert no_names(ours.state_dict())["param_groups"][-1] == no_names(ours_c.state_dict())["param_groups"][-1]
    for o in (ours, ours_c):
        o.close()


def _conv_bn(seed=1):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Conv2d(4, 2, 1, stride=2), torch.nn.BatchNorm2d(2, eps=1e-05, momentum=0.1))


def _fwd_bwd(opt, model, x):
    opt.zero_grad()
    loss = model(x).sum()
    loss.backward()
    return loss


@configs()
def test_can_load_older_state_dict(name, desc, kwargs):
    """A state dict whose groups lack the flags older torch versions did not have loads (torch's defaults for
    them) and the run continues as torch's."""
    if kwargs.get("differentiable"):
        pytest.skip("torch's test skips differentiable")
    models = [_conv_bn(), _conv_bn()]
    x = torch.rand(1, 4, 16, 16, generator=torch.Generator().manual_seed(2))
    ref = PAIRS[name][1](models[0].parameters(), **kwargs)
    ours = build(name, models[1].parameters(), **kwargs)
    for o, m in ((ref, models[0]), (ours, models[1])):
        for _ in range(3):
            _fwd_bwd(o, m, x)
            o.step()
        old = copy.deepcopy(o.state_dict())
        for g in old["param_groups"]:
            for flag in INFO[name].not_og_supported_flags:
                g.pop(flag, None)
        o.load_state_dict(old)
        _fwd_bwd(o, m, x)
        o.step()
    assert_bitwise(models[0].parameters(), models[1].parameters())
    assert ours.param_groups[0]["foreach"] is None and ours.param_groups[0]["maximize"] is False
    ours.close()


@pytest.mark.parametrize("named0,named1", [(False, False), (False, True), (True, False), (True, True)])
@configs(DEFAULTS)
def test_can_load_from_to_named_state_dict(name, desc, kwargs, named0, named1):
    model = _conv_bn()
    x = torch.rand(1, 4, 16, 16)
    ours = build(name, model.named_parameters() if named0 else model.parameters(), **kwargs)
    for _ in range(3):
        _fwd_bwd(ours, model, x)
        ours.step()
    old = copy.deepcopy(ours.state_dict())
    ours.close()
    ours2 = build(name, model.named_parameters() if named1 else model.parameters(), **kwargs)
    ours2.load_state_dict(old)
    _fwd_bwd(ours2, model, x)
    ours2.step()
    if named0 or named1:
        assert ours2.state_dict()["param_groups"][0]["param_names"] == ["0.weight", "0.bias", "1.weight", "1.bias"]
    ours2.close()


@pytest.mark.parametrize("named", [False, True])
@configs(DEFAULTS)
def test_save_load_equality_with_weights_only(name, desc, kwargs, named):
    (w, b, x), _ = twins()
    ours = build(name, [("w", w), ("b", b)] if named else [w, b], **kwargs)
    for _ in range(3):
        ours.step(closure_for(ours, w, b, x))
    sd = ours.state_dict()
    buf = io.BytesIO()
    torch.save(sd, buf)
    for weights_only in (False, True):
        buf.seek(0)
        assert_sd_equal(torch.load(buf, weights_only=weights_only), sd)
    ours.close()


@configs()
def test_load_nontensor_step(name, desc, kwargs):
    """A state dict whose ``step`` is a Python float loads and continues as torch's."""
    if kwargs.get("differentiable"):
        pytest.skip("torch's test skips differentiable")
    (w, b, x), (rw, rb, _) = twins()
    ours = build(name, [w, b], **kwargs)
    ref = PAIRS[name][1]([rw, rb], **kwargs)
    for o, ps in ((ours, (w, b)), (ref, (rw, rb))):
        for _ in range(3):
            o.step(closure_for(o, *ps, x))
        sd = copy.deepcopy(o.state_dict())
        for st in sd["state"].values():
            st["step"] = st["step"].item()
        o.load_state_dict(sd)
        o.step(closure_for(o, *ps, x))
    assert_bitwise([w, b], [rw, rb])
    ours.close()


def test_state_dict_round_trips_with_torch_both_ways():
    """torch's state dict into ours and ours into torch's: each continues the other's run bit for bit."""
    (w, b, x), (rw, rb, _) = twins()
    ours, ref = OffloadAdamW([w, b], lr=1e-2, threads=1), torch.optim.AdamW([rw, rb], lr=1e-2)
    for _ in range(3):
        ref.step(closure_for(ref, rw, rb, x))
    with torch.no_grad():
        w.copy_(rw)
        b.copy_(rb)
    ours.load_state_dict(ref.state_dict())
    for _ in range(3):
        ref.step(closure_for(ref, rw, rb, x))
        ours.step(closure_for(ours, w, b, x))
    assert_bitwise([w, b], [rw, rb])
    ref2 = torch.optim.AdamW([rw, rb], lr=1e-2)
    ref2.load_state_dict(copy.deepcopy(ours.state_dict()))  # (torch keeps loaded tensors as given: views here)
    for _ in range(3):
        ref2.step(closure_for(ref2, rw, rb, x))
        ours.step(closure_for(ours, w, b, x))
    assert_bitwise([w, b], [rw, rb])
    ours.close()


@configs(DEFAULTS)
def test_non_empty_state(name, desc, kwargs):
    model = torch.nn.Linear(5, 5)
    ours = build(name, model.parameters(), **kwargs)
    model(torch.rand(2, 5)).sum().backward()
    ours.step()
    assert len(ours.state) == 2 and all(len(st) > 0 for st in ours.state.values())
    ours.close()


# -- hooks ----------------------------------------------------------------------------------------


def _sd_pre_hook(opt):
    opt.state["test"] = 1


def _sd_post_hook(opt, sd):
    sd["ran_state_dict_pre_hook"] = "test" in sd["state"]
    sd["state"].pop("test", None)
    return sd


@configs(DEFAULTS)
def test_state_dict_hooks(name, desc, kwargs):
    """test_state_dict_pre_hook, _post_hook, _pre_post_hook."""
    ours = build(name, [torch.rand(2, 3, requires_grad=True)], **kwargs)
    h = ours.register_state_dict_pre_hook(_sd_pre_hook)
    assert ours.state_dict()["state"]["test"] == 1
    h.remove()
    del ours.state["test"]
    ours.register_state_dict_post_hook(_sd_post_hook)
    assert ours.state_dict()["ran_state_dict_pre_hook"] is False
    ours.register_state_dict_pre_hook(_sd_pre_hook)
    sd = ours.state_dict()
    assert "test" not in sd["state"] and sd["ran_state_dict_pre_hook"] is True
    ours.close()


def _load_pre_hook1(opt, sd):
    sd["param_groups"][0]["lr"] = 0.002


def _load_pre_hook2(opt, sd):
    sd = copy.deepcopy(sd)
    sd["param_groups"][0]["lr"] = 0.003
    return sd


def _load_post_hook(opt):
    opt.state["ran_load_state_dict_pre_hook2"] = opt.param_groups[0]["lr"] == 0.003
    opt.state["ran_load_state_dict_post_hook"] = True


@configs(DEFAULTS)
def test_load_state_dict_hooks(name, desc, kwargs):
    """test_load_state_dict_pre_hook_and_prepend, _post_hook, _pre_post_hook; and a pre-hook's lr edit is the lr
    the next step uses (bit for bit with torch's optimizer under the same hook)."""
    ours = build(name, [torch.rand(2, 3, requires_grad=True)], **kwargs)
    sd = ours.state_dict()
    ours.register_load_state_dict_pre_hook(_load_pre_hook1)
    ours.load_state_dict(sd)
    assert ours.param_groups[0]["lr"] == 0.002
    ours.register_load_state_dict_pre_hook(_load_pre_hook2, prepend=True)
    ours.load_state_dict(sd)
    assert ours.param_groups[0]["lr"] == 0.002  # prepended: the other hook overrides
    ours.close()

    ours = build(name, [torch.rand(2, 3, requires_grad=True)], **kwargs)
    ours.register_load_state_dict_post_hook(_load_post_hook)
    ours.load_state_dict(ours.state_dict())
    assert ours.state["ran_load_state_dict_pre_hook2"] is False and ours.state["ran_load_state_dict_post_hook"]
    ours.register_load_state_dict_pre_hook(_load_pre_hook2)
    ours.load_state_dict(ours.state_dict())
    assert ours.state["ran_load_state_dict_pre_hook2"] is True
    ours.close()

    (w, b, x), (rw, rb, _) = twins()
    ours, ref = build(name, [w, b], **kwargs), PAIRS[name][1]([rw, rb], **kwargs)
    for o, ps in ((ours, (w, b)), (ref, (rw, rb))):
        o.step(closure_for(o, *ps, x))
        saved = copy.deepcopy(o.state_dict())
        o.register_load_state_dict_pre_hook(_load_pre_hook1)
        o.load_state_dict(saved)
        o.step(closure_for(o, *ps, x))
    assert ours.param_groups[0]["lr"] == 0.002
    assert_bitwise([w, b], [rw, rb])
    ours.close()


@configs()
def test_step_hooks(name, desc, kwargs):
    """test_step_pre_hook, test_step_post_hook, test_step_all_hooks (global hooks first before, last after)."""
    data = []
    params = [torch.tensor([1.0, 1.0])]
    ours = build(name, params, **kwargs)
    other = torch.optim.SGD(params)
    handles = [register_optimizer_step_pre_hook(lambda o, a, k: data.append(0)),
               register_optimizer_step_post_hook(lambda o, a, k: data.append(5))]
    try:
        for o in (ours, other):
            handles += [o.register_step_pre_hook(lambda o, a, k: data.append(1)),
                        o.register_step_post_hook(lambda o, a, k: data.append(2))]
        ours.step()
        assert data == [0, 1, 2, 5]
        other.step()
        ours.step()
        assert data == [0, 1, 2, 5] * 3
    finally:
        for h in handles:
            h.remove()
    ours.step()
    other.step()
    assert data == [0, 1, 2, 5] * 3
    ours.close()


def test_step_pre_hook_may_replace_the_arguments():
    (w, b, x), _ = twins()
    ours = OffloadAdamW([w, b], threads=1)
    calls = []
    ours.register_step_pre_hook(lambda o, a, k: ((a[0],), {"closure": lambda: calls.append(1) or 7.0}))
    assert ours.step() == 7.0 and calls == [1]
    ours.close()


# -- copies -------------------------------------------------------------------------------------------


@configs()
def test_deepcopy_copies_all_public_attrs_and_continues_as_torch(name, desc, kwargs):
    """test_deepcopy_copies_all_public_attrs; and the copy is an independent optimizer with the state, over the
    copied parameters, as torch's deepcopy: both continue bit for bit with torch's pair."""
    if kwargs.get("differentiable"):
        pytest.skip("torch's test skips differentiable")
    params = [Parameter(torch.randn(2, 3)) for _ in range(2)]
    rparams = [Parameter(p.detach().clone()) for p in params]
    ours, ref = build(name, params, **kwargs), PAIRS[name][1](rparams, **kwargs)
    for step in range(3):
        for ps in (params, rparams):
            for i, p in enumerate(ps):
                p.grad = torch.full_like(p, 0.1 * (i + step + 1))
        ours.step()
        ref.step()
    public = lambda o: {k for k in o.__dict__ if not k.startswith("_")}  # noqa: E731
    ours_c, ref_c = copy.deepcopy(ours), copy.deepcopy(ref)
    assert public(ours) == public(ours_c)
    assert type(ours_c) is type(ours) and ours_c.param_groups[0]["params"][0] is not params[0]
    for step in range(3):
        for o in (ours, ref, ours_c, ref_c):
            for i, p in enumerate(o.param_groups[0]["params"]):
                p.grad = torch.full_like(p, 0.3 - 0.1 * (i + step))
            o.step()
    assert_bitwise(params, rparams)
    assert_bitwise(ours_c.param_groups[0]["params"], ref_c.param_groups[0]["params"])
    assert_sd_equal(ours_c.state_dict(), ref_c.state_dict())
    for o in (ours, ours_c):
        o.close()


def test_deepcopy_with_the_model_shares_the_copied_parameters_and_pickles():
    model = torch.nn.Linear(4, 3)
    ours = OffloadAdamW(model.parameters(), lr=1e-2, threads=1)
    model(torch.ones(2, 4)).sum().backward()
    ours.step()
    hooks = []
    ours.register_step_post_hook(lambda *a: hooks.append(1))
    m2, o2 = copy.deepcopy((model, ours))
    assert o2.param_groups[0]["params"][0] is m2.weight  # the memo: the copy updates the copied model
    o3 = pickle.loads(pickle.dumps(ours))
    for m, o in ((model, ours), (m2, o2), (o3.param_groups[0]["params"], o3)):
        o.zero_grad()
        if isinstance(m, torch.nn.Module):
            m(torch.ones(2, 4)).sum().backward()
        else:
            for p, q in zip(m, model.parameters()):
                p.grad = q.grad.clone()
        o.step()
    assert hooks == [1]  # hooks are not copied (as torch's)
    assert_bitwise(model.parameters(), m2.parameters())
    assert_bitwise(model.parameters(), o3.param_groups[0]["params"])
    with pytest.raises(NotImplementedError, match="shallow copy"):
        copy.copy(ours)
    snap = copy.deepcopy(ours.state)  # a plain dict of copies (keys too, as deepcopy of torch's state)
    assert type(snap) is dict and torch.equal(next(iter(snap.values()))["exp_avg"], ours.state[model.weight]["exp_avg"])
    for o in (ours, o2, o3):
        o.close()


# -- the torch.optim API around the step ------------------------------------------------------------


def test_zero_grad_closures_and_params_without_grads_as_torch():
    (w0, b0, x), (w1, b1, _) = twins()
    extra0, extra1 = Parameter(torch.ones(3)), Parameter(torch.ones(3))  # never gets a gradient
    ref, ours = torch.optim.AdamW([w0, b0, extra0], lr=1e-2), OffloadAdamW([w1, b1, extra1], lr=1e-2, threads=1)
    for set_to_none in (True, False, True):
        losses = []
        for o, (w, b) in ((ref, (w0, b0)), (ours, (w1, b1))):
            losses.append(o.step(closure_for(o, w, b, x)).item())  # step(closure) returns its loss
            o.zero_grad(set_to_none=set_to_none)
            assert (w.grad is None) == set_to_none and (set_to_none or not w.grad.any())
        assert losses[0] == losses[1]
    assert_bitwise([w0, b0, extra0], [w1, b1, extra1])
    assert extra1 not in ours.state and len(ours.state) == len(ref.state) == 2
    ours.close()


@pytest.mark.parametrize("group,err", [
    ([1.0], TypeError), ({"params": {Parameter(torch.ones(1))}}, TypeError),
    ({"params": [torch.ones(2, requires_grad=True) * 2]}, ValueError),
    ({"params": [("a", Parameter(torch.ones(1))), Parameter(torch.ones(1))]}, ValueError),
    ({"params": [("a", Parameter(torch.ones(1)))]}, ValueError),
    ({"params": "shared"}, ValueError),
])
def test_add_param_group_validation_as_torch(group, err):
    """torch's own checks (type, sets, non-leaf, names, overlap), its messages; the optimizer unchanged."""
    p = Parameter(torch.ones(2))
    if isinstance(group, dict) and group["params"] == "shared":
        group = {"params": [p]}
    outcomes = []
    for cls in (torch.optim.AdamW, OffloadAdamW):
        opt = cls([p], **({"threads": 1} if cls is OffloadAdamW else {}))
        with pytest.raises(err) as caught:
            opt.add_param_group(copy.copy(group) if isinstance(group, dict) else group)
        outcomes.append(str(caught.value))
        assert len(opt.param_groups) == 1
        if cls is OffloadAdamW:
            opt.close()
    assert outcomes[0] == outcomes[1]


# -- issue 40 item 3: every group key honoured or refused ------------------------------------------


def _run(opts_params, x, steps=3):
    for _ in range(steps):
        for o, (w, b) in opts_params:
            o.step(closure_for(o, w, b, x))


@pytest.mark.parametrize("key,value", [("lr", 3e-2), ("betas", (0.8, 0.99)), ("eps", 1e-6), ("weight_decay", 0.3)])
def test_hyperparameter_edits_take_effect_as_torch(key, value):
    (w0, b0, x), (w1, b1, _) = twins()
    ref = torch.optim.AdamW([{"params": [w0]}, {"params": [b0], "lr": 1e-2}])
    ours = OffloadAdamW([{"params": [w1]}, {"params": [b1], "lr": 1e-2}], threads=1)
    pairs = ((ref, (w0, b0)), (ours, (w1, b1)))
    _run(pairs, x)
    for o in (ref, ours):
        o.param_groups[1][key] = value
    _run(pairs, x)
    assert_bitwise([w0, b0], [w1, b1])
    ours.close()


FLAG_EDITS = [("capturable", True), ("differentiable", True), ("betas", (torch.tensor(0.9), torch.tensor(0.99)))]


@pytest.mark.parametrize("key,value", FLAG_EDITS, ids=[k for k, _ in FLAG_EDITS])
def test_group_key_refused_where_set(key, value):
    """A key asking for what is not offered raises NotImplementedError where it is set: in the constructor's group,
    at add_param_group (the optimizer unchanged), at the step after an edit (nothing updated), at load_state_dict
    (nothing loaded); never ignored."""
    (w, b, x), _ = twins()
    extra = Parameter(torch.ones(3))
    ours = OffloadAdamW([w], lr=1e-2, threads=1)
    with pytest.raises(NotImplementedError, match="not offered"):
        OffloadAdamW([{"params": [w], key: value}], threads=1)
    with pytest.raises(NotImplementedError, match="param group 1"):
        ours.add_param_group({"params": [extra], key: value})
    assert len(ours.param_groups) == 1
    ours.add_param_group({"params": [b]})
    _run([(ours, (w, b))], x, 1)
    saved = copy.deepcopy(ours.state_dict())
    ours.param_groups[0][key] = value
    ours.zero_grad()
    loss_of(w, b, x).backward()
    before = [w.detach().clone(), b.detach().clone()]
    with pytest.raises(NotImplementedError, match="param group 0"):
        ours.step()
    assert_bitwise(before, [w, b])
    ours.param_groups[0][key] = saved["param_groups"][0][key]
    ours.step()  # put back: the run goes on
    bad = copy.deepcopy(saved)
    bad["param_groups"][1][key] = value
    now = copy.deepcopy(ours.state_dict())
    with pytest.raises(NotImplementedError, match="param group 1"):
        ours.load_state_dict(bad)
    assert_sd_equal(ours.state_dict(), now)
    ours.close()


FOLLOWED = [("maximize", True), ("foreach", True), ("fused", True), ("decoupled_weight_decay", False),
            ("lr", torch.tensor(1e-3))]


@pytest.mark.parametrize("cls,ref_cls", [(OffloadAdam, torch.optim.Adam), (OffloadAdamW, torch.optim.AdamW)],
                         ids=["Adam", "AdamW"])
@pytest.mark.parametrize("key,value", FOLLOWED, ids=[k for k, _ in FOLLOWED])
def test_group_arithmetic_edits_followed_as_torch(cls, ref_cls, key, value):
    """An edit of a group's arithmetic mid-run (implementation, maximize, decoupled decay, a Tensor lr) takes effect
    at the next step, as torch's; so does a loaded group's (and back)."""
    (w0, b0, x), (w1, b1, _) = twins()
    ref = ref_cls([{"params": [w0]}, {"params": [b0]}], lr=1e-2, weight_decay=0.1)
    ours = cls([{"params": [w1]}, {"params": [b1]}], lr=1e-2, weight_decay=0.1, threads=1)
    pairs = ((ref, (w0, b0)), (ours, (w1, b1)))
    _run(pairs, x)
    for o in (ref, ours):
        o.param_groups[0][key] = value
    _run(pairs, x)
    assert_bitwise([w0, b0], [w1, b1])
    for o in (ref, ours):  # a loaded group asks for it too
        sd = copy.deepcopy(o.state_dict())
        sd["param_groups"][1][key] = value
        o.load_state_dict(sd)
    _run(pairs, x)
    assert_bitwise([w0, b0], [w1, b1])
    ours.close()


def test_amsgrad_edit_refused_mid_run():
    """amsgrad toggled after the parameters were registered changes the state's layout: refused at the next step
    (nothing updated) and at load_state_dict (nothing loaded)."""
    (w, b, x), _ = twins()
    ours = OffloadAdamW([{"params": [w]}, {"params": [b]}], lr=1e-2, threads=1)
    _run([(ours, (w, b))], x, 1)
    saved = copy.deepcopy(ours.state_dict())
    ours.param_groups[0]["amsgrad"] = True
    before = [w.detach().clone(), b.detach().clone()]
    with pytest.raises(NotImplementedError, match="param group 0.*amsgrad False -> True"):
        ours.step(closure_for(ours, w, b, x))
    assert_bitwise(before, [w, b])
    ours.param_groups[0]["amsgrad"] = False
    bad = copy.deepcopy(saved)
    bad["param_groups"][1]["amsgrad"] = True
    with pytest.raises(NotImplementedError, match="param group 1"):
        ours.load_state_dict(bad)
    ours.close()


def test_decoupled_weight_decay_per_group():
    """OffloadAdam(decoupled_weight_decay=True) is AdamW (torch: the same code, the same bits); a group's
    decoupled_weight_decay=False with weight_decay 0 is plain Adam (bit for bit); OffloadAdamW keeps decoupled
    decay on every loaded group, as torch's AdamW."""
    (w0, b0, x), (w1, b1, _) = twins()
    ref = torch.optim.Adam([w0, b0], weight_decay=0.1, decoupled_weight_decay=True)
    ours = OffloadAdam([w1, b1], weight_decay=0.1, decoupled_weight_decay=True, threads=1)
    _run(((ref, (w0, b0)), (ours, (w1, b1))), x)
    assert_bitwise([w0, b0], [w1, b1])
    ours.close()
    (w0, b0, x), (w1, b1, _) = twins()
    ref = torch.optim.AdamW([{"params": [w0], "decoupled_weight_decay": False, "weight_decay": 0.0}, {"params": [b0]}])
    ours = OffloadAdamW([{"params": [w1], "decoupled_weight_decay": False, "weight_decay": 0.0}, {"params": [b1]}],
                        threads=1)
    _run(((ref, (w0, b0)), (ours, (w1, b1))), x)
    assert_bitwise([w0, b0], [w1, b1])
    ours.close()
    ours = OffloadAdamW([w1, b1], threads=1)
    sd = copy.deepcopy(ours.state_dict())
    sd["param_groups"][0]["decoupled_weight_decay"] = False
    ours.load_state_dict(sd)
    assert ours.param_groups[0]["decoupled_weight_decay"] is True  # AdamW.__setstate__'s rule
    ours.close()


def test_state_assignments_honoured_or_refused():
    """opt.state[p][key] = tensor copies into the host state (as replacing torch's tensor would); another device is
    a device move (the state stays in host memory); other assignments raise."""
    (w0, b0, x), (w1, b1, _) = twins()
    ref, ours = torch.optim.AdamW([w0, b0], lr=1e-2), OffloadAdamW([w1, b1], lr=1e-2, threads=1)
    pairs = ((ref, (w0, b0)), (ours, (w1, b1)))
    _run(pairs, x, 2)
    for o, w in ((ref, w0), (ours, w1)):
        o.state[w]["exp_avg"] = torch.zeros_like(w)
    ours.state[w1]["exp_avg_sq"] = ours.state[w1]["exp_avg_sq"].to("meta")
    _run(pairs, x, 2)
    assert_bitwise([w0, b0], [w1, b1])
    with pytest.raises(NotImplementedError):
        ours.state[w1] = {}
    with pytest.raises(NotImplementedError):
        ours.state[w1]["step"] = torch.tensor(100.0)
    with pytest.raises(NotImplementedError):
        ours.state[w1]["new_key"] = torch.zeros(1)
    ours.state["note"] = "kept"
    assert ours.state_dict()["state"]["note"] == "kept"
    ours.state = {}  # a reset, as torch's opt.state = defaultdict(dict): fresh state from here on
    assert len(ours.state) == 0
    ref.state = __import__("collections").defaultdict(dict)
    _run(pairs, x, 2)
    assert_bitwise([w0, b0], [w1, b1])
    ours.close()


"""Issue 40 items 1-3: OffloadAdamW follows ``param_groups`` as torch's optimizer does, or says why not.

Parameters added, replaced, moved or removed after construction (list edits, ``add_param_group``, the issue's
swap of a Linear's parameters into group 0), state entries moved between parameters (``opt.state[new] =
opt.state.pop(old)``), ``del opt.state[p]``, a parameter that comes back, every group key set per group: each run
against ``torch.optim.AdamW`` (or ``Adam``) doing the same edits in the same loop, weights compared bit for bit after
every step; where torch raises, ours raises; what ours cannot follow raises naming the parameter. Fast (CPU, tiny
tensors, one worker thread).
"""

from __future__ import annotations

import copy
import datetime
import warnings

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from trainstream.torch import OffloadAdam, OffloadAdamW  # noqa: E402

LR = 1e-2


def linears(n=3, seed=0, d=4):
    """``n`` Linear layers, twice: equal weights (torch's copy, ours)."""
    torch.manual_seed(seed)
    ref = [nn.Linear(d, d) for _ in range(n)]
    ours = copy.deepcopy(ref)
    return ref, ours


def params(layers, *idx):
    return [p for i in idx for p in layers[i].parameters()]


def drop(lst, p):
    """Remove tensor ``p`` from list ``lst`` (by identity: ``list.remove`` compares values)."""
    del lst[next(i for i, q in enumerate(lst) if q is p)]


def loss(layers, x):
    for m in layers:
        x = torch.tanh(m(x))
    return x.square().sum()


X = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))


def train(pairs, steps=2):
    """``steps`` steps of each ``(optimizer, layers)``: every layer gets a gradient."""
    for _ in range(steps):
        for opt, layers in pairs:
            opt.zero_grad()
            loss(layers, X).backward()
            opt.step()


def same(ref, ours):
    for i, (a, b) in enumerate(zip(ref, ours)):
        for (n, p), q in zip(a.named_parameters(), b.parameters()):
            assert torch.equal(p, q), f"layer {i} {n} differs"


def both(ref_opt, ours_opt, edit):
    """Apply ``edit(opt, layers)`` to torch's optimizer and ours."""
    edit(*ref_opt)
    edit(*ours_opt)


# -- item 1: the groups as they are now --------------------------------------------------------------------


def test_issue_swap_of_a_linears_parameters_into_group_0():
    """The issue's reproduction: build on one Linear, put another Linear's parameters into group 0, train 3 steps.
    torch.optim.AdamW moves them; ours must too, bit for bit (it did not move them before)."""
    torch.manual_seed(0)
    a0, b0 = nn.Linear(4, 3), nn.Linear(4, 3)
    a1, b1 = copy.deepcopy(a0), copy.deepcopy(b0)
    ref = torch.optim.AdamW(a0.parameters(), lr=LR)
    ours = OffloadAdamW(a1.parameters(), lr=LR, threads=1)
    ref.param_groups[0]["params"] = list(b0.parameters())
    ours.param_groups[0]["params"] = list(b1.parameters())
    initial = [p.detach().clone() for p in b1.parameters()]
    train(((ref, [b0]), (ours, [b1])), steps=3)
    same([a0, b0], [a1, b1])
    assert not any(torch.equal(p, q) for p, q in zip(initial, b1.parameters()))
    assert len(ours.state) == len(ref.state) == 2
    assert ours.state_dict()["state"].keys() == ref.state_dict()["state"].keys()
    ours.close()


EDITS = {
    "append": lambda o, L: o.param_groups[0]["params"].extend(params(L, 2)),
    "insert_first": lambda o, L: o.param_groups[0]["params"].insert(0, L[2].weight),
    "remove": lambda o, L: drop(o.param_groups[0]["params"], L[0].weight),
    "replace_all": lambda o, L: o.param_groups[0].__setitem__("params", params(L, 2)),
    "replace_one": lambda o, L: o.param_groups[0]["params"].__setitem__(1, L[2].bias),
    "move_to_group_1": lambda o, L: (drop(o.param_groups[0]["params"], L[0].bias),
                                     o.param_groups[1]["params"].append(L[0].bias)),
    "add_param_group": lambda o, L: o.add_param_group({"params": params(L, 2), "lr": 3e-2, "weight_decay": 0.0}),
    "tuple": lambda o, L: o.param_groups[1].__setitem__("params", tuple(params(L, 1, 2))),
}


@pytest.mark.parametrize("edit", list(EDITS))
@pytest.mark.parametrize("when", ["before_first_step", "mid_run"])
def test_param_list_edits_bitwise(edit, when):
    """Every edit of the parameter lists, before any step or after some, is followed at the next step as torch's:
    new parameters start fresh, those moved keep their state under their new group's hyper-parameters, those
    removed are never updated again (their gradient ignored)."""
    ref, ours = linears()
    mk = lambda cls, L, **kw: cls([{"params": params(L, 0)}, {"params": params(L, 1), "lr": 2e-2}], lr=LR, **kw)  # noqa: E731
    pairs = ((mk(torch.optim.AdamW, ref), ref), (mk(OffloadAdamW, ours, threads=1), ours))
    if when == "mid_run":
        train(pairs)
    both(*pairs, EDITS[edit])
    before = [p.detach().clone() for m in ours for p in m.parameters()]
    train(pairs, steps=3)
    same(ref, ours)
    after = [p.detach() for m in ours for p in m.parameters()]
    listed = {id(p) for g in pairs[1][0].param_groups for p in g["params"]}
    for p, q, b in zip((p for m in ours for p in m.parameters()), after, before):
        assert torch.equal(q, b) != (id(p) in listed)  # updated exactly when listed
    pairs[1][0].close()


def test_removed_parameter_hooks_go_and_state_stays_as_torch():
    """A parameter that left every group loses its gradient hook (even inside last_micro_batch() it is not
    updated); its state stays where torch keeps it, and comes back with it (bitwise); a parameter removed
    before any update has no state and its host state is freed."""
    ref, ours = linears()
    pairs = ((torch.optim.AdamW(params(ref, 0, 1), lr=LR), ref), (OffloadAdamW(params(ours, 0, 1), lr=LR, threads=1),
                                                                   ours))
    opt = pairs[1][0]
    train(pairs)
    both(*pairs, lambda o, L: drop(o.param_groups[0]["params"], L[1].weight))
    train(pairs)
    w = ours[1].weight
    assert not w._post_accumulate_grad_hooks  # removed
    assert w in opt.state and torch.equal(opt.state[w]["exp_avg"], pairs[0][0].state[ref[1].weight]["exp_avg"])
    kept = w.detach().clone()
    opt.zero_grad()
    with opt.last_micro_batch():
        loss(ours, X).backward()
    assert torch.equal(w, kept)
    opt.step()
    assert torch.equal(w, kept)
    pairs[0][0].zero_grad()
    loss(ref, X).backward()
    pairs[0][0].step()
    same(ref, ours)
    both(*pairs, lambda o, L: o.param_groups[0]["params"].append(L[1].weight))  # back: its state continues
    train(pairs)
    same(ref, ours)
    # a parameter removed before it was ever updated: nothing kept, its host memory freed
    bytes_before = opt.stats()["host_state_bytes"]
    both(*pairs, lambda o, L: o.add_param_group({"params": params(L, 2)}))
    added = opt.stats()["host_state_bytes"] - bytes_before
    both(*pairs, lambda o, L: o.param_groups.pop())
    train(pairs)
    assert opt.stats()["host_state_bytes"] == bytes_before and added > 0
    same(ref, ours)
    opt.close()


def test_state_entry_moved_to_the_replacement_as_torch():
    """``opt.state[new] = opt.state.pop(old)`` (Accelerate-style replacements where the user carries the state)
    carries it: the replacement continues from it, bit for bit; ``del opt.state[p]`` restarts p's state."""
    ref, ours = linears()
    pairs = ((torch.optim.AdamW(params(ref, 0, 1), lr=LR), ref), (OffloadAdamW(params(ours, 0, 1), lr=LR, threads=1),
                                                                   ours))
    train(pairs)

    def swap(o, L):
        with torch.no_grad():
            L[2].weight.copy_(L[0].weight)
        o.param_groups[0]["params"][0] = L[2].weight
        o.state[L[2].weight] = o.state.pop(L[0].weight)
        del o.state[L[1].bias]
    both(*pairs, swap)
    assert ours[0].weight not in pairs[1][0].state
    train(pairs, steps=3)
    same(ref, ours)
    sd_ref, sd_ours = pairs[0][0].state_dict(), pairs[1][0].state_dict()
    assert sd_ref["state"].keys() == sd_ours["state"].keys()
    for k in sd_ref["state"]:
        for key, v in sd_ref["state"][k].items():
            assert torch.equal(v, sd_ours["state"][k][key]), (k, key)
    pairs[1][0].close()


def test_state_dict_with_state_of_a_replaced_parameter_raises_as_torch():
    """torch's state_dict() raises KeyError while ``opt.state`` holds an entry of a parameter in no group; so does
    ours (naming the way out), and after ``del opt.state[old]`` both work."""
    ref, ours = linears(2)
    pairs = ((torch.optim.AdamW(params(ref, 0), lr=LR), ref), (OffloadAdamW(params(ours, 0), lr=LR, threads=1), ours))
    train(pairs)
    both(*pairs, lambda o, L: o.param_groups[0].__setitem__("params", params(L, 1)))
    train(pairs)
    for opt, _ in pairs:
        with pytest.raises(KeyError):
            opt.state_dict()
    both(*pairs, lambda o, L: [o.state.pop(p) for p in params(L, 0)])
    assert len(pairs[1][0].state) == len(pairs[0][0].state) == 2
    assert pairs[1][0].state_dict()["state"].keys() == pairs[0][0].state_dict()["state"].keys()
    pairs[1][0].close()


def test_all_parameters_replaced_restart_the_engine():
    """Every registered parameter replaced before an update (Accelerate's FSDP2 swap): the old state is freed and
    the engine starts again from the new parameters (on the device they are on)."""
    ref, ours = linears()
    opt = OffloadAdamW(params(ours, 0, 1), lr=LR, threads=1)
    ref_opt = torch.optim.AdamW(params(ref, 0, 1), lr=LR)
    first = opt._engine
    both((ref_opt, ref), (opt, ours), lambda o, L: o.param_groups[0].__setitem__("params", params(L, 2)))
    train(((ref_opt, ref), (opt, ours)))
    assert opt._engine is not first and first.closed
    assert opt.stats()["params"] == 2
    same(ref, ours)
    opt.close()


# -- item 2: no silent skip -----------------------------------------------------------------------------------


def test_parameter_that_cannot_be_registered_raises_naming_it():
    """A parameter put into a group by an edit that the optimizer cannot take (float64) raises at step(), naming its
    group, position and shape, with nothing updated; removed again, the run goes on."""
    ref, ours = linears(2)
    opt = OffloadAdamW(params(ours, 0), lr=LR, threads=1)
    bad = nn.Parameter(torch.ones(3, 2, dtype=torch.float64))
    opt.param_groups[0]["params"].append(bad)
    loss(ours, X).backward()
    bad.grad = torch.ones_like(bad)
    before = [p.detach().clone() for p in ours[0].parameters()]
    with pytest.raises(TypeError, match=r"param group 0, parameter 2 \(shape \(3, 2\), torch.float64\)"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, ours[0].parameters()))
    opt.param_groups[0]["params"].pop()
    opt.step()
    assert not any(torch.equal(a, b) for a, b in zip(before, ours[0].parameters()))
    with pytest.raises(TypeError, match="param group 0, parameter 0: a str"):
        opt.param_groups[0]["params"].insert(0, "weight")
        opt.step()
    opt.close()


def test_parameter_listed_in_two_groups_raises_naming_it():
    """A parameter in two groups (an edit; torch's add_param_group refuses it, its step updates it twice) raises."""
    _, ours = linears(2)
    opt = OffloadAdamW([{"params": params(ours, 0)}, {"params": params(ours, 1)}], lr=LR, threads=1)
    opt.param_groups[1]["params"].append(ours[0].weight)
    loss(ours, X).backward()
    with pytest.raises(NotImplementedError, match=r"param group 1 lists a parameter that param group 0 lists too \(position 2"):
        opt.step()
    opt.close()


def test_zero1_edit_outside_the_partition_refused():
    """zero_stage=1 skips only the parameters the partition gives another rank; a parameter an edit put into
    param_groups is not in the partition: step() raises naming it (add_param_group partitions it)."""
    dist = torch.distributed
    if dist.is_initialized():
        pytest.skip("a process group is already initialised")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    try:
        ref, ours = linears(2)
        opt = OffloadAdamW(params(ours, 0), lr=LR, threads=1, zero_stage=1)
        ref_opt = torch.optim.AdamW(params(ref, 0), lr=LR)
        opt.param_groups[0]["params"].append(ours[1].weight)
        loss(ours, X).backward()
        with pytest.raises(NotImplementedError, match=r"param group 0, parameter 2 .* not in zero_stage=1's partition"):
            opt.step()
        opt.param_groups[0]["params"].pop()
        both((ref_opt, ref), (opt, ours), lambda o, L: o.add_param_group({"params": params(L, 1)}))
        train(((ref_opt, ref), (opt, ours)))
        same(ref, ours)
        opt.close()
    finally:
        dist.destroy_process_group()


# -- item 3: every group key honoured or refused ----------------------------------------------------------------

PER_GROUP = [("lr", 3e-2), ("betas", (0.8, 0.95)), ("eps", 1e-5), ("weight_decay", 0.3), ("amsgrad", True),
             ("maximize", True), ("foreach", True), ("foreach", False), ("fused", True),
             ("decoupled_weight_decay", False), ("decoupled_weight_decay", True)]


@pytest.mark.parametrize("cls,ref_cls", [(OffloadAdam, torch.optim.Adam), (OffloadAdamW, torch.optim.AdamW)],
                         ids=["Adam", "AdamW"])
@pytest.mark.parametrize("key,value", PER_GROUP, ids=[f"{k}={v}" for k, v in PER_GROUP])
def test_every_group_key_works_per_group(cls, ref_cls, key, value):
    """Each key of a torch Adam/AdamW group, set in one group only, at construction and in a group added later whose
    parameters come by a list edit: bit for bit with torch's."""
    ref, ours = linears()
    pairs = []
    for opt_cls, L, kw in ((ref_cls, ref, {}), (cls, ours, {"threads": 1})):
        opt = opt_cls([{"params": params(L, 0)}, {"params": params(L, 1), key: value}], lr=LR, weight_decay=0.1, **kw)
        pairs.append((opt, L))
    train(pairs)
    both(*pairs, lambda o, L: o.add_param_group({"params": [], key: value}))
    both(*pairs, lambda o, L: o.param_groups[2]["params"].extend(params(L, 2)))
    train(pairs, steps=3)
    same(ref, ours)
    pairs[1][0].close()


@pytest.mark.parametrize("key", ["capturable", "differentiable"])
def test_refused_key_of_a_group_whose_parameters_came_by_an_edit(key):
    """A group asking for what is not offered raises NotImplementedError at the step that would register its new
    parameters (nothing updated), and at add_param_group, never ignored."""
    _, ours = linears(2)
    opt = OffloadAdamW([{"params": params(ours, 0)}], lr=LR, threads=1)
    with pytest.raises(NotImplementedError, match=f"param group 1: {key}=True is not offered"):
        opt.add_param_group({"params": params(ours, 1), key: True})
    opt.param_groups.append({**opt.param_groups[0], "params": params(ours, 1), key: True})
    loss(ours, X).backward()
    before = [p.detach().clone() for m in ours for p in m.parameters()]
    with pytest.raises(NotImplementedError, match=f"param group 1: {key}=True is not offered"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, (p for m in ours for p in m.parameters())))
    opt.close()


def test_unknown_group_keys_kept_as_torch():
    """Keys torch does not read (schedulers' ``initial_lr``, a user's ``name``) are kept, saved and loaded as torch's."""
    ref, ours = linears(2)
    pairs = [(cls([{"params": params(L, 0), "name": "body"}, {"params": params(L, 1)}], lr=LR, **kw), L)
             for cls, L, kw in ((torch.optim.AdamW, ref, {}), (OffloadAdamW, ours, {"threads": 1}))]
    scheds = [torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.5) for o, _ in pairs]
    for _ in range(2):
        train(pairs, steps=1)
        for s in scheds:
            s.step()
    same(ref, ours)
    g_ref, g_ours = (o.state_dict()["param_groups"] for o, _ in pairs)
    assert g_ref == g_ours and g_ours[0]["name"] == "body" and "initial_lr" in g_ours[1]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pairs[1][0].load_state_dict(pairs[1][0].state_dict())
    assert pairs[1][0].param_groups[0]["name"] == "body"
    pairs[1][0].close()


# -- CUDA graphs (issue 40 item 4) ---------------------------------------------------------------


def test_backward_captured_in_a_cuda_graph_is_refused_at_capture(monkeypatch):
    """A gradient hook that finds a CUDA graph capture under way raises, naming the setting to change (the hooks of
    host-updated parameters would not run at replay). The capture itself is the GPU test's; here it is faked."""
    from trainstream.torch import _grads

    model = torch.nn.Linear(4, 3)
    opt = OffloadAdamW(model.parameters(), lr=1e-2, threads=1)
    monkeypatch.setattr(_grads, "_capturing", lambda p: True)
    with pytest.raises(RuntimeError, match="captured in a CUDA graph.*disable_cuda_graphs=True"):
        model(torch.ones(2, 4)).sum().backward()
    monkeypatch.undo()
    opt.zero_grad()
    ref = copy.deepcopy(model)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for m, o in ((model, opt), (ref, ropt)):  # nothing changed: training goes on as torch's
        m(torch.ones(2, 4)).sum().backward()
        o.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))
    opt.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none present)")
def test_cuda_graph_capture_of_backward_raises_in_cpu_mode():
    model = torch.nn.Linear(64, 64).cuda()
    opt = OffloadAdamW(model.parameters(), lr=1e-2)
    x = torch.randn(8, 64, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up outside the graph, as torch's docs do
        model(x).sum().backward()
    torch.cuda.current_stream().wait_stream(s)
    opt.zero_grad(set_to_none=False)
    g = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="captured in a CUDA graph"):
        with torch.cuda.graph(g):
            model(x).sum().backward()
    opt.close()


def test_deepcopy_keeps_the_state_of_a_parameter_in_no_group():
    """A parameter replaced in param_groups after an update keeps its state entry, in a copy too: both state_dict()s
    raise KeyError, as torch's (the fuzzer's finding)."""
    for cls in (torch.optim.AdamW, OffloadAdamW):
        torch.manual_seed(0)
        a, b = nn.Linear(3, 2), nn.Linear(3, 2)
        opt = cls(a.parameters(), lr=0.1)
        a(torch.ones(1, 3)).sum().backward()
        opt.step()
        opt.param_groups[0]["params"] = list(b.parameters())
        if cls is OffloadAdamW:
            b(torch.ones(1, 3)).sum().backward()
            opt.step()  # ours learns of the edit at a step
        for o in (opt, copy.deepcopy(opt)):
            with pytest.raises(KeyError):
                o.state_dict()
            if isinstance(o, OffloadAdamW):
                o.close()


def test_state_moved_onto_a_parameter_of_another_dtype_raises_as_torch():
    """A bf16 entry moved onto an fp16 parameter: torch's step raises; ours too (a ValueError naming it, before any
    weight changes), rather than casting it (the fuzzer's finding)."""
    raised = []
    for cls in (torch.optim.AdamW, OffloadAdamW):
        torch.manual_seed(0)
        a, b = nn.Linear(3, 2).to(torch.bfloat16), nn.Linear(3, 2).to(torch.float16)
        opt = cls(a.parameters(), lr=0.1)
        a(torch.ones(1, 3, dtype=torch.bfloat16)).float().sum().backward()
        opt.step()
        opt.param_groups[0]["params"] = list(b.parameters())
        for pa, pb in zip(a.parameters(), b.parameters()):
            opt.state[pb] = opt.state.pop(pa)
        b(torch.ones(1, 3, dtype=torch.float16)).float().sum().backward()
        before = [p.detach().clone() for p in b.parameters()]
        with pytest.raises((RuntimeError, ValueError)) as exc:
            opt.step()
        raised.append(exc.type)
        if cls is OffloadAdamW:  # (torch's for-each step has decayed the weights before it raises)
            assert all(torch.equal(x, y) for x, y in zip(before, b.parameters()))
            assert "holds exp_avg in torch.bfloat16" in str(exc.value)
            opt.close()

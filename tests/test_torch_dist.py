"""OffloadAdamW in runs of several processes, each rank offloading only what it updates:
FSDP2 (``fully_shard``, HSDP, ``MixedPrecisionPolicy``, uneven and empty shards),
torch.distributed.checkpoint both ways, DDP and ``zero_stage=1``. Two gloo ranks
(``torch.multiprocessing.spawn``); the CUDA variants, marked ``gpu``, put both ranks on
one GPU (NCCL refuses that). Each scenario is bitwise against the same sharded run with
``torch.optim.AdamW``: every rank's local shard after every step, flags reduced over the
ranks. The scenarios of a job share one spawn (start-up paid once); a scenario that raises
stops its job, and the tests of the scenarios after it report that error.
"""

from __future__ import annotations

import copy
import datetime
import faulthandler
import gc
import json
import os
import socket
import traceback

import pytest

torch = pytest.importorskip("torch")
dist = torch.distributed
if not dist.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

import torch.multiprocessing as mp  # noqa: E402
from torch import nn  # noqa: E402

from trainstream import _cores  # noqa: E402
from trainstream.torch import OffloadAdamW  # noqa: E402

LR, WD = 1e-2, 0.05


# -- the harness ----------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dump(results: dict, out: str, rank: int) -> None:
    with open(os.path.join(out, f"results{rank}.json"), "w") as f:
        json.dump(results, f)


def _rank_main(rank: int, world: int, port: int, job: str, device: str, out: str) -> None:
    faulthandler.enable()  # a crash (a signal) prints the rank's Python stack
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)  # 2 ranks on a 2-core machine: spinning intra-op threads starve the workers
    if device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    results: dict[str, dict] = {}
    try:
        for name, fn in JOBS[job]:
            if device == "cuda" and name in GLOO_CUDA_CRASH:
                continue
            try:
                checks = fn(rank, device, out)
            except Exception:  # noqa: BLE001 - reported by the test of this scenario
                results[name] = {"error": f"rank {rank}: {traceback.format_exc()[-3000:]}"}
                break
            flags = torch.tensor([int(bool(v)) for v in checks.values()] or [1])
            dist.all_reduce(flags, op=dist.ReduceOp.MIN)  # every rank's shards
            results[name] = {"checks": dict(zip(checks, map(bool, flags.tolist())))}
            if rank == 0:  # after each scenario: a crash later (a signal) keeps what ran
                _dump(results, out, rank)
    finally:
        if rank == 0 or any("error" in r for r in results.values()):
            _dump(results, out, rank)
        gc.collect()  # FSDP2's modules, collected after the group is gone, aborted the exit (torch 2.13, gloo)
        dist.destroy_process_group()


def _run(job: str, device: str, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp(f"{job}_{device}")
    try:
        mp.spawn(_rank_main, args=(2, _free_port(), job, device, str(out)), nprocs=2, join=True)
    except Exception as exc:  # noqa: BLE001 - the scenarios' own reports say more
        failure = f"{type(exc).__name__}: {exc}"
    else:
        failure = "no result"
    results: dict = {}
    for rank in (1, 0):  # rank 0's report wins; an error of rank 1 fills the gaps
        path = out / f"results{rank}.json"
        if path.exists():
            results.update(json.loads(path.read_text()))
    results["__failure__"] = failure
    return results


def _check(results: dict, name: str) -> None:
    r = results.get(name)
    if r is None:
        job = next(names for names in (FSDP, DDP) if name in names)
        first = next(n for n in job if n not in results)  # where the job stopped
        where = "it stopped in this scenario" if first == name else f"the job stopped in {first}"
        pytest.fail(f"scenario {name} did not run ({where}): {results['__failure__']}; earlier errors: "
                    + "; ".join(v["error"] for v in results.values() if isinstance(v, dict) and "error" in v))
    assert "error" not in r, r["error"]
    failed = [k for k, ok in r["checks"].items() if not ok]
    assert not failed, f"{name}: checks failed on some rank: {failed}"


def _all(flags) -> bool:
    return all(bool(f) for f in flags)


def _same(a: nn.Module, b: nn.Module) -> bool:
    """Every parameter's local shard bitwise equal."""
    def loc(t):
        return t.to_local() if hasattr(t, "to_local") else t
    return all(torch.equal(loc(p), loc(q)) for p, q in zip(a.parameters(), b.parameters()))


def _x(step: int, mb: int, rank: int, device: str, n_in: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + 10 * mb + rank)
    return torch.randn(6, n_in, generator=g).to(device)


# -- FSDP2 ------------------------------------------------------------------------------------------

def _fsdp(device: str, mp_policy=None, mesh_shape=(2,), dtype=torch.float32):
    """Linear(5,7) (7 rows: 4 | 3, uneven), Linear(7,9), Linear(9,1) (1 row: rank 1's weight
    and bias shards are empty), each layer and the root fully_shard-ed."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 9), nn.GELU(), nn.Linear(9, 1)).to(device, dtype)
    names = ("replicate", "shard") if len(mesh_shape) == 2 else None
    mesh = init_device_mesh(device, mesh_shape, mesh_dim_names=names)
    kw = {} if mp_policy is None else {"mp_policy": mp_policy}
    for i in (0, 2, 4):
        fully_shard(m[i], mesh=mesh, **kw)
    fully_shard(m, mesh=mesh, **kw)
    return m


def _groups(m, split):
    if not split:
        return m.parameters()
    first = [m[0].weight, m[4].weight]
    return [{"params": first, "lr": 2e-2, "weight_decay": 0.1},
            {"params": [p for p in m.parameters() if all(p is not q for q in first)], "lr": 5e-3, "weight_decay": 0.0}]


def _fsdp_pair(rank, device, *, mp_policy=None, mesh_shape=(2,), micro=1, nosync=False, clip=None,
               split=False, eager=False, steps=4, **kw):
    """The reference (torch.optim.AdamW, the user's clip_grad_norm_ over model.parameters())
    and OffloadAdamW on the same FSDP2 model. ``clip``: "user" (clip_grad_norm_ in both
    loops), "max" (max_grad_norm), "method" (opt.clip_grad_norm(0.05, parameters=...))."""
    ref, tst = _fsdp(device, mp_policy, mesh_shape), _fsdp(device, mp_policy, mesh_shape)
    opt_r = torch.optim.AdamW(_groups(ref, split), lr=LR, weight_decay=WD)
    opt_t = OffloadAdamW(_groups(tst, split), lr=LR, weight_decay=WD,
                         max_grad_norm=0.05 if clip == "max" else None, **kw)
    flags, norms = [], []
    for step in range(steps):
        for model, opt in ((ref, opt_r), (tst, opt_t)):
            for mb in range(micro):
                last = mb == micro - 1
                if nosync:
                    model.set_requires_gradient_sync(last)
                loss = model(_x(step, mb, rank, device, 5)).square().mean()
                if eager and last and opt is opt_t:
                    with opt.last_micro_batch():
                        loss.backward()
                else:
                    loss.backward()
            if clip == "user" or (clip and opt is opt_r):
                norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05).to_local().item())
            elif clip == "method":
                norms.append(opt.clip_grad_norm(0.05, parameters=model.parameters()).to_local().item())
            opt.step()
            if clip == "max" and opt is opt_t:
                norms.append(opt.last_grad_norm())
            opt.zero_grad()
        flags.append(_same(ref, tst))
    opt_t.close()
    return flags, norms[0::2] == norms[1::2]


def fsdp_fp32(rank, device, out):
    m = _fsdp(device)
    shards = [tuple(p.to_local().shape) for p in m.parameters()]
    opt = OffloadAdamW(m.parameters(), lr=LR)
    st = opt.stats()
    opt.close()
    flags, _ = _fsdp_pair(rank, device)
    return {"uneven and empty shards": shards == ([(4, 5), (4,), (5, 7), (5,), (1, 9), (1,)] if rank == 0
                                                  else [(3, 5), (3,), (4, 7), (4,), (0, 9), (0,)]),
            "one slot per local shard": st["params"] == 6 and st["numel"] == sum(map(_numel, shards)),
            "threads from the local world size": st["threads"] == _cores.default_threads(2),
            "local_rank in stats": st["local_rank"] == rank and st["local_world_size"] == 2,
            "bit-identical": _all(flags)}


def _numel(shape):
    n = 1
    for s in shape:
        n *= s
    return n


def fsdp_accumulation(rank, device, out):
    return {"with sync": _all(_fsdp_pair(rank, device, micro=3)[0]),
            "without sync": _all(_fsdp_pair(rank, device, micro=3, nosync=True)[0])}


def fsdp_clipping(rank, device, out):
    """The user's clip_grad_norm_ (foreach on DTensors: no version moves), max_grad_norm
    and clip_grad_norm(): the same norms, the same bits."""
    out = {}
    for clip in ("user", "max", "method"):
        flags, norms = _fsdp_pair(rank, device, clip=clip, micro=2)
        out[f"{clip}: bit-identical"], out[f"{clip}: norms"] = _all(flags), norms
    return out


def fsdp_param_groups(rank, device, out):
    flags, norms = _fsdp_pair(rank, device, split=True, clip="method", micro=2, nosync=True)
    return {"bit-identical": _all(flags), "norms in the model's order": norms}


def fsdp_mixed_precision(rank, device, out):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    out = {}
    for name, pol, kw in (("bf16, fp32 reduce, no-sync, max_grad_norm",
                           MixedPrecisionPolicy(torch.bfloat16, torch.float32), dict(micro=2, nosync=True, clip="max")),
                          ("bf16, bf16 reduce, sync, user clip",
                           MixedPrecisionPolicy(torch.bfloat16), dict(micro=2, clip="user"))):
        flags, norms = _fsdp_pair(rank, device, mp_policy=pol, **kw)
        out[name] = _all(flags) and norms
    m = _fsdp(device, MixedPrecisionPolicy(torch.bfloat16))
    out["sharded parameters stay fp32"] = all(p.dtype == torch.float32 for p in m.parameters())
    return out


def fsdp_hsdp(rank, device, out):
    """A (replicate 2, shard 1) mesh: placements (Replicate, Shard(0))."""
    out = {}
    for name, kw in (("sync, user clip", dict(micro=2, clip="user")),
                     ("no-sync, max_grad_norm", dict(micro=2, nosync=True, clip="max"))):
        flags, norms = _fsdp_pair(rank, device, mesh_shape=(2, 1), **kw)
        out[name] = _all(flags) and norms
    return out


def fsdp_eager(rank, device, out):
    return {"last_micro_batch": _all(_fsdp_pair(rank, device, micro=2, eager=True)[0])}


def fsdp_weight_edits(rank, device, out):
    """Weights changed between steps: model.load_state_dict (moves only the DTensor's
    version counter) and an edit of the local shard (only the local tensor's)."""
    ref, tst = _fsdp(device), _fsdp(device)
    opt_r = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD)
    opt_t = OffloadAdamW(tst.parameters(), lr=LR, weight_decay=WD)
    flags = []
    for step in range(4):
        for model, opt in ((ref, opt_r), (tst, opt_t)):
            if step == 1:
                model.load_state_dict({k: v * 0.5 for k, v in model.state_dict().items()})
            if step == 2:
                with torch.no_grad():
                    model[2].weight.to_local().add_(0.25)
            model(_x(step, 0, rank, device, 5)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        flags.append(_same(ref, tst))
    opt_t.close()
    return {"edits followed": _all(flags)}


def fsdp_refusals(rank, device, out):
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    m = _fsdp(device)
    got = {}
    for name, kw, exc in (("overlap_forward", dict(overlap_forward=m), NotImplementedError),
                          ("zero_stage=1", dict(zero_stage=1), ValueError)):
        try:
            OffloadAdamW(m.parameters(), **kw).close()
        except exc as e:
            got[name] = "not built" in str(e) or "sharded already" in str(e)
        else:
            got[name] = False
    if device == "cuda":
        c = nn.Linear(4, 4).to(device)
        fully_shard(c, offload_policy=CPUOffloadPolicy())
        try:
            OffloadAdamW(c.parameters()).close()
        except ValueError as e:
            got["CPUOffloadPolicy"] = "CPUOffloadPolicy" in str(e)
        else:
            got["CPUOffloadPolicy"] = False
    return got


# -- torch.distributed.checkpoint -----------------------------------------------------------------

def _train(model, opt, steps, first, rank, device):
    dtype = next(model.parameters()).dtype
    for step in range(first, first + steps):
        model(_x(step, 0, rank, device, 5).to(dtype)).square().mean().backward()
        opt.step()
        opt.zero_grad()


def _make(cls, device, dtype=torch.float32):
    m = _fsdp(device, dtype=dtype)
    half = dict(master_weights=True) if cls is OffloadAdamW and dtype != torch.float32 else {}
    return m, cls(m.parameters(), lr=LR, weight_decay=WD, **half)


def _close(*opts):
    for o in opts:
        if isinstance(o, OffloadAdamW):
            o.close()


def _state_same(a, b) -> bool:
    return all(torch.equal(a[k][n].to_local().cpu(), b[k][n].to_local().cpu()) for k in a for n in ("exp_avg", "exp_avg_sq")) \
        and all(float(a[k]["step"]) == float(b[k]["step"]) for k in a) and a.keys() == b.keys()


def dcp_round_trips(rank, device, out):
    """dcp.save of model and optimizer after 2 steps, dcp.load into a fresh pair, 2 more
    steps: bitwise the uninterrupted run, in every direction with torch.optim.AdamW."""
    got = {}
    for src, dst in ((torch.optim.AdamW, OffloadAdamW), (OffloadAdamW, torch.optim.AdamW), (OffloadAdamW, OffloadAdamW)):
        got.update(_dcp_resume(src, dst, f"{src.__name__} -> {dst.__name__}", rank, device, out))
    return got


def _dcp_resume(src, dst, name, rank, device, out):
    """One direction of :func:`dcp_round_trips` (``src``, ``dst``: optimizer factories;
    ``name`` labels the checks and the checkpoint)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)
    from torch.distributed.tensor import DTensor

    got = {}
    ckpt = os.path.join(out, name.replace(" ", "").replace(">", ""))
    ma, oa = _make(src, device)
    _train(ma, oa, 4, 0, rank, device)
    mb, ob = _make(src, device)
    _train(mb, ob, 2, 0, rank, device)
    osd = get_optimizer_state_dict(mb, ob)
    got[f"{name}: DTensor state under the FQNs"] = all(
        isinstance(st["exp_avg"], DTensor) for st in osd["state"].values()) and "4.weight" in osd["state"]
    dcp.save({"model": get_model_state_dict(mb), "optim": osd}, checkpoint_id=ckpt)
    mc, oc = _make(dst, device)
    sd = {"model": get_model_state_dict(mc), "optim": get_optimizer_state_dict(mc, oc)}
    dcp.load(sd, checkpoint_id=ckpt)
    set_model_state_dict(mc, sd["model"])
    set_optimizer_state_dict(mc, oc, sd["optim"])
    _train(mc, oc, 2, 2, rank, device)
    got[f"{name}: resumed bit-identically"] = _same(ma, mc)
    got[f"{name}: the same state"] = _state_same(get_optimizer_state_dict(ma, oa)["state"],
                                                 get_optimizer_state_dict(mc, oc)["state"])
    _close(oa, ob, oc)
    return got


def fsdp_resident(rank, device, out):
    """``gpu_state_bytes=256`` on FSDP2 shards: each rank keeps in GPU memory the state of its
    local shards that fit, in order (8 bytes an element, at least 8 a shard: rank 0 the 20 + 4 +
    5 + 1 elements of weight and bias shards, rank 1 15 + 3 + 4 and its two empty shards), the
    rest in host memory; it trains bitwise like torch.optim.AdamW, and DCP round trips both ways
    with torch.optim.AdamW resume bit-identically. ``gpu_state_bytes="auto"``: every shard's
    state moves to GPU memory after the first step, bitwise the same. Without CUDA: refused."""
    if device != "cuda":
        m, got = _fsdp(device), {}
        for budget in (256, "auto"):
            try:
                OffloadAdamW(m.parameters(), gpu_state_bytes=budget).close()
                got[f"{budget!r} refused without CUDA"] = False
            except ValueError as e:
                got[f"{budget!r} refused without CUDA"] = "needs CUDA parameters" in str(e)
        return got

    def resident(params, **kw):
        return OffloadAdamW(params, gpu_state_bytes=256, **kw)

    m, o = _make(resident, device)
    st = o.stats()
    want = {0: (4, 8 * (20 + 4 + 5 + 1)), 1: (5, 8 * (15 + 3 + 4) + 8 + 8)}[rank]
    got = {"resident shards": (st["gpu_state_params"], st["gpu_state_bytes"]) == want}
    _close(o)
    ma, oa = _make(torch.optim.AdamW, device)
    _train(ma, oa, 4, 0, rank, device)
    mr, o = _make(resident, device)
    _train(mr, o, 4, 0, rank, device)
    got["trains bitwise like torch.optim.AdamW"] = _same(ma, mr)
    _close(o)
    mu, o = _make(lambda params, **kw: OffloadAdamW(params, gpu_state_bytes="auto", **kw), device)
    _train(mu, o, 4, 0, rank, device)
    got["'auto' trains bitwise like torch.optim.AdamW"] = _same(ma, mu)
    st = o.stats()  # all of this rank's shards moved after the first step
    got["'auto': every shard's state in GPU memory"] = st["gpu_state_params"] == st["params"] and not st["host_state_bytes"]
    _close(o)
    for src, dst, name in ((torch.optim.AdamW, resident, "AdamW -> resident"),
                           (resident, torch.optim.AdamW, "resident -> AdamW")):
        got.update(_dcp_resume(src, dst, name, rank, device, out))
    return got


def dcp_full_state_dict(rank, device, out):
    """get/set_*_state_dict with full_state_dict=True (gathered tensors), the model's weights
    set first: the optimizer's hidden zero-gradient step (lr 0) must use the loaded weights."""
    return _full_state_dict_pairs(rank, device, [(OffloadAdamW, torch.optim.AdamW), (torch.optim.AdamW, OffloadAdamW),
                                                 (OffloadAdamW, OffloadAdamW)])


def _full_state_dict_pairs(rank, device, pairs):
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict, set_model_state_dict,
                                                         set_optimizer_state_dict)

    opts = StateDictOptions(full_state_dict=True)
    got = {}
    for src, dst in pairs:
        ma, oa = _make(src, device)
        _train(ma, oa, 2, 0, rank, device)
        # a copy, as through a file: in one process torch.optim.AdamW would load the source's
        # own `step` tensors and the two optimizers would advance them both
        full = copy.deepcopy(get_optimizer_state_dict(ma, oa, options=opts))
        mc, oc = _make(dst, device)
        set_model_state_dict(mc, get_model_state_dict(ma, options=opts), options=opts)
        set_optimizer_state_dict(mc, oc, full, options=opts)
        _train(ma, oa, 2, 2, rank, device)
        _train(mc, oc, 2, 2, rank, device)
        got[f"{src.__name__} -> {dst.__name__}"] = _same(ma, mc)
        _close(oa, oc)
    return got


# -- DDP and zero_stage=1 --------------------------------------------------------------------------

def _mlp(device):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 31), nn.Tanh(), nn.Linear(31, 17), nn.GELU(), nn.Linear(17, 1)).to(device)


def _ddp(device, gabv=False):
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(_mlp(device), gradient_as_bucket_view=gabv, device_ids=[0] if device == "cuda" else None)


def _ddp_pair(rank, device, *, micro=2, clip=None, gabv=False, set_to_none=True, manual=False, split=False,
              steps=4, ref=None, tst=None, opt_r=None, opt_t=None, first=0, **kw):
    """torch.optim.AdamW and OffloadAdamW on DDP models (``manual``: plain models whose
    gradients the loop all-reduces and averages by hand), ``micro`` micro-batches under
    ``no_sync`` but the last; ``clip``: "user" (clip_grad_norm_ in both loops) or "max"."""
    ref = ref or (_mlp(device) if manual else _ddp(device, gabv))
    tst = tst or (_mlp(device) if manual else _ddp(device, gabv))
    opt_r = opt_r or torch.optim.AdamW(_mlp_groups(ref, split), lr=LR, weight_decay=WD)
    opt_t = opt_t or OffloadAdamW(_mlp_groups(tst, split), lr=LR, weight_decay=WD,
                                  max_grad_norm=0.05 if clip == "max" else None, **kw)
    flags = []
    for step in range(first, first + steps):
        for model, opt in ((ref, opt_r), (tst, opt_t)):
            for mb in range(micro):
                if mb < micro - 1 and not manual:
                    with model.no_sync():
                        model(_x(step, mb, rank, device, 5)).square().mean().backward()
                else:
                    model(_x(step, mb, rank, device, 5)).square().mean().backward()
            if manual:
                for p in model.parameters():
                    dist.all_reduce(p.grad)
                    p.grad.div_(2)
            if clip == "user" or (clip and opt is opt_r):
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            opt.step()
            opt.zero_grad(set_to_none=set_to_none)
        flags.append(_same(ref, tst))
    return flags, ref, tst, opt_r, opt_t


def _mlp_groups(m, split):
    if not split:
        return m.parameters()
    ps = list(m.parameters())
    return [{"params": ps[0::2], "weight_decay": 0.1}, {"params": ps[1::2], "lr": 5e-3, "weight_decay": 0.0}]


def ddp_default(rank, device, out):
    """Gradients taken at step(), after DDP's all-reduce: one copy per parameter and step,
    none in the hooks (which see this rank's own gradient)."""
    got = {}
    for name, kw in (("no_sync, user clip", dict(clip="user")),
                     ("bucket views, zero_grad to zeros, max_grad_norm", dict(clip="max", gabv=True, set_to_none=False)),
                     ("one micro-batch", dict(micro=1))):
        flags, _, tst, _, opt = _ddp_pair(rank, device, **kw)
        st = opt.stats()
        got[name] = _all(flags)
        got[f"{name}: one copy per step"] = st["grad_bytes_offloaded"] == 4 * st["numel"] * 4
        opt.consolidate_state_dict()  # Lightning calls it wherever it exists: a no-op here
        got[f"{name}: state_dict after consolidate_state_dict"] = len(opt.state_dict()["state"]) == 6
        opt.close()
    return got


def ddp_manual_all_reduce(rank, device, out):
    """No DDP: the loop all-reduces param.grad by hand after backward."""
    flags, *_, opt = _ddp_pair(rank, device, manual=True, clip="max")
    opt.close()
    return {"bit-identical": _all(flags)}


def ddp_last_micro_batch_refused(rank, device, out):
    m = _ddp(device)
    opt = OffloadAdamW(m.parameters())
    try:
        with opt.last_micro_batch():
            pass
    except NotImplementedError as e:
        ok = "unreduced" in str(e)
    else:
        ok = False
    opt.close()
    return {"refused": ok}


def zero1(rank, device, out):
    """zero_stage=1: ZeroRedundancyOptimizer's partition, state only for it, bitwise
    DDP + torch.optim.AdamW with no_sync and the user's clip; the consolidated state dict
    is torch.optim.AdamW's, on either rank; it resumes either way."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    flags, ref, tst, opt_r, opt = _ddp_pair(rank, device, clip="user", zero_stage=1)
    zro = ZeroRedundancyOptimizer(list(tst.parameters()), optimizer_class=torch.optim.AdamW, lr=LR)
    mine = {id(p) for p in zro._partition_parameters()[rank][0]["params"]}
    got = {"bit-identical": _all(flags),
           "ZeroRedundancyOptimizer's partition": {id(p) for p in opt.state} == mine,
           "state only for the partition": opt.stats()["numel"] == sum(p.numel() for p in tst.parameters()
                                                                         if id(p) in mine)}
    try:
        opt.state_dict()
        got["state_dict() without consolidation raises"] = False
    except RuntimeError as e:
        got["state_dict() without consolidation raises"] = "consolidate_state_dict" in str(e)
    rsd = opt_r.state_dict()
    for to in (0, 1):
        opt.consolidate_state_dict(to=to)
        if rank == to:
            sd = opt.state_dict()
            got[f"consolidated on rank {to} is torch.optim.AdamW's"] = (
                sd["param_groups"] == rsd["param_groups"] and sd["state"].keys() == rsd["state"].keys()
                and all(torch.equal(sd["state"][i][k].cpu(), rsd["state"][i][k].cpu())
                        for i in rsd["state"] for k in rsd["state"][i]))
    # torch.optim.AdamW's state dict (the reference run's) into a fresh zero_stage=1 optimizer
    # on a copy of the reference model: both go on bitwise
    tst2 = _ddp(device)
    tst2.module.load_state_dict(ref.module.state_dict())
    opt2 = OffloadAdamW(tst2.parameters(), lr=LR, weight_decay=WD, zero_stage=1)
    opt2.load_state_dict(rsd)
    flags2, *_ = _ddp_pair(rank, device, clip="user", ref=ref, tst=tst2, opt_r=opt_r, opt_t=opt2,
                           first=4, steps=2)
    got["resumed from torch.optim.AdamW's state dict"] = _all(flags2)
    opt.close()
    opt2.close()
    return got


def zero1_groups_max_grad_norm(rank, device, out):
    flags, *_, opt = _ddp_pair(rank, device, clip="max", split=True, gabv=True, zero_stage=1)
    opt.close()
    return {"bit-identical": _all(flags)}


def worker_cores_auto(rank, device, out):
    """worker_cores="auto": disjoint slices of the cores, the default thread count from them."""
    opt = OffloadAdamW(_mlp(device).parameters(), worker_cores="auto")
    cores = opt._slots.cores
    st = opt.stats()
    opt.close()
    every = [None, None]
    dist.all_gather_object(every, cores)
    return {"disjoint slices": not set(every[0]) & set(every[1]) and all(every),
            "threads from the slice": st["threads"] == _cores.default_threads(cores=cores),
            "cores in stats": st["worker_cores"] == len(cores)}


def dcp_bf16_master(rank, device, out):
    """bf16 parameters (converted before fully_shard): the fp32 master is state too
    (``master_param``, a DTensor view); a DCP round trip resumes bit-identically."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)

    ckpt = os.path.join(out, "bf16")
    ma, oa = _make(OffloadAdamW, device, torch.bfloat16)
    _train(ma, oa, 4, 0, rank, device)
    mb, ob = _make(OffloadAdamW, device, torch.bfloat16)
    _train(mb, ob, 2, 0, rank, device)
    osd = get_optimizer_state_dict(mb, ob)
    has_master = all("master_param" in st and st["master_param"].dtype == torch.float32 for st in osd["state"].values())
    dcp.save({"model": get_model_state_dict(mb), "optim": osd}, checkpoint_id=ckpt)
    mc, oc = _make(OffloadAdamW, device, torch.bfloat16)
    sd = {"model": get_model_state_dict(mc), "optim": get_optimizer_state_dict(mc, oc)}
    dcp.load(sd, checkpoint_id=ckpt)
    set_model_state_dict(mc, sd["model"])
    set_optimizer_state_dict(mc, oc, sd["optim"])
    _train(mc, oc, 2, 2, rank, device)
    ok = _same(ma, mc)
    _close(oa, ob, oc)
    return {"master_param in the state": has_master, "resumed bit-identically": ok}


JOBS = {
    "fsdp": [(f.__name__, f) for f in (fsdp_fp32, fsdp_accumulation, fsdp_clipping, fsdp_param_groups,
                                      fsdp_mixed_precision, fsdp_hsdp, fsdp_eager, fsdp_weight_edits,
                                      fsdp_refusals, dcp_round_trips, dcp_bf16_master, fsdp_resident,
                                      dcp_full_state_dict)],
    "ddp": [(f.__name__, f) for f in (ddp_default, ddp_manual_all_reduce, ddp_last_micro_batch_refused, zero1,
                                     zero1_groups_max_grad_norm, worker_cores_auto)],
}

FSDP = [name for name, _ in JOBS["fsdp"]]

#: Not run with CUDA tensors: torch's own full_state_dict gather segfaults there over gloo
#: (2 ranks on one H200, torch 2.11: SIGSEGV in _functional_collectives.all_gather_tensor,
#: reproduced with torch.optim.AdamW alone, no TrainStream: experiments/RESULTS.md,
#: data/2026-12-02_c_fsdp_probe_*.log). On CPU (gloo) it runs; on CUDA it needs NCCL, 2 GPUs.
GLOO_CUDA_CRASH = {"dcp_full_state_dict": "torch's FSDP2 full_state_dict gather segfaults with CUDA tensors over "
                                          "gloo (torch.optim.AdamW alone too); needs NCCL on 2 GPUs"}
DDP = [name for name, _ in JOBS["ddp"]]


@pytest.fixture(scope="module")
def fsdp_cpu(tmp_path_factory):
    return _run("fsdp", "cpu", tmp_path_factory)


@pytest.fixture(scope="module")
def fsdp_cuda(tmp_path_factory):
    return _run("fsdp", "cuda", tmp_path_factory)


@pytest.mark.parametrize("name", FSDP)
def test_fsdp2(fsdp_cpu, name):
    _check(fsdp_cpu, name)


@pytest.mark.gpu
@pytest.mark.parametrize("name", FSDP)
def test_fsdp2_cuda(request, name):
    if name in GLOO_CUDA_CRASH:
        pytest.skip(GLOO_CUDA_CRASH[name])
    _check(request.getfixturevalue("fsdp_cuda"), name)


@pytest.fixture(scope="module")
def ddp_cpu(tmp_path_factory):
    return _run("ddp", "cpu", tmp_path_factory)


@pytest.fixture(scope="module")
def ddp_cuda(tmp_path_factory):
    return _run("ddp", "cuda", tmp_path_factory)


@pytest.mark.parametrize("name", DDP)
def test_ddp(ddp_cpu, name):
    _check(ddp_cpu, name)


@pytest.mark.gpu
@pytest.mark.parametrize("name", DDP)
def test_ddp_cuda(ddp_cuda, name):
    _check(ddp_cuda, name)


def test_bench_fsdp_runs_on_cpu_with_two_ranks(tmp_path):
    """experiments/bench_fsdp.py's smoke mode: torchrun, 2 gloo ranks, a tiny GPT; the
    setups that need CUDA (or DeepSpeed) are skipped and say so."""
    import pathlib
    import subprocess
    import sys

    repo = pathlib.Path(__file__).resolve().parent.parent
    script = repo / "experiments" / "bench_fsdp.py"
    assert script.read_text().splitlines()[0].startswith("# Run (GPU machine, N GPUs of one host): torchrun ")
    out = tmp_path / "bench.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        str(script), "--device", "cpu", "--size", "micro", "--batch", "2", "--seq", "32",
                        "--vocab", "256", "--steps", "2", "--warmup", "1", "--json", str(out),
                        "--setups", "fsdp_gpu,ts_cpu~clip,ts_hybrid"],
                       capture_output=True, text=True, timeout=240, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = {row["setup"]: row for row in json.loads(out.read_text())["rows"]}
    assert rows["ts_hybrid"]["skipped"] == "needs CUDA"
    for name in ("fsdp_gpu", "ts_cpu~clip"):
        assert rows[name]["world_size"] == 2 and rows[name]["step_ms_median"] > 0
    assert rows["ts_cpu~clip"]["host_state_gib_sum"] > 0

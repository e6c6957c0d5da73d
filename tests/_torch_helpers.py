"""Shared helpers of the torch adapter's tests (a tiny transformer, its data, the reference
pair trained beside OffloadAdamW): imported by test_torch_optimizer, test_torch_gpu and
test_hostmem (a helper module, not collected by pytest)."""

from __future__ import annotations

from unittest import mock

import torch
import torch.nn as nn
import torch.nn.functional as F

from trainstream.core import _host
from trainstream.torch import OffloadAdamW

VOCAB, CTX = 32, 12


class TinyTransformer(nn.Module):
    def __init__(self, d: int = 32):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d)
        self.layer = nn.TransformerEncoderLayer(d, 4, 2 * d, dropout=0.0, batch_first=True)
        self.head = nn.Linear(d, VOCAB)

    def forward(self, x):
        return self.head(self.layer(self.emb(x)))


def chunked(n):
    """Optimizers built inside run work items of ``n`` elements (the engine's default: 2**20)."""
    return mock.patch.object(_host, "CHUNK_SIZE", n)


def make_model(seed=0, dtype=torch.float32, d=32):
    torch.manual_seed(seed)
    return TinyTransformer(d).to(dtype)


def batches(n, seed=1, batch=4):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (batch, CTX), generator=g) for _ in range(n)]


def loss_of(model, x):
    return F.cross_entropy(model(x).flatten(0, 1).float(), x.flatten())


def backward(ts, loss, last=False):
    """``loss.backward()``, inside ``ts.last_micro_batch()`` when ``last`` (the eager path)."""
    if last:
        with ts.last_micro_batch():
            loss.backward()
    else:
        loss.backward()


def step_beside_master(model, master, ref, ts, loss):
    """One step of ``ts`` on ``model`` and of ``ref`` on ``master`` (fp32 copies of the
    model's parameters), both from the gradients of ``loss``."""
    grads = torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)
    for m, g in zip(master, grads):
        m.grad = g.float()
    loss.backward()
    ts.step()
    ts.zero_grad()
    ref.step()


def two_groups(model, lr=(3e-3, 1e-2), wd=(0.1, 0.0)):
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    return [
        {"params": decay, "lr": lr[0], "weight_decay": wd[0]},
        {"params": no_decay, "lr": lr[1], "weight_decay": wd[1]},
    ]


def assert_same(m1, m2):
    for (n, a), (_, b) in zip(m1.named_parameters(), m2.named_parameters()):
        assert torch.equal(a, b), f"{n} differs (max abs {(a.float() - b.float()).abs().max()})"


def train_pair(steps=50, micro=1, max_norm=None, sched=False, threads=2, chunk=4096, eager=False,
               device="cpu", mode="cpu", zero_to_none=True, d=32, **opt_kw):
    """The same model (width ``d``) trained by torch.optim.AdamW and by OffloadAdamW on
    ``device`` (``opt_kw``: more OffloadAdamW arguments)."""
    ref_model, ts_model = make_model(d=d).to(device), make_model(d=d).to(device)
    ref = torch.optim.AdamW(two_groups(ref_model), betas=(0.9, 0.95))
    with chunked(chunk):
        ts = OffloadAdamW(two_groups(ts_model), betas=(0.9, 0.95), max_grad_norm=max_norm,
                          threads=threads, mode=mode, **opt_kw)
    scheds = []
    if sched:
        scheds = [torch.optim.lr_scheduler.OneCycleLR(o, max_lr=[1e-2, 2e-2], total_steps=steps)
                  for o in (ref, ts)]
    data = [x.to(device) for x in batches(steps * micro)]
    norms = []
    for step in range(steps):
        xs = data[step * micro:(step + 1) * micro]
        # TrainStream first: its norm fixes the float32 clip coefficient the reference uses.
        ts.zero_grad(set_to_none=zero_to_none)
        for i, x in enumerate(xs):
            backward(ts, loss_of(ts_model, x) / micro, last=eager and i == micro - 1)
        ts.step()
        ref.zero_grad()
        for x in xs:
            (loss_of(ref_model, x) / micro).backward()
        if max_norm is not None:
            listed = [p for g in ref.param_groups for p in g["params"]]  # max_grad_norm's order
            torch_norm = torch.nn.utils.clip_grad_norm_(listed, max_norm)
            assert ts.last_grad_norm() == torch_norm.item()  # torch's own norm, bit for bit
            norms.append(ts.last_grad_norm())
        ref.step()
        for s in scheds:
            s.step()
    return ref_model, ts_model, ref, ts, norms


# -- several processes ---------------------------------------------------------------------------

def free_port() -> int:
    """A free TCP port on 127.0.0.1 for a process group's rendezvous."""
    import socket  # noqa: PLC0415
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def all_ranks(checks: dict) -> dict:
    """``checks`` (name: bool) true on every rank of the default process group (MIN over the ranks; NCCL's on the
    current CUDA device)."""
    import torch.distributed as dist  # noqa: PLC0415
    flags = torch.tensor([int(bool(v)) for v in checks.values()] or [1])
    if dist.get_world_size() > 1:
        flags = flags.cuda() if dist.get_backend() == "nccl" else flags
        dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    return dict(zip(checks, map(bool, flags.tolist())))


def spawn_ranks(main, world: int, out, *args) -> dict:
    """``main(rank, world, port, out, *args)`` in ``world`` processes (``torch.multiprocessing.spawn``), each writing
    ``results{rank}.json`` under ``out``: rank 0's results, with the entries of another rank that reports an error
    (``{"error": ...}``) in their place; ``"__failure__"`` says why a rank stopped (a raise, a signal)."""
    import json  # noqa: PLC0415
    import pathlib  # noqa: PLC0415

    import torch.multiprocessing as mp  # noqa: PLC0415
    out = pathlib.Path(out)
    try:
        mp.spawn(main, args=(world, free_port(), str(out), *args), nprocs=world, join=True)
    except Exception as exc:  # noqa: BLE001 - the ranks' own reports say more
        failure = f"{type(exc).__name__}: {exc}"
    else:
        failure = ""
    results: dict = {}
    for rank in range(world):
        path = out / f"results{rank}.json"
        if path.exists():
            for name, r in json.loads(path.read_text()).items():
                if name not in results or "error" in r:
                    results[name] = r
    results["__failure__"] = failure
    return results

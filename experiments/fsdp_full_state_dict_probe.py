# Run (GPU machine): torchrun --standalone --nproc_per_node=2 experiments/fsdp_full_state_dict_probe.py --device cuda
"""Where does FSDP2's ``full_state_dict`` round trip crash with 2 gloo ranks on one GPU?

A control scenario of tests/test_torch_dist.py (torch.optim.AdamW on both sides, no
TrainStream) lost a rank to SIGSEGV on the H200. This probe runs that round trip alone in
fresh processes, printing each stage before it runs, with variants: ``cpu_offload=True``, and
a model whose last layer has no empty shard. Only torch.optim.AdamW is used unless
``--ours``. Found (H200, torch 2.11, 2026-12-02): the plain variant segfaults in
``get_optimizer_state_dict`` (``_functional_collectives.all_gather_tensor`` under
``DTensor.redistribute``) with torch.optim.AdamW alone: torch's crash, not TrainStream's. Each rank prints ``rank R: <stage>``; faulthandler prints the stack of a crash.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import faulthandler
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

LR, WD = 1e-2, 0.05


def _fsdp(device, rows):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 9), nn.GELU(), nn.Linear(9, rows)).to(device)
    mesh = init_device_mesh(device, (dist.get_world_size(),))
    for i in (0, 2, 4):
        fully_shard(m[i], mesh=mesh)
    fully_shard(m, mesh=mesh)
    return m


def _train(m, opt, steps, first, rank, device):
    for step in range(first, first + steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        m(torch.randn(6, 5, generator=g).to(device)).square().mean().backward()
        opt.step()
        opt.zero_grad()


def main() -> None:
    faulthandler.enable()
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--variants", default="plain,cpu_offload,no_empty_shard")
    ap.add_argument("--ours", action="store_true", help="OffloadAdamW as the source optimizer")
    args = ap.parse_args()
    rank = int(os.environ["RANK"])
    if args.device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict, set_model_state_dict,
                                                         set_optimizer_state_dict)

    def say(msg):
        print(f"rank {rank}: {msg}", flush=True)
        sys.stderr.flush()

    src = torch.optim.AdamW
    if args.ours:
        from trainstream.torch import OffloadAdamW as src
    for variant in args.variants.split(","):
        off = variant == "cpu_offload"  # rank 0 alone holds the full dicts; loading broadcasts them
        opts = StateDictOptions(full_state_dict=True, cpu_offload=off)
        load = StateDictOptions(full_state_dict=True, cpu_offload=off, broadcast_from_rank0=off)
        rows = 2 if variant == "no_empty_shard" else 1
        say(f"[{variant}] build + train 2 steps")
        ma = _fsdp(args.device, rows)
        oa = src(ma.parameters(), lr=LR, weight_decay=WD)
        _train(ma, oa, 2, 0, rank, args.device)
        say(f"[{variant}] get_optimizer_state_dict(full)")
        full = get_optimizer_state_dict(ma, oa, options=opts)
        say(f"[{variant}] deepcopy")
        full = copy.deepcopy(full)
        say(f"[{variant}] get_model_state_dict(full)")
        msd = get_model_state_dict(ma, options=opts)
        mc = _fsdp(args.device, rows)
        oc = torch.optim.AdamW(mc.parameters(), lr=LR, weight_decay=WD)
        say(f"[{variant}] set_model_state_dict(full)")
        set_model_state_dict(mc, msd, options=load)
        say(f"[{variant}] set_optimizer_state_dict(full)")
        set_optimizer_state_dict(mc, oc, full, options=load)
        say(f"[{variant}] train both 2 more steps")
        _train(ma, oa, 2, 2, rank, args.device)
        _train(mc, oc, 2, 2, rank, args.device)
        same = all(torch.equal(p.to_local(), q.to_local()) for p, q in zip(ma.parameters(), mc.parameters()))
        say(f"[{variant}] done, bitwise same: {same}")
        if hasattr(oa, "close"):
            oa.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

# Run (GPU machine): python experiments/diag_step_block.py [--speculate {none,true,false}] [--dtype fp32|bf16]
"""Where ``step()`` blocks the host (tests/test_torch_readiness.py::test_step_does_not_wait_for_the_transfers...
failed on an H100 at 86dfb77: step() took 0.97 s with the upload stream held by a ~0.5 s GPU sleep). Holds the
upload stream the same way before each of 4 steps, times step() and prints cProfile's top entries by cumulative
time for the slowest step, for each ``speculate`` setting given (a synchronizing CUDA call shows as ~0.5 s in one
function)."""
import argparse
import cProfile
import io
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402

from trainstream.torch import OffloadAdamW  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--speculate", nargs="+", default=["none", "false"])
ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
args = ap.parse_args()
dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
for spec in args.speculate:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(8)]).to("cuda", dtype)
    opt = OffloadAdamW(model.parameters(), lr=1e-2, threads=2,
                       speculate={"none": None, "true": True, "false": False}[spec])
    x = torch.randn(32, 64, device="cuda", dtype=dtype)
    worst = (0.0, None, -1)
    for i in range(4):
        opt.zero_grad()
        model(x).float().square().mean().backward()
        with torch.cuda.stream(opt._engine.backend.h2d):
            torch.cuda._sleep(1 << 30)
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        opt.step()
        prof.disable()
        took = time.perf_counter() - t0
        print(f"speculate={spec} step {i}: {took * 1e3:.1f} ms", flush=True)
        if took > worst[0]:
            worst = (took, prof, i)
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(worst[1], stream=s).sort_stats("cumulative").print_stats(25)
    print(f"--- speculate={spec}: slowest step {worst[2]} ({worst[0] * 1e3:.1f} ms), by cumulative time")
    print(s.getvalue()[-6000:], flush=True)
    opt.close()

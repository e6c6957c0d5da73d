"""A read-only install: the package directory and HOME unwritable (a read-only container),
so that Numba has nowhere to cache its kernels. Importing and training must still work,
bit-identically to torch.optim.AdamW, with one warning that says how to set a cache
directory (``NUMBA_CACHE_DIR``); the CUDA sources are read from the package data (laid out
as the wheel has them: the checkout's ``kernels/`` as ``trainstream/kernels/``).

The test runs as root in CI, where permission bits do not stop writes; what makes the
copies unwritable for root too is a regular *file* where each cache folder would be:
``trainstream/__pycache__`` and HOME (and ``XDG_CACHE_HOME``) below a file.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = r'''
import warnings
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    import torch
    import trainstream
    from trainstream.torch import OffloadAdamW
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    ref = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    ref.load_state_dict(model.state_dict())
    opt = OffloadAdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(4):
        x = torch.randn(5, 8)
        for m, o in ((model, opt), (ref, ropt)):
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
    opt.synchronize()
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.equal(a, b), "weights differ from torch.optim.AdamW"
    opt.close()
assert trainstream.__file__.startswith(PKG_ROOT), trainstream.__file__
import trainstream._device_kernels as dk
dk.check_kernel_constants()  # reads the installed source (no GPU needed)
assert dk.kernel_source(dk.ADAMW_SOURCE) == open(PKG_ROOT + "/trainstream/kernels/" + dk.ADAMW_SOURCE).read()
cache = [w for w in caught if "NUMBA_CACHE_DIR" in str(w.message)]
assert len(cache) == 1, [str(w.message) for w in caught]
print("ok")
'''


def test_unwritable_package_dir_and_home(tmp_path):
    site = tmp_path / "ro-site"
    shutil.copytree(ROOT / "trainstream", site / "trainstream",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    shutil.copytree(ROOT / "kernels", site / "trainstream" / "kernels")  # the package data, as in the wheel
    for pkg in [site / "trainstream", *(p for p in (site / "trainstream").rglob("*") if p.is_dir())]:
        if pkg.name != "kernels":
            (pkg / "__pycache__").write_text("not a directory: nothing can be cached here\n")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NUMBA_CACHE", "PYTHON"))}
    env.update(HOME=str(blocker / "home"), XDG_CACHE_HOME=str(blocker / "cache"),
               PYTHONPATH=str(site), PYTHONDONTWRITEBYTECODE="1")
    script = SCRIPT.replace("PKG_ROOT", repr(str(site)))
    r = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout[-3000:] + r.stderr[-3000:]

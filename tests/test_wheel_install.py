"""The plain wheel: ``pip wheel .`` carries the CUDA sources (the checkout's top-level ``kernels/``, as the package
data ``trainstream/kernels/``) and every module of ``trainstream/``, and the wheel installed in a
fresh virtual environment, run from outside the checkout, trains bit-identically to
``torch.optim.AdamW`` (``cpu`` mode on the CPU here; ``gpu`` mode on CUDA in the
``gpu``-marked test).

The wheel is built with ``pip wheel --no-deps --no-build-isolation .`` (no index needed;
setuptools comes with the ``test`` extra) from a copy of the checkout without its build
outputs: setuptools packs whatever a stale ``build/`` or ``*.egg-info`` of an earlier
build holds, so a build in the checkout itself could pass with files the configuration
no longer names. The fresh environment (``python -m venv --without-pip``, from the base
interpreter) gets the wheel from this interpreter's pip (``pip --python VENV/bin/python
install --no-deps --no-index``, pip >= 22.3), then this interpreter's ``sys.path`` entries outside the checkout (torch,
numba, ...) through a ``.pth`` file: plain path lines, so the ``.pth`` files in those
folders, an editable install of trainstream among them, are not processed. The training
script checks that every ``trainstream`` module it loaded comes from the fresh
environment.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("adamw.cu", "adamw_body.cu", "adamw_torch.cu", "adamw_variants.cu")  # kernels/; trainstream/kernels/
#: Build outputs and environments of a checkout, left out of the copy that is built.
_NOT_COPIED = {".git", ".venv", "build", "dist", "__pycache__", ".pytest_cache", ".numba_cache", ".whl"}

# Runs in the fresh environment: argv = venv folder, checkout, mode, device.
SCRIPT = r'''
import hashlib, json, sys
from pathlib import Path

venv, checkout, mode, device = Path(sys.argv[1]).resolve(), Path(sys.argv[2]).resolve(), sys.argv[3], sys.argv[4]
assert not any(Path(p or ".").resolve() == checkout for p in sys.path), sys.path

import torch
import torch.nn as nn
import torch.nn.functional as F

import trainstream
import trainstream._device_kernels as dk
from trainstream.torch import OffloadAdamW

# the sources, read through the package (no CuPy needed for the text)
sources = {name: hashlib.sha256(dk.kernel_source(name).encode()).hexdigest()
           for name in dk.KERNEL_SOURCES}
dk.check_kernel_constants()

VOCAB, CTX = 32, 12

def make_model():
    torch.manual_seed(0)
    d = 32
    return nn.Sequential(nn.Embedding(VOCAB, d), nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.GELU(),
                         nn.Linear(2 * d, VOCAB)).to(device)

def groups(model):
    return [{"params": [p for p in model.parameters() if p.ndim >= 2], "weight_decay": 0.1},
            {"params": [p for p in model.parameters() if p.ndim < 2], "weight_decay": 0.0, "lr": 2e-2}]

def loss_of(model, x):
    return F.cross_entropy(model(x).flatten(0, 1), x.flatten())

ref_model, ts_model = make_model(), make_model()
init = [p.detach().clone() for p in ref_model.parameters()]
ref = torch.optim.AdamW(groups(ref_model), lr=1e-2, betas=(0.9, 0.95))
kw = dict(threads=2) if mode == "cpu" else {}
ts = OffloadAdamW(groups(ts_model), lr=1e-2, betas=(0.9, 0.95), mode=mode, **kw)
g = torch.Generator().manual_seed(1)
steps = 6
for step in range(steps):
    x = torch.randint(0, VOCAB, (4, CTX), generator=g).to(device)
    ts.zero_grad()
    loss_of(ts_model, x).backward()
    ts.step()
    ref.zero_grad()
    loss_of(ref_model, x).backward()
    ref.step()
ts.synchronize()
differ = [n for (n, a), (_, b) in zip(ref_model.named_parameters(), ts_model.named_parameters())
          if not torch.equal(a, b)]
moved = sum(not torch.equal(a, b) for a, b in zip(init, ref_model.parameters()))
stats = ts.stats()
ts.close()
files = sorted({str(Path(m.__file__).resolve()) for name, m in list(sys.modules.items())
                if (name == "trainstream" or name.startswith("trainstream."))
                and getattr(m, "__file__", None)})
print(json.dumps({
    "trainstream_file": str(Path(trainstream.__file__).resolve()),
    "module_files": files,
    "sources": sources,
    "differ": differ,
    "moved": moved,
    "params": len(init),
    "steps": stats["steps"],
    "gpu_modules": sorted(dk._modules),
}))
'''


def _ignore(folder: str, names: list[str]) -> set[str]:
    out = {n for n in names if n in _NOT_COPIED or n.endswith(".egg-info")}
    if Path(folder).name == "experiments" and "out" in names:
        out.add("out")
    return out


def _run(cmd, **kw) -> subprocess.CompletedProcess:
    out = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, check=False, **kw)
    assert out.returncode == 0, f"{cmd} failed ({out.returncode}):\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}"
    return out


def _child_env() -> dict[str, str]:
    """This environment, without what would put the checkout (or this process's caches)
    in the child's way."""
    env = dict(os.environ)
    for key in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PYTHONSAFEPATH", "NUMBA_CACHE_DIR"):
        env.pop(key, None)
    env.update(PYTHONNOUSERSITE="1", PIP_NO_INPUT="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    return env


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """Build the wheel, install it in a fresh venv; ``{"wheel", "venv", "python", "work"}``."""
    if importlib.util.find_spec("setuptools") is None:  # found, not imported (it edits sys.path)
        pytest.skip("building the wheel without isolation needs setuptools (in the test extra)")
    base = tmp_path_factory.mktemp("wheel")
    src, dist, venv, work = base / "src", base / "dist", base / "venv", base / "work"
    shutil.copytree(ROOT, src, ignore=_ignore)
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
          "--disable-pip-version-check", "-q", "-w", dist, "."], cwd=src, env=_child_env())
    wheels = list(dist.glob("trainstream-*.whl"))
    assert len(wheels) == 1, wheels

    _run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", "--without-pip", venv],
         env=_child_env())
    python = venv / "bin" / "python"
    # installed before the .pth exists: pip then sees an empty environment
    _run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index",
          "--disable-pip-version-check", "-q", wheels[0]], env=_child_env())
    purelib = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                        env=_child_env()).stdout.strip())
    assert all((purelib / "trainstream" / "kernels" / n).is_file() for n in SOURCES)
    # this interpreter's packages, not the checkout (nor the tests folder pytest added)
    paths = []
    for p in sys.path:
        if not p or not Path(p).is_dir():
            continue
        rp = Path(p).resolve()
        # the checkout's own folders, but not a virtual environment kept inside it (.venv)
        if (rp == ROOT or ROOT in rp.parents) and not any(part.startswith(".venv") for part in rp.parts):
            continue
        paths.append(str(rp))
    (purelib / "_trainstream_test_outer_env.pth").write_text("\n".join(paths) + "\n")
    work.mkdir()
    return {"wheel": wheels[0], "venv": venv, "python": python, "work": work}


def _train_in_fresh_venv(installed, mode: str, device: str) -> dict:
    script = installed["work"] / "check_install.py"
    script.write_text(SCRIPT)
    out = _run([installed["python"], script, installed["venv"], ROOT, mode, device],
               cwd=installed["work"], env=_child_env(), timeout=300)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    venv = Path(installed["venv"]).resolve()
    assert venv in Path(result["trainstream_file"]).parents, result["trainstream_file"]
    for f in result["module_files"]:
        assert venv in Path(f).parents and ROOT not in Path(f).parents, f
    want = {n: hashlib.sha256((ROOT / "kernels" / n).read_bytes()).hexdigest() for n in SOURCES}
    assert result["sources"] == want
    assert result["differ"] == [], f"not bit-identical to torch.optim.AdamW: {result['differ']}"
    assert result["moved"] == result["params"] and result["steps"] == 6
    return result


def test_wheel_carries_the_cuda_sources(installed):
    with zipfile.ZipFile(installed["wheel"]) as z:
        names = z.namelist()
        for n in SOURCES:
            assert z.read(f"trainstream/kernels/{n}") == (ROOT / "kernels" / n).read_bytes()
    # a plain wheel: the package and its metadata, nothing else of the checkout
    assert all(n.startswith(("trainstream/", "trainstream-")) for n in names), names
    # every module (pyproject.toml lists the subpackages: a new one missing from the list fails here)
    modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / "trainstream").rglob("*.py")}
    assert modules - set(names) == set()


def test_installed_wheel_trains_bit_identically_on_cpu(installed):
    pytest.importorskip("torch")
    result = _train_in_fresh_venv(installed, "cpu", "cpu")
    assert result["gpu_modules"] == []


@pytest.mark.gpu
def test_installed_wheel_trains_bit_identically_in_gpu_mode(installed):
    torch = pytest.importorskip("torch")
    pytest.importorskip("cupy")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    result = _train_in_fresh_venv(installed, "gpu", "cuda")
    # the zero-copy kernels were compiled from the installed package's sources
    assert result["gpu_modules"] == ["adamw"]

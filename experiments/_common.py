"""Helpers shared by the experiment scripts (not part of the library).

The scripts run as ``python experiments/<name>.py`` (this folder is then on ``sys.path``)
or are loaded by the tests from their files; each puts this folder on ``sys.path`` first.
"""

from __future__ import annotations

import json
import platform
import subprocess
from pathlib import Path

import numpy as np

try:
    from tqdm import tqdm
except ImportError:  # pragma: no cover - tqdm is in the test extra
    def tqdm(x=None, **_):
        return x

__all__ = ["REPO", "cpu_name", "fmt_frac", "generated_text", "git_commit", "tqdm", "save_result"]

REPO = Path(__file__).resolve().parent.parent


def generated_text(n_sentences: int, seed: int) -> bytes:
    """ASCII text from a small grammar with arithmetic facts: learnable, generated here."""
    rng = np.random.default_rng(seed)
    adj = "small large quick slow bright dark exact pinned mapped idle busy".split()
    noun = "host device stream kernel weight moment gradient buffer worker chunk step".split()
    verb = "copies updates waits for reads writes overlaps releases accumulates".split(" ")
    out = []
    for _ in range(n_sentences):
        r = rng.random()
        if r < 0.6:
            out.append(f"the {rng.choice(adj)} {rng.choice(noun)} {rng.choice(verb)} the {rng.choice(noun)}.")
        elif r < 0.85:
            a, b = rng.integers(0, 50, 2)
            out.append(f"{a}+{b}={a + b}.")
        else:
            out.append(f"step {rng.integers(1, 1000)} of {rng.choice(noun)}s is {rng.choice(adj)}.")
    return " ".join(out).encode("ascii")


def git_commit() -> str | None:
    """HEAD of this repository (``+dirty`` with uncommitted changes), or None."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return out.stdout.strip() + ("+dirty" if dirty else "") if out.returncode == 0 else None
    except Exception:  # noqa: BLE001 - no git, no repo
        return None


def save_result(out: str | Path, name: str, result: dict, markdown: str) -> None:
    """``<out>/<name>.json`` (the whole result) and ``<out>/<name>.md`` (its table)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=1))
    (out / f"{name}.md").write_text(markdown)


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def fmt_frac(x: float) -> str:
    """A fraction as a percentage for the Markdown tables (exactly 1 as ``100%``)."""
    return "100%" if x == 1.0 else f"{100 * x:.4f}%"


# -- the equivalence scripts' per-step records ------------------------------------------------

PER_STEP_KEYS = ("loss_a", "loss_b", "bitid", "bitid_model", "max_ulp", "max_rel", "norm_a", "norm_b")


def empty_per_step() -> dict:
    """The per-step series of one comparison (a vs b), empty."""
    return {k: [] for k in PER_STEP_KEYS}


def record_step(records: list, pairs: list, weights: dict, losses: dict, compare) -> int:
    """Append one step to each comparison of ``pairs`` (``(kind, a, b, promised, note)``,
    matching ``records``): losses, norms and ``compare(weights[a], weights[b])``. Returns
    the largest max-ULP distance of the step."""
    worst = 0
    for rec, (_, a, b, _, _) in zip(records, pairs):
        m = compare(weights[a], weights[b])
        ps = rec["per_step"]
        ps["loss_a"].append(losses[a])
        ps["loss_b"].append(losses[b])
        ps["norm_a"].append(a.last_norm)
        ps["norm_b"].append(b.last_norm)
        for k, v in m.items():
            ps[k].append(v)
        worst = max(worst, m["max_ulp"])
    return worst


def summarize(ps: dict, clip_active_steps: int | None) -> dict:
    """The summary of one comparison's per-step series."""
    return dict(
        steps=len(ps["bitid"]),
        final_bitid=ps["bitid"][-1],
        final_bitid_model=ps["bitid_model"][-1],
        min_bitid=min(ps["bitid"]),
        max_ulp=max(ps["max_ulp"]),
        max_rel=max(ps["max_rel"]),
        final_loss_a=ps["loss_a"][-1],
        final_loss_b=ps["loss_b"][-1],
        clip_active_steps=clip_active_steps,
    )

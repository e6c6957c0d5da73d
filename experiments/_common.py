"""Helpers shared by the experiment scripts (no torch or jax import): the torch GPT's sizes,
the generated text, the run's provenance, and the equivalence studies' per-step records,
table and plots.

The scripts run as ``python experiments/<name>.py`` (this folder is then on ``sys.path``)
or are loaded by the tests from their files; each puts this folder on ``sys.path`` first.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

try:
    from tqdm import tqdm
except ImportError:  # pragma: no cover - tqdm is in the test extra
    def tqdm(x=None, **_):
        return x

REPO = Path(__file__).resolve().parent.parent
#: models_torch.GPT's configurations: (layers, d_model, heads); parameters with the default vocabulary and context
SIZES = {
    "tiny": (2, 256, 4),  # 14.7M (12.9M of them the embedding)
    "mini": (4, 256, 4),  # 16.3M (largest_model.py's CPU smoke test)
    "125m": (12, 768, 12),  # 124.5M
    "350m": (24, 1024, 16),  # 354.9M
    "1.3b": (24, 2048, 16),  # 1.314B
    "2b": (24, 2560, 20),  # 2.020B (head 128, as every size from here)
    "3b": (26, 3072, 24),  # 3.103B (d 3072)
    "4b": (32, 3072, 24),  # 3.783B
    "5b": (24, 4096, 32),  # 5.043B
    "6b": (28, 4096, 32),  # 5.849B
    "7b": (32, 4096, 32),  # 6.654B (GPT-3 6.7B / LLaMA-7B width and depth)
    "8b": (38, 4096, 32),  # 7.863B
    "9b": (44, 4096, 32),  # 9.071B
    "10b": (32, 5120, 40),  # 10.33B
    "11b": (36, 5120, 40),  # 11.59B
    "13b": (40, 5120, 40),  # 12.85B (GPT-3 13B width and depth)
    "15b": (48, 5120, 40),  # 15.37B
    "18b": (40, 6144, 48),  # 18.44B
    "20b": (44, 6144, 48),  # 20.25B
    "23b": (50, 6144, 48),  # 22.97B
    "25b": (54, 6144, 48),  # 24.78B
    "27b": (58, 6144, 48),  # 26.59B
    "30b": (48, 7168, 56),  # 29.97B
}
VOCAB = 50304


def param_count(size: str, vocab: int = VOCAB, ctx: int = 1024) -> int:
    """Parameters of ``models_torch.GPT(*SIZES[size])``, without building it."""
    layers, d, _ = SIZES[size]
    return layers * (12 * d * d + 13 * d) + vocab * d + ctx * d + 2 * d


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


def text_windows(n: int, batch: int, ctx: int, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """``n`` batches of (``batch`` x ``ctx`` bytes, the next byte of each): int64 arrays."""
    data = np.frombuffer(generated_text(max(2000, n * batch * ctx // 40), seed), np.uint8).astype(np.int64)
    rng = np.random.default_rng(seed + 1)
    out = []
    for _ in range(n):
        ix = rng.integers(0, len(data) - ctx - 1, batch)
        out.append((np.stack([data[i:i + ctx] for i in ix]), np.stack([data[i + 1:i + ctx + 1] for i in ix])))
    return out


def git_commit() -> str | None:
    """HEAD of this repository (``+dirty`` with uncommitted changes), or None."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return out.stdout.strip() + ("+dirty" if dirty else "") if out.returncode == 0 else None
    except Exception:  # noqa: BLE001 - no git, no repo
        return None


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def provenance(script: str, argv: list[str] | None) -> dict:
    """The run's script, command line, date (UTC), commit, CPU and cores: the head of its ``meta``."""
    return dict(script=f"experiments/{script}",
                command="python " + " ".join([f"experiments/{script}", *(argv if argv is not None else sys.argv[1:])]),
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), commit=git_commit(),
                cpu=cpu_name(), cores=os.cpu_count())


# -- the equivalence studies ------------------------------------------------------------------


def study_args(ap, default_out: Path, devices_help: str) -> None:
    """The options both equivalence studies take (``None`` defaults: :func:`fill_defaults`)."""
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps (default 300; --quick: 4)")
    ap.add_argument("--quick", action="store_true", help="CI size: a few steps of a tiny model")
    ap.add_argument("--devices", default=None, help=devices_help)
    ap.add_argument("--dtypes", default=None, help="comma list of fp32,bf16,fp16 (default all; JAX's --quick: fp32,bf16)")
    ap.add_argument("--batch", type=int, default=None, help="sequences per (micro-)batch (default 8; --quick: 4)")
    ap.add_argument("--ctx", type=int, default=None, help="context length (default 64; --quick: 32)")
    ap.add_argument("--d-model", type=int, default=None, help="width (default 64; --quick: 32)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (warmup, cosine to 10%%)")
    ap.add_argument("--threads", type=int, default=None, help="TrainStream's worker threads (default: its own)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(default_out))
    ap.add_argument("--no-progress", action="store_true")


def fill_defaults(args, quick: dict, full: dict):
    """Where an option was not given: the CI size (``--quick``) or the full size, with a study's
    own ``quick``/``full`` defaults on top; ``args.dtypes`` as a checked list."""
    size = dict(steps=4, batch=4, ctx=32, d_model=32) if args.quick else dict(steps=300, batch=8, ctx=64, d_model=64)
    for k, v in {**size, "dtypes": "fp32,bf16,fp16", **(quick if args.quick else full)}.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.dtypes = args.dtypes.split(",")
    if not set(args.dtypes) <= {"fp32", "bf16", "fp16"}:
        raise SystemExit(f"--dtypes {','.join(args.dtypes)!r}: expected some of fp32, bf16, fp16")
    return args


PER_STEP_KEYS = ("loss_a", "loss_b", "bitid", "bitid_model", "max_ulp", "max_rel", "norm_a", "norm_b")


def _bits(x: np.ndarray) -> np.ndarray:
    return x.view(np.uint32 if x.dtype.itemsize == 4 else np.uint16)


def _ordered(x: np.ndarray) -> np.ndarray:
    """float32 bit patterns on the ordered-integer line (+0 and -0 both 0), as int64."""
    i = np.ascontiguousarray(x, np.float32).view(np.int32).astype(np.int64)
    return np.where(i < 0, -(i & 0x7FFFFFFF), i)


def compare(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]) -> dict:
    """Two trainers' (fp32 master weights, the model's own weights or their bits), flat: the
    fractions bit-identical, the max distance in float32 ULPs and the max relative error."""
    (ma, wa), (mb, wb) = a, b
    same = _bits(ma) == _bits(mb)
    ulp = np.abs(_ordered(ma) - _ordered(mb))
    a64, b64 = ma.astype(np.float64), mb.astype(np.float64)
    den = np.maximum(np.abs(a64), np.abs(b64))
    with np.errstate(invalid="ignore", divide="ignore"):
        rel = np.where(same | (den == 0), 0.0, np.abs(a64 - b64) / np.where(den == 0, 1.0, den))
    return {"bitid": float(same.mean()), "bitid_model": float((_bits(wa) == _bits(wb)).mean()),
            "max_ulp": int(ulp.max()), "max_rel": float(rel.max())}


def train_pairs(trainers: list, pairs: list, steps: int, batch_of, desc: str, quiet: bool, **fields) -> list[dict]:
    """Train every trainer ``steps`` steps (step ``i`` on ``batch_of(i)``), then close them. Returns
    a record per pair ``(kind, a, b, promised, note)``, with ``fields`` (dtype, clip, ...), its
    device (``device_type`` of a and b) and per step (:data:`PER_STEP_KEYS`) the losses, the
    global norms and :func:`compare`."""
    records = [dict(kind=k, a=a.label, b=b.label, device=a.device_type if a.device_type == b.device_type
                    else f"{a.device_type} vs {b.device_type}", **fields, promised=promised, note=note,
                    per_step={key: [] for key in PER_STEP_KEYS}) for k, a, b, promised, note in pairs]
    try:
        for step in tqdm(range(steps), desc=desc, disable=quiet, leave=False, file=sys.stderr):
            batch = batch_of(step)
            losses = {t: t.step(batch) for t in trainers}
            weights = {t: t.weights() for t in trainers}
            for rec, (_, a, b, _, _) in zip(records, pairs):
                for key, value in (("loss_a", losses[a]), ("loss_b", losses[b]), ("norm_a", a.last_norm),
                                   ("norm_b", b.last_norm), *compare(weights[a], weights[b]).items()):
                    rec["per_step"][key].append(value)
    finally:
        for t in trainers:
            t.close()
    return records


def run_study(name: str, title: str, about: str, meta: dict, args, settings: list, train_setting,
              t_start: float) -> dict:
    """Each setting through ``train_setting(setting) -> (records with summaries, description)``;
    ``<out>/<name>.json`` and ``.md`` rewritten after each (a run cut short keeps what it did),
    then the plots; prints the table and how many promised rows stayed bit-identical."""
    for s in meta["skipped"]:
        print(f"skipped: {s}")
    comparisons: list = []
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def write(complete: bool) -> dict:
        result = dict(meta=dict(meta, runtime_s=time.perf_counter() - t_start, complete=complete), comparisons=comparisons)
        (out / f"{name}.json").write_text(json.dumps(result, indent=1))
        (out / f"{name}.md").write_text(markdown_table(result, title, about))
        return result

    for setting in settings:
        records, desc = train_setting(setting)
        comparisons += records
        write(False)
        print(f"  {desc}: {len(records)} comparisons, {time.perf_counter() - t_start:.1f} s so far", flush=True)
    result = write(True)
    result["files"] = [str(out / f"{name}.json"), str(out / f"{name}.md")]
    print("\n" + markdown_table(result, title, about))
    broken = [c for c in comparisons if c["promised"] and c["summary"]["min_bitid"] < 1.0]
    print(f"{len(comparisons)} comparisons, {sum(c['promised'] for c in comparisons)} promised bit-identical, "
          f"{len(broken)} of those not; {time.perf_counter() - t_start:.1f} s; outputs in {out}")
    return result


def summarize(ps: dict, clip_active_steps: int | None) -> dict:
    """The summary of one comparison's per-step series."""
    return dict(steps=len(ps["bitid"]), final_bitid=ps["bitid"][-1], final_bitid_model=ps["bitid_model"][-1],
                min_bitid=min(ps["bitid"]), max_ulp=max(ps["max_ulp"]), max_rel=max(ps["max_rel"]),
                final_loss_a=ps["loss_a"][-1], final_loss_b=ps["loss_b"][-1], clip_active_steps=clip_active_steps)


def fmt_frac(x: float) -> str:
    """A fraction as a percentage for the tables (exactly 1 as ``100%``)."""
    return "100%" if x == 1.0 else f"{100 * x:.4f}%"


def markdown_table(result: dict, title: str, about: str) -> str:
    """One row per comparison (an ``accum`` column where the comparisons have one)."""
    m = result["meta"]
    accum = any("accum" in c for c in result["comparisons"])
    versions = ", ".join(f"{k} {v}" for k, v in m["versions"].items() if v)
    lines = [
        f"# {title}", "", f"`{m['command']}`  ",
        f"{m['date']}, commit `{m['commit']}`, {versions}, CPU {m['cpu']} ({m['cores']} cores)"
        + (f", GPU {m['gpu']}" if m["gpu"] else "") + f"; training and comparisons took {m['runtime_s']:.1f} s"
        + ("" if m.get("complete", True) else " (**partial**: the run had not finished every setting)") + "  ",
        about, "",
        "Bit-identical: fraction of fp32 (master) weights equal bit for bit after the last step (for fp16/bf16, "
        "`model` is the fraction of the model's own half weights). Max ULP: the largest distance in float32 ULPs "
        "over all weights and steps; max rel: the largest `|a-b|/max(|a|,|b|)`. Promised: the contract promises "
        "bit-identity for this row.", "",
        "| comparison (a vs b) | device | dtype | clip |" + (" accum |" if accum else "")
        + " promised | steps | bit-identical | model | max ULP | max rel err | final loss a / b |",
        "|---" * (11 + accum) + "|",
    ]
    for c in result["comparisons"]:
        s = c["summary"]
        name = f"{c['a']} vs {c['b']}" + (f" ({c['note']})" if c["note"] else "")
        lines.append(
            f"| {name} | {c['device']} | {c['dtype']} | {'off' if c['clip'] is None else c['clip']} | "
            + (f"{c['accum']} | " if accum else "")
            + f"{'yes' if c['promised'] else 'no'} | {s['steps']} | {fmt_frac(s['final_bitid'])} | "
            f"{fmt_frac(s['final_bitid_model'])} | {s['max_ulp']} | {s['max_rel']:.3g} | "
            f"{s['final_loss_a']:.4f} / {s['final_loss_b']:.4f} |")
    if m["skipped"]:
        lines += ["", "Not run:"] + [f"- {s}" for s in m["skipped"]]
    return "\n".join(lines) + "\n"


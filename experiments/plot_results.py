"""python experiments/plot_results.py [--data experiments/data] [--out experiments/plots]

Regenerates the PNG plots of experiments/RESULTS.md from the JSON files in
experiments/data/ (needs numpy and matplotlib only; no GPU, a few seconds):

* ``step_time.png``: bench_train.py's median step time (ms) by setup, one panel per config
  (125M x 8, 350M x 8, 1.3B x 8, 1.3B x 24). Solid bars: the setups of the newest
  bench_train JSON of that config (one process; dots are its individual rows, diamonds
  the back-to-back step where recorded). Hatched bars: setups that the newest file did
  not run, from the newest older file that did (its commit in the label): an older
  process on the shared host, so compare those with care. Dashed lines: the targets
  (0.7x torchao fp32 of the newest file; 1.05x bf16 in-GPU at 1.3B x 24).
* ``peak_memory.png``: peak GPU memory (GiB) by setup, the newest row of each setup
  per config; hatched: rows recorded before bench_train.py took peaks net of memory an
  earlier setup left allocated (they may read high). Dashed line: 16 B/param below AMP
  (dotted where the AMP row itself is hatched).
* ``scaling_step_time.png`` and ``scaling_memory.png`` (``--scaling FILE ...``, only these):
  from bench_train.py JSON (``--configs 3b:24,7b:24`` and the like, ``--largest`` tries
  included), one panel per batch size: the median step time (and the MFU in the legend)
  against the parameter count, and the peak GPU memory (solid) and host memory (dashed:
  the drop of the machine's MemAvailable during the setup) against it, one line per
  setup; a size without a figure is an ``x`` on the panel's floor, its reason in the
  legend (GPU OOM or host OOM: it does not fit; a timeout: not measured). ``python experiments/plot_results.py --scaling
  bench_train_3b7b.json --out experiments/plots``.
* ``equivalence.png``: per-step divergence of the H200 equivalence run (fp32, torch and
  JAX): the largest distance in float32 ULPs over all weights at each step, and the
  fraction of weights that are bit-identical. Read from the JSON inside
  ``data/2026-11-30_s4_equivalence_h200_100/all_with_json.tgz`` (the newest run that kept
  its per-step JSON; the later run at 9a91e4e kept only its Markdown tables).
"""
from __future__ import annotations

import argparse
import glob
import io
import json
import os
import re
import statistics
import tarfile

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from PIL import Image  # noqa: E402  (matplotlib's own dependency)

HERE = os.path.dirname(os.path.abspath(__file__))

CONFIGS = [("125m", 8), ("350m", 8), ("1.3b", 8), ("1.3b", 24)]
CONFIG_LABEL = {("125m", 8): "125M x 8", ("350m", 8): "350M x 8",
                ("1.3b", 8): "1.3B x 8", ("1.3b", 24): "1.3B x 24"}
# The setups plotted, top to bottom (variants measured and not adopted are left out).
SETUPS = [
    ("bf16_fused", "bf16 in-GPU, fused AdamW"),
    ("amp_fused", "AMP in-GPU (fp32 weights)"),
    ("torchao_fp32", "torchao offload, fp32 state"),
    ("torchao_bf16", "torchao offload, bf16 setup"),
    ("ds_zero_offload", "DeepSpeed ZeRO-2 offload"),
    ("ts_cpu", "TrainStream cpu"),
    ("ts_cpu_eager", "TrainStream cpu, eager"),
    ("ts_gpu", "TrainStream gpu"),
    ("ts_gpu_eager", "TrainStream gpu, eager"),
    ("ts_hybrid", "TrainStream hybrid"),
    ("ts_hybrid_eager~nice19", "TrainStream hybrid eager, nice 19"),
]
COLOR = {"bf16_fused": "#7f7f7f", "amp_fused": "#b0b0b0", "torchao_fp32": "#d62728",
         "torchao_bf16": "#ff9896", "ds_zero_offload": "#9467bd"}
TS_COLOR = "#1f77b4"
REF_COLORS = ["#1f77b4", "#ff7f0e", "#9467bd", "#8c564b"]  # TrainStream's line is green
# Files whose names carry no commit (the log names them).
FILE_COMMIT = {
    "2026-11-30_s2_bench_train_125m-350m-1.3b_x8.json": "7282f26",
    "2026-11-30_s2_bench_train_1.3bx24_run1.json": "49bd462",
    "2026-11-30_s2_bench_train_1.3bx24_run2.json": "8b830f7",
    "2026-11-30_s2_bench_train_1.3bx24_profile.json": "7282f26",
}
# Run order within session 2 (the profile file is its third 1.3B x 24 run).
S2_RUN = {"run1": 1, "run2": 2, "profile": 3, "x8": 3}


def _order(path: str) -> tuple[int, int]:
    name = os.path.basename(path)
    s = int(re.search(r"_s(\d+)_", name).group(1))
    m = re.search(r"_run(\d+)_", name)
    if m:
        return s, int(m.group(1))
    for key, run in S2_RUN.items():
        if key in name:
            return s, run
    return s, 0


def _commit(path: str) -> str:
    name = os.path.basename(path)
    m = re.search(r"_run\d+_([0-9a-f]{7})_", name)
    return m.group(1) if m else FILE_COMMIT.get(name, "?")


def _save(fig, out: str) -> None:
    """Save at dpi 100 as a 256-colour PNG (the plots are flat colours: a fifth the size)."""
    buf = io.BytesIO()
    fig.savefig(buf, dpi=100, format="png")
    plt.close(fig)
    buf.seek(0)
    Image.open(buf).convert("RGB").quantize(colors=256).save(out, optimize=True)


def load_bench(data: str) -> list[dict]:
    """Every bench_train file: {path, order, commit, rows}."""
    files = []
    for path in glob.glob(os.path.join(data, "*bench_train*.json*")):
        with open(path) as f:
            if path.endswith(".jsonl"):
                rows = [json.loads(line) for line in f if line.strip()]
            else:
                rows = json.load(f)["rows"]
        rows = [r for r in rows if "step_ms_median" in r]
        files.append({"path": path, "order": _order(path), "commit": _commit(path), "rows": rows})
    files.sort(key=lambda f: f["order"])
    return files


def _rows(file: dict, config: tuple[str, int], setup: str) -> list[dict]:
    return [r for r in file["rows"]
            if (r["size"], r["batch"]) == config and r["setup"] == setup]


def _median(rows: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def plot_step_time(files: list[dict], out: str) -> None:
    fig, axes = plt.subplots(2, 2, figsize=(12, 8.4))
    for ax, config in zip(axes.flat, CONFIGS):
        holding = [f for f in files if any((r["size"], r["batch"]) == config for r in f["rows"])]
        newest = holding[-1]
        ao = _median(_rows(newest, config, "torchao_fp32"), "step_ms_median")
        labels, y = [], 0
        xmax = 0.0
        for setup, label in SETUPS:
            rows = _rows(newest, config, setup)
            src, solid = newest, True
            if not rows:
                older = [f for f in holding if _rows(f, config, setup)]
                if not older:
                    continue
                src, solid = older[-1], False
                rows = _rows(src, config, setup)
            ms = _median(rows, "step_ms_median")
            color = COLOR.get(setup, TS_COLOR)
            ax.barh(y, ms, color=color if solid else "white", edgecolor=color,
                    hatch=None if solid else "///", height=0.7)
            if solid and len(rows) > 1:
                ax.plot([r["step_ms_median"] for r in rows], [y] * len(rows), "k.", ms=4)
            stream = _median(rows, "step_ms_stream")
            if stream is not None:
                ax.plot(stream, y, "D", color="black", mfc="none", ms=5)
            text = f"{ms:.1f}"
            ao_src = _median(_rows(src, config, "torchao_fp32"), "step_ms_median")
            if ao_src and setup.startswith("ts_"):
                text += f" ({ms / ao_src:.2f}x torchao)"
            ax.text(max(ms, stream or 0), y, "  " + text, va="center", fontsize=7.5)
            labels.append(label if solid else f"{label} [{src['commit']}]")
            xmax = max(xmax, ms, stream or 0)
            y += 1
        if ao:
            ax.axvline(0.7 * ao, color="#d62728", ls="--", lw=1)
            ax.text(0.7 * ao, y - 0.35, " 0.7x torchao", color="#d62728", fontsize=7.5)
        if config == ("1.3b", 24):
            bf16 = _median(_rows(newest, config, "bf16_fused"), "step_ms_median")
            ax.axvline(1.05 * bf16, color="#2ca02c", ls="--", lw=1)
            ax.text(1.05 * bf16, y - 0.35, " 1.05x bf16", color="#2ca02c", fontsize=7.5)
        ax.set_yticks(range(len(labels)), labels, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlim(0, xmax * 1.45)
        ax.set_xlabel("median step, ms (device synchronized after each step)", fontsize=8)
        ax.set_title(f"{CONFIG_LABEL[config]}k tokens: solid = one process at "
                     f"{newest['commit']}", fontsize=9)
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle("bench_train.py step time, H200 + 16-core host, 2026-11-30 "
                 "(hatched: older run, commit in brackets; diamond: back-to-back step)",
                 fontsize=10)
    fig.tight_layout()
    _save(fig, out)


def plot_peak_memory(files: list[dict], out: str) -> None:
    fig, axes = plt.subplots(2, 2, figsize=(12, 8.0))
    for ax, config in zip(axes.flat, CONFIGS):
        labels, y, xmax = [], 0, 0.0
        amp = amp_net = None
        params_m = None
        for setup, label in SETUPS:
            found = [(f, r) for f in files for r in _rows(f, config, setup) if "peak_gib" in r]
            if not found:
                continue
            net = [(f, r) for f, r in found if "left_by_earlier_setups_gib" in r]
            f, r = (net or found)[-1]
            gib = r["peak_gib"]
            params_m = r.get("params_M", params_m)
            if setup == "amp_fused":
                amp, amp_net = gib, bool(net)
            color = COLOR.get(setup, TS_COLOR)
            ax.barh(y, gib, color=color if net else "white", edgecolor=color,
                    hatch=None if net else "///", height=0.7)
            ax.text(gib, y, f"  {gib:.2f}", va="center", fontsize=7.5)
            labels.append(f"{label} [{f['commit']}]")
            xmax = max(xmax, gib)
            y += 1
        if amp is not None and params_m:
            line = amp - 16 * params_m * 1e6 / 2**30
            ax.axvline(line, color="#2ca02c", ls="--" if amp_net else ":", lw=1)
            ax.text(line, y - 0.35, " AMP - 16 B/param" + ("" if amp_net else "*"),
                    color="#2ca02c", fontsize=7.5)
        ax.set_yticks(range(len(labels)), labels, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlim(0, xmax * 1.2)
        ax.set_xlabel("peak GPU memory, GiB (max_memory_allocated)", fontsize=8)
        ax.set_title(f"{CONFIG_LABEL[config]}k tokens" +
                     (f", {params_m / 1000:.3g}B params" if params_m else ""), fontsize=9)
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle("Peak GPU memory by setup, H200, 2026-11-30 (newest row per setup, commit "
                 "in brackets; hatched: not net of earlier setups, may read high; *: from a hatched AMP row)",
                 fontsize=9.5)
    fig.tight_layout()
    _save(fig, out)


def _load_equivalence(tgz: str) -> dict[str, dict]:
    out = {}
    with tarfile.open(tgz) as tar:
        for member in tar.getmembers():
            if member.name.endswith(".json"):
                key = os.path.basename(os.path.dirname(member.name))  # equivalence_torch_fp32
                out[key] = json.load(tar.extractfile(member))
    return out


def plot_equivalence(data: str, out: str) -> None:
    tgz = os.path.join(data, "2026-11-30_s4_equivalence_h200_100", "all_with_json.tgz")
    runs = _load_equivalence(tgz)
    # Reference-vs-reference (and unpromised) rows drawn, per script: (a, b, device) prefixes.
    refs = {
        "torch": [("torch default [cpu]", "torch fused [cpu]", "default vs fused, CPU"),
                  ("torch default [cuda]", "torch fused [cuda]", "default vs fused, CUDA"),
                  ("torch default [cuda]", "torch default [cpu]", "default CUDA vs CPU")],
        "jax": [("optax.adamw [eager]", "optax.adamw [jit]", "optax eager vs jit, CPU"),
                ("optax.adamw [jit, gpu]", "optax.adamw [jit]", "optax GPU vs CPU"),
                ("offload_adamw step [jit, mode=gpu, gpu]", "optax.adamw [jit, gpu]",
                 "offload_adamw gpu vs optax, both GPU (no promise)"),
                ("offload_adamw convention=torch [jit]", "optax.adamw [jit]",
                 "torch convention vs optax, CPU")],
    }
    fig, axes = plt.subplots(2, 2, figsize=(12, 7.6))
    for row, script in enumerate(("torch", "jax")):
        run = runs[f"equivalence_{script}_fp32"]
        comps = run["comparisons"]
        steps = range(1, run["meta"]["steps"] + 1)
        promised = [c for c in comps if c["promised"]]
        worst_ulp = [max(c["per_step"]["max_ulp"][i] for c in promised) for i in range(len(steps))]
        worst_bit = [min(c["per_step"]["bitid"][i] for c in promised) for i in range(len(steps))]
        ax_u, ax_b = axes[row]
        label = f"TrainStream, all {len(promised)} promised rows (worst of them)"
        ax_u.plot(steps, worst_ulp, color="#2ca02c", lw=2.5, label=label)
        ax_b.plot(steps, [100 * b for b in worst_bit], color="#2ca02c", lw=2.5, label=label)
        for (a, b, name), color in zip(refs[script], REF_COLORS):
            match = [c for c in comps if c["a"] == a and c["b"] == b and c["clip"] is None
                     and c.get("accum", 1) == 1]
            if not match:
                continue
            ps = match[0]["per_step"]
            ax_u.plot(steps, ps["max_ulp"], lw=1, color=color, label=name)
            ax_b.plot(steps, [100 * v for v in ps["bitid"]], lw=1, color=color, label=name)
        what = ("OffloadAdamW vs torch.optim.AdamW" if script == "torch"
                else "offload_adamw vs optax.adamw")
        ax_u.set_yscale("symlog", linthresh=1)
        ax_u.set_ylim(-0.2, 5e9)
        ax_u.set_ylabel("max distance over weights, float32 ULPs", fontsize=8)
        ax_u.set_title(f"{what}, fp32: max ULP per step", fontsize=9)
        ax_b.set_yscale("log")
        ax_b.set_ylim(1, 150)
        ax_b.set_ylabel("weights bit-identical, %", fontsize=8)
        ax_b.set_title(f"{what}, fp32: bit-identical weights per step", fontsize=9)
        for ax in (ax_u, ax_b):
            ax.set_xlabel("training step", fontsize=8)
            ax.tick_params(labelsize=8)
            ax.legend(fontsize=7, loc="center right")
    fig.suptitle("Equivalence on the H200 (tree 1475b8e, 2026-11-30): 120,704-parameter GPT, "
                 "100 steps, no clipping, 1 micro-batch; TrainStream rows stay at 0 ULP / 100%",
                 fontsize=10)
    fig.tight_layout()
    _save(fig, out)


def _sizes() -> dict:
    """bench_train.SIZES, read from its source (no torch import here)."""
    import ast  # noqa: PLC0415

    tree = ast.parse(open(os.path.join(HERE, "bench_train.py")).read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "SIZES":
            return ast.literal_eval(node.value)
    raise RuntimeError("SIZES not found in bench_train.py")


def _params_b(size: str, sizes: dict, vocab: int = 50304, ctx: int = 1024) -> float:
    layers, d, _ = sizes[size]
    return (layers * (12 * d * d + 13 * d) + vocab * d + ctx * d + 2 * d) / 1e9


SCALING_COLORS = {"bf16_fused": "#7f7f7f", "amp_fused": "#b0b0b0", "torchao_fp32": "#d62728",
                  "torchao_bf16": "#ff9896", "ds_zero_offload": "#9467bd", "ts_cpu": "#aec7e8",
                  "ts_cpu_eager": "#1f77b4", "ts_gpu": "#98df8a", "ts_hybrid": "#2ca02c"}


def load_scaling(paths: list[str]) -> list[dict]:
    """The rows of bench_train JSON files (newest file last wins per setup, size, batch)."""
    sizes = _sizes()
    latest: dict = {}
    for path in paths:
        with open(path) as f:
            doc = json.load(f)
        for r in doc["rows"]:
            if "skipped" in r or r.get("size") not in sizes:
                continue
            r = dict(r, params_b=r["params_M"] / 1e3 if "params_M" in r else _params_b(r["size"], sizes))
            key = (r["setup"], r["size"], r["batch"])
            if key in latest and "step_ms_median" in latest[key] and "step_ms_median" not in r:
                continue  # a measured row is not replaced by a failed retry
            latest[key] = r
    return list(latest.values())


def plot_scaling(paths: list[str], out_dir: str) -> list[str]:
    """Step time and peak memory against the parameter count, per setup and batch size."""
    rows = load_scaling(paths)
    batches = sorted({r["batch"] for r in rows})
    setups = list(dict.fromkeys(r["setup"] for r in rows))
    written = []
    for what in ("step_time", "memory"):
        fig, axes = plt.subplots(1, len(batches), figsize=(6.2 * len(batches), 4.6), squeeze=False)
        for ax, batch in zip(axes[0], batches):
            for k, setup in enumerate(setups):
                mine = sorted((r for r in rows if r["setup"] == setup and r["batch"] == batch),
                              key=lambda r: r["params_b"])
                ok = [r for r in mine if "step_ms_median" in r]
                bad = [r for r in mine if "step_ms_median" not in r]
                color = SCALING_COLORS.get(setup.split("~")[0].split("@")[0], f"C{k % 10}")
                xs = [r["params_b"] for r in ok]
                if what == "step_time":
                    mfu = "/".join(f"{100 * r['mfu']:.0f}" for r in ok if "mfu" in r)
                    ax.plot(xs, [r["step_ms_median"] / 1e3 for r in ok], "o-", color=color,
                            label=f"{setup}" + (f" (MFU {mfu}%)" if mfu else ""))
                else:
                    ax.plot(xs, [r["peak_gib"] for r in ok], "o-", color=color, label=f"{setup} GPU")
                    host = [(r["params_b"], r["host_used_peak_gib"]) for r in ok if "host_used_peak_gib" in r]
                    if host:
                        ax.plot(*zip(*host), "s--", color=color, mfc="none", label=f"{setup} host")
                if bad:
                    fails = ", ".join(f"{r['size']} {r.get('failure', '?')}" for r in bad)
                    ax.plot([r["params_b"] for r in bad], [0] * len(bad), "x", color=color, ms=10, mew=2,
                            clip_on=False, label=f"{setup}: no figure ({fails})")
            ax.set_xlabel("parameters, billions", fontsize=9)
            if what == "step_time":
                ax.set_ylabel("median step, s (device synchronized)", fontsize=9)
                ax.set_title(f"step time, batch {batch} x {rows[0].get('seq', 1024)} tokens", fontsize=10)
            else:
                ax.set_ylabel("peak memory, GiB", fontsize=9)
                ax.set_title(f"peak GPU (solid) and host (dashed) memory, batch {batch}", fontsize=10)
            ax.set_ylim(bottom=0)
            ax.set_xlim(left=0)
            ax.grid(alpha=0.3)
            ax.tick_params(labelsize=8)
            ax.legend(fontsize=6.5)
        fig.suptitle("bench_train.py against model size, H200 machine\n"
                     + "\n".join(os.path.basename(p) for p in paths), fontsize=7)
        fig.tight_layout()
        path = os.path.join(out_dir, f"scaling_{what}.png")
        _save(fig, path)
        written.append(path)
    return written


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=os.path.join(HERE, "data"))
    ap.add_argument("--out", default=os.path.join(HERE, "plots"))
    ap.add_argument("--scaling", nargs="+", metavar="JSON",
                    help="only the plots against model size, from these bench_train JSON files")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.scaling:
        for path in plot_scaling(args.scaling, args.out):
            print(f"wrote {path} ({os.path.getsize(path) // 1024} KiB)")
        return
    files = load_bench(args.data)
    plot_step_time(files, os.path.join(args.out, "step_time.png"))
    plot_peak_memory(files, os.path.join(args.out, "peak_memory.png"))
    plot_equivalence(args.data, os.path.join(args.out, "equivalence.png"))
    for name in ("step_time.png", "peak_memory.png", "equivalence.png"):
        path = os.path.join(args.out, name)
        print(f"wrote {path} ({os.path.getsize(path) // 1024} KiB)")


if __name__ == "__main__":
    main()

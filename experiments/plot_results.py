# Run: python experiments/plot_results.py --scaling FILE.json [FILE.json ...] [--largest STATE.json] [--out experiments/plots]
"""The plots of RESULTS.md against model size, from bench_train.py JSON files (numpy and
matplotlib only, no GPU; the newest file wins per setup, size and batch):
``scaling_step_time.png``, the median step time (the MFU in the legend), and
``scaling_memory.png``, the peak GPU memory (solid) and host memory (dashed: the drop of
the machine's MemAvailable during the setup), against the parameter count, a line per
setup and a panel per batch size. A size without a figure is an ``x`` on the panel's
floor, its reason in the legend (GPU or host OOM: it does not fit; a timeout: not measured).
``--largest``: ``largest_model.png`` from a largest_model.py state, the largest model per setup (bars, a group
per machine profile; ``>=``: the top of the ladder fitted; an empty bar: no size fitted).
"""
from __future__ import annotations

import argparse
import io
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from PIL import Image  # noqa: E402  (matplotlib's own dependency)

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _common import param_count  # noqa: E402
COLORS = {"bf16_fused": "#7f7f7f", "amp_fused": "#b0b0b0", "torchao_fp32": "#d62728", "torchao_bf16": "#ff9896",
          "ds_zero_offload": "#9467bd", "ts_cpu": "#aec7e8", "ts_cpu_eager": "#1f77b4", "ts_gpu": "#98df8a",
          "ts_hybrid": "#2ca02c"}


def _save(fig, out: str) -> None:
    """Save at dpi 100 as a 64-colour PNG (flat colours: a small file)."""
    buf = io.BytesIO()
    fig.savefig(buf, dpi=100, format="png")
    plt.close(fig)
    buf.seek(0)
    Image.open(buf).convert("RGB").quantize(colors=64).save(out, optimize=True)


def load_scaling(paths: list[str]) -> list[dict]:
    """The rows of bench_train JSON files (the newest file wins per setup, size, batch)."""
    latest: dict = {}
    for path in paths:
        with open(path) as f:
            for r in json.load(f)["rows"]:
                if "skipped" in r:
                    continue
                r = dict(r, params_b=r["params_M"] / 1e3 if "params_M" in r else param_count(r["size"]) / 1e9)
                key = (r["setup"], r["size"], r["batch"])
                if not (key in latest and "step_ms_median" in latest[key] and "step_ms_median" not in r):
                    latest[key] = r  # a measured row is not replaced by a failed retry
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
                mine = sorted((r for r in rows if r["setup"] == setup and r["batch"] == batch), key=lambda r: r["params_b"])
                ok = [r for r in mine if "step_ms_median" in r]
                bad = [r for r in mine if "step_ms_median" not in r]
                color = COLORS.get(setup.split("~")[0].split("@")[0], f"C{k % 10}")
                xs = [r["params_b"] for r in ok]
                if what == "step_time":
                    mfu = "/".join(f"{100 * r['mfu']:.0f}" for r in ok if "mfu" in r)
                    ax.plot(xs, [r["step_ms_median"] / 1e3 for r in ok], "o-", color=color,
                            label=setup + (f" (MFU {mfu}%)" if mfu else ""))
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
        fig.suptitle("bench_train.py against model size, H200 machine\n" + "\n".join(map(os.path.basename, paths)),
                     fontsize=7)
        fig.tight_layout()
        path = os.path.join(out_dir, f"scaling_{what}.png")
        _save(fig, path)
        written.append(path)
    return written


LARGEST_COLORS = {"ts_cpu": "#1f77b4", "ts_cpu_master": "#aec7e8", "ts_cpu_res": "#17becf", "bf16_fused": "#7f7f7f",
                  "amp_fused": "#b0b0b0", "torchao_bf16": "#ff9896", "torchao_fp32": "#d62728",
                  "ds_zero_offload_bf16": "#c5b0d5", "ds_zero_offload": "#9467bd"}


def plot_largest(path: str, out_dir: str) -> str:
    """Bars: the largest model (billions of parameters) per setup, grouped per profile, from a largest_model.py state;
    the size's name on each bar, the step time at the profile's common size below the names."""
    with open(path) as f:
        state = json.load(f)
    fits: dict = {}
    ladder_top: dict = {}
    for a in state["attempts"]:
        key = (a["profile"], a["label"])
        fits.setdefault(key, None)
        ladder_top[a["profile"]] = max(ladder_top.get(a["profile"], 0), a["params_b"])
        if "step_ms_median" in a and not a.get("profile_applied", {}).get("violation"):
            if fits[key] is None or a["params_b"] > fits[key]["params_b"]:
                fits[key] = a
    profiles = list(dict.fromkeys(k[0] for k in fits))
    labels = list(dict.fromkeys(k[1] for k in fits))
    common = {(c["profile"], c["label"]): c for c in state.get("common", []) if "step_ms_median" in c}
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(labels) * len(profiles)), 4.8))
    width = 0.8 / max(1, len(labels))
    for j, label in enumerate(labels):
        for i, prof in enumerate(profiles):
            a = fits.get((prof, label))
            x = i + (j - (len(labels) - 1) / 2) * width
            h = a["params_b"] if a else 0.0
            ax.bar(x, h, width * 0.92, color=LARGEST_COLORS.get(label, f"C{j % 10}"), label=label if i == 0 else None,
                   edgecolor="black", linewidth=0.4)
            if (prof, label) in fits:
                top = a is not None and a["params_b"] >= ladder_top[prof]
                text = (">=" if top else "") + a["size"] if a else "none"
                c = common.get((prof, label))
                text += f"\n{c['step_ms_median']:.0f} ms" if c else ""
                ax.text(x, h, text, ha="center", va="bottom", fontsize=6, rotation=90)
    ax.set_xticks(range(len(profiles)))
    ax.set_xticklabels(profiles)
    ax.set_ylabel("largest model trained, billions of parameters", fontsize=9)
    ax.set_title("largest GPT per setup and machine profile (batch x seq, activation checkpointing)\n"
                 "label: size, and the step time at the profile's common size", fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    out = os.path.join(out_dir, "largest_model.png")
    _save(fig, out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scaling", nargs="+", metavar="JSON", default=[], help="bench_train JSON files")
    ap.add_argument("--largest", metavar="JSON", default=None, help="a largest_model.py state")
    ap.add_argument("--out", default=os.path.join(HERE, "plots"))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if not args.scaling and not args.largest:
        ap.error("nothing to plot: give --scaling and/or --largest")
    paths = plot_scaling(args.scaling, args.out) if args.scaling else []
    for path in paths + ([plot_largest(args.largest, args.out)] if args.largest else []):
        print(f"wrote {path} ({os.path.getsize(path) // 1024} KiB)")


if __name__ == "__main__":
    main()

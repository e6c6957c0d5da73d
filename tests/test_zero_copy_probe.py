"""experiments/zero_copy_probe.py on the CPU: it imports without CuPy, and its sweep, rate
arithmetic and table helpers are right. The kernels themselves run on the GPU machine."""

from __future__ import annotations

import re
import sys

import pytest

from _experiments import EXPERIMENTS, load_script  # noqa: E402

SCRIPT = EXPERIMENTS / "zero_copy_probe.py"
MEMCPY = {"h2d_gbps": 50.0, "d2h_gbps": 40.0, "both_gbps": 100.0}


@pytest.fixture(scope="module")
def probe():
    return load_script("zero_copy_probe")


def test_first_line_is_its_command():
    first = SCRIPT.read_text().splitlines()[0]
    assert first.startswith("# python experiments/zero_copy_probe.py --mib 1024 --json ")


def test_main_without_cupy_exits_2_with_a_message(probe, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy raises ImportError
    assert probe.main(["--quick"]) == 2
    assert "needs CuPy" in capsys.readouterr().err


def test_gbps_and_pcie_bytes(probe):
    assert probe.gbps(10**9, 1000.0) == pytest.approx(1.0)
    assert probe.gbps(1 << 30, 20.0) == pytest.approx(53.6870912)
    assert probe.pcie_bytes("read", 100) == 100
    assert probe.pcie_bytes("write", 100) == 100
    for kind in ("rmw", "copy", "split"):
        assert probe.pcie_bytes(kind, 100) == 200


def test_make_row_counts_both_directions_and_picks_the_baseline(probe):
    rmw = probe.make_row("rmw", "default", 4, 256, 264, 132, 1 << 30, [30.0, 20.0, 25.0], MEMCPY)
    assert rmw["ms"] == 25.0
    assert rmw["gbps"] == pytest.approx(2 * (1 << 30) / 25e-3 / 1e9)
    assert rmw["fraction"] == pytest.approx(rmw["gbps"] / 100.0)
    assert rmw["blocks_per_sm"] == 2
    write = probe.make_row("write", "none", 1, 256, 132, 132, 1 << 30, [25.0], MEMCPY)
    assert write["baseline"] == "d2h"
    assert write["fraction"] == pytest.approx(write["gbps"] / 40.0)
    read = probe.make_row("read", "nc", 1, 256, 132, 132, 1 << 30, [25.0], MEMCPY)
    assert read["fraction"] == pytest.approx(read["gbps"] / 50.0)


def test_table_sorted_by_kind_then_rate_and_best_per_kind(probe):
    rows = [
        probe.make_row(kind, load, 1, 256, 132, 132, 1 << 30, [ms], MEMCPY)
        for kind, load, ms in (("split", "default", 20.0), ("read", "default", 30.0),
                               ("rmw", "default", 25.0), ("read", "nc", 20.0), ("rmw", "default", 22.0))
    ]
    lines = probe.format_table(rows).splitlines()[2:]
    assert [(line.split()[0], float(line.split()[6])) for line in lines] == [
        ("read", 20.0), ("read", 30.0), ("rmw", 22.0), ("rmw", 25.0), ("split", 20.0)]
    best = probe.best_per_kind(rows)
    assert sorted(best) == ["read", "rmw", "split"]
    assert (best["read"]["load"], best["rmw"]["ms"]) == ("nc", 22.0)
    assert [line.split()[1] for line in probe.format_best(rows).splitlines()] == ["read", "rmw", "split"]


def test_parse_args_quick_and_explicit_lists(probe):
    quick = probe.parse_args(["--quick"])
    assert (quick.ilp, quick.blocks_per_sm, quick.repeats) == (probe.QUICK_ILPS, probe.QUICK_BLOCKS_PER_SM, 5)
    full = probe.parse_args(["--ilp", "2,8", "--kinds", "rmw,copy", "--threads", "256,512"])
    assert (full.ilp, full.kinds, full.threads, full.repeats) == ((2, 8), ("rmw", "copy"), (256, 512), 10)
    for bad in (["--ilp", "3"], ["--kinds", "scatter"], ["--threads", "100"], ["--mib", "1"]):
        with pytest.raises(SystemExit):
            probe.parse_args(bad)


def test_sweep_configs(probe):
    configs = probe.sweep_configs(probe.parse_args([]), 132)
    # 7 (kind, load) variants x 4 ILPs x 1 block size x 5 grids: keeps --mib 1024 near 45 s
    assert len(configs) == 7 * 4 * 5
    assert {c[4] for c in configs} == {132, 264, 528, 1056, 2112}
    only = probe.sweep_configs(probe.parse_args(["--quick", "--kinds", "split"]), 1)
    assert only == [("split", "default", 1, 256, 2), ("split", "default", 1, 256, 8),
                    ("split", "default", 4, 256, 2), ("split", "default", 4, 256, 8)]


def test_every_swept_kernel_is_in_the_source_with_its_arguments(probe):
    src = probe.KERNEL_SOURCE
    for ilp in probe.ILPS:
        assert f"PROBE_KERNELS({ilp})" in src
    for kind, load in probe.VARIANTS:
        stem = probe.kernel_name(kind, load, 1)[: -len("1")]
        match = re.search(rf'extern "C" __global__ void {stem}##ILP\(([^)]*)\)', src)
        assert match, stem
        n_params = len(match.group(1).split(","))
        assert len(probe.kernel_args(kind, 1 << 20, 2 << 20, 5, None)) == n_params, kind

"""The experiment scripts run end to end in CI size, and their tables show bit-identity
where the contract promises it."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("matplotlib")

from _experiments import EXPERIMENTS, load_script  # noqa: E402


@pytest.fixture(scope="module")
def torch_equivalence(tmp_path_factory):
    out = tmp_path_factory.mktemp("equivalence_torch")
    script = load_script("equivalence_torch")
    result = script.main(["--quick", "--steps", "3", "--devices", "cpu", "--threads", "2",
                          "--out", str(out), "--no-progress"])
    return out, result


def test_equivalence_torch_first_line_is_its_command():
    first = (EXPERIMENTS / "equivalence_torch.py").read_text().splitlines()[0]
    assert first.startswith("# Run: python experiments/equivalence_torch.py")


def test_equivalence_torch_writes_json_markdown_and_plots(torch_equivalence):
    out, result = torch_equivalence
    saved = json.loads((out / "equivalence_torch.json").read_text())
    assert saved["comparisons"] == json.loads(json.dumps(result["comparisons"]))
    assert saved["meta"]["steps"] == 3
    table = (out / "equivalence_torch.md").read_text()
    assert table.count("\n| ") == len(result["comparisons"]) + 1  # header + one row each
    for dt in ("fp32", "bf16", "fp16"):
        png = out / f"divergence_{dt}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_equivalence_torch_promised_rows_bit_identical(torch_equivalence):
    _, result = torch_equivalence
    promised = [c for c in result["comparisons"]
                if c["kind"] == "trainstream-vs-reference" and c["promised"]]
    # OffloadAdamW (cpu mode, and its eager path without clipping) vs torch default, on the
    # CPU, for fp32 and half-vs-fp32-master, with and without clipping and accumulation.
    covered = {(c["a"], c["dtype"], c["clip"] is not None, c["accum"]) for c in promised}
    for dt in ("fp32", "bf16", "fp16"):
        for clip in (False, True):
            for accum in (1, 2):
                assert ("OffloadAdamW cpu [cpu]", dt, clip, accum) in covered
                if not clip:
                    assert ("OffloadAdamW cpu eager [cpu]", dt, clip, accum) in covered
    for c in promised:
        assert c["b"] == "torch default [cpu]" and c["device"] == "cpu"
        ps, what = c["per_step"], f"{c['a']} vs {c['b']} {c['dtype']} clip={c['clip']} accum={c['accum']}"
        assert len(ps["bitid"]) == 3
        assert ps["bitid"] == [1.0] * 3, what
        assert ps["bitid_model"] == [1.0] * 3, what
        assert ps["max_ulp"] == [0] * 3 and ps["max_rel"] == [0.0] * 3, what
        assert ps["loss_a"] == ps["loss_b"], what
        assert c["summary"]["final_bitid"] == 1.0
    table = (torch_equivalence[0] / "equivalence_torch.md").read_text()
    assert "| OffloadAdamW cpu [cpu] vs torch default [cpu] | cpu | bf16 | 0.5 | 2 | yes | 3 | 100% | 100% | 0 | 0 |" in table


def test_equivalence_torch_has_reference_rows(torch_equivalence):
    _, result = torch_equivalence
    fused = [c for c in result["comparisons"]
             if c["kind"] == "reference-vs-reference" and c["a"] == "torch default [cpu]"
             and c["b"] == "torch fused [cpu]"]
    assert {(c["dtype"], c["clip"] is not None, c["accum"]) for c in fused} == {
        (dt, clip, accum) for dt in ("fp32", "bf16", "fp16") for clip in (False, True) for accum in (1, 2)}
    for c in fused:
        assert not c["promised"] and len(c["per_step"]["max_ulp"]) == 3
    # every TrainStream row is promised: its reference is the loop a user writes (its own
    # clip_grad_norm_, micro-batches summed in param.grad)
    assert all(c["promised"] for c in result["comparisons"] if c["kind"] == "trainstream-vs-reference")

"""The torch adapter's differential fuzzer in CI (issue 40 item 5): random sequences of what training loops do to an
optimizer (tests/_fuzz_torch.py says which), each run against torch.optim.AdamW / Adam (every implementation:
for-loop, foreach, fused) and against ours with the same sequence; after every step the weights are bitwise equal, or
both raised, or ours refused naming why. Derandomized (the same sequences every run); a failure prints hypothesis'
shrunk sequence. ``TRAINSTREAM_FUZZ_EXAMPLES`` sets the count; the longer run is experiments/fuzz.py."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("torch")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402

import _fuzz_torch as F  # noqa: E402

#: no "explain" phase: a failure prints the shrunk case at once (explaining re-runs it ~100 times)
PHASES = [Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink]
EXAMPLES = int(os.environ.get("TRAINSTREAM_FUZZ_EXAMPLES", "300"))


@settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None, print_blob=True,
          phases=PHASES,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
@given(cfg=F.configs(), ops=F.sequences())
def test_sequences_match_torch(cfg, ops):
    outcome, detail = F.run_sequence(cfg, ops)  # raises a Finding otherwise
    assert outcome in ("identical", "both raised", "refused", "config refused"), (outcome, detail)


def test_pending_operations_are_named():
    """Each operation left out today has its reason; each names an operation the strategy knows."""
    for name, reason in F.PENDING.items():
        assert reason and name in F.OPERATIONS, name

"""The run report on the bundled sample, for every policy, equals the recorded one (timings aside): a change that
moves code changes no result. ``python tests/test_reports.py`` re-records it; do that only with a change that is
meant to change results (a retrained model, a policy whose rule changed), and say which in the commit."""

from __future__ import annotations

import contextlib
import io
import json
import math
import sys
from pathlib import Path

import pytest

RECORDED = Path(__file__).resolve().parent / "data" / "bundled_sample_reports.json"
POLICIES = ("full", "sliding-window", "uniform", "infinipot-v", "cords", "protokv", "hybridkv")
#: Timings differ from run to run; everything else must not.
TIMING_KEYS = {"ms", "ttft_ms"}


def strip_timings(value):
    if isinstance(value, dict):
        return {k: strip_timings(v) for k, v in value.items() if k not in TIMING_KEYS and not k.endswith("_ms")}
    if isinstance(value, list):
        return [strip_timings(v) for v in value]
    return value


def report_of(policy: str, folder: Path) -> dict:
    """``python -m kvdemo run`` on the bundled sample at the tiny model's app budget (M=96, C=72), asking every
    question the sample has a ground truth for."""
    from kvdemo.cli import main
    from kvdemo.world.synthetic import sample_episode

    out = folder / f"{policy}.json"
    args = ["run", "--policy", policy, "--quiet", "--json", str(out)]
    if policy != "full":
        args += ["-M", "96"] + (["-C", "72"] if policy != "protokv" else [])
    for question in sample_episode().questions:
        args += ["--ask", question.text]
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert main(args) == 0
    return strip_timings(json.loads(out.read_text()))


def differences(got, want, path: str = "report") -> list[str]:
    """Where two reports differ: integers, strings and structure exactly; floats (statistics such as HybridKV's
    quantile cutoff) to 1e-6 relative, since torch builds round float32 reductions differently in the last bits."""
    if isinstance(want, dict) and isinstance(got, dict):
        if set(got) != set(want):
            return [f"{path}: keys {sorted(set(got) ^ set(want))}"]
        return [d for key in want for d in differences(got[key], want[key], f"{path}.{key}")]
    if isinstance(want, list) and isinstance(got, list):
        if len(got) != len(want):
            return [f"{path}: {len(got)} items, recorded {len(want)}"]
        return [d for i, (g, w) in enumerate(zip(got, want)) for d in differences(g, w, f"{path}[{i}]")]
    if isinstance(want, float) and isinstance(got, float):
        return [] if math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-9) else [f"{path}: {got} != {want}"]
    return [] if got == want and type(got) is type(want) else [f"{path}: {got!r} != {want!r}"]


def test_the_comparison_is_exact_but_for_float_rounding():
    assert differences({"a": [1, 0.5683732628822327]}, {"a": [1, 0.5683733224868774]}) == []
    assert differences({"a": [1, 0.57]}, {"a": [1, 0.5683733224868774]}) != []
    assert differences({"a": [2, 0.5]}, {"a": [1, 0.5]}) != []
    assert differences({"a": "x"}, {"a": "y"}) != []


@pytest.mark.slow
@pytest.mark.parametrize("policy", POLICIES)
def test_the_report_on_the_bundled_sample_is_unchanged(policy, tmp_path):
    recorded = json.loads(RECORDED.read_text())[policy]
    assert differences(report_of(policy, tmp_path), recorded) == []


if __name__ == "__main__":
    import tempfile

    sys.path.insert(0, str(RECORDED.parents[2]))  # run as a script from the checkout

    with tempfile.TemporaryDirectory() as folder:
        reports = {policy: report_of(policy, Path(folder)) for policy in POLICIES}
    RECORDED.write_text(json.dumps(reports, indent=0, sort_keys=True))
    print(f"recorded {', '.join(POLICIES)} in {RECORDED}", file=sys.stderr)

"""The run report's arithmetic: unbiased pass@k and percentiles, checked against direct enumeration."""

from __future__ import annotations

import itertools

import pytest

from harness.core.records import EpisodeOutcome, Judgement
from harness.running.report import build_report, format_percentiles, pass_at_k, percentiles


@pytest.mark.parametrize("n, c", [(4, 0), (4, 1), (4, 2), (5, 3), (6, 6), (3, 1)])
def test_pass_at_k_equals_the_fraction_of_k_subsets_with_a_success(n, c):
    samples = [True] * c + [False] * (n - c)
    for k in range(1, n + 1):
        subsets = list(itertools.combinations(samples, k))
        assert pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets))


def test_pass_at_k_rejects_impossible_counts():
    with pytest.raises(ValueError, match="n=2, c=3"):
        pass_at_k(2, 3, 1)


def test_percentiles_interpolate():
    assert percentiles([1, 2, 3, 4, 5], (0.5, 0.9)) == {"p50": 3, "p90": pytest.approx(4.6)}
    assert percentiles([], (0.5,)) == {"p50": None}


def _outcome(task, i, status="finished"):
    return EpisodeOutcome(f"{task}-{i}", "r", task, i, 1, status, 0, "x", None, 0.0, 10.0 * (i + 1), None)


def test_report_counts_successes_failures_and_judge_errors():
    outcomes = [_outcome("a", 0), _outcome("a", 1), _outcome("b", 0), _outcome("b", 1, "crashed")]
    judgements = [Judgement("a-0", "j", "h", 1.0, {}, None, 0.0), Judgement("a-1", "j", "h", 0.0, {}, None, 0.0),
                  Judgement("b-0", "j", "h", None, {}, "raised", 0.0), Judgement("b-1", "j", "h", 0.0, {}, None, 0.0),
                  Judgement("a-0", "other", "h", 0.0, {}, None, 0.0)]
    report = build_report(outcomes, judgements, judge="j")
    assert report["mean_reward"] == pytest.approx(1 / 3)
    assert report["success_rate"] == 0.25
    assert report["pass_at_k"] == {"pass@1": 0.25, "pass@2": 0.5}
    assert report["failures"] == {"crashed": 1, "judge_error": 1}
    assert report["episode_duration_ms"]["p50"] == 15.0


@pytest.mark.parametrize("values, shown", [
    ({"p50": 96.0, "p90": 104.0, "p99": 110.4}, "p50 96  p90 104  p99 110"),  # not `p50 96.000  p90 104`
    ({"p50": 12.25, "p90": 40.0}, "p50 12.2  p90 40.0"),
    ({"p50": 0.5, "p90": 3.25}, "p50 0.500  p90 3.250"),
    ({"p50": 3.0, "p90": 7.0}, "p50 3  p90 7"),  # token counts
    ({"p50": None, "p90": None}, "p50 -  p90 -"),
])
def test_a_row_of_percentiles_shows_every_value_with_the_same_decimals(values, shown):
    assert format_percentiles(values) == shown

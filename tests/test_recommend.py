"""attnzoo.recommend and mechanism="auto": the choice from a table of measurements."""

import importlib
import json

import pytest
import torch

import attnzoo
from attnzoo.cli import main

module = importlib.import_module("attnzoo.recommend")


def _row(name, L, causal, time_s, err, peak=2**20):
    return {"mechanism": name, "L": L, "causal": causal, "time_s": time_s, "peak_bytes": peak,
            "err_trained": err}


@pytest.fixture
def table(tmp_path, monkeypatch):
    """full slows as L², local is fast but only close at short lengths, linear fast and far,
    efficient (no causal form) fastest and close."""
    rows = []
    for L in (1024, 4096):
        s = L / 1024
        rows += [_row("full", L, c, 0.01 * s * s, 0.0, 2**20 * s) for c in (False, True)]
        rows += [_row("local", L, c, 0.004 * s, 0.05 if L == 1024 else 0.2) for c in (False, True)]
        rows += [_row("linear", L, c, 0.002 * s, 0.9) for c in (False, True)]
        rows += [_row("efficient", L, False, 0.001 * s, 0.08)]
    path = tmp_path / "recommend.json"
    path.write_text(json.dumps({"machine": {"cpu": "test CPU"}, "lengths": [1024, 4096], "rows": rows}))
    monkeypatch.setattr(module, "TABLE", path)
    module._choice.cache_clear()
    yield path
    module._choice.cache_clear()


def test_the_fastest_within_the_error_wins(table):
    rec = attnzoo.recommend(1024, max_error=0.1)
    assert rec.mechanism == "efficient" and rec.time_ratio == pytest.approx(0.1)
    assert rec.error == 0.08 and "test CPU" in rec.reason
    causal = attnzoo.recommend(1024, causal=True, max_error=0.1)  # efficient has no causal form
    assert causal.mechanism == "local" and causal.time_ratio == pytest.approx(0.4)
    why = {e["mechanism"]: e["why_not"] for e in causal.runners_up}
    assert why["efficient"] == "no causal" and why["linear"].startswith("error 0.9 > 0.1")
    assert why["lsh"] == "not measured at this length"


def test_error_bound_length_and_interpolation(table):
    assert attnzoo.recommend(4096, causal=True, max_error=0.1).mechanism == "full"  # local's 0.2 too far
    assert attnzoo.recommend(4096, causal=True, max_error=0.3).mechanism == "local"
    assert attnzoo.recommend(4096, causal=True, max_error=1.0).mechanism == "linear"
    mid = attnzoo.recommend(2048, causal=True, max_error=0.1)  # error of the longest length <= 2048
    assert mid.mechanism == "local" and mid.time_ratio == pytest.approx(0.008 / 0.04)
    far = attnzoo.recommend(16384, causal=True, max_error=0.3)  # extrapolated, said so
    assert far.mechanism == "local" and "measured at L = 4096" in far.reason
    assert far.time_ratio == pytest.approx(0.064 / 2.56)


def test_nothing_sub_quadratic_faster_gives_full(table):
    rec = attnzoo.recommend(1024, causal=True, key_mask=True, max_error=0.01)
    assert rec.mechanism == "full" and rec.time_ratio == 1.0 and "nothing sub-quadratic" in rec.reason


def test_measure_times_here_and_caches(table, tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNZOO_CACHE", str(tmp_path / "cache"))
    calls = []

    def fake(name, L, causal, device, timeout_s):
        calls.append(name)
        return {"full": 1.0, "local": 0.5, "efficient": 2.0}.get(name, 3.0)

    monkeypatch.setattr(module, "_time_here", fake)
    rec = attnzoo.recommend(1024, max_error=0.1, measure=True)
    assert rec.mechanism == "local" and rec.time_ratio == 0.5  # efficient measured slower here
    n = len(calls)
    attnzoo.recommend(1024, max_error=0.1, measure=True)
    assert len(calls) == n  # cached
    with pytest.raises(ValueError, match="measure=True"):
        attnzoo.recommend(1024, device="cuda")


def test_auto_runs_the_chosen_mechanism(table):
    q, k, v = (torch.randn(1, 2, 1024, 8) for _ in range(3))
    torch.testing.assert_close(attnzoo.attention(q, k, v, mechanism="auto", causal=True),
                               attnzoo.attention(q, k, v, mechanism="local", causal=True))
    torch.testing.assert_close(attnzoo.attention(q, k, v, mechanism="auto", max_error=1.0, causal=True),
                               attnzoo.attention(q, k, v, mechanism="linear", causal=True))
    layer = attnzoo.MultiheadAttention(16, 2, "auto", causal=True)
    assert layer(torch.randn(2, 1024, 16)).shape == (2, 1024, 16)
    with pytest.raises(ValueError, match="unknown option"):
        attnzoo.attention(q, k, v, mechanism="auto", window=3)
    assert "auto" not in attnzoo.mechanisms()


def test_cli_prints_the_choice_and_the_runners_up(table, capsys):
    assert main(["recommend", "--length", "1024", "--causal", "--max-error", "0.1"]) == 0
    out = capsys.readouterr().out
    assert "local at L = 1024 (causal)" in out and "linear" in out and "error 0.9 > 0.1" in out


def test_the_shipped_table_answers():
    for causal in (False, True):
        rec = attnzoo.recommend(4096, causal=causal, max_error=0.3)
        assert rec.mechanism in attnzoo.mechanisms() and 0 < rec.time_ratio <= 1

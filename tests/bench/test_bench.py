import csv
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import attnzoo
from attnzoo.bench import BenchConfig, Shape, run_sweep, sweep, write
from attnzoo.bench.measure import make_inputs, memory_env
from attnzoo.bench.report import exponents
from attnzoo.bench.sweep import derived, loglog_slope
from attnzoo.cli import main
from attnzoo.mechanisms.prob_sparse import sizes


@pytest.fixture(scope="module")
def tiny_sweep(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    config = BenchConfig(mechanisms=["full", "local", "efficient"], lengths=[128, 64],
                         shape=Shape(heads=2, head_dim=16, causal=True), repeats=2, threads=1,
                         options={"local": {"window": 16}})
    events: list[tuple[str, str, int]] = []
    result = run_sweep(config, on_cell=lambda c: events.append(("time", c["mechanism"], c["L"])),
                       on_memory=lambda c: events.append(("memory", c["mechanism"], c["L"])))
    return result, write(result, out), out, events


def test_sweep_writes_every_file(tiny_sweep):
    result, paths, out, _ = tiny_sweep
    names = {p.name for p in paths}
    assert {"results.json", "results.csv", "report.md", "time_vs_length.png",
            "memory_vs_length.png", "error.png"} <= names
    assert all(p.exists() and p.stat().st_size > 0 for p in paths)
    saved = json.loads((out / "results.json").read_text())
    assert saved["machine"]["torch"] == torch.__version__ and saved["machine"]["cores"] >= 1
    rows = list(csv.DictReader((out / "results.csv").open()))
    assert len(rows) == 3 * 2


def test_sweep_reports_progress_for_both_processes(tiny_sweep):
    """Each mechanism's memory readings as they come, then its timed cells; a mechanism skipped
    whole (efficient: no causal form) passes through both, so a bar of 2 steps a cell fills."""
    *_, events = tiny_sweep
    expected = [(part, name, L) for name in ("full", "local", "efficient") for part in ("memory", "time")
                for L in (64, 128)]
    assert events == expected


def test_sweep_contents_are_sane(tiny_sweep):
    result, _, out, _ = tiny_sweep
    assert result["config"]["lengths"] == [64, 128]  # sorted
    ok = [c for c in result["cells"] if c["status"] == "ok"]
    assert {c["mechanism"] for c in ok} == {"full", "local"}
    for c in ok:
        assert 0 < c["time_min_s"] <= c["time_s"] <= c["time_max_s"] < 60
        assert c["flops"] > 0 and c["gflops_per_s"] > 0
        if Path("/proc/self/clear_refs").exists():  # read in the memory process (memory_env)
            assert isinstance(c["peak_bytes"], int) and c["peak_bytes"] >= 0
        else:
            assert c["peak_bytes"] is None
    for c in ok:
        if c["mechanism"] == "full":
            assert c["error_gaussian"] == 0 and c["error_peaked"] == 0
            assert c["nerror_gaussian"] == 0 and c["nerror_peaked"] == 0
        else:
            assert 0 < c["error_gaussian"] and 0 < c["error_peaked"]
            assert 0 < c["nerror_gaussian"] and 0 < c["nerror_peaked"]
    assert "## Normalised error against full, peaked inputs" in (out / "report.md").read_text()
    for c in (c for c in result["cells"] if c["mechanism"] == "efficient"):
        assert c["status"] == "skipped" and "no causal form" in c["reason"]
    assert "efficient" in (out / "report.md").read_text().split("## Skipped")[1]


def test_bad_config_is_refused():
    with pytest.raises(ValueError, match="unknown mechanism"):
        BenchConfig(mechanisms=["nope"])
    with pytest.raises(ValueError, match="lengths"):
        BenchConfig(lengths=[])
    with pytest.raises(ValueError, match="unknown option"):
        BenchConfig(options={"local": {"windw": 3}})


def test_loglog_slope():
    assert loglog_slope([1, 2, 4], [3, 12, 48]) == pytest.approx(2.0)
    assert loglog_slope([8], [1.0]) is None


def test_derived_exponents_fit_and_last_step_and_crossover():
    """Memory flat, then quadrupling at the last doubling: the fit over every length reads
    under 1, the last step 2. Time quadratic for full, linear for the other, which beats
    full from the first length where its median is lower (not where it is equal)."""
    def cell(name, L, time_s, peak):
        return {"mechanism": name, "L": L, "status": "ok", "time_s": time_s, "peak_bytes": peak}
    Ls = [1024, 2048, 4096, 8192]
    cells = ([cell("full", L, (L / 1024) ** 2, 100) for L in Ls]
             + [cell("late", L, 2 * L / 1024, 100 if L < 8192 else 400) for L in Ls]
             + [{"mechanism": "late", "L": 16384, "status": "skipped", "reason": "timeout"}])
    d = derived(cells, ["full", "late"])
    assert d["full"]["time_exponent"] == pytest.approx(2) == d["full"]["time_exponent_last"]
    assert d["full"]["crossover_L"] is None
    late = d["late"]
    assert late["time_exponent"] == pytest.approx(1) == late["time_exponent_last"]
    assert late["memory_exponent_last"] == pytest.approx(2)
    assert 0.5 < late["memory_exponent"] < 1
    assert late["crossover_L"] == 4096  # 2048: equal times (4 s each) do not beat full
    assert exponents(late, "memory") == f"{late['memory_exponent']:.2f} / 2.00"
    one = derived([cell("full", 64, 1.0, None)], ["full"])["full"]
    assert one["time_exponent_last"] is None and exponents(one, "memory") == "— / —"


def test_peaked_inputs_concentrate_attention():
    shape = Shape(heads=1, head_dim=32, dtype="float64")
    for family, low, high in (("gaussian", 0.0, 0.05), ("peaked", 0.3, 1.0)):
        q, k, _ = make_inputs(shape, 256, family)
        weights = torch.softmax(q @ k.transpose(-1, -2) / 32**0.5, -1)
        top = weights.max(-1).values.mean().item()
        assert low <= top <= high, (family, top)


# torch's counter knows baddbmm but not its in-place form, which the causal kernel engine uses
IN_PLACE_MATMULS = {torch.ops.aten.baddbmm_: lambda t, a, b, **_: 2 * a[0] * a[1] * a[2] * b[2]}


@pytest.mark.parametrize("name", attnzoo.mechanisms())
def test_flops_formula_matches_counted_matmuls(name, monkeypatch):
    monkeypatch.setenv("ATTNZOO_NATIVE", "0")  # the eager engines' matmuls (the native kernel has none)
    spec = attnzoo.get(name)
    B, H, L, D, Dv = 2, 3, 50, 8, 6
    Lk = L if (name == "lsh" or not spec.capabilities.cross) else 61
    for causal in ([False, True] if spec.capabilities.causal else [False]):
        g = torch.Generator().manual_seed(0)
        q = torch.randn(B, H, L, D, generator=g)
        k = torch.randn(B, H, Lk, D, generator=g)
        v = torch.randn(B, H, Lk, Dv, generator=g)
        with FlopCounterMode(display=False, custom_mapping=IN_PLACE_MATMULS) as counter:
            attnzoo.attention(q, k, v, mechanism=name, causal=causal, generator=g)
        formula = spec.flops(B, H, L, Lk, D, Dv, causal, spec.options())
        counted = counter.get_total_flops()
        if name == "full" and causal:
            # the counter charges the whole L×Lk; the formula counts only the visible pairs
            counted = counted * sum(min(max(i + Lk - L + 1, 0), Lk) for i in range(L)) / (L * Lk)
        elif name == "prob_sparse":  # M's sampled dot products are elementwise, not matmuls
            u, U_part = sizes(L, Lk, 5)
            counted += 2 * B * H * L * U_part * D
        elif name == "log_sparse":  # elementwise: one score and one weighted value per offset
            N = max(L, Lk)  # frame of the aligned positions
            back = attnzoo.connectivity("log_sparse", length=N, causal=True).sum(-1).max().item()
            offsets = back if causal else 2 * back - 1  # every query scores every offset
            counted = 2 * B * H * N * offsets * (D + Dv)
        assert formula == pytest.approx(counted), (name, causal)


def test_cli_bench_runs(tmp_path, capsys):
    # (one mechanism: each runs in child processes of its own, a few seconds each; the sweep of
    # several is tiny_sweep's)
    code = main(["bench", "--mechanisms", "linear", "--lengths", "32,64", "--repeats", "1",
                 "--heads", "1", "--head-dim", "8", "--threads", "1", "--out", str(tmp_path)])
    assert code == 0
    out = capsys.readouterr().out
    assert "linear" in out and "results.json" in out
    assert "Command: `attnzoo bench --mechanisms linear" in (tmp_path / "report.md").read_text()


def test_cells_past_the_timeout_are_skipped_with_the_reason():
    config = BenchConfig(mechanisms=["full"], lengths=[32, 64], shape=Shape(heads=1, head_dim=8),
                         repeats=1, threads=1, timeout_s=1e-9)
    cells = run_sweep(config)["cells"]
    assert [c["status"] for c in cells] == ["skipped", "skipped"]
    assert "> timeout" in cells[0]["reason"] and "already exceeded" in cells[1]["reason"]


def test_memory_child_needs_the_fixed_mmap_threshold_from_its_start():
    """A sweep's memory child refuses to run without memory_env's setting (it would read the
    heap's state as the call's memory), and with it gives each length's peak bytes."""
    job = {"mechanism": "linear", "part": "memory", "lengths": [16, 32],
           "shape": dataclasses.asdict(Shape(heads=1, head_dim=8)), "repeats": 1, "threads": 1,
           "timeout_s": 60.0, "error_max_len": 0, "mem_cap_gib": 8.0, "options": {}}
    cmd = [sys.executable, "-m", "attnzoo.bench.child", json.dumps(job)]
    bare_env = {**memory_env(), "MALLOC_MMAP_THRESHOLD_": ""}
    bare = subprocess.run(cmd, capture_output=True, text=True, env=bare_env)
    assert bare.returncode != 0 and "MALLOC_MMAP_THRESHOLD_=131072" in bare.stderr
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=memory_env())
    cells = [json.loads(line) for line in out.stdout.splitlines()]
    assert [(c["L"], c["status"]) for c in cells] == [(16, "ok"), (32, "ok")]
    assert all("peak_bytes" in c and "time_s" not in c for c in cells)


def _fake_children(monkeypatch, script: str) -> None:
    """Every sweep child runs ``script`` (python -c) instead, with a per-cell limit of 2 s."""
    monkeypatch.setattr(sweep, "_child_cmd", lambda name, config, part: [sys.executable, "-c", script])
    monkeypatch.setattr(sweep, "_per_cell_limit", lambda config: 2.0)


CELL = {"mechanism": "full", "L": 32, "status": "ok", "time_s": 0.5, "peak_bytes": 7}
FIRST_CELL = f"import json, sys; print(json.dumps({CELL}))"  # then the length 64 does not come


@pytest.mark.parametrize("tail, reason", [
    ("; sys.stdout.flush(); sys.exit('boom at L=64')", "child failed: boom at L=64"),
    ("; sys.stdout.flush(); import time; time.sleep(30)", "killed after 2 s without finishing L=64"),
])
def test_a_child_that_fails_or_hangs_leaves_its_lengths_skipped_with_the_reason(monkeypatch, tail, reason):
    _fake_children(monkeypatch, FIRST_CELL + tail)
    config = BenchConfig(mechanisms=["full"], lengths=[32, 64], shape=Shape(heads=1, head_dim=8))
    seen = []
    cells = run_sweep(config, on_cell=seen.append)["cells"]
    assert [c["status"] for c in cells] == ["ok", "skipped"] and cells[1]["reason"] == reason
    assert cells[0]["peak_bytes"] == 7 and seen == cells


def test_a_child_writing_much_to_stderr_does_not_stall(monkeypatch):
    """Its stderr goes to a file: 1 MiB of warnings would fill a pipe nobody reads."""
    _fake_children(monkeypatch, FIRST_CELL.replace("print(", "sys.stderr.write('w' * 2**20); print(", 1))
    config = BenchConfig(mechanisms=["full"], lengths=[32], shape=Shape(heads=1, head_dim=8))
    assert [c["status"] for c in run_sweep(config)["cells"]] == ["ok"]


@pytest.mark.parametrize("causal", [False, True])
def test_normalised_error_measures_against_the_visible_average(causal):
    """avg is each query's plain mean of the values it may see (dense check): what full attention
    gives where every score is equal."""
    from attnzoo.bench.measure import visible_average

    v = torch.randn(2, 3, 9, 4, dtype=torch.float64)
    seen = torch.ones(9, 9, dtype=torch.float64)
    seen = seen.tril() if causal else seen
    want = (seen / seen.sum(-1, keepdim=True)) @ v
    torch.testing.assert_close(visible_average(v, causal), want)
    q = torch.zeros(2, 3, 9, 4, dtype=torch.float64)  # equal scores: full attention is the average
    full = attnzoo.attention(q, torch.randn_like(q), v, causal=causal)
    torch.testing.assert_close(full, want)

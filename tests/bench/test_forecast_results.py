"""benchmarks/forecast_results.py: the grid's runs, and the report built from finished runs.

The runs themselves take hours; these tests write their metrics.json by hand and check what the
report makes of them.
"""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("forecast_results", ROOT / "benchmarks" / "forecast_results.py")
fr = importlib.util.module_from_spec(spec)
sys.modules["forecast_results"] = fr  # dataclasses look their module up
spec.loader.exec_module(fr)


def finish(runs: Path, run, mse: float, mae: float = 0.2, seconds: float = 600.0, epochs: int = 5,
           peak: float = 1500.0, cpu: str = "CPU A", threads: list[int] | None = None,
           data: Path | None = None) -> None:
    """Write the metrics.json a finished run leaves (without ``threads``, as the records from before
    runs recorded them; without ``data``, none of the no-model forecast's scores)."""
    out = runs / run.name
    out.mkdir(parents=True)
    (out / "metrics.json").write_text(json.dumps({
        "test": {"mse": mse, "mae": mae}, "epochs_run": epochs, "seconds_per_epoch": seconds,
        "peak_rss_mib": peak, "cpus": [cpu] if cpu else [], **({"threads": threads} if threads else {}),
        **({"data": str(data), "target": "OT", "features": "S"} if data else {})}))


def write_cost(runs: Path, cells: dict[tuple[str, int], tuple[float, float]], cpu: str = "CPU X",
               threads: int = 2) -> None:
    """Write the cost.json `--cost` leaves: (mechanism, input) -> (seconds a step, peak MiB)."""
    runs.mkdir(parents=True, exist_ok=True)
    (runs / fr.COST).write_text(json.dumps({"cells": [
        {"mechanism": m, "seq_len": n, "label_len": fr.LENGTH_LABEL[n], "pred_len": 168, "batch_size": 32,
         "seconds_each": [sec] * 5, "seconds_median": sec, "peak_rss_mib": peak, "cpu": cpu,
         "threads": threads} for (m, n), (sec, peak) in cells.items()]}))


def protocol(mech: str, h: int, seed: int = 0, revin: bool = False):
    return fr.Run(mech, fr.SEQ_LEN, fr.LABEL_LEN[h], h, seed, revin)


def test_grid_is_every_run_once_in_order_of_priority():
    runs = fr.grid()
    assert len(runs) == len(set(runs)) == len({r.name for r in runs}) == 48
    assert runs[:12] == fr.pair(False)  # the protocol pair, every seed, first
    assert {r.seed for r in runs if r.mech in fr.PAIR and not r.revin and r.seq_len == fr.SEQ_LEN} == {0, 1}
    study = [r for r in runs if r.pred_len == 168 and r.mech in fr.LENGTH_MECHANISMS and not r.revin
             and r.seed == 0]
    assert {(r.mech, r.seq_len) for r in study} == {(m, n) for m in fr.LENGTH_MECHANISMS for n in fr.LENGTHS}


def test_only_keeps_the_matching_runs_in_order():
    runs = fr.grid()
    assert fr.only(runs, None) == runs
    short = fr.only(runs, ["*-in96-*", "*-in336-*"])
    assert [(r.seq_len, r.mech) for r in short] == [(n, m) for n in (96, 336) for m in fr.LENGTH_MECHANISMS]
    assert fr.only(runs, ["full-*-revin-*"]) == [r for r in fr.pair(True) if r.mech == "full"]
    assert fr.only(runs, ["nothing"]) == []


def test_run_command_is_the_protocol():
    args = protocol("prob_sparse", 168, seed=1, revin=True).args()
    joined = " ".join(args)
    assert joined.startswith("forecast --features S --target OT")
    assert "--seq-len 720 --label-len 336 --pred-len 168 --attn prob_sparse --revin --seed 1" in joined
    assert "--revin" not in " ".join(protocol("full", 24).args())
    assert "--threads 2 " in " ".join(protocol("full", 24).args(threads=2))


def test_summary_means_seeds_and_gives_half_their_range(tmp_path):
    finish(tmp_path, protocol("full", 24, 0), 0.06, mae=0.2, seconds=600, epochs=6, peak=1400)
    finish(tmp_path, protocol("full", 24, 1), 0.08, mae=0.3, seconds=800, epochs=4, peak=1600)
    (row,) = [fr.summary(done) for done in fr.cells(tmp_path, fr.grid()).values()]
    assert row["mse"] == pytest.approx(0.07) and row["mae"] == pytest.approx(0.25)
    assert row["mse_spread"] == pytest.approx(0.01) and row["seeds"] == [0, 1]
    assert row["mse_each_seed"] == [0.06, 0.08] and row["mae_each_seed"] == [0.2, 0.3]
    assert row["epochs"] == 5 and row["seconds_per_epoch"] == 700 and row["peak_rss_mib"] == 1600
    assert row["command"].endswith("--attn full --seed {seed}") and row["d_model"] == fr.WIDTH["d_model"]
    assert "--threads 1 " in row["command"] and row["threads"] == [1]
    assert fr._fmt(row, "mse") == "0.070 ± 0.010" and fr._fmt(row, "mae") == "0.250"


def test_a_cells_command_gives_the_threads_its_runs_recorded(tmp_path):
    finish(tmp_path, protocol("full", 24, 0), 0.06, threads=[2])
    finish(tmp_path, protocol("prob_sparse", 24, 0), 0.06, threads=[2])
    finish(tmp_path, protocol("prob_sparse", 24, 1), 0.06, threads=[1])
    rows = {done[0][0].mech: fr.summary(done) for done in fr.cells(tmp_path, fr.grid()).values()}
    assert "--threads 2 " in rows["full"]["command"] and rows["full"]["threads"] == [2]
    mixed = rows["prob_sparse"]
    assert "--threads {threads} " in mixed["command"] and mixed["threads"] == [1, 2]


def test_report_writes_tables_verdict_json_and_picture(tmp_path):
    runs, docs = tmp_path / "runs", tmp_path / "docs"
    docs.mkdir()
    finish(runs, protocol("prob_sparse", 24, 0), 0.090)
    finish(runs, protocol("prob_sparse", 24, 1), 0.080)
    finish(runs, protocol("full", 24, 0), 0.100, seconds=1200, epochs=3)
    finish(runs, protocol("full", 168, 0, revin=True), 0.095)
    finish(runs, protocol("prob_sparse", 24, 0, revin=True), 0.095)
    finish(runs, protocol("prob_sparse", 168, 0), 0.100)
    finish(runs, protocol("prob_sparse", 168, 1), 0.120)
    for n, mse in [(96, 0.2), (336, 0.15)]:
        finish(runs, fr.Run("linear", n, fr.LENGTH_LABEL[n], 168, 0), mse, seconds=n)
    (runs / protocol("full", 24).name / "swap.json").write_text(json.dumps({
        "full": {"mse": 0.100, "notes": []}, "prob_sparse": {"mse": 0.105, "notes": []}}))
    write_cost(runs, {("linear", 96): (0.1, 600), ("linear", 336): (0.4, 900), ("full", 1440): (4.0, 3000)})
    fr.report(runs, docs)

    md = (docs / "results.md").read_text()
    assert "| prob_sparse | 0.105 | 1.05 | 0.090 |  |" in md  # beside prob_sparse's seed 0, as the swap's
    assert "9 of its 48 runs have finished" in md
    assert "| prob_sparse | 0.085 ± 0.005 | 0.200 | — |" in md
    # the RevIN table, each MSE beside its change from seed 0 without RevIN, where there is one
    assert "| full | — | — | — | — | 0.095 | 0.200 | 5.0 |" in md
    assert "| prob_sparse | 0.095 (+6%) | 0.200 | — | — | — | — | 5.0 |" in md
    # the study: each cell's step measured together, then its run's own figures; a cell measured but
    # not yet trained
    assert "| linear | 336 | 0.150 | 0.200 | 0.40 | 900 | 336 | 1500 | CPU A, 1 thread |" in md
    assert "| full | 1440 | — | — | 4.00 | 3000 | — | — | — |" in md
    assert "(`benchmarks/forecast_results.py --cost`; CPU X, 2 threads, the median of 5 steps of 32 " \
        "windows)" in md
    # prob_sparse below the paper at 24, full above it; the best read on seed 0 alone, not the mean of
    # two seeds beside one
    assert "| prob_sparse, change in MSE / MAE from Informer (prob_sparse) in the paper | -13% / -19% " \
        "| — | -40% / -42% |" in md
    assert "| full, change in MSE / MAE from Informer with full attention in the paper | +9% / -19% " \
        "(1 seed) | — | — |" in md
    assert "| the best MSE on this page, read on seed 0 (the seed every cell has), against S4's | 0.090 " \
        "(prob_sparse, 720-step input): 1.48× S4's | — | 0.095 (full with RevIN, 720-step input): 0.91× " \
        "S4's, level with it within the largest gap between seeds |" in md
    assert "RevIN lowers test MSE by more than the largest gap between seeds (0.020) in 0 of 1 cell, " \
        "raises it in 0, and leaves 1 level." in md
    assert "Informer (prob_sparse), paper" not in md.split("## With RevIN")[1].split("##")[0]
    assert "| prob_sparse | 720 | 0.100 | 0.200 |" in md  # seed 0 of the protocol's two
    assert "7 finished runs at a 720-step input, on CPU A, two runs side by side: 10–20 minutes an epoch, " \
        "50–60 " in md
    assert "| linear | 336 (0.150) | 336 | 96 → 336 | ×4.0 | ×1.5 |" in md
    assert "![test MSE, time and memory against input length]" in md and (docs / fr.PICTURE).exists()

    rows = json.loads((docs / "results.json").read_text())
    assert len(rows) == 7
    keys = {"mechanism", "seq_len", "label_len", "pred_len", "features", "revin", "mse", "mae", "mse_spread",
            "seeds", "epochs", "seconds_per_epoch", "d_model", "n_heads", "d_ff", "command"}
    assert all(keys <= set(r) for r in rows)


def test_the_no_model_forecast_is_scored_on_the_protocols_test_windows(tmp_path):
    """The last input value repeated, at each horizon, on the windows the runs are tested on: a row
    of the protocol table, a line in the picture, and a sentence that counts the trained cells
    below it."""
    import torch

    from attnzoo.data import ETTH1, load_forecast_data

    runs, docs = tmp_path / "runs", tmp_path / "docs"
    finish(runs, protocol("full", 24), 0.030, data=ETTH1)
    finish(runs, protocol("prob_sparse", 24), 0.090)  # (a record without its data file's name)
    naive = fr.last_value(fr.cells(runs, fr.grid()))
    for h in fr.HORIZONS:  # each window's last input against each of its h targets
        test = load_forecast_data(ETTH1, seq_len=fr.SEQ_LEN, label_len=fr.LABEL_LEN[h], pred_len=h).test
        x = torch.stack([test[i][0][-1] for i in range(len(test))])  # (windows, 1)
        y = torch.stack([test[i][4] for i in range(len(test))])  # (windows, h, 1)
        assert naive[h]["mse"] == pytest.approx(((y - x[:, None]) ** 2).double().mean().item(), rel=1e-5)
    assert 0.03 < naive[24]["mse"] < naive[48]["mse"] < naive[168]["mse"] < 0.1  # ETTh1's OT
    fr.report(runs, docs)
    md = (docs / "results.md").read_text()
    assert (f"| the last input value repeated (no model) | {naive[24]['mse']:.3f} | {naive[24]['mae']:.3f} | "
            in md)
    assert (f"at horizon 24, 1 of 2 trained cells below its {naive[24]['mse']:.3f} at all (the best: 0.030, "
            "full, 720-step input); at horizon 48, no trained cell yet") in md
    assert "scores better than the paper's rows and S4's at every horizon" in md
    assert fr.last_value({}) == {}


def test_a_mark_and_a_score_that_round_alike_are_told_apart():
    """0.0866 under a mark of 0.0872 must not read "0.087 below 0.087"."""
    assert fr._told_apart(0.0872, 0.0866) == ("0.0872", "0.0866")
    assert fr._told_apart(0.050, 0.0519) == ("0.050", "0.052")
    assert fr._told_apart(0.1, 0.1) == ("0.100000", "0.100000")


def test_pace_of_one_run(tmp_path):
    finish(tmp_path, protocol("lsh", 48), 0.1, seconds=300, epochs=4)
    assert fr.grid_pace(fr.cells(tmp_path, fr.grid())) == (
        "Measured over the 1 finished run at a 720-step input, on CPU A, two runs side by side: 5 minutes "
        "an epoch, 20 minutes a run. ")
    finish(tmp_path, protocol("lsh", 24), 0.1, seconds=600, epochs=6, cpu="CPU B")  # another machine: apart
    finish(tmp_path, protocol("linear", 24), 0.1, seconds=120, epochs=5, threads=[2])  # other threads: apart
    assert fr.grid_pace(fr.cells(tmp_path, fr.grid())) == (
        "Measured over the 3 finished runs at a 720-step input, on CPU B, two runs side by side (1 run): "
        "10 minutes an epoch, 60 minutes a run; on CPU A, one run at a time on 2 threads (1 run): 2 minutes "
        "an epoch, 10 minutes a run; on CPU A, two runs side by side (1 run): 5 minutes an epoch, 20 "
        "minutes a run. ")
    finish(tmp_path, protocol("linear", 48), 0.1, seconds=240, epochs=5, threads=[1, 2])  # resumed on 2
    assert "on CPU A, resumed on another number of threads (1 and 2) (1 run): 4 minutes an epoch, 20 " \
        "minutes a run" in fr.grid_pace(fr.cells(tmp_path, fr.grid()))


def test_report_without_runs_says_so(tmp_path):
    fr.report(tmp_path / "runs", tmp_path)
    md = (tmp_path / "results.md").read_text()
    assert "0 of its 48 runs have finished" in md and "None yet" in md
    assert not (tmp_path / fr.PICTURE).exists()


def test_swapped_config_and_notes():
    model = {"enc_attn": "full", "enc_options": {}, "dec_self_attn": "full", "dec_self_options": {},
             "seq_len": 720}
    cfg, notes = fr.swapped(model, "prob_sparse")
    assert cfg["enc_attn"] == cfg["dec_self_attn"] == "prob_sparse" and notes == []
    cfg, notes = fr.swapped(model, "linformer")
    assert cfg["dec_self_attn"] == "full" and cfg["enc_options"] == {"max_len": 720}
    assert notes == ["encoder only (not causal)", "its length projections untrained"]
    assert fr.swapped(model, "full") == (model, [])


def test_swap_verdict_groups_by_ratio_and_reads_the_baseline():
    # e: 1.1011, which the table prints as 1.10, is grouped as 1.10
    found = {"full": {"mse": 1.0}, "a": {"mse": 1.05}, "e": {"mse": 1.1011}, "b": {"mse": 1.5},
             "c": {"mse": 2.0}, "d": {"error": "ValueError: x"}}
    assert fr._swap_verdict(found) == (
        "Swapped in without retraining: below full's test MSE or at most 10 % above it, the trained "
        "model's accuracy kept: a, e; 10–50 % above, some of it lost: b; more than 1.5× full's, a "
        "mechanism to train with rather than swap in: c.")
    assert "barely uses" in fr._swap_verdict({**found, fr.AVERAGE: {"mse": 1.02}})
    assert "(better than full itself)" in fr._swap_verdict({**found, fr.AVERAGE: {"mse": 0.85}})
    assert fr._swap_verdict({"full": {"mse": 1.0}, "d": {"error": "x"}}).startswith("No mechanism could")
    assert "better than no attention" in fr._swap_verdict({**found, fr.AVERAGE: {"mse": 1.8}})


def seed0_of(runs: Path) -> dict:
    return fr.seed_zero(fr.cells(runs, fr.grid()))


def test_revin_verdict_reads_changes_against_the_seed_spread(tmp_path):
    assert fr.revin_verdict({}, 0.01) == ""
    finish(tmp_path, protocol("full", 24), 0.110)
    finish(tmp_path, protocol("full", 24, revin=True), 0.080)  # lower by more than the spread
    finish(tmp_path, protocol("prob_sparse", 48), 0.100)
    finish(tmp_path, protocol("prob_sparse", 48, revin=True), 0.105)  # level
    finish(tmp_path, protocol("linear", 168), 0.100)
    finish(tmp_path, protocol("linear", 168, revin=True), 0.130)  # higher
    finish(tmp_path, protocol("lsh", 48), 0.100)
    finish(tmp_path, protocol("lsh", 48, revin=True), 0.095)  # lower, but within the spread: level
    finish(tmp_path, protocol("lsh", 24, revin=True), 0.050)  # nothing to compare with
    assert fr.revin_verdict(seed0_of(tmp_path), 0.010) == (
        "In parentheses: the change from seed 0 without RevIN. RevIN lowers test MSE by more than the "
        "largest gap between seeds (0.010) in 1 of 4 cells, raises it in 1, and leaves 2 level.")
    assert fr.revin_verdict(seed0_of(tmp_path), 0.0).endswith(
        "RevIN lowers test MSE in 2 of 4 cells, raises it in 2, and leaves 0 level.")
    assert fr.revin_table(seed0_of(tmp_path))[2:5] == [
        "| prob_sparse | — | — | 0.105 (+5%) | 0.200 | — | — | 5.0 |",
        "| full | 0.080 (-27%) | 0.200 | — | — | — | — | 5.0 |",
        "| log_sparse | — | — | — | — | — | — | — |"]


def test_length_summary_finds_the_shortest_input_as_good_as_the_best(tmp_path):
    def study(mech, n, mse):
        finish(tmp_path, fr.Run(mech, n, fr.LENGTH_LABEL[n], 168, 0), mse)

    study("linear", 96, 0.200)
    study("linear", 336, 0.150)
    study("linear", 1440, 0.145)
    study("full", 96, 0.2)  # one length: nothing to read
    cost = {("linear", 96): {"seconds_median": 0.1, "peak_rss_mib": 1000},
            ("linear", 1440): {"seconds_median": 0.5, "peak_rss_mib": 3000}}
    assert fr.length_summary(seed0_of(tmp_path), 0.0, cost) == [
        "| mechanism | best input (test MSE) | shortest input within 0.000 of its best | inputs compared | "
        "time a step | peak memory |", "|---|---|---|---|---|---|",
        "| linear | 1440 (0.145) | 1440 | 96 → 1440 | ×5.0 | ×3.0 |"]
    # a gap between seeds of 0.010: 336 is as good as 1440
    assert fr.length_summary(seed0_of(tmp_path), 0.010, cost)[2] == "| linear | 1440 (0.145) | 336 | " \
        "96 → 1440 | ×5.0 | ×3.0 |"
    study("full", 336, 0.1)  # its cost not measured: none said
    assert "| full | 336 (0.100) | 336 | 96 → 336 | — | — |" \
        in fr.length_summary(seed0_of(tmp_path), 0.0, cost)
    assert fr.length_summary({}, 0.0, cost) == []


def test_length_table_marks_a_disturbed_time(tmp_path):
    finish(tmp_path, fr.Run("prob_sparse", 720, 336, 168, 0), 0.1, seconds=900, peak=2000, cpu="CPU B")
    assert "| prob_sparse | 720 | 0.100 | 0.200 | — | — | 900 | 2000 | CPU B, 1 thread |" \
        in fr.length_table(seed0_of(tmp_path), {})
    record = tmp_path / fr.Run("prob_sparse", 720, 336, 168, 0).name / "metrics.json"
    record.write_text(json.dumps({**json.loads(record.read_text()), "seconds_note": "paused 10 min"}))
    table = fr.length_table(seed0_of(tmp_path), {})
    assert "| prob_sparse | 720 | 0.100 | 0.200 | — | — | 900 † | 2000 | CPU B, 1 thread |" in table
    assert table[-1] == "- † prob_sparse at 720: paused 10 min"


def test_cost_times_each_cell_of_the_study_in_its_own_process(tmp_path, monkeypatch):
    seen = []

    def fake_run(cmd, **kw):
        seen.append(cmd)
        out = Path(cmd[cmd.index("--out") + 1])
        (out / "steps.json").write_text(json.dumps({"seconds_median": 0.5, "seconds_each": [0.5] * 5,
                                                    "peak_rss_mib": None, "cpu": "CPU X", "threads": 2}))
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(fr.subprocess, "run", fake_run)
    fr.measure_cost(tmp_path, 2, fr.length_study())
    assert len(seen) == len(fr.length_study())
    assert all(" --threads 2 " in " ".join(c) and c[-4:-2] == ["--time-steps", str(fr.COST_STEPS)]
               for c in seen)
    cost = fr.read_cost(tmp_path)
    assert set(cost) == {(r.mech, r.seq_len) for r in fr.length_study()}
    assert fr.cost_setting(cost) == "CPU X, 2 threads, the median of 5 steps of 32 windows"
    assert cost[("full", 1440)]["label_len"] == 336 and cost[("full", 1440)]["batch_size"] == fr.BATCH
    # a part measured again replaces its own cells alone; a failure keeps what was measured before it
    calls = []

    def second(cmd, **kw):
        calls.append(cmd)
        if len(calls) == 2:
            return subprocess.CompletedProcess(cmd, 1, "", "boom")
        (Path(cmd[cmd.index("--out") + 1]) / "steps.json").write_text(json.dumps({
            "seconds_median": 9.0, "seconds_each": [9.0] * 5, "peak_rss_mib": 1.0, "cpu": "CPU Y",
            "threads": 2}))
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(fr.subprocess, "run", second)
    with pytest.raises(RuntimeError, match="failed .exit 1.:\nboom"):
        fr.measure_cost(tmp_path, 2, fr.only(fr.length_study(), ["*-in96-*"]))
    cost = fr.read_cost(tmp_path)
    assert len(cost) == len(fr.length_study()) and cost[("prob_sparse", 96)]["seconds_median"] == 9.0
    assert cost[("full", 96)]["seconds_median"] == 0.5
    assert fr.read_cost(tmp_path / "none") == {}


def test_length_points_give_each_panel_what_it_has(tmp_path):
    finish(tmp_path, fr.Run("linear", 96, 48, 168, 0), 0.2)
    write_cost(tmp_path, {("linear", 336): (1.0, None), ("full", 1440): (4.0, 3000.0)})
    rows, cost = seed0_of(tmp_path), fr.read_cost(tmp_path)
    assert fr._length_points(rows, cost, "linear") == [[(96, 0.2)], [(336, 1.0)], []]
    assert fr._length_points(rows, cost, "full") == [[], [(1440, 4.0)], [(1440, 3000.0)]]
    assert fr.plot_lengths(rows, cost, {"mse": 0.09}, tmp_path / "p.png") and (tmp_path / "p.png").exists()
    assert not fr.plot_lengths({}, {}, None, tmp_path / "none.png")
def test_a_cells_time_is_of_one_cpu(tmp_path):
    """Seeds trained on two machines: their times are not averaged into one; their MSE is."""
    finish(tmp_path, protocol("full", 24, 0), 0.06, seconds=600, cpu="CPU A")
    finish(tmp_path, protocol("full", 24, 1), 0.08, seconds=900, cpu="CPU B")
    (row,) = [fr.summary(done) for done in fr.cells(tmp_path, fr.grid()).values()]
    assert row["mse"] == pytest.approx(0.07) and row["seconds_per_epoch"] is None and row["cpu"] is None


def test_swap_table_sets_each_swap_beside_the_seed_0_run_trained_with_it(tmp_path):
    source = protocol("full", 24)
    finish(tmp_path, source, 0.100)
    finish(tmp_path, protocol("full", 24, 1), 0.140)
    finish(tmp_path, protocol("prob_sparse", 24), 0.090)
    finish(tmp_path, protocol("prob_sparse", 24, 1), 0.130)
    (tmp_path / source.name / "swap.json").write_text(json.dumps({
        "full": {"mse": 0.100, "notes": []}, "prob_sparse": {"mse": 0.120, "notes": []},
        "linformer": {"error": "ValueError: x", "notes": ["encoder only (not causal)"]}}))
    table = fr.swap_table(tmp_path, seed0_of(tmp_path))
    assert table[:4] == ["Horizon 24:", "", "| mechanism | test MSE, swapped in | ÷ full's | test MSE, "
                         "trained with it | note |", "|---|---|---|---|---|"]
    assert table[4:7] == ["| full | 0.100 | 1.00 | 0.100 |  |", "| prob_sparse | 0.120 | 1.20 | 0.090 |  |",
                          "| linformer | failed | — | — | ValueError: x |"]
    # the baseline is the last row, wherever swap.json has it
    (tmp_path / source.name / "swap.json").write_text(json.dumps({
        "full": {"mse": 0.100, "notes": []}, fr.AVERAGE: {"mse": 0.1, "notes": []},
        "prob_sparse": {"mse": 0.120, "notes": []}}))
    assert fr.swap_table(tmp_path, seed0_of(tmp_path))[6].startswith(f"| {fr.AVERAGE} |")
    assert table[8].startswith("Swapped in without retraining: 10–50 % above, some of it lost: prob_sparse.")


def test_report_says_which_records_were_rebuilt(tmp_path):
    finish(tmp_path, protocol("full", 24, 0), 0.06)
    fr.report(tmp_path, tmp_path / "docs")
    assert "rebuilt" not in (tmp_path / "docs" / "results.md").read_text()
    record = tmp_path / protocol("full", 24, 0).name / "metrics.json"
    record.write_text(json.dumps({**json.loads(record.read_text()), "recovered": "how"}))
    finish(tmp_path, protocol("full", 24, 1), 0.07)
    fr.report(tmp_path, tmp_path / "docs")
    assert "The records of 1 finished run were lost" in (tmp_path / "docs" / "results.md").read_text()

"""ETTh1 univariate (OT) forecasting at Informer's protocol: trains the grid, writes docs/results.md,
docs/results.json and docs/img/input_length.png.

    .venv/bin/python benchmarks/forecast_results.py                 # train what is missing, then report
    .venv/bin/python benchmarks/forecast_results.py --report        # only rebuild the docs
    .venv/bin/python benchmarks/forecast_results.py --list          # every run and whether it is done
    .venv/bin/python benchmarks/forecast_results.py --only '*-in96-*' --only '*-in336-*'   # a part only
    .venv/bin/python benchmarks/forecast_results.py --cost --threads 2   # time the length study's steps

Every run is one `attnzoo forecast` process, ``--jobs`` at a time with ``--threads`` torch threads
each: by default two single-threaded runs side by side, which finish more per hour than one on two
threads (1.5 times as much on the 2-core AMD EPYC of later runs; docs/results.md gives the
measurements); ``--jobs 1 --threads 2`` finishes a single run sooner, for one that would not
otherwise fit the hours the machine is there. Each run writes
its log (one line an epoch) to ``RUNS/<name>/log.txt``. A run whose metrics.json exists is not
repeated; one with a checkpoint but no metrics continues with ``--resume``, so the grid can be
stopped and started again at any time. Runs go in order of priority: the protocol table (seeds
0 and 1 of prob_sparse and full, then one seed of log_sparse, lsh and linear), prob_sparse and
full with RevIN (seed 0), the input-length study, then the others with RevIN.

The records a report reads (each run's metrics.json, and swap.json where it has one) are committed
in ``runs/etth1/``, so ``--report`` rebuilds the page on any clone; checkpoints and weights are not.

Swap at inference: as soon as a seed-0 full-attention run of the protocol table finishes, its
best weights are tested again with each other mechanism in the self-attention slots, without
retraining (kept in ``RUNS/<name>/swap.json``).
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import math
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HORIZONS = [24, 48, 168]
LABEL_LEN = {24: 168, 48: 168, 168: 336}  # Informer's scripts/ETTh1.sh at a 720-step input
SEQ_LEN = 720
SEEDS = [0, 1]
PAIR = ["prob_sparse", "full"]  # Informer and Informer with full attention: every seed
OTHERS = ["log_sparse", "lsh", "linear"]  # one seed
LENGTHS = [96, 336, 720, 1440]  # the input-length study, at horizon 168
LENGTH_LABEL = {96: 48, 336: 168, 720: 336, 1440: 336}
LENGTH_MECHANISMS = ["prob_sparse", "full", "log_sparse", "linear"]
# The paper's width is d_model 512, 8 heads, d_ff 2048: a training step at a 720-step input took
# 13 s on this machine's 2 threads (~1 h an epoch); d_model 128 with 8 heads takes 2.7 s on one
# thread beside a second run (docs/results.md gives the measurements).
WIDTH = {"d_model": 128, "n_heads": 8, "d_ff": 512}
BATCH = 32
CONFIG = ["--features", "S", "--target", "OT", "--d-model", str(WIDTH["d_model"]),
          "--n-heads", str(WIDTH["n_heads"]), "--e-layers", "2", "--d-layers", "1",
          "--d-ff", str(WIDTH["d_ff"]), "--dropout", "0.05", "--batch-size", str(BATCH), "--lr", "1e-4",
          "--epochs", "6", "--patience", "3"]
# Informer (Zhou et al., AAAI 2021), Table 1, ETTh1 univariate: (MSE, MAE) at each horizon.
PAPER = {"Informer (prob_sparse)": {24: (0.098, 0.247), 48: (0.158, 0.319), 168: (0.183, 0.346)},
         "Informer with full attention": {24: (0.092, 0.246), 48: (0.161, 0.322), 168: (0.187, 0.355)}}
PAPER_ROW = {"prob_sparse": "Informer (prob_sparse)", "full": "Informer with full attention"}  # of PAIR
# The best published univariate ETTh1 results at these horizons (S4, Gu et al., ICLR 2022): MSE.
S4 = {24: 0.061, 48: 0.079, 168: 0.104}
PICTURE = "img/input_length.png"  # under docs/
COST = "cost.json"  # under RUNS: a training step of each cell of the input-length study (--cost)
COST_STEPS = 5


@dataclass(frozen=True)
class Run:
    mech: str
    seq_len: int
    label_len: int
    pred_len: int
    seed: int
    revin: bool = False

    @property
    def name(self) -> str:
        return (f"{self.mech}-in{self.seq_len}-label{self.label_len}-h{self.pred_len}"
                f"{'-revin' if self.revin else ''}-s{self.seed}")

    @property
    def cell(self) -> tuple:
        """What the seeds of a table cell share."""
        return (self.mech, self.seq_len, self.label_len, self.pred_len, self.revin)

    def args(self, threads: int | str = 1) -> list[str]:
        return ["forecast", *CONFIG, "--threads", str(threads), "--seq-len", str(self.seq_len),
                "--label-len", str(self.label_len), "--pred-len", str(self.pred_len), "--attn", self.mech,
                *(["--revin"] if self.revin else []), "--seed", str(self.seed)]


def protocol_cell(mech: str, h: int, revin: bool = False) -> tuple:
    """The :attr:`Run.cell` of the 720-step protocol's cell of ``mech`` at horizon ``h``."""
    return Run(mech, SEQ_LEN, LABEL_LEN[h], h, 0, revin).cell


def length_rows(rows: dict[tuple, dict], mech: str) -> list[tuple[int, dict]]:
    """(input length, row) of ``mech``'s runs of the input-length study found in ``rows``, shortest first."""
    return [(n, r) for n in LENGTHS if (r := rows.get(Run(mech, n, LENGTH_LABEL[n], 168, 0).cell))]


def pair(revin: bool) -> list[Run]:
    """prob_sparse and full at every horizon: every seed without RevIN, seed 0 with it."""
    return [Run(m, SEQ_LEN, LABEL_LEN[h], h, s, revin) for h in HORIZONS for m in PAIR
            for s in (SEEDS[:1] if revin else SEEDS)]


def others(revin: bool) -> list[Run]:
    return [Run(m, SEQ_LEN, LABEL_LEN[h], h, 0, revin) for h in HORIZONS for m in OTHERS]


def length_study() -> list[Run]:
    return [Run(m, n, LENGTH_LABEL[n], 168, 0) for n in LENGTHS for m in LENGTH_MECHANISMS]


def grid() -> list[Run]:
    """Every run, in order of priority, each once."""
    return list(dict.fromkeys(pair(False) + others(False) + pair(True) + length_study() + others(True)))


def only(runs: list[Run], patterns: list[str] | None) -> list[Run]:
    """The runs whose name matches one of the shell-style ``patterns`` (all runs for none), in order."""
    return [r for r in runs if not patterns or any(fnmatch.fnmatchcase(r.name, p) for p in patterns)]


def metrics(runs: Path, run: Run) -> dict | None:
    path = runs / run.name / "metrics.json"
    return json.loads(path.read_text()) if path.exists() else None


def train(runs: Path, run: Run, threads: int = 1) -> str:
    """Train one run on ``threads`` torch threads (continuing it where a checkpoint exists); returns
    how it ended."""
    out = runs / run.name
    if (out / "metrics.json").exists():
        return "done before"
    out.mkdir(parents=True, exist_ok=True)
    resume = ["--resume"] if (out / "checkpoint.pt").exists() else []
    cmd = [sys.executable, "-m", "attnzoo", *run.args(threads), "--out", str(out), *resume]
    with open(out / "log.txt", "a") as log:
        log.write(" ".join(cmd) + "\n")
        log.flush()
        code = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode
    return "finished" if code == 0 else f"failed (exit {code}; see {out / 'log.txt'})"


def measure_cost(runs: Path, threads: int, cells: list[Run], steps: int = COST_STEPS) -> Path:
    """Time a training step of each of ``cells`` (of the input-length study), one process after another
    on this machine (`attnzoo forecast ... --time-steps`), into ``RUNS/cost.json`` as each finishes
    (over what it held for the same cell): the study's times and memory measured together, where its
    runs' own were timed on different machines and beside different neighbours."""
    path = runs / COST
    path.parent.mkdir(parents=True, exist_ok=True)
    for i, run in enumerate(cells, start=1):
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [sys.executable, "-m", "attnzoo", *run.args(threads), "--time-steps", str(steps),
                   "--out", tmp]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode:
                raise RuntimeError(f"{' '.join(cmd)} failed (exit {done.returncode}):\n{done.stdout[-2000:]}"
                                   f"{done.stderr[-2000:]}")
            cost = json.loads((Path(tmp) / "steps.json").read_text())
        measured = read_cost(runs) | {(run.mech, run.seq_len): {
            "mechanism": run.mech, "seq_len": run.seq_len, "label_len": run.label_len,
            "pred_len": run.pred_len, "batch_size": BATCH, **cost}}
        path.write_text(json.dumps({"cells": list(measured.values())}, indent=1) + "\n")
        _say(f"{run.mech} at {run.seq_len}: {cost['seconds_median']:.2f} s a step, "
             f"{_mib(cost['peak_rss_mib'])} MiB  ({i} of {len(cells)})")
    return path


def read_cost(runs: Path) -> dict[tuple[str, int], dict]:
    """The cells of ``RUNS/cost.json`` by (mechanism, input length); empty where it was never measured."""
    path = runs / COST
    cells = json.loads(path.read_text())["cells"] if path.exists() else []
    return {(c["mechanism"], c["seq_len"]): c for c in cells}


def cost_setting(cost: dict[tuple[str, int], dict]) -> str:
    """Where and how the cost was measured, in words ('' for none)."""
    settings = {(c["cpu"], c["threads"], c["batch_size"], len(c["seconds_each"])) for c in cost.values()}
    return "; ".join(f"{cpu}, {_count(t, 'thread')}, the median of {n} steps of {b} windows"
                     for cpu, t, b, n in sorted(settings))


# --- swap at inference -------------------------------------------------------------------------


AVERAGE = "average"  # the swap's baseline: no attention weights at all


@dataclass(frozen=True)
class _NoOptions:
    pass


def _average(q, k, v, opts, *, causal=False, key_mask=None, scale=None, generator=None):
    """(B, H, L, Dv): each query's plain average of the values it may see, whatever q and k say."""
    from attnzoo.bench.measure import visible_average

    return visible_average(v, causal)


def _register_average() -> None:
    """Register the baseline ``average`` in this process, through attnzoo's public registry: a
    swapped-in mechanism no better than it says the trained model barely uses its self-attention."""
    import attnzoo
    from attnzoo.registry import Capabilities, Mechanism, register

    if AVERAGE not in attnzoo.mechanisms():
        register(Mechanism(name=AVERAGE, summary="each query's plain average of the values it may see",
                           options=_NoOptions, fn=_average, reference=_average,
                           capabilities=Capabilities(causal=True, cross=False, key_mask=False),
                           time="O(L d)", memory="O(L d)", citation="a baseline, not a mechanism"))


def swapped(model: dict, mech: str) -> tuple[dict, list[str]]:
    """A trained model's config with ``mech`` in its self-attention slots, and what differs from
    the model as trained besides the mechanism."""
    import attnzoo

    cfg, notes = {**model, "enc_attn": mech, "enc_options": {}}, []
    if mech == "full":
        return cfg, notes
    if attnzoo.get(mech).capabilities.causal:
        cfg.update(dec_self_attn=mech, dec_self_options={})
    else:
        notes.append("encoder only (not causal)")
    if mech == "linformer":
        cfg["enc_options"] = {"max_len": model["seq_len"]}
        notes.append("its length projections untrained")
    if mech == "lsh":
        notes.append("keys from the query projection (shared QK)")
    if mech == AVERAGE:
        notes.append("baseline: each query's plain average of the values it sees")
    return cfg, notes


def swap(runs: Path, run: Run) -> Path:
    """Test MSE and MAE of the full-attention forecaster ``run`` with every other mechanism (and
    the baseline ``average``) swapped in, without retraining; kept in ``RUNS/<name>/swap.json``,
    to which a later call adds only what it lacks."""
    import torch
    from torch.utils.data import DataLoader

    import attnzoo
    from attnzoo.data import load_forecast_data
    from attnzoo.models import Informer, InformerConfig
    from attnzoo.models.train import evaluate

    path = runs / run.name / "swap.json"
    found = json.loads(path.read_text()) if path.exists() else {}
    _register_average()
    todo = [mech for mech in attnzoo.mechanisms() if "mse" not in found.get(mech, {})]  # failed: again
    if not todo:
        return path
    torch.set_num_threads(1)
    trained = metrics(runs, run)
    data = load_forecast_data(_data_path(trained), target=trained["target"], features=trained["features"],
                              seq_len=run.seq_len, label_len=run.label_len, pred_len=run.pred_len)
    test = DataLoader(data.test, batch_size=BATCH)
    weights = torch.load(runs / run.name / "best.pt", weights_only=True)
    own = trained["test"]["mse"]
    for mech in todo:  # full first: it must give the run's own test metrics again
        cfg, notes = swapped(trained["model"], mech)
        torch.manual_seed(trained["seed"])  # linformer's untrained projections: the same every time
        try:
            model = Informer(InformerConfig(**cfg))
            loaded = model.load_state_dict(weights, strict=False)
            # What may differ: lsh has no key projection (shared QK); linformer's projections and
            # performer's random features are the mechanism's own. Any other weight must load.
            odd = [k for k in loaded.missing_keys + loaded.unexpected_keys
                   if not (k.endswith(("k_proj.weight", "k_proj.bias")) and mech == "lsh")
                   and not k.endswith(("proj_k", "proj_v", "features"))]
            if odd:
                raise ValueError(f"weights that did not load: {odd}")
            found[mech] = {**evaluate(model, test, torch.device("cpu")), "notes": notes}
        except Exception as e:  # one mechanism's failure is its row's, not the table's
            if mech == "full":  # ... except the baseline's: there is nothing to compare with
                raise
            found[mech] = {"error": f"{type(e).__name__}: {e}", "notes": notes}
        if mech == "full" and abs(found[mech]["mse"] - own) > 1e-6 * own:
            raise RuntimeError(f"{run.name}: the reloaded model does not give its own test MSE "
                               f"({found[mech]['mse']} against {own})")
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(found, indent=1))
    tmp.replace(path)
    return path


def _data_path(record: dict) -> Path:
    """The data file of a run's record (which names it relative to the folder its run was started
    from: the repository's)."""
    return Path(record["data"]) if Path(record["data"]).is_absolute() else ROOT / record["data"]


def last_value(found: dict[tuple, list[tuple[Run, dict]]]) -> dict[int, dict]:
    """{horizon: test MSE and MAE} of the forecast with no model, each window's last input value
    repeated (:class:`attnzoo.models.LastValue`), on the protocol's test windows and in the same
    scaled space as the runs' scores; {} where no finished run names a data file that is here."""
    import torch
    from torch.utils.data import DataLoader

    from attnzoo.data import load_forecast_data
    from attnzoo.models import LastValue, evaluate

    records = [record for done in found.values() for _, record in done
               if "data" in record and _data_path(record).exists()]
    sources = {(_data_path(r).resolve(), r["target"], r["features"]) for r in records}
    if len(sources) != 1:  # none, or runs of other data: no one forecast to set beside them
        return {}
    (path, target, features), scores = sources.pop(), {}
    for h in HORIZONS:  # (the test targets and each one's last input are the same at any input length)
        try:
            data = load_forecast_data(path, target=target, features=features, seq_len=SEQ_LEN,
                                      label_len=LABEL_LEN[h], pred_len=h)
        except ValueError:  # (a file that does not load: the page goes without the row)
            return {}
        scores[h] = evaluate(LastValue(data.test.target_cols, h), DataLoader(data.test, batch_size=BATCH),
                             torch.device("cpu"))
    return scores


def last_value_verdict(seed0: dict[tuple, dict], naive: dict[int, dict]) -> str:
    """How many trained cells (``seed0``: :func:`seed_zero`, any table) beat the forecast with no
    model (``naive``: :func:`last_value`) at each horizon."""
    if not naive:
        return ""
    parts = []
    for h in HORIZONS:
        at_h = _at_horizon(seed0, h)
        if not at_h:
            parts.append(f"at horizon {h}, no trained cell yet")
            continue
        beat = [r for r in at_h if r["mse"] < naive[h]["mse"]]
        best = min(at_h, key=lambda r: r["mse"])
        mark, best_mse = _told_apart(naive[h]["mse"], best["mse"])
        parts.append(f"at horizon {h}, {len(beat)} of {_count(len(at_h), 'trained cell')} below its "
                     f"{mark} at all (the best: {best_mse}, {_described(best)})")
    published = {h: min(S4[h], *(marks[h][0] for marks in PAPER.values())) for h in HORIZONS}
    beaten = len([h for h in HORIZONS if naive[h]["mse"] < published[h]])
    against = ("better than the paper's rows and S4's at every horizon" if beaten == len(HORIZONS) else
               f"better than every published row of the table at {beaten} of {len(HORIZONS)} horizons"
               if beaten else "worse than the published rows of the table at every horizon")
    return ("A forecast with no model at all, each window's last input value repeated (\"Repeat\" in "
            "Zeng et al., AAAI 2023; `attnzoo.models.LastValue`, scored on the same test windows; runs "
            f"trained since it was added record it as `test_last_value`), scores {against}. Read every "
            "number on this page against it. On seed 0, in any table: " + "; ".join(parts) + ".")


def _told_apart(a: float, b: float) -> tuple[str, str]:
    """``a`` and ``b`` to 3 decimals, or to as many more (up to 6) as tell them apart."""
    digits = next((d for d in range(3, 7) if f"{a:.{d}f}" != f"{b:.{d}f}"), 6)
    return f"{a:.{digits}f}", f"{b:.{digits}f}"


_ONE_SWAP_AT_A_TIME = threading.Lock()
_ONE_LINE_AT_A_TIME = threading.Lock()


def _say(line: str) -> None:
    """A progress line after the time, written whole even from several threads at once (two
    prints at once ran together on one line)."""
    with _ONE_LINE_AT_A_TIME:
        sys.stdout.write(f"{time.strftime('%H:%M')}  {line}\n")
        sys.stdout.flush()


def swap_source(run: Run) -> bool:
    """Whether ``run`` is a full-attention forecaster whose mechanisms are swapped."""
    return run.mech == "full" and run.seed == 0 and not run.revin and run.seq_len == SEQ_LEN


def swap_table(runs: Path, seed0: dict[tuple, dict]) -> list[str]:
    """The swap of each horizon beside what each mechanism reaches trained, both of seed 0
    (``seed0``: the cells of seed-0 runs alone)."""
    tables = []
    for h in HORIZONS:
        path = runs / Run("full", SEQ_LEN, LABEL_LEN[h], h, 0).name / "swap.json"
        if not path.exists():
            continue
        found = json.loads(path.read_text())
        full = found["full"]["mse"]
        tables += [f"Horizon {h}:", "", "| mechanism | test MSE, swapped in | ÷ full's | test MSE, trained "
                   "with it | note |", "|---|---|---|---|---|"]
        for mech, r in sorted(found.items(), key=lambda mr: mr[0] == AVERAGE):  # the baseline last
            trained = seed0.get(protocol_cell(mech, h))
            own = f"{trained['mse']:.3f}" if trained else "—"
            if "error" in r:
                tables.append(f"| {mech} | failed | — | {own} | {r['error']} |")
                continue
            tables.append(f"| {mech} | {r['mse']:.3f} | {r['mse'] / full:.2f} | {own} | "
                          f"{'; '.join(r['notes'])} |")
        tables += ["", _swap_verdict(found), ""]
    return tables


def _swap_verdict(found: dict) -> str:
    """One sentence on which mechanisms keep the trained model's accuracy when swapped in."""
    full = found["full"]["mse"]
    # grouped on the ratio as the table prints it, so that a 1.10 there is never "more than 10 %" here
    ratio = {m: round(r["mse"] / full, 2) for m, r in found.items()
             if m not in ("full", AVERAGE) and "mse" in r}

    def within(lo: float, hi: float) -> list[str]:
        return [m for m, x in ratio.items() if lo < x <= hi]

    groups = [("below full's test MSE or at most 10 % above it, the trained model's accuracy kept",
               within(0, 1.1)),
              ("10–50 % above, some of it lost", within(1.1, 1.5)),
              ("more than 1.5× full's, a mechanism to train with rather than swap in", within(1.5, math.inf))]
    if not ratio:
        return "No mechanism could be swapped in (the table gives each one's error)."
    verdict = "Swapped in without retraining: " + "; ".join(
        f"{what}: {', '.join(ms)}" for what, ms in groups if ms) + "."
    if "mse" not in found.get(AVERAGE, {}):
        return verdict
    avg = found[AVERAGE]["mse"] / full
    if avg <= 1.1:
        reading = (" (better than full itself): on this test split what its self-attention computes does "
                   "not help this forecaster at all" if avg < 0.95 else
                   ": this forecaster barely uses what its self-attention computes")
        return verdict + (f" But the plain average is itself {avg:.2f}× full's{reading}, so keeping its "
                          "accuracy here says little about how close a mechanism comes to full attention; "
                          "the large ratios are the informative ones.")
    return verdict + (f" The plain average is {avg:.2f}× full's: a mechanism below that does better "
                      "than no attention at all.")


# --- the report --------------------------------------------------------------------------------


def cells(runs: Path, selected: list[Run]) -> dict[tuple, list[tuple[Run, dict]]]:
    found: dict[tuple, list[tuple[Run, dict]]] = {}
    for run in selected:
        m = metrics(runs, run)
        if m is not None:
            found.setdefault(run.cell, []).append((run, m))
    return found


def seed_zero(found: dict[tuple, list[tuple[Run, dict]]]) -> dict[tuple, dict]:
    """The :func:`summary` of each cell's seed-0 run alone (``found``: :func:`cells`): every cell
    has that seed, so one-seed cells (RevIN, the input-length study, the swap) are read against
    the others like for like."""
    return {cell: summary(zero) for cell, done in found.items()
            if (zero := [(run, m) for run, m in done if run.seed == 0])}


def summary(done: list[tuple[Run, dict]]) -> dict:
    """One row of results.json: the means over a cell's seeds, and each seed's own (in the order of
    ``seeds``)."""
    run = done[0][0]
    mse = [m["test"]["mse"] for _, m in done]
    cpu = _cpu([m for _, m in done])
    # times of two machines are not averaged: a cell whose seeds ran on different CPUs has none
    mixed = cpu is None and any(m.get("cpus") for _, m in done)
    seconds = [m["seconds_per_epoch"] for _, m in done if m.get("seconds_per_epoch") and not mixed]
    peak = [m["peak_rss_mib"] for _, m in done if m.get("peak_rss_mib")]
    threads = sorted({t for _, m in done for t in _threads(m)})
    return {"mechanism": run.mech, "seq_len": run.seq_len, "label_len": run.label_len,
            "pred_len": run.pred_len, "features": "S", "revin": run.revin,
            "mse": statistics.mean(mse), "mae": statistics.mean(m["test"]["mae"] for _, m in done),
            "mse_spread": (max(mse) - min(mse)) / 2, "seeds": [r.seed for r, _ in done],
            "mse_each_seed": mse, "mae_each_seed": [m["test"]["mae"] for _, m in done],
            "epochs": statistics.mean(m["epochs_run"] for _, m in done),
            "seconds_per_epoch": statistics.mean(seconds) if seconds else None,
            "peak_rss_mib": max(peak) if peak else None, "cpu": cpu, "threads": threads,
            **({"seconds_note": note} if (note := "; ".join(m["seconds_note"] for _, m in done
                                                            if m.get("seconds_note"))) else {}),
            **WIDTH,
            "command": "attnzoo " + " ".join(run.args(threads[0] if len(threads) == 1 else "{threads}"))
                                       .replace(f"--seed {run.seed}", "--seed {seed}")}


def _threads(record: dict) -> list[int]:
    """The torch thread counts a run trained on (the records from before runs recorded them: one)."""
    return record.get("threads") or [1]


def _cpu(records: list[dict]) -> str | None:
    """The CPU every run of ``records`` trained on alone, where there is one and each names it."""
    cpus = {tuple(m.get("cpus") or ()) for m in records}
    return cpus.pop()[0] if len(cpus) == 1 and len(next(iter(cpus))) == 1 else None


def _fmt(row: dict | None, key: str) -> str:
    if row is None:
        return "—"
    seeds = _seeds(row)
    spread = f" ± {row['mse_spread']:.3f}" if key == "mse" and len(row["seeds"]) > 1 else ""
    return f"{row[key]:.3f}{spread}{seeds if key == 'mse' else ''}"


def _table_head() -> list[str]:
    return ["| mechanism | " + " | ".join(f"h={h} MSE | h={h} MAE" for h in HORIZONS) + " | mean epochs |",
            "|---|" + "---|---|" * len(HORIZONS) + "---|"]


def _mean_epochs(found: list[dict | None]) -> str:
    epochs = [r["epochs"] for r in found if r]
    return f"{statistics.mean(epochs):.1f}" if epochs else "—"


def protocol_table(rows: dict[tuple, dict], naive: dict[int, dict]) -> list[str]:
    """The 720-step protocol without RevIN (``rows``: means over seeds), then the paper's and S4's,
    and the forecast with no model (``naive``: :func:`last_value`)."""
    lines = _table_head()
    for mech in PAIR + OTHERS:
        found = [rows.get(protocol_cell(mech, h)) for h in HORIZONS]
        lines.append(f"| {mech} | " + " | ".join(f"{_fmt(r, 'mse')} | {_fmt(r, 'mae')}" for r in found)
                     + f" | {_mean_epochs(found)} |")
    for name, marks in PAPER.items():
        lines.append(f"| {name}, paper (d_model 512) | "
                     + " | ".join(f"{marks[h][0]:.3f} | {marks[h][1]:.3f}" for h in HORIZONS) + " | — |")
    lines.append("| S4, best published | " + " | ".join(f"{S4[h]:.3f} | —" for h in HORIZONS) + " | — |")
    if naive:
        lines.append("| the last input value repeated (no model) | " + " | ".join(
            f"{naive[h]['mse']:.3f} | {naive[h]['mae']:.3f}" for h in HORIZONS) + " | — |")
    return lines


def revin_table(seed0: dict[tuple, dict]) -> list[str]:
    """The protocol with RevIN (``seed0``: :func:`seed_zero`; RevIN runs have that seed alone), each
    MSE followed by its change from seed 0 without RevIN."""
    lines = _table_head()
    for mech in PAIR + OTHERS:
        cells, found = [], []
        for h in HORIZONS:
            base, rev = (seed0.get(protocol_cell(mech, h, revin)) for revin in (False, True))
            change = f" ({_change(rev['mse'], base['mse'])})" if rev and base else ""
            cells.append(f"{rev['mse']:.3f}{change} | {rev['mae']:.3f}" if rev else "— | —")
            found.append(rev)
        lines.append(f"| {mech} | {' | '.join(cells)} | {_mean_epochs(found)} |")
    return lines


def _seeds(row: dict) -> str:
    return " (1 seed)" if len(row["seeds"]) == 1 else ""


def _change(ours: float, theirs: float) -> str:
    return f"{ours / theirs - 1:+.0%}"


def against_table(rows: dict[tuple, dict], seed0: dict[tuple, dict], noise: float) -> list[str]:
    """Where the pair's cells (``rows``: means over seeds) stand against the paper's rows, as the
    change in MSE and MAE, and where the best of any table on the page (``seed0``:
    :func:`seed_zero`) stands against S4; within ``noise`` of S4's reads as level with it."""
    lines = ["| | " + " | ".join(f"h={h}" for h in HORIZONS) + " |", "|---|" + "---|" * len(HORIZONS)]
    for mech, paper in PAPER_ROW.items():
        found = [rows.get(protocol_cell(mech, h)) for h in HORIZONS]
        lines.append(f"| {mech}, change in MSE / MAE from {paper} in the paper | " + " | ".join(
            f"{_change(r['mse'], PAPER[paper][h][0])} / {_change(r['mae'], PAPER[paper][h][1])}{_seeds(r)}"
            if r else "—" for h, r in zip(HORIZONS, found, strict=True)) + " |")
    lines.append("| the best MSE on this page, read on seed 0 (the seed every cell has), against S4's | "
                 + " | ".join(_best_against_s4(seed0, h, noise) for h in HORIZONS) + " |")
    return lines


def _at_horizon(seed0: dict[tuple, dict], h: int) -> list[dict]:
    """The cells of ``seed0`` (:func:`seed_zero`) at horizon h, of any table: mechanism, input
    length, RevIN."""
    return [r for r in seed0.values() if r["pred_len"] == h]


def _described(row: dict) -> str:
    """A cell of any table in words: its mechanism, RevIN where it has it, and its input length."""
    return f"{row['mechanism']}{' with RevIN' if row['revin'] else ''}, {row['seq_len']}-step input"


def _best_against_s4(seed0: dict[tuple, dict], h: int, noise: float) -> str:
    at_h = _at_horizon(seed0, h)
    if not at_h:
        return "—"
    b = min(at_h, key=lambda r: r["mse"])
    level = ", level with it within the largest gap between seeds" if abs(b["mse"] - S4[h]) <= noise else ""
    return f"{b['mse']:.3f} ({_described(b)}): {b['mse'] / S4[h]:.2f}× S4's{level}"


def _noise(rows: dict[tuple, dict]) -> float:
    """The largest gap between the seeds of any cell (twice its half-range): one run against
    another that differs by less is not read as a difference."""
    return 2 * max((r["mse_spread"] for r in rows.values()), default=0.0)


def _beyond(noise: float) -> str:
    """The words that say a difference counts only past ``noise``."""
    return f" by more than the largest gap between seeds ({noise:.3f})" if noise else ""


def _count(n: int, what: str) -> str:
    return f"{n} {what}" if n == 1 else f"{n} {what}s"


def revin_verdict(seed0: dict[tuple, dict], noise: float) -> str:
    """In how many cells RevIN lowers, raises or keeps seed 0's test MSE by more than ``noise``
    (``seed0``: :func:`seed_zero`: RevIN runs have that seed alone, and the same seed on both sides
    keeps the comparison like for like)."""
    both = [(base, rev) for mech in PAIR + OTHERS for h in HORIZONS
            if (base := seed0.get(protocol_cell(mech, h)))
            and (rev := seed0.get(protocol_cell(mech, h, True)))]
    if not both:
        return ""
    lower = sum(rev["mse"] < base["mse"] - noise for base, rev in both)
    higher = sum(rev["mse"] > base["mse"] + noise for base, rev in both)
    return (f"In parentheses: the change from seed 0 without RevIN. RevIN lowers test MSE{_beyond(noise)} "
            f"in {lower} of {_count(len(both), 'cell')}, raises it in {higher}, and leaves "
            f"{len(both) - lower - higher} level.")


def length_summary(seed0: dict[tuple, dict], noise: float, cost: dict[tuple[str, int], dict]) -> list[str]:
    """Per mechanism of the input-length study (``seed0``: :func:`seed_zero`): its best input, the
    shortest input within ``noise`` of that best, and what its longest input costs against its
    shortest in a training step (``cost``: :func:`read_cost`)."""
    lines = []
    for mech in LENGTH_MECHANISMS:
        found = length_rows(seed0, mech)
        if len(found) < 2:
            continue
        best_n, best = min(found, key=lambda nr: nr[1]["mse"])
        enough = min(n for n, r in found if r["mse"] <= best["mse"] + noise)
        n0, n1 = found[0][0], found[-1][0]
        first, last = cost.get((mech, n0)), cost.get((mech, n1))
        grow = [f"×{last[key] / first[key]:.1f}" if first and last and first[key] and last[key] else "—"
                for key in ("seconds_median", "peak_rss_mib")]
        lines.append(f"| {mech} | {best_n} ({best['mse']:.3f}) | {enough} | {n0} → {n1} | "
                     f"{' | '.join(grow)} |")
    if not lines:
        return []
    return [f"| mechanism | best input (test MSE) | shortest input within {noise:.3f} of its best | "
            "inputs compared | time a step | peak memory |", "|---|---|---|---|---|---|", *lines]


def grid_pace(found: dict[tuple, list[tuple[Run, dict]]]) -> str:
    """What an epoch and a run of the protocol's 720-step runs took, measured (``found``: :func:`cells`),
    apart for each CPU and number of threads (one thread: the grid's two runs side by side; a run
    resumed on another number of threads apart from both)."""
    done = [m for cell in found.values() for run, m in cell
            if run.seq_len == SEQ_LEN and m.get("seconds_per_epoch")]
    if not done:
        return ""
    by_setting: dict[tuple[str, str], list[dict]] = {}
    for m in done:
        threads = "/".join(str(t) for t in _threads(m))
        by_setting.setdefault((" + ".join(m.get("cpus") or ["a CPU not recorded"]), threads), []).append(m)

    def span(xs: list[float]) -> str:
        lo, hi = f"{min(xs):.0f}", f"{max(xs):.0f}"
        return lo if lo == hi else f"{lo}–{hi}"

    def pace(cpu: str, threads: str, ms: list[dict]) -> str:
        runs = "" if len(by_setting) == 1 else f" ({_count(len(ms), 'run')})"
        how = ("two runs side by side" if threads == "1" else
               f"resumed on another number of threads ({threads.replace('/', ' and ')})" if "/" in threads
               else f"one run at a time on {threads} threads")
        return (f"on {cpu}, {how}{runs}: {span([m['seconds_per_epoch'] / 60 for m in ms])} "
                f"minutes an epoch, {span([m['seconds_per_epoch'] * m['epochs_run'] / 60 for m in ms])} "
                "minutes a run")

    return (f"Measured over the {_count(len(done), 'finished run')} at a 720-step input, "
            f"{'; '.join(pace(*key, ms) for key, ms in by_setting.items())}. ")


def length_table(rows: dict[tuple, dict], cost: dict[tuple[str, int], dict]) -> list[str]:
    """The input-length study's cells that have a run or a measured step (``cost``: :func:`read_cost`),
    then a line for each time a record says was disturbed (†)."""
    lines = ["| mechanism | input | test MSE | test MAE | a step (s) | its peak memory (MiB) | "
             "the run's s / epoch | the run's peak memory (MiB) | the run timed on |",
             "|---|---|---|---|---|---|---|---|---|"]
    notes = []
    for mech in LENGTH_MECHANISMS:
        runs = dict(length_rows(rows, mech))
        for n in LENGTHS:
            r, c = runs.get(n), cost.get((mech, n))
            if r is None and c is None:
                continue
            step = [f"{c['seconds_median']:.2f}", _mib(c["peak_rss_mib"])] if c else ["—", "—"]
            if r is None:
                lines.append(f"| {mech} | {n} | — | — | {' | '.join(step)} | — | — | — |")
                continue
            sec = f"{r['seconds_per_epoch']:.0f}" if r["seconds_per_epoch"] else "—"
            if r.get("seconds_note"):
                sec += " †"
                notes.append(f"- † {mech} at {n}: {r['seconds_note']}")
            on = (f"{r['cpu']}, {_count(r['threads'][0], 'thread')}" if r["cpu"] and len(r["threads"]) == 1
                  else "CPU or threads not recorded, or several")
            lines.append(f"| {mech} | {n} | {r['mse']:.3f} | {r['mae']:.3f} | {' | '.join(step)} | {sec} | "
                         f"{_mib(r['peak_rss_mib'])} | {on} |")
    return lines + (["", *notes] if notes else [])


def _mib(x: float | None) -> str:
    return "—" if x is None else f"{x:.0f}"


def _length_points(rows: dict[tuple, dict], cost: dict[tuple[str, int], dict],
                   mech: str) -> list[list[tuple[int, float]]]:
    """(input length, value) of ``mech``: its runs' test MSE, then its measured step's seconds and
    peak memory."""
    measured = [c for n in LENGTHS if (c := cost.get((mech, n)))]
    return [[(n, r["mse"]) for n, r in length_rows(rows, mech)],
            *([(c["seq_len"], c[key]) for c in measured if c[key] is not None]
              for key in ("seconds_median", "peak_rss_mib"))]


def plot_lengths(rows: dict[tuple, dict], cost: dict[tuple[str, int], dict], naive: dict | None,
                 path: Path) -> bool:
    """Test MSE of the study's runs, and the time and peak memory of a training step of each cell
    measured together (``cost``), against input length, with S4's and the no-model forecast's
    (``naive``) test MSE: False where there is nothing to draw."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    drawn = False
    for i, mech in enumerate(LENGTH_MECHANISMS):
        for ax, pts in zip(axes, _length_points(rows, cost, mech), strict=True):
            if pts:
                drawn = True
                ax.plot([n for n, _ in pts], [y for _, y in pts], marker="o", color=f"C{i}", label=mech)
    if not drawn:
        plt.close(fig)
        return False
    axes[0].axhline(S4[168], color="gray", linestyle=":", label="S4, best published")
    if naive:
        axes[0].axhline(naive["mse"], color="black", linestyle="--", label="the last input value repeated")
    titles = ("test MSE at horizon 168", f"a training step (s),\n{cost_setting(cost) or 'not measured yet'}",
              "peak memory of the process of the step (MiB)")
    for ax, title in zip(axes, titles, strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xticks(LENGTHS, [str(n) for n in LENGTHS])
        ax.set_xlabel("input length (steps)")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    # one legend for the three panels: a mechanism may have a measured step and no run yet
    handles = {label: h for ax in axes for h, label in zip(*ax.get_legend_handles_labels(), strict=True)}
    axes[0].legend(handles.values(), handles.keys(), fontsize=8)
    fig.suptitle("ETTh1 univariate: what a longer input buys, and what it costs, per mechanism")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def recovered_note(found: dict[tuple, list[tuple[Run, dict]]]) -> str:
    """A sentence on the runs whose records were rebuilt from an earlier page (``found``: :func:`cells`)."""
    n = sum("recovered" in m for done in found.values() for _, m in done)
    if not n:
        return ""
    return (f"The records of {_count(n, 'finished run')} were lost with the machine that trained them, "
            "before records were committed; theirs in runs/etth1/ were rebuilt from the page as published "
            "then: each run's test MSE and MAE exact; its epochs, time an epoch and peak memory its own "
            "where that page gave them, otherwise its cell's (the mean over its seeds, their peak); its CPU "
            "inferred (each record's `recovered` field says which values are its own); and their swap "
            "tables to that page's precision.")


def _paragraph(text: str) -> list[str]:
    """A paragraph of results.md, or nothing where ``text`` is empty."""
    return [text, ""] if text else []


def report(runs: Path, docs: Path) -> None:
    found = cells(runs, grid())
    rows = {cell: summary(done) for cell, done in found.items()}
    finished = sum(len(done) for done in found.values())
    docs.mkdir(parents=True, exist_ok=True)
    (docs / "results.json").write_text(json.dumps(sorted(rows.values(), key=lambda r: (
        r["revin"], r["pred_len"], r["seq_len"], r["mechanism"])), indent=1) + "\n")
    seed0 = seed_zero(found)  # the RevIN runs and the input-length study have seed 0 alone
    noise = _noise(rows)
    cost = read_cost(runs)
    naive = last_value(found)
    pictured = plot_lengths(seed0, cost, naive.get(168), docs / PICTURE)
    config = " ".join([*CONFIG, "--threads", "T"])
    lines = [
        "# Forecasting ETTh1 with each mechanism, at Informer's protocol", "",
        "Univariate ETTh1 (the target OT in and out), Informer's splits and train-only scaling; test MSE "
        "and MAE in the scaled space, as the papers report them. The protocol is Informer's own "
        "(its scripts/ETTh1.sh with `--features S`): a 720-step input, a decoder start token of 168 "
        "steps at horizons 24 and 48 and 336 at 168, 2 encoder layers with distilling and 1 decoder "
        "layer, dropout 0.05, batch 32, Adam at lr 1e-4 halved every epoch, 6 epochs, early stopping "
        "with patience 3 on validation MSE (the test is of the best epoch). The encoder and decoder "
        "self-attention use the named mechanism at its defaults; cross-attention is full, as in Informer.",
        "",
        f"Width: d_model {WIDTH['d_model']}, {WIDTH['n_heads']} heads, d_ff {WIDTH['d_ff']}, against the "
        "paper's 512, 8 and 2048. Measured on the 2-core Intel Xeon of the first runs (one training step "
        "of 32 windows, "
        "prob_sparse, 720-step input, horizon 168): the paper's width 13.0 s on 2 threads (about an hour "
        "an epoch of ~250 steps, 6 hours a run, 70 hours for the 12 runs of prob_sparse and full); "
        "d_model 256 6.9 s and d_model 128 2.7 s on one thread each, two runs side by side. On the "
        "2-core AMD EPYC of later runs (the same step at d_model 128, `attnzoo forecast ... --time-steps 5`, "
        "medians): 2.3 s alone on 2 threads, 3.0 s alone on one, 2.9 and 3.3 s for each of two side "
        "by side on one thread each: two runs side by side finish 1.5 times as many steps an hour as "
        "one on two threads, which finishes a single run a quarter sooner. "
        f"{grid_pace(found)}The narrower model is the widest at which the grid fits in days, not weeks.",
        "",
        f"Every run: `attnzoo {' '.join(['forecast', config])} --seq-len N --label-len M --pred-len H "
        "--attn MECH [--revin] --seed S`; the exact command of each cell is in results.json. "
        "Cells give the mean over seeds, ± half their range.", "",
        *([] if finished == len(grid()) else [
            f"**The grid is still training: {finished} of its {len(grid())} runs have finished** "
            "(`benchmarks/forecast_results.py --list` shows which); a cell without a run reads —.", ""]),
        *_paragraph(recovered_note(found)),
        "## The protocol table", "", *protocol_table(rows, naive), "",
        *_paragraph(last_value_verdict(seed0, naive)),
        "Against the paper and the best published result:", "", *against_table(rows, seed0, noise), "",
        "## With RevIN", "",
        "`--revin`: each input window normalised by its own mean and deviation (with a learnt affine), "
        "the forecast mapped back (Kim et al., ICLR 2022). Seed 0 alone; the paper's and S4's rows are "
        "in the table above.", "",
        *revin_table(seed0), "",
        *_paragraph(revin_verdict(seed0, noise)),
        "## What a longer input buys", "",
        "Horizon 168, seed 0; decoder start token 48, 168, 336, 336 steps for inputs 96, 336, 720, 1440. "
        "What each cell costs is measured together, one process after another on one quiet machine "
        f"(`benchmarks/forecast_results.py --cost`; {cost_setting(cost) or 'not measured yet'}): a "
        "training step (forward, backward and Adam), the median of those steps after one untimed, and "
        "the peak resident memory of the process that ran them. Each run's own figures "
        "follow: seconds an epoch of training and validation, on the CPU and threads its column names "
        "(one thread: a second run beside it on the other core), and its peak resident memory (the "
        "highest of its processes, where it was resumed); they compare only within one setting.", "",
        *length_table(seed0, cost), "",
        *([f"![test MSE, time and memory against input length]({PICTURE})", ""] if pictured else []),
        *(["Per mechanism: its best input, the shortest input that forecasts as well (within the largest "
           "gap between seeds), and what its longest input costs against its shortest, as a multiple:", "",
           *summary_lines, ""] if (summary_lines := length_summary(seed0, noise, cost)) else []),
        "## Swap at inference", "",
        "The seed-0 forecaster trained with full attention, tested again with each mechanism at its "
        "defaults in the encoder's self-attention, and in the decoder's where the mechanism has a causal "
        "form, without retraining (cross-attention stays full); beside it, the test MSE of the "
        "forecaster trained with that mechanism (seed 0 too), where the grid has it. A ratio near 1 "
        "means the approximation keeps the trained model's accuracy; a large one, that the mechanism needs "
        "training with it. The last row is a baseline, not a mechanism: self-attention replaced by each "
        "query's plain average of the values it may see, which says how much the trained model uses "
        "its self-attention at all.", "",
        *(swap_table(runs, seed0) or ["(None yet: a swap is tested when its full-attention run has "
                                     "finished, and again by the next grid run if it failed.)", ""]),
        "Regenerate: `.venv/bin/python benchmarks/forecast_results.py` (trains what is missing, "
        "then writes docs/results.md, docs/results.json and docs/img/input_length.png; "
        "`--report` only writes them).", ""]
    (docs / "results.md").write_text("\n".join(lines))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--report", action="store_true", help="only rebuild the docs from finished runs")
    parser.add_argument("--cost", action="store_true",
                        help=f"time a training step of every cell of the input-length study (or those --only "
                             f"names) into RUNS/{COST} (on a quiet machine: minutes), then report")
    parser.add_argument("--list", action="store_true", help="every run of the grid and whether it is done")
    parser.add_argument("--jobs", type=int, default=None,
                        help="runs at a time (default: 2 on one thread each, else 1)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each run")
    parser.add_argument("--only", action="append", metavar="GLOB",
                        help="train (or --list) only the runs whose name matches, e.g. '*-in96-*'; "
                             "repeatable; the report still reads every finished run")
    parser.add_argument("--runs", default=str(ROOT / "runs" / "etth1"), help="folder of the runs")
    parser.add_argument("--docs", default=str(ROOT / "docs"), help="where the report goes")
    args = parser.parse_args()
    runs, todo = Path(args.runs), only(grid(), args.only)
    jobs = args.jobs or (2 if args.threads == 1 else 1)
    if not todo or (args.cost and not only(length_study(), args.only)):
        where = "the input-length study" if args.cost else "the grid"
        parser.error(f"--only {' '.join(args.only)}: no run of {where} matches (see --list)")
    if args.list:
        for run in todo:
            print(f"{'done' if metrics(runs, run) else '    '}  {run.name}")
        return 0
    if args.cost:
        measure_cost(runs, args.threads, only(length_study(), args.only))
    elif not args.report:
        def one(run: Run) -> None:
            started = time.monotonic()
            _say(f"start  {run.name}")
            ended = train(runs, run, args.threads)
            record = metrics(runs, run)  # (a record rebuilt after its machine was lost has no weights)
            if swap_source(run) and record is not None and "recovered" not in record:
                try:
                    with _ONE_SWAP_AT_A_TIME:  # it seeds torch's global generator
                        swap(runs, run)
                except Exception as e:  # the other runs go on; the next grid run tries it again
                    _say(f"swap failed  {run.name}: {type(e).__name__}: {e}")
            _say(f"{ended}  {run.name}  ({(time.monotonic() - started) / 60:.0f} min)")

        with ThreadPoolExecutor(jobs) as pool:
            list(pool.map(one, todo))
    report(runs, Path(args.docs))
    return 0


if __name__ == "__main__":
    sys.exit(main())

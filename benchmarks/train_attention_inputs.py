"""Train the forecaster whose attention inputs the benchmark's ``trained`` family uses, and ship them.

    .venv/bin/python benchmarks/train_attention_inputs.py

Trains an Informer-style forecaster with full attention on ETTh1 univariate (OT) at a long input
(the command below, ~10 minutes on 2 cores), then writes what the benchmark needs to rebuild the
first encoder layer's attention inputs at any length into
``src/attnzoo/data/trained_attention.pt`` (under 1 MB): the input embedding (value convolution
and calendar projection; the sinusoidal positions are recomputed at each length), that layer's
query, key and value projections, the scaling of OT, and how it was trained.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "runs" / "attention-inputs"
TARGET = ROOT / "src" / "attnzoo" / "data" / "trained_attention.pt"
WIDTH = {"d_model": 256, "n_heads": 4, "d_ff": 512}  # head dim 64, as the benchmark's default shape
SEQ_LEN = 336  # two weeks of hours: a long input, at a training cost of ~10 minutes
ARGS = ["forecast", "--features", "S", "--target", "OT", "--seq-len", str(SEQ_LEN), "--label-len", "168",
        "--pred-len", "24", "--attn", "full", "--d-model", str(WIDTH["d_model"]), "--n-heads",
        str(WIDTH["n_heads"]), "--d-ff", str(WIDTH["d_ff"]), "--epochs", "2", "--max-steps", "100",
        "--lr", "1e-4", "--seed", "0", "--out", str(OUT)]


def main() -> int:
    if not (OUT / "metrics.json").exists():
        subprocess.run([sys.executable, "-m", "attnzoo", *ARGS], check=True)
    from attnzoo.data import ETTH1, load_forecast_data

    metrics = json.loads((OUT / "metrics.json").read_text())
    state = torch.load(OUT / "best.pt", weights_only=True)
    data = load_forecast_data(ETTH1, target="OT", features="S", seq_len=SEQ_LEN, label_len=168, pred_len=24)
    keep = {"value": "enc_embedding.value.weight", "time": "enc_embedding.time.weight",
            **{f"{p}.{w}": f"encoder.0.attn.{p}_proj.{w}" for p in "qkv" for w in ("weight", "bias")}}
    shipped = {
        "weights": {name: state[key].clone() for name, key in keep.items()},
        "mean": data.scaler.mean.clone(), "std": data.scaler.std.clone(), **WIDTH,
        "trained": {"command": "attnzoo " + " ".join(ARGS[:-2]), "test_mse": metrics["test"]["mse"],
                    "test_mae": metrics["test"]["mae"], "epochs": metrics["epochs_run"]},
    }
    torch.save(shipped, TARGET)
    print(f"wrote {TARGET} ({TARGET.stat().st_size / 2**10:.0f} KiB); test MSE {metrics['test']['mse']:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

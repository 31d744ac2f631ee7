"""Time-series loading for forecasting: ETT and any CSV with a date column.

Splits (as Informer and its successors use them):

- ETT hourly files (ETTh1, ETTh2): train = the first 12 months (12·30·24 rows),
  validation = the next 4, test = the next 4; ETT minute files (ETTm1, ETTm2): the
  same months, 4 rows an hour.
- any other CSV: 70 % train, 20 % test, the rest validation, in time order.

Each later split starts ``seq_len`` rows early so its first window has history.
The scaler is fitted on the training rows only. Features: ``M`` (every column in,
every column out), ``S`` (the target in and out), ``MS`` (every column in, the
target out).
"""

from __future__ import annotations

import csv
import datetime as dt
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import Dataset

SPLITS = ("train", "val", "test")
FEATURES = ("M", "S", "MS")


@dataclass(frozen=True)
class Series:
    """A loaded CSV: times (N,), values (N, C) float64, column names (C,)."""

    times: list[dt.datetime]
    values: torch.Tensor
    columns: list[str]
    path: str


def _parse_time(text: str, row: int, path: str) -> dt.datetime:
    try:
        return dt.datetime.fromisoformat(text.strip())
    except ValueError:
        raise ValueError(f"{path}: row {row}: cannot read date {text!r} (expected ISO, e.g. "
                         f"2016-07-01 00:00:00)") from None


def read_csv(path: str | Path, date_column: str = "date") -> Series:
    """Read a CSV whose ``date_column`` holds increasing ISO timestamps and the rest numbers."""
    path = str(path)
    try:
        with open(path, newline="") as f:
            rows = list(csv.reader(f))
    except FileNotFoundError:
        raise ValueError(f"no such data file: {path}") from None
    if not rows:
        raise ValueError(f"{path} is empty")
    header, body = rows[0], rows[1:]
    if date_column not in header:
        raise ValueError(f"{path}: no date column {date_column!r}; columns are {header}")
    d = header.index(date_column)
    columns = [c for i, c in enumerate(header) if i != d]
    times, values = [], []
    for n, row in enumerate(body, start=2):
        if len(row) != len(header):
            raise ValueError(f"{path}: row {n} has {len(row)} fields, the header {len(header)}")
        times.append(_parse_time(row[d], n, path))
        try:
            values.append([float(x) if x.strip() else math.nan for i, x in enumerate(row) if i != d])
        except ValueError as err:
            raise ValueError(f"{path}: row {n}: {err}") from None
    values_t = torch.tensor(values, dtype=torch.float64)
    bad = torch.isnan(values_t)
    if bad.any():
        r, c = (int(i) for i in bad.nonzero()[0])
        raise ValueError(f"{path}: {int(bad.sum())} missing or NaN value(s), first in column "
                         f"{columns[c]!r} at row {r + 2}; fill or drop them first")
    for n in range(1, len(times)):
        if times[n] <= times[n - 1]:
            raise ValueError(f"{path}: dates are not increasing at row {n + 2} "
                             f"({times[n - 1]} then {times[n]})")
    return Series(times, values_t, columns, path)


def time_features(times: list[dt.datetime]) -> torch.Tensor:
    """(N, 4) calendar features in [-0.5, 0.5]: hour of day, day of week, day of month, day of
    year (Informer's ``timeF`` encoding at hourly frequency)."""
    rows = [[t.hour / 23.0 - 0.5, t.weekday() / 6.0 - 0.5, (t.day - 1) / 30.0 - 0.5,
             (t.timetuple().tm_yday - 1) / 365.0 - 0.5] for t in times]
    return torch.tensor(rows, dtype=torch.float32)


def split_borders(path: str, n_rows: int, seq_len: int) -> dict[str, tuple[int, int]]:
    """Row ranges [start, end) of each split, the later ones starting seq_len rows early."""
    name = Path(path).name
    if name.startswith("ETTh") or name.startswith("ETTm"):
        per_hour = 4 if name.startswith("ETTm") else 1
        month = 30 * 24 * per_hour
        ends = [12 * month, 16 * month, 20 * month]
    else:
        n_train, n_test = int(n_rows * 0.7), int(n_rows * 0.2)
        ends = [n_train, n_rows - n_test, n_rows]
    ends = [min(e, n_rows) for e in ends]
    starts = [0, ends[0] - seq_len, ends[1] - seq_len]
    return {s: (max(0, a), b) for s, a, b in zip(SPLITS, starts, ends, strict=True)}


@dataclass(frozen=True)
class Scaler:
    """Standard scaling with statistics of the training rows."""

    mean: torch.Tensor
    std: torch.Tensor

    def transform(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean) / self.std

    def inverse(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.std + self.mean


class Windows(Dataset):
    """Sliding windows over one split.

    Item: ``(x_enc (seq_len, C_in), mark_enc (seq_len, 4), x_dec (label_len + pred_len, C_in),
    mark_dec (label_len + pred_len, 4), y (pred_len, C_out))``. The decoder input holds
    the last ``label_len`` known steps followed by ``pred_len`` zeros (placeholders).
    """

    def __init__(self, values: torch.Tensor, marks: torch.Tensor, target_cols: list[int], *,
                 seq_len: int, label_len: int, pred_len: int):
        self.values, self.marks, self.target_cols = values.float(), marks, target_cols
        self.seq_len, self.label_len, self.pred_len = seq_len, label_len, pred_len
        self.n = values.shape[0] - seq_len - pred_len + 1

    def __len__(self) -> int:
        return max(0, self.n)

    def __getitem__(self, i: int):
        s, e = i, i + self.seq_len
        d0, d1 = e - self.label_len, e + self.pred_len
        x_dec = self.values[d0:d1].clone()
        x_dec[self.label_len:] = 0.0  # placeholders: the future is not an input
        y = self.values[e:d1][:, self.target_cols]
        return self.values[s:e], self.marks[s:e], x_dec, self.marks[d0:d1], y


@dataclass(frozen=True)
class ForecastData:
    """The three splits of a series, scaled, with what the model needs to know of them."""

    train: Windows
    val: Windows
    test: Windows
    scaler: Scaler
    columns_in: list[str]
    columns_out: list[str]


def load_forecast_data(path: str | Path, *, target: str = "OT", features: str = "S",
                       seq_len: int = 96, label_len: int = 48, pred_len: int = 24,
                       date_column: str = "date", max_rows: int | None = None) -> ForecastData:
    """Load, split, scale and window a CSV for forecasting (see the module doc)."""
    if features not in FEATURES:
        raise ValueError(f"features must be one of {FEATURES}, got {features!r}")
    if not (0 < label_len <= seq_len) or pred_len < 1:
        raise ValueError(f"need 0 < label_len <= seq_len and pred_len >= 1, got "
                         f"seq_len={seq_len}, label_len={label_len}, pred_len={pred_len}")
    series = read_csv(path, date_column)
    if target not in series.columns:
        raise ValueError(f"{series.path}: no target column {target!r}; columns are {series.columns}")
    values, times = series.values, series.times
    if max_rows is not None:
        values, times = values[:max_rows], times[:max_rows]
    t = series.columns.index(target)
    cols_in = [target] if features == "S" else series.columns
    values = values[:, [t]] if features == "S" else values
    target_cols = [0] if features == "S" else ([t] if features == "MS" else list(range(values.shape[1])))
    borders = split_borders(series.path, values.shape[0], seq_len)
    a, b = borders["train"]
    mean, std = values[a:b].mean(0), values[a:b].std(0, correction=0).clamp(min=1e-8)
    scaler = Scaler(mean, std)
    scaled, marks = scaler.transform(values), time_features(times)
    splits = {}
    for name, (a, b) in borders.items():
        w = Windows(scaled[a:b], marks[a:b], target_cols, seq_len=seq_len, label_len=label_len,
                    pred_len=pred_len)
        if len(w) == 0:
            raise ValueError(f"{series.path}: the {name} split has {b - a} rows, too short for one "
                             f"window of seq_len + pred_len = {seq_len + pred_len}")
        splits[name] = w
    cols_out = [cols_in[c] for c in target_cols]
    return ForecastData(splits["train"], splits["val"], splits["test"], scaler, cols_in, cols_out)

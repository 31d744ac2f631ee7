import datetime as dt
import math

import pytest
import torch

from attnzoo.data import ETTH1, load_forecast_data, read_csv
from attnzoo.data.timeseries import split_borders


def write_csv(path, n=300, *, columns=("a", "b", "OT"), start=dt.datetime(2020, 1, 1), bad=None):
    lines = ["date," + ",".join(columns)]
    for i in range(n):
        t = start + dt.timedelta(hours=i)
        row = [f"{math.sin(i / 10 + c):.5f}" for c in range(len(columns))]
        lines.append(t.isoformat(sep=" ") + "," + ",".join(row))
    if bad == "nan":
        lines[5] = lines[5].rsplit(",", 1)[0] + ",nan"
    if bad == "order":
        lines[7], lines[8] = lines[8], lines[7]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_shipped_etth1_splits_like_informer():
    series = read_csv(ETTH1)
    assert series.columns == ["HUFL", "HULL", "MUFL", "MULL", "LUFL", "LULL", "OT"]
    assert series.values.shape == (17420, 7)
    borders = split_borders(str(ETTH1), 17420, 96)
    assert borders == {"train": (0, 8640), "val": (8544, 11520), "test": (11424, 14400)}
    data = load_forecast_data(ETTH1, features="S", seq_len=96, label_len=48, pred_len=24)
    assert len(data.train) == 8640 - 96 - 24 + 1
    train_rows = data.train.values
    torch.testing.assert_close(train_rows.mean(0), torch.zeros(1), atol=1e-5, rtol=0)
    torch.testing.assert_close(train_rows.std(0, correction=0), torch.ones(1), atol=1e-5, rtol=0)


@pytest.mark.parametrize("features,c_in,c_out", [("S", 1, 1), ("M", 3, 3), ("MS", 3, 1)])
def test_features_and_windows(tmp_path, features, c_in, c_out):
    data = load_forecast_data(write_csv(tmp_path / "x.csv"), features=features, seq_len=24,
                              label_len=12, pred_len=6)
    x_enc, mark_enc, x_dec, mark_dec, y = data.train[3]
    assert x_enc.shape == (24, c_in) and mark_enc.shape == (24, 4)
    assert x_dec.shape == (18, c_in) and mark_dec.shape == (18, 4) and y.shape == (6, c_out)
    assert (x_dec[12:] == 0).all()  # placeholders
    torch.testing.assert_close(x_dec[:12], x_enc[-12:])  # the known label part
    nxt = data.train[4][0]
    torch.testing.assert_close(nxt[:-1], x_enc[1:])  # windows slide by one step
    assert data.columns_out[-1] == "OT"


def test_generic_csv_split_is_70_10_20(tmp_path):
    borders = split_borders(str(tmp_path / "x.csv"), 1000, 50)
    assert borders == {"train": (0, 700), "val": (650, 800), "test": (750, 1000)}


def test_bad_inputs_name_the_problem(tmp_path):
    with pytest.raises(ValueError, match="no target column 'price'"):
        load_forecast_data(write_csv(tmp_path / "a.csv"), target="price")
    with pytest.raises(ValueError, match="NaN value"):
        read_csv(write_csv(tmp_path / "b.csv", bad="nan"))
    with pytest.raises(ValueError, match="not increasing at row"):
        read_csv(write_csv(tmp_path / "c.csv", bad="order"))
    with pytest.raises(ValueError, match="too short for one window"):
        load_forecast_data(write_csv(tmp_path / "d.csv", n=60), seq_len=48, label_len=24, pred_len=24)
    with pytest.raises(ValueError, match="no date column"):
        read_csv(write_csv(tmp_path / "e.csv"), date_column="time")
    with pytest.raises(ValueError, match="no such data file"):
        read_csv(tmp_path / "missing.csv")
    with pytest.raises(ValueError, match="features must be"):
        load_forecast_data(write_csv(tmp_path / "f.csv"), features="X")

"""Time-series data for forecasting: ETT (ETTh1 ships with the package) and any CSV."""

from pathlib import Path

from attnzoo.data.timeseries import ForecastData, Scaler, Windows, load_forecast_data, read_csv

ETTH1 = Path(__file__).with_name("ett") / "ETTh1.csv"

__all__ = ["ETTH1", "ForecastData", "Scaler", "Windows", "load_forecast_data", "read_csv"]

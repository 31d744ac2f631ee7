import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from attnzoo.cli import main
from attnzoo.data import ETTH1, load_forecast_data
from attnzoo.data.timeseries import Windows
from attnzoo.models import Informer, InformerConfig, LastValue, TrainConfig, evaluate, time_steps, train

TINY = dict(d_model=16, n_heads=2, e_layers=2, d_layers=1, d_ff=32, seq_len=24, label_len=12,
            pred_len=6)


def _csv(tmp_path: Path) -> Path:
    sys.path.insert(0, str(Path(__file__).parents[1] / "data"))
    from test_timeseries import write_csv

    return write_csv(tmp_path / "series.csv", n=400)


@pytest.mark.parametrize("enc,dec", [("prob_sparse", "prob_sparse"), ("log_sparse", "log_sparse"),
                                     ("lsh", "lsh"), ("linear", "linear"), ("full", "full"),
                                     ("nystrom", "full")])
def test_informer_shapes_and_gradients(enc, dec):
    cfg = InformerConfig(**TINY, enc_attn=enc, dec_self_attn=dec)
    model = Informer(cfg)
    B = 3
    out = model(torch.randn(B, 24, 1), torch.rand(B, 24, 4) - 0.5, torch.randn(B, 18, 1),
                torch.rand(B, 18, 4) - 0.5)
    assert out.shape == (B, 6, 1)
    out.sum().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_decoder_does_not_see_future_placeholders_change():
    # The decoder's causal self-attention: outputs at step t ignore decoder inputs after t + 1
    # (Informer's value embedding is a kernel-3 conv with circular padding, so input t + 1 feeds
    # step t, and the last step wraps to the first: we leave the last input alone. The inputs
    # after the label part are zero placeholders, so in use nothing of the future leaks.)
    torch.manual_seed(0)
    model = Informer(InformerConfig(**TINY, enc_attn="full", dec_self_attn="full")).eval()
    x_enc, m_enc = torch.randn(1, 24, 1), torch.rand(1, 24, 4)
    x_dec, m_dec = torch.randn(1, 18, 1), torch.rand(1, 18, 4)
    a = model(x_enc, m_enc, x_dec, m_dec)
    x_dec2 = x_dec.clone()
    x_dec2[:, 15:17] += 1.0
    b = model(x_enc, m_enc, x_dec2, m_dec)
    torch.testing.assert_close(a[:, :2], b[:, :2])  # output steps 12, 13 come before input 15
    assert not torch.allclose(a[:, 4:], b[:, 4:])


@pytest.mark.parametrize("revin", [True, False])
def test_revin_forecasts_follow_each_window_level_and_scale(revin):
    # RevIN (S features): forecasting a*x + b gives a*forecast(x) + b exactly, for any window;
    # without it a plain model does not. MS: only the target's own channel sets its level.
    torch.manual_seed(0)
    cfg = InformerConfig(**{**TINY, "enc_in": 3, "dec_in": 3}, c_out=1, target_cols=[1], revin=revin,
                         enc_attn="full", dec_self_attn="full")
    model = Informer(cfg).eval()
    with torch.no_grad():
        model.revin is None or model.revin.bias.add_(0.3)  # a learnt affine that is not the identity
    x_enc, m_enc, m_dec = torch.randn(2, 24, 3), torch.rand(2, 24, 4), torch.rand(2, 18, 4)
    x_dec = torch.cat([x_enc[:, -12:], torch.zeros(2, 6, 3)], dim=1)
    a, b = torch.tensor([2.5, 3.0, 0.5]), torch.tensor([-4.0, 7.0, 1.0])
    x_dec2 = torch.cat([(x_enc * a + b)[:, -12:], torch.zeros(2, 6, 3)], dim=1)
    with torch.no_grad():
        out, moved = model(x_enc, m_enc, x_dec, m_dec), model(x_enc * a + b, m_enc, x_dec2, m_dec)
    if revin:
        torch.testing.assert_close(moved, out * a[1] + b[1], rtol=1e-4, atol=1e-4)
    else:
        assert (moved - (out * a[1] + b[1])).abs().max() > 0.1


def test_last_value_repeats_each_windows_last_input_of_each_target():
    values = torch.arange(40.0).reshape(20, 2)  # channel 1 at step t: 2t + 1
    windows = Windows(values, torch.zeros(20, 4), [1], seq_len=5, label_len=2, pred_len=3)
    got = evaluate(LastValue([1], 3), DataLoader(windows, batch_size=4), torch.device("cpu"))
    # window i: the last input 2(i + 4) + 1, the targets 2(i + 5) + 1 ... 2(i + 7) + 1: errors 2, 4, 6
    assert got == {"mse": (4 + 16 + 36) / 3, "mae": 4.0}
    with pytest.raises(ValueError, match="the forecast has shape"):  # two steps for three targets
        evaluate(LastValue([1], 2), DataLoader(windows, batch_size=4), torch.device("cpu"))


def test_revin_needs_a_channel_for_each_output():
    with pytest.raises(ValueError, match="revin needs"):
        Informer(InformerConfig(**{**TINY, "enc_in": 2, "dec_in": 2}, c_out=1, target_cols=[5], revin=True))


def _cfg(tmp_path, out, **kw):
    model = InformerConfig(**TINY, dropout=kw.pop("dropout", 0.1), distil=kw.pop("distil", True),
                           enc_attn=kw.pop("attn", "prob_sparse"), dec_self_attn="prob_sparse")
    return TrainConfig(data=str(_csv(tmp_path)), model=model, batch_size=8, epochs=kw.pop("epochs", 2),
                       max_steps=5, out=str(tmp_path / out), **kw)


def _same_weights(tmp_path, a: str, b: str) -> None:
    wa = torch.load(tmp_path / a / "checkpoint.pt", weights_only=False)["model"]
    wb = torch.load(tmp_path / b / "checkpoint.pt", weights_only=False)["model"]
    assert wa.keys() == wb.keys()
    for name in wa:
        if isinstance(wa[name], torch.Tensor):
            assert torch.equal(wa[name], wb[name]), name


def test_resume_continues_exactly(tmp_path):
    # Two epochs of 5 batches, stopped within epoch 1 (after 3 batches), at its end (a stop on an
    # epoch's last batch ends the epoch), within epoch 2 (checkpointing after every batch on the
    # way), and resumed each time: the same weights, dropout draws, losses and metrics as a run
    # that was never stopped.
    straight = train(_cfg(tmp_path, "a"))
    assert train(_cfg(tmp_path, "b", stop_after_steps=3)) == {"stopped_after_step": 3, "history": []}
    assert torch.load(tmp_path / "b" / "checkpoint.pt", weights_only=False)["state"]["batches_done"] == 3
    at_end = train(_cfg(tmp_path, "b", resume=True, stop_after_steps=2))
    assert at_end["stopped_after_epoch"] == 1
    assert torch.load(tmp_path / "b" / "checkpoint.pt", weights_only=False)["state"]["batches_done"] == 0
    within = train(_cfg(tmp_path, "b", resume=True, stop_after_steps=2, checkpoint_every_s=0))
    assert within["stopped_after_step"] == 2 and len(within["history"]) == 1
    resumed = train(_cfg(tmp_path, "b", resume=True, checkpoint_every_s=0))
    _same_weights(tmp_path, "a", "b")
    assert straight["test"] == resumed["test"]
    for a, b in zip(straight["history"], resumed["history"], strict=True):
        assert a["train_loss"] == b["train_loss"] and a["val_mse"] == b["val_mse"]
    for f in ("metrics.json", "best.pt", "forecast.png"):
        assert (tmp_path / "b" / f).exists()
    assert not list((tmp_path / "b").glob("*.tmp"))


def test_peak_memory_and_cpus_are_the_runs_across_a_resume(tmp_path, monkeypatch):
    # The process that trained epoch 1 peaked higher than the one resumed for epoch 2 and the test:
    # the run's peak is the first one's, not the last process's alone.
    module = sys.modules[TrainConfig.__module__]
    monkeypatch.setattr(module, "peak_rss_mib", lambda: 5000.0)
    monkeypatch.setattr(module, "cpu_name", lambda: "CPU A")
    train(_cfg(tmp_path, "p", stop_after_epochs=1))
    monkeypatch.setattr(module, "peak_rss_mib", lambda: 100.0)
    assert train(_cfg(tmp_path, "p", resume=True))["peak_rss_mib"] == 5000.0
    # Each epoch names the CPUs it trained on: resumed on another machine within epoch 1 (at step 2
    # of 5), that epoch is two CPUs', the next one the second's; the run's, both, once each.
    monkeypatch.setattr(module, "cpu_name", lambda: "CPU A")
    train(_cfg(tmp_path, "c", stop_after_steps=2))
    monkeypatch.setattr(module, "cpu_name", lambda: "CPU B")
    metrics = train(_cfg(tmp_path, "c", resume=True))
    assert [r["cpus"] for r in metrics["history"]] == [["CPU A", "CPU B"], ["CPU B"]]
    assert metrics["cpus"] == ["CPU A", "CPU B"]
    # and the thread counts it ran on, the same way
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        train(_cfg(tmp_path, "t", stop_after_steps=2))
        torch.set_num_threads(2)
        metrics = train(_cfg(tmp_path, "t", resume=True))
    finally:
        torch.set_num_threads(threads)
    assert [r["threads"] for r in metrics["history"]] == [[1, 2], [2]] and metrics["threads"] == [1, 2]
    assert train(_cfg(tmp_path, "one"))["cpus"] == ["CPU B"]
    monkeypatch.setattr(module, "peak_rss_mib", lambda: None)  # no resource module: no figure
    assert train(_cfg(tmp_path, "q"))["peak_rss_mib"] is None


def test_resume_without_checkpoint_or_with_other_options_is_refused(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="no checkpoint"):
        train(_cfg(tmp_path, "none", resume=True))
    with pytest.raises(ValueError, match="must be >= 1"):
        _cfg(tmp_path, "none", stop_after_steps=0)
    with pytest.raises(ValueError, match="checkpoint_every_s must be >= 0"):
        _cfg(tmp_path, "none", checkpoint_every_s=float("nan"))
    train(_cfg(tmp_path, "c", stop_after_epochs=1))
    with pytest.raises(ValueError, match="different run .*lr: saved 0.0001, now 0.001"):
        train(_cfg(tmp_path, "c", resume=True, lr=1e-3))
    # Within epoch 2, resumed with epochs=1: the partial epoch would be dropped without a word.
    train(_cfg(tmp_path, "c", resume=True, stop_after_steps=2))
    with pytest.raises(ValueError, match="within epoch 2, which epochs=1"):
        train(_cfg(tmp_path, "c", resume=True, epochs=1))
    # Under torchrun a stop within an epoch would leave nothing to resume from.
    monkeypatch.setattr(sys.modules[TrainConfig.__module__], "_distributed", lambda: (0, 2))
    with pytest.raises(ValueError, match="stop_after_steps needs a single process"):
        train(_cfg(tmp_path, "d", stop_after_steps=2))


def test_cli_smoke_on_shipped_etth1(tmp_path, capsys):
    code = main(["forecast", "--d-model", "16", "--n-heads", "2", "--d-ff", "32", "--seq-len", "48",
                 "--label-len", "24", "--pred-len", "12", "--epochs", "1", "--max-steps", "3",
                 "--batch-size", "16", "--out", str(tmp_path / "run")])
    assert code == 0
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["test"]["mse"] > 0 and metrics["model"]["enc_attn"] == "prob_sparse"
    out = capsys.readouterr().out  # not a terminal: one plain line an epoch
    assert "epoch 1/1  train loss " in out and " val mse " in out and "test MSE" in out
    assert f"the last input value repeated, no model: MSE {metrics['test_last_value']['mse']:.4f}" in out
    test = load_forecast_data(ETTH1, seq_len=48, label_len=24, pred_len=12).test  # the same, by hand
    last = torch.stack([test[i][0][-1] for i in range(len(test))])  # (windows, 1)
    errors = torch.stack([test[i][4] for i in range(len(test))]) - last[:, None]  # (windows, 12, 1)
    assert metrics["test_last_value"]["mse"] == pytest.approx((errors**2).double().mean().item(), rel=1e-5)
    assert metrics["seconds_per_epoch"] > 0 and metrics["peak_rss_mib"] > 0
    assert Path(metrics["data"]).resolve() == ETTH1.resolve()


def test_record_names_its_data_relative_to_the_working_directory(tmp_path, monkeypatch):
    # Run from the folder that holds the data, the record reads the same on every clone; from
    # elsewhere, it names the data by its absolute path.
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert train(_cfg(tmp_path, "a", epochs=1))["data"] == str(_csv(tmp_path))
    monkeypatch.chdir(tmp_path)
    assert train(_cfg(tmp_path, "r", epochs=1))["data"] == str(_csv(tmp_path).relative_to(tmp_path))


def _timing(tmp_path, **kw):
    return dataclasses.replace(_cfg(tmp_path, "t", **kw), max_steps=None)  # (a training option)


def test_time_steps_times_training_steps_without_training_a_run(tmp_path, capsys, monkeypatch):
    module = sys.modules[TrainConfig.__module__]
    stepped = []
    real_step = module._step
    monkeypatch.setattr(module, "_step", lambda *a: stepped.append(a[2][0].shape) or real_step(*a))
    cost = time_steps(_timing(tmp_path), steps=3)
    assert len(stepped) == 4  # one untimed, then the 3 timed, each a full batch
    assert all(shape[0] == 8 for shape in stepped)
    assert len(cost["seconds_each"]) == 3 and all(t > 0 for t in cost["seconds_each"])
    assert cost["seconds_median"] == sorted(cost["seconds_each"])[1]
    assert cost["threads"] == torch.get_num_threads() and cost["cpu"]
    with pytest.raises(ValueError, match="steps must be >= 1"):
        time_steps(_timing(tmp_path), steps=0)
    with pytest.raises(ValueError, match="full batches, fewer than 1001 steps"):
        time_steps(_timing(tmp_path), steps=1000)
    with pytest.raises(ValueError, match="trains no run: resume, stop_after_steps would do nothing"):
        time_steps(_timing(tmp_path, resume=True, stop_after_steps=2))
    monkeypatch.setattr(module, "_distributed", lambda: (0, 2))
    with pytest.raises(ValueError, match="one process"):
        time_steps(_timing(tmp_path))
    monkeypatch.setattr(module, "_distributed", lambda: (0, 1))
    monkeypatch.setattr(module, "peak_rss_mib", lambda: None)  # where it cannot be read: said so
    csv = _csv(tmp_path)
    assert main(["forecast", "--data", str(csv), "--d-model", "16", "--n-heads", "2", "--d-ff", "32",
                 "--seq-len", "24", "--label-len", "12", "--pred-len", "6", "--time-steps", "2",
                 "--out", str(tmp_path / "cli")]) == 0
    out = capsys.readouterr().out
    assert "a training step of 32 windows: " in out and "peak memory not measured here" in out
    assert len(json.loads((tmp_path / "cli" / "steps.json").read_text())["seconds_each"]) == 2
    assert {p.name for p in (tmp_path / "cli").iterdir()} == {"steps.json"}


def test_two_processes_match_one_with_the_same_global_batch(tmp_path):
    csv = _csv(tmp_path)
    common = ["forecast", "--data", str(csv), "--d-model", "16", "--n-heads", "2", "--d-ff", "32",
              "--seq-len", "24", "--label-len", "12", "--pred-len", "6", "--epochs", "1",
              "--max-steps", "1", "--dropout", "0", "--no-distil", "--threads", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    torchrun = Path(sys.executable).with_name("torchrun")
    subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", "2", "-m", "attnzoo", *common,
                    "--batch-size", "4", "--out", str(tmp_path / "ddp")], check=True, env=env,
                   capture_output=True)
    subprocess.run([sys.executable, "-m", "attnzoo", *common, "--batch-size", "8",
                    "--out", str(tmp_path / "one")], check=True, env=env, capture_output=True)
    w2 = torch.load(tmp_path / "ddp" / "checkpoint.pt", weights_only=False)["model"]
    w1 = torch.load(tmp_path / "one" / "checkpoint.pt", weights_only=False)["model"]
    torch.manual_seed(0)  # the trainer's seed: the same initial weights
    init = Informer(InformerConfig(**TINY, dropout=0.0, distil=False)).state_dict()
    moved = 0
    for name, t in w1.items():
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            # Adam's first step moves each weight by about lr = 1e-4 times the sign of its gradient;
            # a key bias has an exactly zero gradient up to rounding (softmax ignores a shift shared
            # by all keys), whose sign is noise. 1e-5 = lr / 10 separates agreement from that.
            torch.testing.assert_close(w2[name], t, atol=1e-5, rtol=0, msg=name)
            assert (t - init[name]).abs().max() <= 1.01e-4, name  # one step, not more
            moved += int((t - init[name]).abs().max() > 5e-5)
    assert moved > 10  # the step really changed the weights

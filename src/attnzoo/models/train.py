"""Training, evaluation, checkpoints and distributed data parallelism for the forecaster.

Library code: it reports progress through callbacks and raises on bad input; the CLI prints.

- Adam, MSE loss, learning rate halved every epoch, early stopping on the validation
  loss (Informer's recipe); test MSE and MAE in the scaled space, as the papers report.
- A checkpoint (model, optimiser, scheduler, RNG states, epoch, early-stopping state, and
  within an epoch the batches done, their summed loss and the seconds spent) is written
  atomically (temporary file, then ``os.replace``) after every epoch and, in a single
  process, also within an epoch every ``checkpoint_every_s`` seconds; ``resume=True``
  continues from it exactly. The data order of epoch e is a function of (seed, e) alone
  (``DistributedSampler``), so it needs no saved state: a run resumed within an epoch
  skips the batches it had trained on.
- Under ``torchrun`` (WORLD_SIZE > 1) the model trains with DistributedDataParallel
  (gloo on CPU, nccl on GPU), each rank a shard of every batch (``batch_size`` per
  rank), rank 0 alone writing files. BatchNorm in the distilling layers becomes
  SyncBatchNorm on GPU; on CPU, where torch has no SyncBatchNorm, each rank normalises
  with its own batch statistics.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

from attnzoo.data import ETTH1, ForecastData, load_forecast_data
from attnzoo.machine import cpu_name
from attnzoo.models.informer import Informer, InformerConfig


@dataclass
class TrainConfig:
    data: str = str(ETTH1)
    target: str = "OT"
    features: str = "S"  # M, S or MS
    model: InformerConfig = field(default_factory=InformerConfig)
    batch_size: int = 32  # per process
    lr: float = 1e-4
    epochs: int = 6
    patience: int = 3  # epochs without a better validation loss before stopping
    seed: int = 0
    max_steps: int | None = None  # training batches per epoch (None = all); for smoke runs
    max_rows: int | None = None  # use only the first rows of the file
    out: str = "runs/forecast"
    resume: bool = False
    stop_after_epochs: int | None = None  # stop (as if interrupted) after this many epochs
    stop_after_steps: int | None = None  # stop (as if interrupted) after training this many batches
    checkpoint_every_s: float = 600.0  # single process: also checkpoint within an epoch (0: every batch)
    plot_windows: int = 4  # test windows drawn in forecast.png

    def __post_init__(self):
        if self.batch_size < 1 or self.epochs < 1 or self.patience < 1 or self.lr <= 0:
            raise ValueError("batch_size, epochs and patience must be >= 1 and lr > 0")
        if not self.checkpoint_every_s >= 0:  # also refuses NaN, which would never checkpoint
            raise ValueError("checkpoint_every_s must be >= 0")
        if any(n is not None and n < 1 for n in (self.stop_after_epochs, self.stop_after_steps)):
            raise ValueError("stop_after_epochs and stop_after_steps must be >= 1")


@dataclass
class Callbacks:
    """Progress hooks (the CLI draws bars with them)."""

    on_epoch_start: Callable[[int, int], None] = lambda epoch, n_batches: None
    on_batch: Callable[[int, float], None] = lambda step, loss: None
    on_epoch_end: Callable[[int, dict], None] = lambda epoch, record: None


def _distributed() -> tuple[int, int]:
    """(rank, world size), starting the process group under torchrun."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return (dist.get_rank(), world) if world > 1 else (0, 1)


def _device(rank: int) -> torch.device:
    if torch.cuda.is_available():
        index = int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count()
        return torch.device("cuda", index)
    return torch.device("cpu")


def _model_config(cfg: TrainConfig, data) -> InformerConfig:
    model = dataclasses.replace(cfg.model, enc_in=len(data.columns_in), dec_in=len(data.columns_in),
                                c_out=len(data.columns_out), seq_len=data.train.seq_len,
                                label_len=data.train.label_len, pred_len=data.train.pred_len,
                                target_cols=list(data.train.target_cols))
    if model.enc_attn == "linformer" and "max_len" not in model.enc_options:
        model.enc_options = {**model.enc_options, "max_len": model.seq_len}
    if model.cross_attn == "linformer" and "max_len" not in model.cross_options:
        model.cross_options = {**model.cross_options, "max_len": model.seq_len}
    return model


def _batches(model, batch, device):
    x_enc, mark_enc, x_dec, mark_dec, y = (t.to(device) for t in batch)
    return model(x_enc, mark_enc, x_dec, mark_dec), y


def _step(model: nn.Module, optimiser: torch.optim.Optimizer, batch, device) -> float:
    """One step of the optimiser on the MSE of a batch; returns the loss."""
    pred, y = _batches(model, batch, device)
    loss = nn.functional.mse_loss(pred, y)
    optimiser.zero_grad()
    loss.backward()
    optimiser.step()
    return loss.item()


def _data_and_model(cfg: TrainConfig, device: torch.device) -> tuple[ForecastData, InformerConfig, Informer]:
    """The data splits of ``cfg``, its model config completed from the data, and the model on
    ``device``, its weights seeded by ``cfg.seed``."""
    data = load_forecast_data(cfg.data, target=cfg.target, features=cfg.features,
                              seq_len=cfg.model.seq_len, label_len=cfg.model.label_len,
                              pred_len=cfg.model.pred_len, max_rows=cfg.max_rows)
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    model_cfg = _model_config(cfg, data)
    return data, model_cfg, Informer(model_cfg).to(device)


def _train_loader(data: ForecastData, cfg: TrainConfig, rank: int, world: int) -> DataLoader:
    """The training split in the run's order: that of epoch e is a function of (seed, e) alone."""
    sampler = DistributedSampler(data.train, num_replicas=world, rank=rank, shuffle=True, seed=cfg.seed)
    return DataLoader(data.train, batch_size=cfg.batch_size, sampler=sampler)


def time_steps(cfg: TrainConfig, steps: int = 5) -> dict:
    """What a training step of ``cfg`` costs on this machine, without training a run: the wall seconds
    of ``steps`` steps (forward, backward and Adam on the first full batches of ``cfg.batch_size``
    windows of epoch 1's order), after one untimed step that warms the caches and builds what is
    built on first use; their median, the peak resident memory of the process (its data and model
    too, not the step's alone), the CPU and the threads. The cost of an epoch's steps apart from
    its data loading and validation, comparable between mechanisms and lengths measured in one
    process after another on one quiet machine. One process, on the first GPU where there is one."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    training_only = [name for name in ("resume", "max_steps", "stop_after_epochs", "stop_after_steps")
                     if getattr(cfg, name)]
    if training_only:
        raise ValueError(f"timing steps trains no run: {', '.join(training_only)} would do nothing")
    if _distributed()[1] > 1:
        raise ValueError("timing steps runs in one process: start it without torchrun")
    device = _device(0)
    data, _, model = _data_and_model(cfg, device)
    optimiser = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    if len(data.train) // cfg.batch_size < steps + 1:
        raise ValueError(f"the training split has {len(data.train) // cfg.batch_size} full batches, "
                         f"fewer than {steps + 1} steps")
    loader = _train_loader(data, cfg, 0, 1)
    model.train()
    seconds = []
    for i, batch in zip(range(steps + 1), loader, strict=False):
        started = time.perf_counter()
        _step(model, optimiser, batch, device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i:
            seconds.append(time.perf_counter() - started)
    return {"seconds_each": seconds, "seconds_median": statistics.median(seconds),
            "peak_rss_mib": peak_rss_mib(), "cpu": cpu_name(), "threads": torch.get_num_threads()}


class LastValue(nn.Module):
    """The forecast with no model (persistence; "Repeat" in Zeng et al., Are Transformers Effective
    for Time Series Forecasting?, AAAI 2023): each window's last input value of each target,
    repeated over the horizon. It takes the forecaster's inputs: x_enc (B, L, C_in), ... ->
    (B, pred_len, C_out); :func:`evaluate` scores it as it scores a model, the mark a trained
    forecaster must pass to have learnt anything (on ETTh1's OT it is hard to pass)."""

    def __init__(self, target_cols: list[int], pred_len: int):
        super().__init__()
        self.target_cols, self.pred_len = list(target_cols), pred_len

    def forward(self, x_enc, mark_enc, x_dec, mark_dec):
        return x_enc[:, -1:, self.target_cols].expand(-1, self.pred_len, -1)


@torch.no_grad()
def evaluate(model: nn.Module, loader, device) -> dict:
    """MSE and MAE over every window of a loader, in the scaled space."""
    model.eval()
    se = ae = count = 0.0
    for batch in loader:
        pred, y = _batches(model, batch, device)
        if pred.shape != y.shape:  # (a broadcast would score a wrong shape without a word)
            raise ValueError(f"the forecast has shape {tuple(pred.shape)}, its targets {tuple(y.shape)}")
        se += ((pred - y) ** 2).sum().item()
        ae += (pred - y).abs().sum().item()
        count += y.numel()
    return {"mse": se / count, "mae": ae / count}


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    # .cpu(): a checkpoint loaded with map_location="cuda" moved the states, which must be on the CPU
    torch.set_rng_state(state["torch"].cpu())
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])


def save_atomic(obj, path: Path) -> None:
    """torch.save to a temporary file beside ``path``, flushed to disk, then renamed: neither a
    killed process nor a crashed machine leaves a half-written file in place of the last good one."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    if hasattr(os, "O_DIRECTORY"):  # the rename itself, where the OS lets a folder be synced
        folder = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(folder)
        finally:
            os.close(folder)


# What may change between an interrupted run and its resumption.
_RESUMABLE = {"resume", "stop_after_epochs", "stop_after_steps", "checkpoint_every_s", "epochs",
              "patience", "plot_windows"}


def _check_same_run(saved: dict, now: dict) -> None:
    differ = sorted(key for key in now if key not in _RESUMABLE and saved.get(key) != now[key])
    if differ:
        detail = "; ".join(f"{key}: saved {saved.get(key)!r}, now {now[key]!r}" for key in differ)
        raise ValueError(f"--resume: the checkpoint is of a different run ({detail}); pass the "
                         f"options of the interrupted run")


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def peak_rss_mib() -> float | None:
    """This process's peak resident memory so far, in MiB (ru_maxrss: KiB on Linux, bytes on
    macOS); None where the OS does not tell (Windows)."""
    try:
        import resource
    except ImportError:
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10


def _run_peak(saved: float | None) -> float | None:
    """The run's peak resident memory in MiB: this process's, or ``saved`` (the peak of the processes
    before a resume) where that was higher."""
    return max((p for p in (saved, peak_rss_mib()) if p is not None), default=None)


def _with(seen: list | None, now) -> list:
    """``seen`` and ``now``, each once: an epoch's CPUs (or thread counts), so that its time is never
    read as one machine's when it was two's (resumed within it on another)."""
    return list(dict.fromkeys([*(seen or []), now]))


def _each_once(history: list[dict], key: str) -> list:
    """What the epochs of ``history`` list under ``key`` (their CPUs, their thread counts), each once."""
    return list(dict.fromkeys(x for r in history for x in r.get(key, [])))


def _shown(path: str) -> str:
    """``path`` as a record shows it: relative to the working directory where it lies within it
    (a run's record then reads the same on every clone run from the same folder), else absolute."""
    p, here = Path(os.path.abspath(path)), Path.cwd()  # (.. folded away, links left as they are)
    return str(p.relative_to(here)) if p.is_relative_to(here) else str(p)


def _bare(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def train(cfg: TrainConfig, callbacks: Callbacks | None = None) -> dict:
    """Train, early-stop, test; returns the metrics (also written to ``out/metrics.json``)."""
    callbacks = callbacks or Callbacks()
    rank, world = _distributed()
    if world > 1 and cfg.stop_after_steps is not None:
        raise ValueError("stop_after_steps needs a single process: under torchrun there is no "
                         "checkpoint within an epoch to resume from (use stop_after_epochs)")
    device = _device(rank)
    out = Path(cfg.out)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    data, model_cfg, model = _data_and_model(cfg, device)
    if world > 1:
        if device.type == "cuda":
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        device_ids = [device] if device.type == "cuda" else None
        model = nn.parallel.DistributedDataParallel(model, device_ids=device_ids)
    optimiser = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimiser, lambda epoch: 0.5**epoch)
    train_loader = _train_loader(data, cfg, rank, world)
    sampler = train_loader.sampler
    val_loader = DataLoader(data.val, batch_size=cfg.batch_size)
    test_loader = DataLoader(data.test, batch_size=cfg.batch_size)
    within = {"batches_done": 0, "loss_sum": 0.0, "seconds": 0.0, "epoch_cpus": [],  # of the epoch under way
              "epoch_threads": []}
    state = {"epoch": 0, "best_val": math.inf, "bad_epochs": 0, "history": [], **within}
    checkpoint_path, best_path = out / "checkpoint.pt", out / "best.pt"
    resumed_rng = None
    if cfg.resume:
        if not checkpoint_path.exists():
            raise ValueError(f"--resume: no checkpoint at {checkpoint_path}")
        ckpt = torch.load(checkpoint_path, map_location=device, weights_only=False)
        _check_same_run(ckpt["config"], dataclasses.asdict(cfg))
        _bare(model).load_state_dict(ckpt["model"])
        optimiser.load_state_dict(ckpt["optimiser"])
        scheduler.load_state_dict(ckpt["scheduler"])
        resumed_rng = ckpt["rng"][rank] if rank < len(ckpt["rng"]) else ckpt["rng"][0]
        _set_rng_state(resumed_rng)
        state = {**within, **ckpt["state"]}
        if state["batches_done"] and ckpt.get("world", 1) != world:
            raise ValueError(f"--resume: the checkpoint was written within an epoch by "
                             f"{ckpt.get('world', 1)} process(es); resume it with as many, not {world}")
        if state["batches_done"] and (state["epoch"] >= cfg.epochs or state["bad_epochs"] >= cfg.patience):
            raise ValueError(f"--resume: the checkpoint is within epoch {state['epoch'] + 1}, which "
                             f"epochs={cfg.epochs} and patience={cfg.patience} would not finish; "
                             f"resume with the interrupted run's epochs and patience")

    def checkpoint(rng: list) -> None:
        state["peak_rss_mib"] = _run_peak(state.get("peak_rss_mib"))
        save_atomic({"model": _bare(model).state_dict(), "optimiser": optimiser.state_dict(),
                     "scheduler": scheduler.state_dict(), "rng": rng, "state": state,
                     "config": dataclasses.asdict(cfg), "world": world}, checkpoint_path)

    n_batches = len(train_loader) if cfg.max_steps is None else min(cfg.max_steps, len(train_loader))
    steps_run = 0
    while state["epoch"] < cfg.epochs and state["bad_epochs"] < cfg.patience:
        epoch = state["epoch"]
        sampler.set_epoch(epoch)
        model.train()
        callbacks.on_epoch_start(epoch, n_batches)
        batches = iter(train_loader)  # draws the loader's base seed from the global generator
        if state["batches_done"]:  # resumed within the epoch: skip what was trained on, then take
            for _ in range(state["batches_done"]):  # the RNG state saved there, after that draw
                next(batches)
            _set_rng_state(resumed_rng)
        started = time.perf_counter()  # of the time not yet in state["seconds"]
        state["epoch_cpus"] = _with(state.get("epoch_cpus"), cpu_name())
        state["epoch_threads"] = _with(state.get("epoch_threads"), torch.get_num_threads())
        for step, batch in enumerate(batches, start=state["batches_done"]):
            if step >= n_batches:
                break
            value = _step(model, optimiser, batch, device)
            state["loss_sum"] += value
            callbacks.on_batch(step, value)
            steps_run += 1
            now = time.perf_counter()
            # Within an epoch: a checkpoint every checkpoint_every_s (single process), and the stop
            # of stop_after_steps (at an epoch's last batch, the epoch's end does both).
            stop = cfg.stop_after_steps is not None and steps_run >= cfg.stop_after_steps
            if world == 1 and step + 1 < n_batches and (stop or now - started >= cfg.checkpoint_every_s):
                state["batches_done"], state["seconds"] = step + 1, state["seconds"] + now - started
                started = now
                checkpoint([_rng_state()])
            if stop and step + 1 < n_batches:
                return {"stopped_after_step": steps_run, "history": state["history"]}
        scheduler.step()
        val = evaluate(model, val_loader, device)["mse"]
        improved = val < state["best_val"]
        state["best_val"] = min(val, state["best_val"])
        state["bad_epochs"] = 0 if improved else state["bad_epochs"] + 1
        state["epoch"] = epoch + 1
        record = {"epoch": epoch + 1, "train_loss": state["loss_sum"] / max(n_batches, 1), "val_mse": val,
                  "lr": optimiser.param_groups[0]["lr"], "improved": improved,
                  "seconds": state["seconds"] + time.perf_counter() - started,
                  "cpus": state["epoch_cpus"], "threads": state["epoch_threads"]}
        state["history"].append(record)
        state.update(within)
        if world > 1:
            rng = [None] * world
            dist.all_gather_object(rng, _rng_state())
        else:
            rng = [_rng_state()]
        if rank == 0:
            if improved:
                save_atomic(_bare(model).state_dict(), best_path)
            checkpoint(rng)
        if world > 1:
            dist.barrier()
        callbacks.on_epoch_end(epoch, record)
        stopped = cfg.stop_after_steps is not None and steps_run >= cfg.stop_after_steps
        if stopped or (cfg.stop_after_epochs is not None and epoch + 1 >= cfg.stop_after_epochs):
            return {"stopped_after_epoch": epoch + 1, "history": state["history"]}
    _bare(model).load_state_dict(torch.load(best_path, map_location=device, weights_only=True))
    metrics = {"test": evaluate(model, test_loader, device),
               "test_last_value": evaluate(LastValue(data.test.target_cols, model_cfg.pred_len), test_loader,
                                           device),
               "best_val_mse": state["best_val"],
               "epochs_run": state["epoch"], "history": state["history"],
               "model": dataclasses.asdict(model_cfg), "data": _shown(cfg.data), "target": cfg.target,
               "features": cfg.features, "world_size": world, "seed": cfg.seed,
               "seconds_per_epoch": _mean([r["seconds"] for r in state["history"] if "seconds" in r]),
               "peak_rss_mib": _run_peak(state.get("peak_rss_mib")),
               "cpus": _each_once(state["history"], "cpus"),
               "threads": _each_once(state["history"], "threads")}
    if rank == 0:
        (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
        plot_forecasts(_bare(model), data, device, out / "forecast.png", cfg.plot_windows)
    if world > 1:
        dist.barrier()
    return metrics


@torch.no_grad()
def plot_forecasts(model: nn.Module, data, device, path: Path, n_windows: int) -> None:
    """Forecast against truth (original units) for a few windows spread over the test split."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    model.eval()
    n = len(data.test)
    picks = [int(i * (n - 1) / max(n_windows - 1, 1)) for i in range(n_windows)]
    col = len(data.columns_out) - 1  # the target: the only output in S and MS, the last column in M
    name = data.columns_out[col]
    c_in = data.columns_in.index(name)
    mean, std = data.scaler.mean[c_in].item(), data.scaler.std[c_in].item()
    fig, axes = plt.subplots(1, n_windows, figsize=(4 * n_windows, 3.2), squeeze=False)
    for ax, i in zip(axes[0], picks, strict=True):
        x_enc, mark_enc, x_dec, mark_dec, y = (t.unsqueeze(0).to(device) for t in data.test[i])
        pred = model(x_enc, mark_enc, x_dec, mark_dec)[0, :, col].cpu() * std + mean
        history = x_enc[0, :, c_in].cpu() * std + mean
        truth = y[0, :, col].cpu() * std + mean
        L, P = history.shape[0], truth.shape[0]
        ax.plot(range(L), history, color="gray", label="history")
        ax.plot(range(L, L + P), truth, color="black", label="truth")
        ax.plot(range(L, L + P), pred, color="tab:red", label="forecast")
        ax.set_title(f"test window {i}", fontsize=9)
        ax.set_xlabel("step")
    axes[0][0].set_ylabel(name)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"{name}: forecast against truth on test windows (original units)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

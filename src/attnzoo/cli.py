"""The ``attnzoo`` command: list, bench, patterns, forecast."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable

import attnzoo

try:
    from rich.console import Console
    from rich.table import Table
except ImportError as missing:  # the library needs torch alone; its command needs the `cli` extra
    raise SystemExit(f"the attnzoo command needs {missing.name}: pip install 'attnzoo[cli]'") from missing


def _yes(flag: bool) -> str:
    return "✓" if flag else "—"


def _option_text(spec) -> str:
    fields = dataclasses.fields(spec.options)
    return ", ".join(f"{f.name}={f.default!r}" for f in fields) or "—"


def cmd_list(args: argparse.Namespace, console: Console) -> int:
    table = Table(title="attnzoo mechanisms", show_lines=False)
    table.add_column("name", no_wrap=True, style="bold")
    table.add_column("what", overflow="fold", ratio=3)
    for col in ("causal", "cross", "mask", "step", "random"):
        table.add_column(col, justify="center", no_wrap=True)
    table.add_column("time", no_wrap=True)
    table.add_column("memory", overflow="fold", ratio=1)
    table.add_column("options", overflow="fold", ratio=2)
    table.add_column("paper", overflow="fold", ratio=2)
    for name in attnzoo.mechanisms():
        spec = attnzoo.get(name)
        caps = spec.capabilities
        table.add_row(name, spec.summary, _yes(caps.causal), _yes(caps.cross), _yes(caps.key_mask),
                      _yes(caps.recurrent), _yes(spec.randomized), spec.time, spec.memory,
                      _option_text(spec), spec.citation)
    console.print(table)
    console.print("causal / cross (Lq ≠ Lk) / mask (key_mask) / step (recurrent decoding) / "
                  "random (draws from the generator)")
    return 0


def cmd_recommend(args: argparse.Namespace, console: Console) -> int:
    rec = attnzoo.recommend(args.length, causal=args.causal, key_mask=args.key_mask, cross=args.cross,
                            max_error=args.max_error, device=args.device, measure=args.measure)
    console.print(f"[bold]{rec.mechanism}[/bold] at L = {rec.length}"
                  f"{' (causal)' if rec.causal else ''}: {rec.reason}")
    table = Table(title="the candidates, fastest first")
    for col in ("mechanism", "time / full", "memory / full", "error", "measured at L", "why not"):
        table.add_column(col, no_wrap=col != "why not")
    ratio = "{:.2f}".format
    for e in rec.runners_up:
        table.add_row(e["mechanism"], "—" if e["time_ratio"] is None else ratio(e["time_ratio"]),
                      "—" if e["memory_ratio"] is None else ratio(e["memory_ratio"]),
                      "—" if e["error"] is None else f"{e['error']:.3g}", str(e["error_measured_at"] or "—"),
                      e["why_not"] or "")
    console.print(table)
    console.print("error: normalised, ‖out − full‖ / ‖avg − full‖ on a trained forecaster's attention inputs "
                  "(0 exact, 1 no closer than averaging)")
    return 0


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers like 1024,2048, got {text!r}") from None


def _names(values: list[str]) -> list[str]:
    """['full,local', 'lsh'] -> ['full', 'local', 'lsh']: names given with commas, spaces or both."""
    return [name for value in values for name in value.split(",") if name]


def _parse_value(text: str):
    """'8' -> 8, '0.5' -> 0.5, 'true' -> True, 'none' -> None, '32,32' -> (32, 32), else the text."""
    if "," in text:
        parts = [_parse_value(part) for part in text.split(",")]
        if all(isinstance(part, int) and not isinstance(part, bool) for part in parts):
            return tuple(parts)
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"true": True, "false": False, "none": None}.get(text.lower(), text)


def _dotted_options(pairs: list[str], check: Callable[[str], object], form: str) -> dict[str, dict]:
    """['lsh.n_hashes=8', 'local.window=128'] -> {'lsh': {'n_hashes': 8}, 'local': {...}};
    ``check`` raises ValueError for a bad name before the dot."""
    options: dict[str, dict] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        name, dot, option = key.partition(".")
        if not sep or not dot:
            raise ValueError(f"--option takes {form}, got {pair!r}")
        check(name)
        options.setdefault(name, {})[option] = _parse_value(value)
    return options


def _mechanism_options(pairs: list[str]) -> dict[str, dict]:
    return _dotted_options(pairs, attnzoo.get, "MECHANISM.OPTION=VALUE")


def cmd_bench(args: argparse.Namespace, console: Console) -> int:
    from pathlib import Path

    from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn

    from attnzoo.bench import BenchConfig, Shape, run_sweep, write
    from attnzoo.progress import progress

    config = BenchConfig(
        mechanisms=_names(args.mechanisms),
        **({"lengths": [L for part in args.lengths for L in part]} if args.lengths else {}),
        shape=Shape(batch=args.batch, heads=args.heads, head_dim=args.head_dim, dtype=args.dtype,
                    causal=args.causal, backward=args.backward),
        repeats=args.repeats, threads=args.threads, timeout_s=args.timeout,
        error_max_len=args.error_max_len, options=_mechanism_options(args.option),
    )
    total = 2 * len(config.mechanisms) * len(config.lengths)  # a memory reading and a timed cell each
    columns = (TextColumn("[bold]bench"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}"),
               TimeElapsedColumn())
    with progress(console, *columns) as bar:
        task = bar.add_task("", total=total)

        def step(part: str) -> Callable[[dict], None]:
            def on(cell: dict) -> None:
                note = "" if cell["status"] == "ok" else " (skipped)"
                where = f"{cell['mechanism']} L={cell['L']} {part}"
                bar.update(task, advance=1, description=where + note)
            return on

        result = run_sweep(config, step("time"), step("memory"))
    command = "attnzoo bench " + " ".join(args.argv) if args.argv else "attnzoo bench"
    paths = write(result, Path(args.out), command=command)
    console.print(_bench_table(result))
    console.print(f"wrote {', '.join(str(p) for p in paths)}")
    return 0


def _bench_table(result: dict) -> Table:
    from attnzoo.bench.report import exponents

    lengths = result["config"]["lengths"]
    cells = {(c["mechanism"], c["L"]): c for c in result["cells"]}
    m = result["machine"]
    table = Table(title=f"time (ms, median) on {m['cpu']}, {m['threads']} threads; "
                  f"matmul ceiling {m['matmul_gflops']:.0f} GFLOP/s")
    table.add_column("mechanism", style="bold")
    for L in lengths:
        table.add_column(f"L={L}", justify="right")
    for col in ("peak MiB", "GFLOP/s", "err gauss", "err peaked", "t ~ L^", "mem ~ L^", "beats full"):
        table.add_column(f"{col}", justify="right")
    for name in result["config"]["mechanisms"]:
        row = [name]
        for L in lengths:
            c = cells.get((name, L))
            row.append(f"{c['time_s'] * 1e3:.1f}" if c and c["status"] == "ok" else "[dim]skip[/dim]")
        ok = [c for c in result["cells"] if c["mechanism"] == name and c["status"] == "ok"]
        last = ok[-1] if ok else {}
        with_err = [c for c in ok if c.get("error_gaussian") is not None]
        err = with_err[-1] if with_err else {}
        d = result["derived"][name]

        def f(x, spec):
            return "—" if x is None else format(x, spec)

        peak = last.get("peak_bytes")
        row += [f(None if peak is None else peak / 2**20, ".0f"), f(last.get("gflops_per_s"), ".1f"),
                f(err.get("error_gaussian"), ".1e"), f(err.get("error_peaked"), ".1e"),
                exponents(d, "time"), exponents(d, "memory"),
                str(d["crossover_L"] or "—")]
        table.add_row(*row)
    table.caption = ("peak MiB and GFLOP/s at the longest length run; errors at the longest length "
                     "with an error; exponents fitted over the lengths run / over the last step")
    return table


def cmd_patterns(args: argparse.Namespace, console: Console) -> int:
    from pathlib import Path

    from attnzoo.bench.patterns import draw

    names = _names(args.mechanisms) or attnzoo.mechanisms()
    for name in names:
        attnzoo.get(name)
    with console.status(f"drawing {len(names)} mechanisms at L = {args.length}"):
        paths = draw(Path(args.out), mechanisms=names, length=args.length, causal=not args.non_causal,
                     seed=args.seed, options=_mechanism_options(args.option))
    console.print(f"wrote {', '.join(str(p) for p in paths)}")
    return 0


SLOTS = ("enc", "dec", "cross")


def _check_slot(name: str) -> None:
    if name not in SLOTS:
        raise ValueError(f"--option takes enc|dec|cross.OPTION=VALUE, got slot {name!r}")


def _slot_options(pairs: list[str]) -> dict[str, dict]:
    """['enc.factor=3', 'cross.window=8'] -> {'enc': {'factor': 3}, 'dec': {}, 'cross': {...}}."""
    given = _dotted_options(pairs, _check_slot, "enc|dec|cross.OPTION=VALUE")
    return {slot: given.get(slot, {}) for slot in SLOTS}


def _train_with_bars(cfg, console: Console, disable: bool) -> dict:
    """Train with rich's bars (a terminal): epochs, and the batches of this epoch."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from attnzoo.models import Callbacks, train

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("{task.fields[note]}"))
    with Progress(*columns, console=console, disable=disable) as bar:
        epochs = bar.add_task("epochs", total=cfg.epochs, note="")
        batches = bar.add_task("batches", total=1, note="")

        def start(epoch, n):
            bar.reset(batches, total=n, description=f"epoch {epoch + 1}", note="")

        def batch(step, loss):
            bar.update(batches, completed=step + 1, note=f"loss {loss:.4f}")  # resumed: from its batch

        def end(epoch, record):
            bar.update(epochs, completed=record["epoch"],
                       note=f"val mse {record['val_mse']:.4f}" + (" *" if record["improved"] else ""))

        return train(cfg, Callbacks(start, batch, end))


def _train_with_lines(cfg, console: Console, every_s: float = 300.0) -> dict:
    """Train printing plain lines (a log file): one an epoch, and one at most every ``every_s``
    seconds within a long epoch."""
    import time

    from attnzoo.models import Callbacks, train

    state = {"n": 0, "printed": time.monotonic()}

    def start(epoch, n):
        state.update(n=n, printed=time.monotonic())

    def batch(step, loss):
        if time.monotonic() - state["printed"] >= every_s:
            state["printed"] = time.monotonic()
            console.print(f"  batch {step + 1}/{state['n']}  loss {loss:.4f}", highlight=False)

    def end(epoch, r):
        best = "  (best)" if r["improved"] else ""
        console.print(f"epoch {r['epoch']}/{cfg.epochs}  train loss {r['train_loss']:.4f}  val mse "
                      f"{r['val_mse']:.4f}  lr {r['lr']:.3g}  {r['seconds']:.0f} s{best}", highlight=False)

    return train(cfg, Callbacks(start, batch, end))


def cmd_forecast(args: argparse.Namespace, console: Console) -> int:
    import os

    import torch

    from attnzoo.models import InformerConfig, TrainConfig

    if args.threads:
        torch.set_num_threads(args.threads)
    slots = _slot_options(args.option)
    enc = args.enc_attn or args.attn
    dec = args.dec_attn or args.attn
    model = InformerConfig(seq_len=args.seq_len, label_len=args.label_len, pred_len=args.pred_len,
                           d_model=args.d_model, n_heads=args.n_heads, e_layers=args.e_layers,
                           d_layers=args.d_layers, d_ff=args.d_ff, dropout=args.dropout,
                           distil=not args.no_distil, enc_attn=enc, dec_self_attn=dec,
                           cross_attn=args.cross_attn, enc_options=slots["enc"],
                           dec_self_options=slots["dec"], cross_options=slots["cross"], seed=args.seed,
                           revin=args.revin)
    cfg = TrainConfig(data=args.data or TrainConfig.data, target=args.target, features=args.features,
                      model=model, batch_size=args.batch_size, lr=args.lr, epochs=args.epochs,
                      patience=args.patience, seed=args.seed, max_steps=args.max_steps,
                      max_rows=args.max_rows, out=args.out, resume=args.resume,
                      stop_after_epochs=args.stop_after_epochs, stop_after_steps=args.stop_after_steps,
                      checkpoint_every_s=args.checkpoint_every)
    if args.time_steps is not None:
        return _time_steps(cfg, args.time_steps, console)
    rank0 = int(os.environ.get("RANK", "0")) == 0
    if console.is_terminal or not rank0:
        metrics = _train_with_bars(cfg, console, disable=not rank0)
    else:
        metrics = _train_with_lines(cfg, console)
    if rank0 and "test" in metrics:
        console.print(f"[bold]test[/bold] MSE {metrics['test']['mse']:.4f}  MAE {metrics['test']['mae']:.4f} "
                      f"(scaled space; best val MSE {metrics['best_val_mse']:.4f}, "
                      f"{metrics['epochs_run']} epochs)")
        naive = metrics["test_last_value"]
        console.print(f"the last input value repeated, no model: MSE {naive['mse']:.4f}  "
                      f"MAE {naive['mae']:.4f}")
        console.print(f"wrote {args.out}/metrics.json, checkpoint.pt, best.pt, forecast.png")
    elif rank0:
        where = (f"epoch {metrics['stopped_after_epoch']}" if "stopped_after_epoch" in metrics
                 else f"{metrics['stopped_after_step']} batches")
        console.print(f"stopped after {where}; continue with --resume")
    return 0


def _time_steps(cfg, steps: int, console: Console) -> int:
    """``attnzoo forecast --time-steps``: :func:`attnzoo.models.time_steps` of ``cfg`` (a TrainConfig)."""
    import json
    from pathlib import Path

    from attnzoo.models import time_steps

    cost = time_steps(cfg, steps)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "steps.json").write_text(json.dumps(cost, indent=2))
    peak = "not measured here" if cost["peak_rss_mib"] is None else f"{cost['peak_rss_mib']:.0f} MiB"
    threads = f"{cost['threads']} thread{'s' if cost['threads'] > 1 else ''}"
    console.print(f"a training step of {cfg.batch_size} windows: {cost['seconds_median']:.3f} s (median of "
                  f"{steps}; {threads}, {cost['cpu']}), peak memory {peak}; wrote {out}/steps.json",
                  highlight=False)
    return 0


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's default after its help, except where the help states it already or the
    default says nothing (None, empty, off)."""

    def _get_help_string(self, action):
        says_nothing = action.default is None or action.default is False or action.default in ("", [])
        if "(default:" in (action.help or "") or says_nothing:  # (not `in (None, False)`: 0 == False)
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="attnzoo", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p_list = sub.add_parser("list", help="every mechanism with its capabilities and cost")
    p_list.set_defaults(run=cmd_list)

    p_bench = sub.add_parser("bench", help="time, memory, FLOPs and error of each mechanism by length",
                             formatter_class=_Help)
    p_bench.add_argument("--mechanisms", nargs="+", default=[],
                         help="names, comma- or space-separated (default: all)")
    p_bench.add_argument("--lengths", nargs="+", type=_int_list, default=None,
                         help="sequence lengths, e.g. 1024,2048 or 1024 2048 (default: 1024 2048 4096 8192)")
    p_bench.add_argument("--batch", type=int, default=1, help="batch size B of q, k, v")
    p_bench.add_argument("--heads", type=int, default=8, help="heads H")
    p_bench.add_argument("--head-dim", type=int, default=64, help="head dimension D")
    p_bench.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16", "float16"],
                         help="dtype of q, k and v")
    p_bench.add_argument("--causal", action="store_true", help="causal attention")
    p_bench.add_argument("--backward", action="store_true", help="time forward + backward")
    p_bench.add_argument("--repeats", type=int, default=3, help="timed calls per cell")
    p_bench.add_argument("--threads", type=int, default=torch_threads(), help="torch threads")
    p_bench.add_argument("--timeout", type=float, default=60.0,
                         help="seconds; a call slower than this ends that mechanism's sweep")
    p_bench.add_argument("--error-max-len", type=int, default=8192,
                         help="measure error against full only up to this length")
    p_bench.add_argument("--option", action="append", default=[], metavar="MECH.OPT=VALUE",
                         help="a mechanism option, e.g. lsh.n_hashes=8 (repeatable)")
    p_bench.add_argument("--out", default="bench-results", help="output folder")
    p_bench.set_defaults(run=cmd_bench)

    p_pat = sub.add_parser("patterns", help="PNG grids of each mechanism's connectivity and weights",
                           formatter_class=_Help)
    p_pat.add_argument("--mechanisms", nargs="+", default=[],
                       help="names, comma- or space-separated (default: all)")
    p_pat.add_argument("--length", type=int, default=64, help="sequence length drawn")
    p_pat.add_argument("--non-causal", action="store_true", help="draw the non-causal variants")
    p_pat.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    p_pat.add_argument("--option", action="append", default=[], metavar="MECH.OPT=VALUE",
                       help="a mechanism option, e.g. strided.stride=4 (repeatable)")
    p_pat.add_argument("--out", default="patterns", help="output folder")
    p_pat.set_defaults(run=cmd_patterns)

    p_rec = sub.add_parser("recommend", help="the fastest mechanism within an error at a length",
                           formatter_class=_Help)
    p_rec.add_argument("--length", type=int, required=True, help="sequence length L")
    p_rec.add_argument("--causal", action="store_true", help="causal attention")
    p_rec.add_argument("--key-mask", action="store_true", help="the calls pass a key mask (padding)")
    p_rec.add_argument("--cross", action="store_true", help="cross-attention (Lq != Lk)")
    p_rec.add_argument("--max-error", type=float, default=0.1,
                       help="largest normalised error on real attention inputs (0 exact, 1 averaging)")
    p_rec.add_argument("--device", default=None, help="where the calls run (default: the CPU)")
    p_rec.add_argument("--measure", action="store_true",
                       help="time the candidates on this machine (cached) instead of the shipped table")
    p_rec.set_defaults(run=cmd_recommend)

    p_fc = sub.add_parser("forecast", help="train and test the Informer-style forecaster (ETTh1 default)",
                          formatter_class=_Help)
    add = p_fc.add_argument
    add("--data", default="", help="CSV with a date column (empty: the shipped ETTh1)")
    add("--target", default="OT", help="the column to forecast")
    add("--features", default="S", choices=["M", "S", "MS"],
        help="S: the target in and out; M: every column in and out; MS: every column in, the target out")
    add("--seq-len", type=int, default=96, help="encoder input: known steps the model sees")
    add("--label-len", type=int, default=48, help="decoder start token: known steps fed to the decoder")
    add("--pred-len", type=int, default=24, help="horizon: steps to forecast")
    add("--attn", default="prob_sparse", help="encoder and decoder self-attention mechanism")
    add("--enc-attn", default="", help="encoder self-attention (overrides --attn)")
    add("--dec-attn", default="", help="decoder causal self-attention (overrides --attn)")
    add("--cross-attn", default="full", help="decoder cross-attention to the encoder output")
    add("--option", action="append", default=[], metavar="SLOT.OPT=VALUE",
        help="a mechanism option for slot enc, dec or cross, e.g. enc.factor=3 (repeatable)")
    add("--revin", action="store_true",
        help="reversible instance normalisation: each window normalised by its own mean and deviation")
    add("--d-model", type=int, default=512, help="model width")
    add("--n-heads", type=int, default=8, help="attention heads")
    add("--e-layers", type=int, default=2, help="encoder layers")
    add("--d-layers", type=int, default=1, help="decoder layers")
    add("--d-ff", type=int, default=2048, help="feed-forward width")
    add("--dropout", type=float, default=0.05, help="dropout probability")
    add("--no-distil", action="store_true", help="no distilling layers (length halving) in the encoder")
    add("--batch-size", type=int, default=32, help="training windows per batch, per process")
    add("--lr", type=float, default=1e-4, help="Adam's learning rate, halved after every epoch")
    add("--epochs", type=int, default=6, help="most epochs to train")
    add("--patience", type=int, default=3, help="stop after this many epochs without a better validation MSE")
    add("--seed", type=int, default=0, help="seeds the weights, the data order and the mechanisms' draws")
    add("--max-steps", type=int, default=None, help="training batches per epoch (default: all)")
    add("--max-rows", type=int, default=None, help="use only the first rows of the CSV (default: all)")
    add("--threads", type=int, default=0, help="torch threads (0: as many as torch picks)")
    add("--out", default="runs/forecast", help="folder for checkpoints, metrics.json and forecast.png")
    add("--resume", action="store_true", help="continue an interrupted run from OUT/checkpoint.pt")
    add("--checkpoint-every", type=float, default=600.0,
        help="seconds between checkpoints within an epoch (one process; 0: every batch), so an "
             "interruption loses at most that much")
    add("--stop-after-epochs", type=int, default=None,
        help="stop after this many epochs, as if interrupted (then --resume)")
    add("--stop-after-steps", type=int, default=None,
        help="stop after training this many batches, as if interrupted (one process; then --resume)")
    add("--time-steps", type=int, default=None, metavar="N",
        help="train nothing: time N training steps (after one untimed), print their median and the "
             "peak memory, write OUT/steps.json")
    p_fc.set_defaults(run=cmd_forecast)
    return parser


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    args.argv = argv[1:]
    # Wide enough for the tables when output goes to a file or a pipe.
    console = Console() if sys.stdout.isatty() else Console(width=200)
    try:
        return args.run(args, console)
    except ValueError as err:
        console.print(f"[red]error:[/red] {err}")
        return 2


if __name__ == "__main__":
    sys.exit(main())

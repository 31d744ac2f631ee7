"""The ``attnzoo`` command: list, bench, patterns, forecast."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from rich.console import Console
from rich.table import Table

import attnzoo


def _yes(flag: bool) -> str:
    return "✓" if flag else "—"


def _option_text(spec) -> str:
    fields = dataclasses.fields(spec.options)
    return ", ".join(f"{f.name}={f.default!r}" for f in fields) or "—"


def cmd_list(args: argparse.Namespace, console: Console) -> int:
    table = Table(title="attnzoo mechanisms", show_lines=False)
    table.add_column("name", no_wrap=True, style="bold")
    table.add_column("what", overflow="fold", ratio=3)
    for col in ("causal", "cross", "mask", "step"):
        table.add_column(col, justify="center", no_wrap=True)
    table.add_column("time", no_wrap=True)
    table.add_column("memory", overflow="fold", ratio=1)
    table.add_column("options", overflow="fold", ratio=2)
    table.add_column("paper", overflow="fold", ratio=2)
    for name in attnzoo.mechanisms():
        spec = attnzoo.get(name)
        caps = spec.capabilities
        table.add_row(name, spec.summary, _yes(caps.causal), _yes(caps.cross), _yes(caps.key_mask),
                      _yes(caps.recurrent), spec.time, spec.memory, _option_text(spec),
                      spec.citation)
    console.print(table)
    console.print("causal / cross (Lq ≠ Lk) / mask (key_mask) / step (recurrent decoding)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="attnzoo", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p_list = sub.add_parser("list", help="every mechanism with its capabilities and cost")
    p_list.set_defaults(run=cmd_list)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Wide enough for the tables when output goes to a file or a pipe.
    console = Console() if sys.stdout.isatty() else Console(width=200)
    try:
        return args.run(args, console)
    except ValueError as err:
        console.print(f"[red]error:[/red] {err}")
        return 2


if __name__ == "__main__":
    sys.exit(main())

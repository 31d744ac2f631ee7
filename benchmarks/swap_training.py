"""Train a small torch nn.TransformerEncoder with attention mechanisms swapped in.

    .venv/bin/python benchmarks/swap_training.py              # docs/swap.md and docs/img/swap_training.png
    .venv/bin/python benchmarks/swap_training.py --steps 20 --mechanisms full,local

The toy task is causal and long: at every position t of a sequence of L = 2048 noise values,
predict the mean of the last `span` inputs x[t-span+1..t] (a sliding average, span 32 by
default), a target that only attention over the recent past can compute. One model is built,
copied for each mechanism and swapped with ``attnzoo.swap_attention``, so every run starts
from the same weights and sees the same batches. Reports the loss curves, the final loss on
held-out batches and the median time a training step takes.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from pathlib import Path

import torch
from torch import nn

import attnzoo

OPTIONS = {"local": {"window": 64}, "linear": {}, "full": {}}


class Model(nn.Module):
    def __init__(self, d_model: int, heads: int, layers: int):
        super().__init__()
        self.embed = nn.Linear(1, d_model)
        self.pos = nn.Parameter(torch.randn(4096, d_model) * 0.02)
        layer = nn.TransformerEncoderLayer(d_model, heads, 2 * d_model, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers)
        self.head = nn.Linear(d_model, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, L) -> (B, L)
        L = x.shape[1]
        h = self.embed(x[..., None]) + self.pos[:L]
        mask = nn.Transformer.generate_square_subsequent_mask(L)
        return self.head(self.encoder(h, mask=mask, is_causal=True))[..., 0]


def batch(generator: torch.Generator, B: int, L: int, span: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(B, L, generator=generator)
    c = torch.nn.functional.pad(x.cumsum(1), (span, 0))  # (B, L + span)
    return x, (c[:, span:] - c[:, :-span]) / span  # the mean of the last `span` inputs


def train(model: nn.Module, args, log) -> dict:
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    data = torch.Generator().manual_seed(1)
    losses, times = [], []
    for step in range(args.steps):
        x, y = batch(data, args.batch, args.length, args.span)
        start = time.perf_counter()
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
        if step % 10 == 0 or step == args.steps - 1:
            log(f"  step {step + 1}/{args.steps}: loss {loss.item():.4f}, {times[-1]:.2f} s")
    held_out = torch.Generator().manual_seed(2)
    with torch.no_grad():
        model.eval()
        batches = [batch(held_out, args.batch, args.length, args.span) for _ in range(4)]
        test = statistics.mean(nn.functional.mse_loss(model(x), y).item() for x, y in batches)
    return {"losses": losses, "step_s": statistics.median(times[1:]), "test": test}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mechanisms", default="torch,full,local,linear",
                        help="comma-separated; torch = the model as built, not swapped")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--span", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--out", default="docs/swap.md")
    args = parser.parse_args()

    def log(line: str) -> None:  # plain lines: readable in a terminal and in a log file
        print(line, flush=True)

    torch.manual_seed(0)
    base = Model(d_model=64, heads=4, layers=2)
    results = {}
    for name in args.mechanisms.split(","):
        log(f"{name}:")
        model = copy.deepcopy(base)
        if name != "torch":
            attnzoo.swap_attention(model, name, **OPTIONS.get(name, {}))
        results[name] = train(model.train(), args, log)
    write(results, args)


def write(results: dict, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(args.out)
    image = out.parent / "img" / "swap_training.png"
    image.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, r in results.items():
        ax.plot(range(1, len(r["losses"]) + 1), r["losses"], label=f"{name} ({r['step_s']:.2f} s/step)")
    ax.set(xlabel="step", ylabel="training MSE", yscale="log",
           title=f"nn.TransformerEncoder, swap_attention, L = {args.length}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(image, dpi=120)
    rows = "\n".join(f"| {n} | {OPTIONS.get(n, {}) or '—'} | {r['losses'][0]:.4f} | {r['losses'][-1]:.4f} | "
                     f"{r['test']:.4f} | {r['step_s']:.2f} |" for n, r in results.items())
    flags = " ".join(f"--{k} {v}" for k, v in vars(args).items() if k != "out")
    out.write_text(f"""# swap_attention on a toy long-sequence task

Command: `python benchmarks/swap_training.py {flags}`.
Machine: {torch.get_num_threads()} threads, torch {torch.__version__}.

A torch `nn.TransformerEncoder` (d_model 64, 4 heads, 2 layers, causal) learns, at each of
{args.length} positions, the mean of the last {args.span} noise inputs. The same initial model is
swapped with each mechanism (`attnzoo.swap_attention(model, name, **options)`; `torch`: not
swapped, torch's own attention) and trained
{args.steps} Adam steps of batch {args.batch} on the same batches. Test: the MSE on 4 held-out
batches in eval mode (the target's own variance is {1 / args.span:.4f}).

| mechanism | options | first loss | last loss | test MSE | s / training step (median) |
|---|---|---|---|---|---|
{rows}

![training loss](img/{image.name})
""")
    print(f"wrote {out} and {image}", flush=True)


if __name__ == "__main__":
    main()

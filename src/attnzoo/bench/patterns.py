"""Pictures of each mechanism: its connectivity and its effective attention weights.

- ``connectivity.png``: which keys each query may attend to (rows = queries), like the
  figures of the Sparse Transformer and LogSparse papers. Fixed patterns come from
  ``attnzoo.connectivity``; data-dependent ones (prob_sparse's active rows, lsh's
  buckets) from seeded random inputs; mechanisms without a sparsity pattern (the
  kernel and low-rank ones) connect every visible pair and are drawn so.
- ``weights.png``: the attention matrix each mechanism effectively applies, on the
  same seeded inputs. Every mechanism is linear in V, so feeding V = I (one value
  per key, Dv = Lk) returns its (Lq, Lk) weights; ``full`` is the target.
"""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

import attnzoo  # noqa: E402
from attnzoo.bench.measure import Shape, make_inputs  # noqa: E402

# Options that make the defaults visible at a small length; --option overrides them.
ILLUSTRATION = {
    "local": {"window": 8},
    "block_local": {"window": 8},
    "lsh": {"bucket_size": 8},
    "linformer": {"proj_len": 16},
    "performer": {"nb_features": 32},
    "nystrom": {"num_landmarks": 8},
}


def _options(name: str, length: int, given: dict) -> dict:
    opts = {**ILLUSTRATION.get(name, {}), **given.get(name, {})}
    if "window" in opts:  # local's and block_local's window: at most the picture's length
        opts["window"] = min(opts["window"], length)
    return opts


def _inputs(length: int, seed: int, head_dim: int):
    return make_inputs(Shape(batch=1, heads=1, head_dim=head_dim, dtype="float64"), length,
                       "peaked", seed=seed)


def connectivity_of(name: str, length: int, causal: bool, options: dict, seed: int = 0,
                    head_dim: int = 16) -> torch.Tensor:
    """(L, L) bool, or (P, L, L) for patterns that differ by head."""
    spec = attnzoo.get(name)
    causal = causal and spec.capabilities.causal
    if spec.data_pattern is not None:
        q, k, _ = _inputs(length, seed, head_dim)
        if options.get("shared_qk"):
            k = q
        mask = attnzoo.connectivity(name, q=q, k=k, causal=causal,
                                    generator=torch.Generator().manual_seed(seed), **options)
        return mask[0, 0]
    return attnzoo.connectivity(name, length=length, causal=causal, **options)


def weights_of(name: str, length: int, causal: bool, options: dict, seed: int = 0,
               head_dim: int = 16) -> torch.Tensor:
    """The (L, L) attention weights the mechanism applies to V, from V = I."""
    spec = attnzoo.get(name)
    causal = causal and spec.capabilities.causal
    q, k, _ = _inputs(length, seed, head_dim)
    if options.get("shared_qk"):
        k = q
    eye = torch.eye(length, dtype=q.dtype)[None, None]  # (1, 1, L, L): value j = one-hot j
    out = attnzoo.attention(q, k, eye, mechanism=name, causal=causal,
                            generator=torch.Generator().manual_seed(seed), **options)
    return out[0, 0]


def _grid(n: int):
    cols = min(5, n)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.1 * cols, 3.3 * rows), squeeze=False)
    for ax in axes.flat[n:]:
        ax.axis("off")
    return fig, list(axes.flat)


def _panel(ax, image, title, cmap, vmax=None):
    image = image.numpy() if isinstance(image, torch.Tensor) else image
    ax.imshow(image, cmap=cmap, vmin=0, vmax=vmax, interpolation="nearest")
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("key j", fontsize=8)
    ax.set_ylabel("query i", fontsize=8)
    ax.tick_params(labelsize=7)


def draw(out: Path, *, mechanisms: list[str] | None = None, length: int = 64, causal: bool = True,
         seed: int = 0, options: dict | None = None) -> list[Path]:
    """Write connectivity.png and weights.png into ``out``; returns their paths."""
    if length < 2:
        raise ValueError(f"patterns need length >= 2, got {length}")
    names = mechanisms or attnzoo.mechanisms()
    options = options or {}
    out.mkdir(parents=True, exist_ok=True)
    mode = "causal" if causal else "non-causal"

    fig, axes = _grid(len(names))
    for ax, name in zip(axes, names, strict=False):
        mask = connectivity_of(name, length, causal, _options(name, length, options), seed)
        if mask.dim() == 3:  # per-head patterns: head 0 in one colour, head 1 in another
            image = mask[0].float() + 2 * mask[1].float()
            title = f"{name} (split: A1 | A2 | both)"
            _panel(ax, image, title, "viridis", vmax=3)
        else:
            density = mask.float().mean().item()
            extra = "" if attnzoo.get(name).pattern or attnzoo.get(name).data_pattern else ", dense"
            _panel(ax, mask.float(), f"{name} ({density:.0%} of pairs{extra})", "Blues", vmax=1)
    fig.suptitle(f"Connectivity at L = {length} ({mode}; rows are queries, dark = attends)")
    fig.tight_layout()
    paths = [out / "connectivity.png"]
    fig.savefig(paths[0], dpi=110)
    plt.close(fig)

    fig, axes = _grid(len(names))
    for ax, name in zip(axes, names, strict=False):
        w = weights_of(name, length, causal, _options(name, length, options), seed)
        _panel(ax, w.clamp(min=0).numpy(), name, "magma_r", vmax=max(w.max().item(), 1e-12) * 0.5)
    fig.suptitle(f"Effective attention weights at L = {length} ({mode}; smooth 'peaked' inputs, "
                 f"seed {seed})")
    fig.tight_layout()
    paths.append(out / "weights.png")
    fig.savefig(paths[1], dpi=110)
    plt.close(fig)
    return paths

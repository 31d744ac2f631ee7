#!/usr/bin/env python3
"""attnzoo beside the best public implementation of each mechanism, measured side by side.

    make peers                      # the peers, pinned in pyproject's `peers` group, --no-deps
    make peers-ft                   # optional: pytorch-fast-transformers (C++ build, ~9 min)
    .venv/bin/python benchmarks/peers.py                  # every pair, L = 1024 4096 16384
    .venv/bin/python benchmarks/peers.py --only lsh,linear_causal --lengths 4096 --rounds 1
    .venv/bin/python benchmarks/peers.py --list
    .venv/bin/python benchmarks/peers.py --render        # docs/performance.md anew from its JSON

For every pair and length, ours and the peer run on the same inputs (same seed, each in
its library's layout, converted before the call) and the same configuration, each in a
fresh process, alternating: which side goes first alternates from cell to cell and, with
``--rounds`` > 1, from round to round. Rounds are interleaved: the run goes over every cell
once, then again, so each cell's processes spread over the whole run, and the report is
written after every pass (a run cut short keeps what it measured). A side's round is two
processes (:func:`run_child`). One times forwards under no_grad and forward+backward
(inputs and parameters require grad, ``out.backward(g)`` for a fixed g), after one warm-up
call, with glibc's defaults, as a user's process has them. The other, started with
MALLOC_MMAP_THRESHOLD_ fixed (attnzoo.bench.measure.memory_env), reads the peak extra
resident memory of a call the way ``attnzoo bench`` does (VmHWM reset after gc +
malloc_trim, minus VmRSS before; see attnzoo.bench.measure), over MEMORY_CALLS calls where
a call is cheap, else one (:func:`peak_memories`), after one warm-up call. Times are
medians over every timed call of every round; memory is the median over every memory call
of every round. With ``--cheap-rounds N`` a cell whose rounds each took under CHEAP_S
seconds a side gets N rounds: this machine's speed differs from process to process, and
more processes steady the medians where they cost little. In full attention's cells both
sides make the same SDPA call, so a ratio of processes measures that spread alone: each of
their rounds adds a third process where the two sides' calls alternate (:func:`measure_paired`),
and their ratio is read there.

Writes docs/performance.md (ratios ours/peer and ours/SDPA with the project's targets,
the machine, the command) and docs/performance.json (every number). Only this script
prints; nothing here is imported by the package.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
import unittest.mock
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

import attnzoo
from attnzoo.bench.measure import (
    MMAP_THRESHOLD,
    matmul_gflops,
    memory_env,
    peak_memory,
    require_memory_env,
    timings,
)

ROOT = Path(__file__).resolve().parent.parent
B, H, D = 1, 8, 64
D_MODEL = H * D  # for the pairs measured as whole modules (the peer owns its projections)
CALL_LIMIT_S = 120.0  # a side whose first call takes longer is not repeated
TIMED_S, MAX_REPEATS = 1.0, 15  # fast calls are repeated up to about TIMED_S of timed calls (noise)
CHEAP_S = 25.0  # a cell whose every round took less a side gets --cheap-rounds rounds (cell_rounds)
MEMORY_CALLS = 3  # memory calls a process makes where its first call took under MEMORY_CALL_S
MEMORY_CALL_S = 1.0
AGREE_RTOL = 1e-4  # float32 outputs of one function agree to this share of their largest entry


@dataclass
class Case:
    """One side of a pair at one length: a call and the tensors that get gradients."""

    fwd: Callable[[], torch.Tensor]
    leaves: list[torch.Tensor]
    module: torch.nn.Module | None = None  # the side's module, where it owns random parameters


@dataclass(frozen=True)
class Pair:
    """One mechanism beside its peer. Our side is built from the fields (:func:`ours_case`), and
    the same options give the FLOP floor (:func:`floor_s`), so the two cannot disagree."""

    mechanism: str  # attnzoo's name
    causal: bool
    peer: Callable[[int], Case] | None  # None: no public implementation; measured against SDPA only
    peer_label: str = ""
    config: str = ""  # the shared configuration, in words
    scope: str = "core"  # "core": attention on q, k, v; "module": projections included, on x (B, L, 512)
    options: dict = field(default_factory=dict)  # ours; a callable value is called with L
    shared_qk: bool = False  # core: k is q (one leaf), and the mechanism's shared_qk option is set
    same_output: bool = False  # the peer computes the same function of the same inputs: checked (agreement)
    peer_factor: float = 1.0  # the peer's output is this multiple of ours (where same_output)
    # Where the sides draw their own random parameters: (pair, L) -> the check's two calls (ours,
    # the peer's), made one function by copying parameters across and setting aside the
    # differences the config names (agreement); None: the two sides as measured.
    align: Callable[[Pair, int], tuple[Callable, Callable]] | None = None


# ---------------------------------------------------------------------------- inputs


def _qkv(L: int, shared_qk: bool = False):
    """q, k, v of (B, H, L, D), N(0, 1), seed 0 (the same draws on both sides of a pair)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, L, D, generator=g) for _ in range(3))
    if shared_qk:
        k = q
    return q, k, v


def _leaves(*tensors):
    return [t.requires_grad_(True) for t in tensors]


def _blhd(t):
    return t.detach().transpose(1, 2).contiguous()


def pair_options(pair: Pair, L: int) -> dict:
    """Our side's options at length L (callables called with L; shared_qk set where k is q)."""
    options = {n: o(L) if callable(o) else o for n, o in pair.options.items()}
    return {**options, "shared_qk": True} if pair.shared_qk else options


def ours_case(pair: Pair, L: int) -> Case:
    """Our side: attnzoo.attention on q, k, v ("core"), or attnzoo.nn.MultiheadAttention on
    x (B, L, 512) ("module", projections included)."""
    options = pair_options(pair, L)
    if pair.scope == "module":
        torch.manual_seed(0)
        layer = attnzoo.nn.MultiheadAttention(D_MODEL, H, mechanism=pair.mechanism, causal=pair.causal,
                                              **options).eval()
        x = torch.randn(B, L, D_MODEL, generator=torch.Generator().manual_seed(0))
        return Case(lambda: layer(x), _leaves(x) + list(layer.parameters()), layer)
    q, k, v = _qkv(L, pair.shared_qk)
    return Case(lambda: attnzoo.attention(q, k, v, mechanism=pair.mechanism, causal=pair.causal,
                                          generator=torch.Generator().manual_seed(0), **options),
                _leaves(q, v) if pair.shared_qk else _leaves(q, k, v))


# ---------------------------------------------------------------------------- peers


def sdpa(causal: bool) -> Callable[[int], Case]:
    def build(L: int) -> Case:
        q, k, v = _qkv(L)
        leaves = _leaves(q, k, v)
        return Case(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal),
                    leaves)
    return build


def informer(causal: bool) -> Callable[[int], Case]:
    def build(L: int) -> Case:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        from informer_official import prob_attention
        q, k, v = (_blhd(t) for t in _qkv(L))
        leaves = _leaves(q, k, v)
        return Case(lambda: prob_attention(q, k, v, mask_flag=causal), leaves)
    return build


def reformer_lsh(L: int) -> Case:
    from reformer_pytorch.reformer_pytorch import LSHAttention
    att = LSHAttention(bucket_size=64, n_hashes=4, causal=False, dropout=0.0).eval()
    q, _, v = _qkv(L)
    qk, v = q.reshape(B * H, L, D), v.reshape(B * H, L, D)
    return Case(lambda: att(qk, v)[0], _leaves(qk, v))


def linformer_module(L: int) -> Case:
    from linformer import LinformerSelfAttention
    torch.manual_seed(0)
    m = LinformerSelfAttention(dim=D_MODEL, seq_len=L, k=256, heads=H, dim_head=D).eval()
    x = torch.randn(B, L, D_MODEL, generator=torch.Generator().manual_seed(0))
    return Case(lambda: m(x), _leaves(x) + list(m.parameters()), m)


def nystrom_module(L: int) -> Case:
    from nystrom_attention import NystromAttention
    torch.manual_seed(0)
    m = NystromAttention(dim=D_MODEL, dim_head=D, heads=H, num_landmarks=256).eval()
    x = torch.randn(B, L, D_MODEL, generator=torch.Generator().manual_seed(0))
    return Case(lambda: m(x), _leaves(x) + list(m.parameters()), m)


def performer_fast(causal: bool) -> Callable[[int], Case]:
    def build(L: int) -> Case:
        import contextlib
        import io

        from performer_pytorch import FastAttention
        torch.manual_seed(0)
        with contextlib.redirect_stdout(io.StringIO()):  # its CPU causal path prints a warning
            att = FastAttention(dim_heads=D, nb_features=256, causal=causal).eval()
        q, k, v = _qkv(L)
        return Case(lambda: att(q, k, v), _leaves(q, k, v), att)
    return build


def local_attention(causal: bool) -> Callable[[int], Case]:
    def build(L: int) -> Case:
        from local_attention import LocalAttention
        att = LocalAttention(window_size=256, causal=causal, look_backward=1,
                             look_forward=0 if causal else 1, dropout=0.0).eval()
        q, k, v = _qkv(L)
        return Case(lambda: att(q, k, v), _leaves(q, k, v))
    return build


def lat_linear(L: int) -> Case:
    from linear_attention_transformer.linear_attention_transformer import linear_attn
    q, k, v = _qkv(L)
    return Case(lambda: linear_attn(q, k, v), _leaves(q, k, v))


def fast_transformers(kind: str) -> Callable[[int], Case]:
    def build(L: int) -> Case:
        from fast_transformers.attention import CausalLinearAttention, LinearAttention
        from fast_transformers.masking import FullMask, LengthMask, TriangularCausalMask
        lengths = LengthMask(torch.full((B,), L, dtype=torch.int64), max_len=L)
        att, mask = ((CausalLinearAttention(D), TriangularCausalMask(L)) if kind == "causal"
                     else (LinearAttention(D), FullMask(L)))
        _ = mask.all_ones  # the (L, L) FullMask is built with the inputs, outside the call
        q, k, v = (_blhd(t) for t in _qkv(L))
        leaves = _leaves(q, k, v)
        return Case(lambda: att.eval()(q, k, v, mask, lengths, lengths), leaves)
    return build


def _performer_features(L: int) -> torch.Tensor:
    """Ours draws its features once, outside the call, as performer-pytorch draws them at construction."""
    from attnzoo.mechanisms.performer import draw_features
    return draw_features(256, D, orthogonal=True, generator=torch.Generator().manual_seed(0))


PERFORMER = dict(features=_performer_features)

# ---------------------------------------------------------------------------- one function for the check


@torch.no_grad()
def _copy_projections(layer, q_w, k_w, v_w, out: torch.nn.Linear) -> None:
    """A peer module's q, k and v weights (no biases) and output projection into our layer."""
    for mine, theirs in ((layer.q_proj, q_w), (layer.k_proj, k_w), (layer.v_proj, v_w)):
        mine.weight.copy_(theirs)
    layer.out_proj.weight.copy_(out.weight)
    layer.out_proj.bias.copy_(out.bias)


def linformer_align(pair: Pair, L: int) -> tuple[Callable, Callable]:
    """The peer's weights into our layer; its E and F are (seq_len, k), ours (proj_len, max_len)."""
    peer = pair.peer(L)
    ours = ours_case(pair, L)
    m, layer = peer.module, ours.module
    _copy_projections(layer, m.to_q.weight, m.to_k.weight, m.to_v.weight, m.to_out)
    with torch.no_grad():
        layer.proj_k.copy_(m.proj_k.T)
        layer.proj_v.copy_(m.proj_v.T)
    return ours.fwd, peer.fwd


def nystrom_align(pair: Pair, L: int) -> tuple[Callable, Callable]:
    """The peer's weights into our layer, the peer's residual conv zeroed (ours has none), and
    its pseudo-inverse started from each head's norms (:func:`_pinv_per_head`)."""
    import nystrom_attention.nystrom_attention as module
    peer = pair.peer(L)
    ours = ours_case(pair, L)
    m = peer.module
    _copy_projections(ours.module, *m.to_qkv.weight.chunk(3), m.to_out[0])
    with torch.no_grad():
        m.res_conv.weight.zero_()

    def peer_fwd():
        with unittest.mock.patch.object(module, "moore_penrose_iter_pinv", _pinv_per_head):
            return peer.fwd()
    return ours.fwd, peer_fwd


def _pinv_per_head(x, iters=6):
    """nystrom-attention's ``moore_penrose_iter_pinv`` with Z₀'s norms taken per (m, m) matrix, as
    attnzoo's ``iterative_pinv`` takes them (its documented departure), not over the whole batch."""
    abs_x = x.abs()
    z = x.transpose(-1, -2) / (abs_x.sum(-1).amax(-1) * abs_x.sum(-2).amax(-1))[..., None, None]
    eye = torch.eye(x.shape[-1], dtype=x.dtype)
    for _ in range(iters):
        xz = x @ z
        z = 0.25 * z @ (13 * eye - (xz @ (15 * eye - (xz @ (7 * eye - xz)))))
    return z


def performer_align(pair: Pair, L: int) -> tuple[Callable, Callable]:
    """Our features into the peer's, and eps 0 on both sides: the peer adds 1e-4 to every
    feature after shifting the logits by their largest (and, causal, 1e-6 to every feature's
    running sum in the normaliser); ours adds its eps (1e-6) to the normaliser."""
    from performer_pytorch.performer_pytorch import softmax_kernel
    peer = pair.peer(L)
    ours = ours_case(dataclasses.replace(pair, options={**pair.options, "eps": 0.0}), L)
    with torch.no_grad():
        peer.module.projection_matrix.copy_(_performer_features(L))
    if pair.causal:  # its CPU path's eps: added to every feature's running sum in the normaliser
        peer.module.causal_linear_fn = functools.partial(peer.module.causal_linear_fn, eps=0.0)

    def peer_fwd():
        with unittest.mock.patch.dict(softmax_kernel.__kwdefaults__, eps=0.0):
            return peer.fwd()
    return ours.fwd, peer_fwd


# The linformer and nystrom-attention modules project q, k and v without biases and the
# output with one: our layer takes the same (it has biases on all four by default).
PEER_BIASES = dict(bias=False, out_bias=True)
PERFORMER_CHECK = ("checked with our features copied into the peer and eps 0 on both sides (the peer "
                   "adds 1e-4 to every feature, ours 1e-6 to the normaliser: performer_align)")


# ---------------------------------------------------------------------------- pairs

PAIRS: dict[str, Pair] = {
    "full": Pair("full", False, sdpa(False), "torch SDPA", "softmax attention", same_output=True),
    "full_causal": Pair("full", True, sdpa(True), "torch SDPA is_causal", "causal softmax attention",
                        same_output=True),
    "prob_sparse": Pair("prob_sparse", False, informer(False),
                        "Informer official ProbAttention (re-implemented)",
                        "factor 5, official arithmetic (sum/Lk, mean(V))",
                        options=dict(variant="official", factor=5)),
    "prob_sparse_causal": Pair("prob_sparse", True, informer(True),
                               "Informer official ProbAttention, mask_flag",
                               "factor 5, official arithmetic (cumsum(V), ProbMask)",
                               options=dict(variant="official", factor=5)),
    "lsh": Pair("lsh", False, reformer_lsh, "reformer-pytorch LSHAttention",
                "shared QK, bucket 64, 4 hashes, n_buckets = L/64, chunk + previous chunk; the peer's "
                "defaults: attend across buckets, duplicates not counted (allow_duplicate_attention)",
                shared_qk=True, options=dict(bucket_size=64, n_hashes=4, attend_across_buckets=True,
                                             count_duplicates=False)),
    "linformer": Pair("linformer", False, linformer_module, "linformer LinformerSelfAttention",
                      "k = 256, d_model 512, 8 heads, whole module; as the peer's, no biases on "
                      "q, k, v, one on the output; checked with the peer's weights, E and F copied into "
                      "ours", scope="module", options=dict(proj_len=256, max_len=lambda L: L, **PEER_BIASES),
                      same_output=True, align=linformer_align),
    "performer": Pair("performer", False, performer_fast(False), "performer-pytorch FastAttention",
                      "256 orthogonal features, drawn once; " + PERFORMER_CHECK, options=PERFORMER,
                      same_output=True, align=performer_align),
    "performer_causal": Pair("performer", True, performer_fast(True),
                             "performer-pytorch FastAttention causal (its CPU path)",
                             "256 orthogonal features, drawn once; " + PERFORMER_CHECK, options=PERFORMER,
                             same_output=True, align=performer_align),
    "block_local": Pair("block_local", False, local_attention(False), "local-attention LocalAttention",
                        "window_size 256, one block back and one forward: each block of 256 queries "
                        "sees the 768 keys of its own and its neighbours, on both sides",
                        options=dict(window=256), same_output=True),
    "block_local_causal": Pair("block_local", True, local_attention(True),
                               "local-attention LocalAttention causal",
                               "window_size 256, one block back: 257–512 keys a query, on both sides",
                               options=dict(window=256), same_output=True),
    "nystrom": Pair("nystrom", False, nystrom_module, "nystrom-attention NystromAttention",
                    "256 landmarks, 6 pinv iterations, d_model 512, 8 heads, whole module "
                    "(the peer adds a depthwise residual conv of 33 taps); as the peer's, no "
                    "biases on q, k, v, one on the output; checked with the peer's weights copied into "
                    "ours, its residual conv zeroed and its pseudo-inverse started from each head's "
                    "norms, as ours (the peer takes one maximum over all heads)", scope="module",
                    options=dict(num_landmarks=256, **PEER_BIASES), same_output=True, align=nystrom_align),
    "efficient": Pair("efficient", False, lat_linear, "linear-attention-transformer linear_attn",
                      "softmax of q over features, of k over positions; the peer then multiplies by "
                      "D^-0.5 (not in the paper), so its output is ours × D^-0.5",
                      same_output=True, peer_factor=D**-0.5),
    "linear": Pair("linear", False, fast_transformers("linear"),
                   "fast-transformers LinearAttention (C++ build)", "elu + 1 features", same_output=True),
    "linear_causal": Pair("linear", True, fast_transformers("causal"),
                          "fast-transformers CausalLinearAttention (C++ kernel)", "elu + 1 features",
                          same_output=True),
    "taylor": Pair("taylor", False, None),
    "taylor_causal": Pair("taylor", True, None),
    "log_sparse": Pair("log_sparse", False, None),
    "log_sparse_causal": Pair("log_sparse", True, None),
    "strided": Pair("strided", False, None),
    "strided_causal": Pair("strided", True, None),
    "fixed": Pair("fixed", False, None),
    "fixed_causal": Pair("fixed", True, None),
    "local": Pair("local", False, None, options=dict(window=768)),  # sliding: 769 keys a query
    "local_causal": Pair("local", True, None, options=dict(window=384)),
    "lsh_causal": Pair("lsh", True, None, shared_qk=True),
    "linformer_core": Pair("linformer", False, None),
    "nystrom_core": Pair("nystrom", False, None, options=dict(num_landmarks=256)),
}


# ---------------------------------------------------------------------------- child


def calls_for(first_s: float, repeats: int) -> int:
    """Timed calls for a call whose warm-up took ``first_s``: ``repeats``, or more (up to
    MAX_REPEATS) so that fast calls fill about TIMED_S, where this machine's noise is largest."""
    return max(repeats, min(MAX_REPEATS, math.ceil(TIMED_S / max(first_s, 1e-6))))


def timed_calls(fn, n: int, key: str) -> dict[str, list]:
    """``n`` calls of ``fn``: the wall seconds of each (``{key}_s``), and the kernel CPU seconds
    (``{key}_sys_s``) and minor page faults (``{key}_faults``) the process, all its threads,
    spent in each. Kernel time is part of the wall time the ratios compare, and it moves: the
    same forward (linear, L = 16384) read 26k–29k faults a call in some processes and ~1k in
    others, by the state glibc's heap happened to be in."""
    wall, kernel, faults = [], [], []
    for _ in range(n):
        before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        fn()
        wall.append(time.perf_counter() - start)
        after = resource.getrusage(resource.RUSAGE_SELF)
        kernel.append(after.ru_stime - before.ru_stime)
        faults.append(after.ru_minflt - before.ru_minflt)
    return {f"{key}_s": wall, f"{key}_sys_s": kernel, f"{key}_faults": faults}


def peak_memories(fn, first_s: float) -> list[int]:
    """The peak extra resident bytes of MEMORY_CALLS calls of ``fn`` (one where its first call
    took MEMORY_CALL_S or more), or [] where /proc cannot tell. Where glibc's heap still holds
    the previous call's freed memory, the same call reads differently from call to call in one
    process: SDPA's training step at L = 4096 read 33-67 MiB, efficient's 16-38 MiB."""
    calls = MEMORY_CALLS if first_s < MEMORY_CALL_S else 1
    return [peak for peak in (peak_memory(fn) for _ in range(calls)) if peak is not None]


def measure_side(case: Case, repeats: int, backward: bool, part: str = "time") -> dict:
    """Forward (no grad), then forward+backward: a warm-up call, then by ``part`` at least
    ``repeats`` timed calls (:func:`calls_for`) or the memory calls (:func:`peak_memories`).
    The two parts run in separate processes (:func:`run_child`): a memory call begins with
    malloc_trim(0), after which the heap is faulted in afresh, and the memory process's glibc
    setting (attnzoo.bench.measure.memory_env) slows large allocations (efficient's peer at
    4096: 12-14 ms a forward under it, 6 without)."""
    if part not in ("time", "memory"):
        raise ValueError(f"part must be 'time' or 'memory', not {part!r}")

    def measure(fn, first: float, key: str) -> dict:
        if part == "time":
            return timed_calls(fn, calls_for(first, repeats), key)
        return {f"{key}_peak_bytes": peak_memories(fn, first)}

    out: dict = {}
    with torch.no_grad():
        first = timings(case.fwd, 1)[0]
        out["fwd_first_s"] = first
        if first > CALL_LIMIT_S:
            return {**out, "status": f"first forward took {first:.0f} s"}
        out.update(measure(case.fwd, first, "fwd"))
    if not backward:
        return {**out, "status": "ok"}
    grad = torch.randn(case.fwd().shape, generator=torch.Generator().manual_seed(1))
    fwd_bwd = functools.partial(_step, case, grad)
    first = timings(fwd_bwd, 1)[0]
    out["fwdbwd_first_s"] = first
    if first > CALL_LIMIT_S:
        return {**out, "status": "ok", "bwd_status": f"first forward+backward took {first:.0f} s"}
    out.update(measure(fwd_bwd, first, "fwdbwd"))
    return {**out, "status": "ok", "bwd_status": "ok"}


def measure_paired(ours: Case, peer: Case, repeats: int, backward: bool) -> dict:
    """Both sides of a cell in one process, their calls alternating (ours, peer, peer, ours, ...),
    forward (no grad) then forward+backward, after a warm-up call of each: the ratio ours / peer
    of each adjacent two (``{key}_ratios``), at least ``repeats`` of them (:func:`calls_for`).
    For full attention, where both sides make the same call: this machine's speed differs from
    process to process by as much as the target (SDPA's training step at L = 4096 took
    806-816 ms in three processes and 767-797 in three others), and two alternating calls in
    one process differ by what the sides do differently (768.8 / 767.6, 796.3 / 797.7)."""
    def ratios(a, b) -> list[float]:
        n = calls_for(max(timings(a, 1)[0], timings(b, 1)[0]), repeats)
        found = []
        for i in range(n):
            if i % 2 == 0:
                t_a, t_b = timings(a, 1)[0], timings(b, 1)[0]
            else:
                t_b, t_a = timings(b, 1)[0], timings(a, 1)[0]
            found.append(t_a / t_b)
        return found

    with torch.no_grad():
        out = {"fwd_ratios": ratios(ours.fwd, peer.fwd)}
    if backward:
        grad = torch.randn(peer.fwd().shape, generator=torch.Generator().manual_seed(1))
        out["fwdbwd_ratios"] = ratios(*(functools.partial(_step, case, grad) for case in (ours, peer)))
    return {**out, "status": "ok"}


def _step(case: Case, grad: torch.Tensor) -> None:
    """One forward+backward of ``case`` from ``grad``, its leaves' gradients cleared first."""
    for t in case.leaves:
        t.grad = None
    case.fwd().backward(grad)


def child(pair: str, side: str, L: int, repeats: int, backward: bool, threads: int,
          part: str = "time") -> dict:
    torch.set_num_threads(threads)
    p = PAIRS[pair]
    try:
        if side == "paired":
            return measure_paired(ours_case(p, L), p.peer(L), repeats, backward)
        case = ours_case(p, L) if side == "ours" else p.peer(L)
        return measure_side(case, repeats, backward, part)
    except ImportError as err:
        return {"status": f"not installed: {err.name}"}
    except (MemoryError, RuntimeError) as err:
        if "alloc" in str(err).lower() or isinstance(err, MemoryError):
            return {"status": "out of memory (20 GiB address-space cap)"}
        raise


def _as_measured(pair: Pair, L: int) -> tuple[Callable, Callable]:
    peer = pair.peer(L)  # first: a peer not installed raises before ours is built
    return ours_case(pair, L).fwd, peer.fwd


def agreement(pair: Pair, L: int) -> dict:
    """How far our forward (times ``peer_factor``) is from the peer's on the same inputs at
    length L, for a pair whose peer computes the same function (``same_output``), made one
    by ``pair.align`` where the sides draw their own parameters: max |ours − peer| and
    max |peer|, or the status where the peer is not installed. In the calling process,
    outside any timing."""
    torch.manual_seed(0)
    try:
        ours_fwd, peer_fwd = (pair.align or _as_measured)(pair, L)
    except ImportError as err:
        return {"status": f"not installed: {err.name}"}
    with torch.no_grad():
        ours, theirs = ours_fwd() * pair.peer_factor, peer_fwd()
    if theirs.shape != ours.shape:  # fast-transformers' (B, L, H, D)
        theirs = theirs.transpose(1, 2)
    return {"status": "ok", "L": L, "max_abs_diff": (ours - theirs).abs().max().item(),
            "max_abs": theirs.abs().max().item()}


# ---------------------------------------------------------------------------- parent


def run_child(pair: str, side: str, L: int, args) -> dict:
    """One side of a cell for one round: a process for the memory calls (``memory_env``),
    then one for the timed calls with glibc's defaults; their results in one dict, whose
    ``child_s`` is the two processes' wall time together (:func:`cell_rounds`). Side "paired"
    (:func:`measure_paired`) is the timed process alone."""
    if side == "paired":
        return _child_process(pair, side, L, args, "time")
    memory = _child_process(pair, side, L, args, "memory")
    if memory["status"] != "ok":
        return memory
    timed = _child_process(pair, side, L, args, "time")
    if timed["status"] != "ok":
        return {**timed, "child_s": memory["child_s"] + timed["child_s"]}
    return {**timed, **{k: v for k, v in memory.items() if k.endswith("_peak_bytes")},
            "memory_child_s": memory["child_s"], "child_s": memory["child_s"] + timed["child_s"]}


def _child_process(pair: str, side: str, L: int, args, part: str) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", pair, side, str(L), "--part", part,
           "--repeats", str(args.repeats), "--threads", str(args.threads)]
    if args.no_backward:
        cmd.append("--no-backward")
    env = dict(memory_env() if part == "memory" else os.environ, OMP_NUM_THREADS=str(args.threads))
    load_before, started = os.getloadavg()[0], time.time()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.child_timeout)
    except subprocess.TimeoutExpired:
        return {"status": f"child exceeded {args.child_timeout:.0f} s", "child_s": args.child_timeout}
    child_s = time.time() - started
    for line in proc.stdout.splitlines()[::-1]:
        if line.startswith("RESULT:"):
            return {**json.loads(line[7:]), "load_before": load_before, "child_s": child_s}
    return {"status": f"child failed (exit {proc.returncode}): {proc.stderr.strip()[-400:]}",
            "child_s": child_s}


def cell_rounds(runs: dict[str, list[dict]], rounds: int, cheap_rounds: int) -> int:
    """Rounds for a cell, given its runs so far: ``rounds``, or ``cheap_rounds`` where every
    round of a side so far took under CHEAP_S (its ``child_s``: both processes, :func:`run_child`).
    This machine's speed differs from process to process (the same call runs at one of two
    speeds, for the whole process), so a median over two processes a side can land on either;
    where processes are cheap, more of them steady it."""
    done = [run for side in runs.values() for run in side]
    cheap = bool(done) and all(run.get("child_s", math.inf) < CHEAP_S for run in done)
    return max(rounds, cheap_rounds) if cheap else rounds


def job_rounds(job: tuple[str, int], runs: dict, rounds: int, cheap_rounds: int) -> int:
    """:func:`cell_rounds` of the cell ``job`` = (pair name, L)."""
    return cell_rounds(runs[job], rounds, cheap_rounds)


def merge_paired(runs: list[dict]) -> dict:
    """The paired side's cell (:func:`measure_paired`) from its rounds: the median ratio over
    every alternating two of every round, and how many."""
    ok = [r for r in runs if r.get("status") == "ok"]
    if not ok:
        return {"status": runs[0].get("status", "not run")}
    cell = {"status": "ok", "rounds": len(ok)}
    for key in ("fwd", "fwdbwd"):
        if ratios := [x for r in ok for x in r.get(f"{key}_ratios", [])]:
            cell[f"{key}_ratio"], cell[f"{key}_pairs"] = statistics.median(ratios), len(ratios)
    return cell


def merge(runs: list[dict]) -> dict:
    """One side's cell from its rounds: median over all timed calls, median over all memory calls.
    A call's peak memory also holds what glibc's heap failed to reuse: the same SDPA training step
    at L = 4096 read 29-60 MiB from call to call. The least over the calls was tried in a full
    run and did no better: the low readings are rare, and it read 43 MiB against 29 for the same
    call on both sides."""
    ok = [r for r in runs if r.get("status") == "ok"]
    if not ok:
        return {"status": runs[0].get("status", "not run")}
    cell = {"status": "ok", "rounds": len(ok)}
    for key in ("fwd", "fwdbwd"):
        times = [t for r in ok for t in r.get(f"{key}_s", [])]
        peaks = [p for r in ok for p in r.get(f"{key}_peak_bytes", [])]
        if times:
            cell[f"{key}_s"] = statistics.median(times)
            cell[f"{key}_samples"] = len(times)
        for extra in ("sys_s", "faults"):  # (runs from before recorded neither)
            if values := [x for r in ok for x in r.get(f"{key}_{extra}", [])]:
                cell[f"{key}_{extra}"] = statistics.median(values)
        if peaks:
            cell[f"{key}_mib"] = statistics.median(peaks) / 2**20
    bwd = [r.get("bwd_status") for r in ok if r.get("bwd_status") not in (None, "ok")]
    if bwd:
        cell["bwd_status"] = bwd[0]
    return cell


def machine(threads: int) -> dict:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "threads": threads, "torch": torch.__version__,
            "python": platform.python_version(),
            "matmul_gflops": matmul_rate(threads), "sdpa_gflops": sdpa_rate(threads)}


def matmul_rate(threads: int) -> float:
    """This machine's float32 matmul rate now, GFLOP/s (the report gives each floor at it too)."""
    return round(matmul_gflops(threads, n=2048, repeats=5), 1)


SDPA_RATE_L = 4096  # the length SDPA's rate is measured at (B, H, D as the pairs')


def sdpa_rate(threads: int) -> float:
    """SDPA's rate of useful attention work now, GFLOP/s: the FLOPs of its non-causal float32
    forward at L = SDPA_RATE_L (full attention's registry count, 4·B·H·L²·D, the one its floor
    takes) over the call's median time. Issue 8 sets the FLOP floors
    at it: "SDPA reaches about 110 GFLOP/s of useful attention work: the floor for every
    mechanism is its FLOP count over that rate" (:func:`floor_rate`)."""
    torch.set_num_threads(threads)
    q, k, v = (torch.randn(B, H, SDPA_RATE_L, D) for _ in range(3))
    call = functools.partial(torch.nn.functional.scaled_dot_product_attention, q, k, v)
    call()
    full = attnzoo.get("full")
    flops = full.flops(B, H, SDPA_RATE_L, SDPA_RATE_L, D, D, False, attnzoo.registry.make_options(full, {}))
    return round(flops / statistics.median(timings(call, 5)) / 1e9, 1)


RATES = {"matmul_gflops": matmul_rate, "sdpa_gflops": sdpa_rate}  # measured before and during a run


def remeasure_rate(doc: dict, threads: int) -> None:
    """Adds each rate (:data:`RATES`) measured now to the doc's and sets the rate the report uses to
    their median: one matmul rate measured before the run read 123.6, 177.2 and 133.1 GFLOP/s in
    three runs, which moved the floors, and with them the targets of the cells whose peer is near
    2× its floor."""
    m = doc["machine"]
    for key, measure in RATES.items():
        rates = m.setdefault(f"{key}_measured", [m[key]])
        rates.append(measure(threads))
        m[key] = round(statistics.median(rates), 1)


def floor_rate(doc: dict) -> tuple[float, str]:
    """(GFLOP/s, its name) that the FLOP floors are at: SDPA's rate of useful attention work, as
    the targets word it (:func:`sdpa_rate`), or, in runs from before it was measured, the matmul rate."""
    m = doc["machine"]
    if "sdpa_gflops" in m:
        return m["sdpa_gflops"], "SDPA's rate"
    return m["matmul_gflops"], "the matmul rate"


def main_parent(args) -> None:
    from rich.console import Console

    from attnzoo.progress import progress

    console = Console(stderr=True)
    names = args.only.split(",") if args.only else list(PAIRS)
    unknown = [n for n in names if n not in PAIRS]
    if unknown:
        sys.exit(f"unknown pair(s) {', '.join(unknown)}; known: {', '.join(PAIRS)}")
    for needed in ("full", "full_causal"):  # every ratio to SDPA needs SDPA of the same causality
        if needed not in names and any(PAIRS[n].causal == (needed == "full_causal") for n in names):
            names.insert(0, needed)
    doc = {"created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "command": "python benchmarks/peers.py " + " ".join(sys.argv[1:]),
           "machine": machine(args.threads), "lengths": args.lengths, "repeats": args.repeats,
           "timed_s": TIMED_S, "max_repeats": MAX_REPEATS,
           "rounds": args.rounds, "cheap_rounds": args.cheap_rounds, "cheap_s": CHEAP_S, "interleaved": True,
           "paired_full": True, "mmap_threshold": MMAP_THRESHOLD}
    doc["agreement"] = {n: agreement(PAIRS[n], min(args.lengths)) for n in names if PAIRS[n].same_output}
    jobs = [(n, L) for n in names for L in args.lengths]
    runs = {job: {s: [] for s in ["ours"] + (["peer"] if PAIRS[job[0]].peer else [])
                  + (["paired"] if PAIRS[job[0]].mechanism == "full" else [])} for job in jobs}
    out, started = Path(args.out), time.time()
    with progress(console) as bar:
        task = bar.add_task("pairs", total=len(jobs) * args.rounds)
        for r, due in rounds_due(jobs, runs, args.rounds, args.cheap_rounds):
            for i in due:
                (n, L), cell = jobs[i], runs[jobs[i]]
                sides = list(cell)
                for side in sides if (r + i) % 2 == 0 else sides[::-1]:  # by round and cell
                    bar.update(task, description=f"{n} L={L} {side} (round {r + 1})")
                    cell[side].append(run_child(n, side, L, args))
                due_in_all = sum(job_rounds(j, runs, args.rounds, args.cheap_rounds) for j in jobs)
                bar.update(task, advance=1, total=due_in_all)
            doc["rounds_done"] = r + 1  # each pass's report is written: a cut-off run keeps its passes
            remeasure_rate(doc, args.threads)
            write_report(doc, runs, out, started)
    del doc["rounds_done"]
    write_report(doc, runs, out, started)
    console.print(f"wrote {out} and {out.with_suffix('.json')} in {doc['wall_s']} s")


def rounds_due(jobs: list, runs: dict, rounds: int, cheap_rounds: int):
    """Yields ``(r, [indices of the jobs due round r])`` until none is: round r of every cell runs
    before round r + 1 of any, so a cell's processes spread over the whole run rather than the
    few minutes one cell takes, and the hour a cell happens to run in weighs less in its ratio.
    A cell's rounds are :func:`job_rounds` of its runs so far (the cheap rounds come last)."""
    r = 0
    while due := [i for i, job in enumerate(jobs) if r < job_rounds(job, runs, rounds, cheap_rounds)]:
        yield r, due
        r += 1


def write_report(doc: dict, runs: dict, out: Path, started: float) -> None:
    """docs/performance.md and .json from the runs so far."""
    doc["cells"] = {f"{n}/{L}": {s: (merge_paired if s == "paired" else merge)(side)
                                 for s, side in cell.items() if side}
                    for (n, L), cell in runs.items() if any(cell.values())}
    doc["wall_s"] = round(time.time() - started)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(doc, indent=1))
    out.write_text(report(doc))


# ---------------------------------------------------------------------------- report


def _milliseconds(seconds: float) -> str:
    return f"{seconds * 1e3:.0f}" if seconds >= 0.1 else f"{seconds * 1e3:.1f}"


def _ms(cell: dict, key: str) -> str:
    if key in cell:
        return _milliseconds(cell[key])
    return cell.get("bwd_status" if key.startswith("fwdbwd") else "status", "–")


def _short(fraction: float) -> str:
    """A shortfall as a percentage: a tenth of one below 1 % (a miss by 0.3 % is no 0 %)."""
    return f"{fraction:.0%}" if fraction >= 0.01 else f"{fraction:.1%}"


def _ratio(a: dict, b: dict, key: str, target: float | None = None) -> str:
    if key not in a or key not in b or not b[key]:
        return "–"
    return _marked(a[key] / b[key], target)


def _marked(r: float, target: float | None) -> str:
    return f"{r:.2f}" + ("" if target is None else " ✓" if r <= target else " ✗")


def _paired_ratio(cell: dict, key: str) -> float | None:
    """The median ratio of a cell's alternating calls in one process (:func:`measure_paired`) for
    a time ``key``; None where the cell was not so measured (runs from before never were)."""
    if not key.endswith("_s"):
        return None
    return cell.get("paired", {}).get(key.removesuffix("_s") + "_ratio")


def floor_s(pair: Pair, L: int, doc: dict) -> float | None:
    """The pair's FLOP floor in seconds at :func:`floor_rate`: the mechanism's FLOPs, plus for
    module pairs its projections' (:func:`projection_flops`)."""
    spec = attnzoo.get(pair.mechanism)
    if spec.flops is None:
        return None
    own = {f.name for f in dataclasses.fields(spec.options)}  # not the layer's (max_len, bias)
    options = {n: o for n, o in pair_options(pair, L).items() if n in own}
    flops = spec.flops(B, H, L, L, D, D, pair.causal, attnzoo.registry.make_options(spec, options))
    if pair.scope == "module":
        flops += projection_flops(pair, L)
    return flops / (floor_rate(doc)[0] * 1e9)


def projection_flops(pair: Pair, L: int) -> float:
    """The four d_model × d_model projections (q, k, v, out) of a module pair, each on L rows but
    linformer's k and v: E(X W_K) = (E X) W_K projects only its proj_len rows, the least work
    (the mechanism's FLOPs count E X), though the peer projects all L first."""
    kv_rows = min(pair.options["proj_len"], L) if pair.mechanism == "linformer" else L
    return 2.0 * B * D_MODEL * D_MODEL * (2 * L + 2 * kv_rows)


def sdpa_target(L: int) -> float | None:
    """Issue 8's target for a mechanism's forward over SDPA's of the same causality: faster at
    L = 4096, at most a fifth at 16384; none at other lengths."""
    return 1.0 if L == 4096 else 0.2 if L == 16384 else None


def peer_target(name: str, peer: dict, L: int, doc: dict, key: str) -> float:
    """Issue 8's target for ours / peer in ``key`` (:data:`MEASURES`) of pair ``name`` at L: 0.5;
    for a time, 1.0 where the peer's own is already within 2× of its FLOP floor (the forward's,
    or a training step's, :data:`STEP_WORK` × it: halving it would beat the floor); memory has
    no floor. 1.05 for full attention, which is SDPA with nothing of ours around it."""
    if PAIRS[name].mechanism == "full":
        return 1.05
    over = _over_floor(doc, name, L, key, peer[key]) if key.endswith("_s") and peer.get(key) else None
    return 1.0 if over is not None and over <= 2 else 0.5



def _more_calls(doc: dict) -> str:
    """The report's note on repeated fast calls (runs from before it had none)."""
    if "timed_s" not in doc:
        return ""
    return (f" (calls under {doc['timed_s'] / doc['repeats']:.2g} s are repeated, up to {doc['max_repeats']} "
            f"times, to fill about {doc['timed_s']:g} s)")


def _memory_calls(doc: dict) -> str:
    """Where the report's memory calls ran (runs from before ran them in the timed process)."""
    return "" if doc.get("mmap_threshold") else ", the memory calls and one more untimed call"


def _memory_process(doc: dict) -> str:
    """The report's note on the memory processes' glibc setting (runs from before had none)."""
    if not (threshold := doc.get("mmap_threshold")):
        return ""
    return (f", read in a process of its own started with MALLOC_MMAP_THRESHOLD_={threshold}: glibc "
            f"maps every block of {threshold // 1024} KiB or more for its life, so the reading is the "
            "call's peak of live memory, not what the heap failed to reuse")


def _more_rounds(doc: dict) -> str:
    """The report's note on the extra rounds of cheap cells (runs from before had none)."""
    if doc.get("cheap_rounds", 0) <= doc["rounds"]:
        return ""
    same_call = " and for full attention against SDPA, the same call" if doc.get("same_call_rounds") else ""
    cheap = f"every round of a side took under {doc['cheap_s']:g} s"
    return (f" ({doc['cheap_rounds']} where {cheap}{same_call}: the speed of this machine differs from "
            "process to process)")


def _paired_note(doc: dict) -> str:
    """The report's note on full attention's paired time ratios (runs from before had none)."""
    if not doc.get("paired_full"):
        return ""
    return (" Full attention's time ratios (‡) are not of those medians: both sides make the same "
            "SDPA call, and a ratio of processes measures this machine's spread from process to "
            "process, as wide as the target (5%); each of its rounds adds a process where the two "
            "sides' calls alternate (ours, SDPA, SDPA, ours, ...), and the ratio is the median over "
            "every two adjacent calls of every round.")


def _interleaved(doc: dict) -> str:
    """The report's note on the order of rounds (runs from before it ran each cell's rounds together)."""
    return ", interleaved (round r of every cell before round r + 1 of any)" if doc.get("interleaved") else ""


def _rates(m: dict, key: str = "matmul_gflops") -> str:
    """The report's note on a rate's measurements (:data:`RATES`; runs from before measured the
    matmul rate once)."""
    rates = m.get(f"{key}_measured", [])
    if len(rates) < 2:
        return ""
    return (f" (the median of {len(rates)} measurements, one before the run and one after each pass "
            f"over the cells: {min(rates)}–{max(rates)})")


def _sdpa_rate(m: dict) -> str:
    """The report's note on SDPA's rate, where the run measured it (:func:`sdpa_rate`)."""
    if "sdpa_gflops" not in m:
        return ""
    return (f"; SDPA's rate of useful attention work {m['sdpa_gflops']} GFLOP/s{_rates(m, 'sdpa_gflops')}: "
            f"4·B·H·L²·D FLOPs of its forward at L = {SDPA_RATE_L}, B = {B}, H = {H}, D = {D}, over its time")


def _kernel_time(cells: dict) -> str:
    """The report's line on kernel time: for each side, the median over the cells at L >= 4096 of
    the kernel CPU time a call spent, as a share of its wall time (runs from before have none)."""
    shares: dict[str, list[float]] = {"ours": [], "peer": []}
    for name, c in cells.items():
        if int(name.rsplit("/", 1)[1]) < 4096:
            continue
        for side, cell in c.items():
            if side in shares:  # (not the paired process: it keeps ratios only)
                shares[side] += [cell[f"{k}_sys_s"] / cell[f"{k}_s"] for k in ("fwd", "fwdbwd")
                                 if f"{k}_sys_s" in cell]
    if not shares["ours"]:
        return ""
    said = [f"{statistics.median(v):.0%} for {'ours' if s == 'ours' else 'the peers'}"
            for s, v in shares.items() if v]
    return (" Kernel time (page faults, thread wake-ups) inside the timed calls, as a share of their "
            f"wall time, median over the cells at L ≥ 4096: {' and '.join(said)} (per cell: `fwd_sys_s`, "
            "`fwd_faults` and the same for fwdbwd in docs/performance.json).")


def _partial(doc: dict) -> list[str]:
    """A warning line for a report written while the run goes on (or after it was cut off)."""
    if "rounds_done" not in doc:
        return []
    return [f"**Partial: written after pass {doc['rounds_done']} over the cells; the run had not finished.**",
            ""]


def _agreement(doc: dict, name: str) -> str:
    """The configuration's note of how far the outputs are apart (:func:`agreement`), if checked."""
    a = doc.get("agreement", {}).get(name)
    if not a or a["status"] != "ok":
        return ""
    same = a["max_abs_diff"] <= AGREE_RTOL * a["max_abs"]
    return (f"; {'the same outputs' if same else '**✗ the outputs differ**'}, checked at L = {a['L']}: "
            f"max |ours − peer| = {a['max_abs_diff']:.1e} (max |peer| = {a['max_abs']:.2g})")


MEASURES = {"fwd_s": "forward time", "fwdbwd_s": "training-step time", "fwd_mib": "forward memory",
            "fwdbwd_mib": "training-step memory"}  # what a pair's report row compares, in its order
STEP_WORK = 3.0  # a training step's least work over its forward's: each product's backward is two
NYSTROM_WORK = (  # {what}: a forward or a training step, with its own counts of products
    "nearly all of this {what} is work both sides do, near the machine's matmul rate: the layer's "
    "four projections ({gemms} GEMMs of (L × 512) by (512 × 512); ours by oneDNN's AVX-512 inner "
    "product where MKL's is slower, attnzoo.backends.cpu.projections), the pseudo-inverse's six "
    "iterations ({products} products of (256 × 256) matrices a head) and the two landmark kernels "
    "(the landmarks' queries over the keys and the queries over the landmarks, both in C near "
    "the FMA units' peak), about a third each. Ours carries P = AZ from step to step for the last "
    "two steps only (attnzoo.mechanisms.nystrom.pinv_times; ~1.3× the float32 error of the "
    "iteration); through all six steps, or through the spectrum of AAᵀ by eigh, float32 lost "
    "30–80× its accuracy, and in float64 eigh cost what it saved.")
BOTH_SDPA = ("both sides make the same call, torch's scaled_dot_product_attention on the same tensors "
             "(attnzoo.attention passes them to it, nothing of ours around it)")  # full attention
SAME_CALL = (  # each side in processes of its own (runs from before)
    f"{BOTH_SDPA}: the ratio measures only how this machine's speed differs from process to process, "
    "for a whole process (see the header), over 3 processes a side at ~1–4 min each.")
PAIRED = "SDPA, the calls alternating in one process"  # (measure_paired)
PAIRED_WHY = (f"{BOTH_SDPA}; with their calls alternating in one process, the ratio is what the "
              "machine did differently from one call to the next.")
MISS_REASONS = {  # (pair, measure): why it misses, for the report's summary, where it does
    ("full", "fwd_s"): SAME_CALL,
    ("full", "fwdbwd_s"): SAME_CALL,
    ("nystrom", "fwdbwd_s"): NYSTROM_WORK.format(what="step", gemms=12,
                                                 products="exact backpropagation: ~57"),
    ("nystrom", "fwd_s"): NYSTROM_WORK.format(what="forward", gemms=4, products="~19"),
    ("linformer", "fwdbwd_s"): (
        "the step is products on both sides: the layer's q and output projections and E X and F X "
        "(the sequence brought to 256 rows before W_K and W_V: the least work) at the machine's "
        "matmul rate (ours by oneDNN's AVX-512 inner product where MKL's is slower), and "
        "the scores and values of 256 keys a query (ours in C at the FMA units' peak). Ours runs "
        "within ~1.1× of its floor at the matmul rate; a peer's step within ~2.2× of that floor "
        "cannot be halved short of ~1.1×, beyond what SDPA's own step reaches."),
    ("efficient", "fwd_s"): (
        "ours is two (L × 64) by (64 × 64) products a head and the exponentials of q and k, in C "
        "(native/kernels.c); the peer's are torch's softmax and BLAS. Timed alone on the AMD EPYC "
        "(L = 4096, 2 threads, the kernels called from C), our forward takes ~3.3 ms, its two "
        "products ~2.3 ms of it at the FMA units' peak (117 GFLOP/s a core, one 16-lane multiply-add "
        "a cycle), the exponentials and the rows' maxima and sums the rest."),
    ("efficient", "fwdbwd_s"): (
        "the step is six such products a head (two forward; dP = g Gᵀ, dG = Pᵀ g, dE = V dSᵀ and "
        "dV = E dS backward) and the exponentials twice (the backward recomputes them from the "
        "forward's row shifts and column maxima: nothing of (L, D) is kept), all in C. Timed alone on "
        "the AMD EPYC (L = 4096, 2 threads), the forward takes ~3.3 ms and the backward ~6.3 ms, "
        "~4.6 of it its four products at the FMA units' peak."),
}


def _sdpa_pairs() -> list[tuple[str, Pair]]:
    """The pairs compared with SDPA too: the core ones but full (module pairs have _core rows)."""
    return [(n, p) for n, p in PAIRS.items() if p.mechanism != "full" and p.scope == "core"]


def _sdpa_of(pair: Pair) -> str:
    """The full-attention pair of ``pair``'s causality: SDPA's, which the targets compare with."""
    return "full_causal" if pair.causal else "full"


def _against_sdpa(cells: dict, name: str, pair: Pair, L: int) -> tuple[dict, dict] | None:
    """Our side of a core pair at L and SDPA's of the same causality (the full pair's peer, else
    its ours: the same call); None where either was not measured."""
    c, ref = cells.get(f"{name}/{L}"), cells.get(f"{_sdpa_of(pair)}/{L}")
    return (c["ours"], ref.get("peer", ref["ours"])) if c and ref else None


def marks(doc: dict) -> list[tuple[str, int, str, str, float, float, float]]:
    """Every ratio the report marks ✓ or ✗, as (pair, L, measure, against, ours, theirs, target):
    each pair against its peer at L >= 4096 (:data:`MEASURES`, :func:`peer_target`), and the
    core mechanisms' forwards against SDPA (:func:`sdpa_target`)."""
    cells, found = doc["cells"], []
    for name in PAIRS:
        for L in doc["lengths"]:
            c = cells.get(f"{name}/{L}")
            if L >= 4096 and c and "peer" in c:
                for key in MEASURES:
                    target = peer_target(name, c["peer"], L, doc, key)
                    if (paired := _paired_ratio(c, key)) is not None:
                        found.append((name, L, key, PAIRED, paired, 1.0, target))
                    elif key in c["ours"] and c["peer"].get(key):
                        found.append((name, L, key, "the peer", c["ours"][key], c["peer"][key], target))
    for name, pair in _sdpa_pairs():
        for L in doc["lengths"]:
            sides, target = _against_sdpa(cells, name, pair, L), sdpa_target(L)
            if sides and target and "fwd_s" in sides[0] and sides[1].get("fwd_s"):
                found.append((name, L, "fwd_s", "SDPA", sides[0]["fwd_s"], sides[1]["fwd_s"], target))
    return found


def _over_floor(doc: dict, name: str, L: int, key: str, seconds: float) -> float | None:
    """``seconds`` over the FLOP floor of pair ``name``'s forward (``fwd_s``) or training step
    (``fwdbwd_s``: :data:`STEP_WORK` × the forward's) at L; None where the mechanism has no FLOPs."""
    floor = floor_s(PAIRS[name], L, doc)
    return None if floor is None else seconds / (floor * (STEP_WORK if key == "fwdbwd_s" else 1.0))


def _floor_clause(doc: dict, name: str, L: int, key: str, goal_s: float) -> str:
    """For a time missed: what meeting it asks, as a multiple of the FLOP floor, beside what SDPA's
    own call of the same causality and L took over its floor in the same run."""
    need = _over_floor(doc, name, L, key, goal_s)
    sides = _against_sdpa(doc["cells"], name, PAIRS[name], L)
    if need is None or not sides or not sides[1].get(key):
        return ""
    sdpa = _over_floor(doc, _sdpa_of(PAIRS[name]), L, key, sides[1][key])
    return (f" That is {need:.2f}× its FLOP floor (the forward's{' × 3' if key == 'fwdbwd_s' else ''}), "
            f"where SDPA's own took {sdpa:.2f}× its floor in this run.")


def _summary(doc: dict) -> list[str]:
    """The report's count of the marks met, and each miss with what meeting it would take."""
    found = marks(doc)
    missed = [m for m in found if m[4] / m[5] > m[6]]
    lines = ["## Summary", "", f"{len(found) - len(missed)} of {len(found)} marked ratios meet their "
             f"target{':' if missed else '.'}", ""]
    for name, L, key, against, ours, theirs, target in missed:
        if against == PAIRED:
            lines.append(f"- ✗ `{name}` at L = {L}, {MEASURES[key]} against {against}: {ours:.3f}, "
                         f"target ≤ {target:g}.")
            lines.append(f"  Why: {PAIRED_WHY}")
            continue
        time_ = key.endswith("_s")
        unit = (lambda x: f"{_milliseconds(x)} ms") if time_ else (lambda x: f"{x:.0f} MiB")
        lines.append(f"- ✗ `{name}` at L = {L}, {MEASURES[key]} against {against}: {unit(ours)} / "
                     f"{unit(theirs)} = {ours / theirs:.2f}, target ≤ {target:g}: met at "
                     f"{unit(target * theirs)} or less, {_short(1 - target * theirs / ours)} below ours."
                     + (_floor_clause(doc, name, L, key, target * theirs) if time_ else ""))
        if (name, key) in MISS_REASONS:
            lines.append(f"  Why: {MISS_REASONS[name, key]}")
    return lines + ([""] if missed else []) + _other_reading(doc, found)


FLOOR_WORDS = ("This machine's float32 matmul runs at about 135 GFLOP/s, and SDPA reaches about 110 "
               "GFLOP/s of useful attention work: the floor for every mechanism is its FLOP count over "
               "that rate.")  # the targets' definition of the floor


def _other_reading(doc: dict, found: list) -> list[str]:
    """The report's account of the floor's rate: the targets' words, SDPA's rate and the matmul
    rate of this run, and each mark whose target the matmul rate would make another (runs
    before 2026-11-28 read "that rate" as the matmul rate). Nothing for runs without SDPA's rate."""
    m = doc["machine"]
    if "sdpa_gflops" not in m:
        return []
    at_matmul = {**doc, "machine": {k: v for k, v in m.items() if not k.startswith("sdpa_gflops")}}
    lines = ["### The floor's rate", "",
             f"Issue 8: \"{FLOOR_WORDS}\" The floors here are at SDPA's rate measured in this run, "
             f"{m['sdpa_gflops']} GFLOP/s; the matmul rate, {m['matmul_gflops']} GFLOP/s, would make every "
             f"floor {m['sdpa_gflops'] / m['matmul_gflops']:.2f}× as long."]
    there = marks(at_matmul)
    changed = [(a, b) for a, b in zip(found, there, strict=True) if a[6] != b[6]]
    if not changed:
        lines[-1] += " No mark's target would change."
        return lines + [""]
    missed = sum(b[4] / b[5] > b[6] for b in there)
    lines[-1] += (f" These marks' targets would change, and {len(found) - missed} of {len(found)} would "
                  "meet theirs:")
    lines.append("")
    for (name, L, key, _, ours, theirs, here), (*_, target) in changed:
        over = [_over_floor(d, name, L, key, theirs) for d in (doc, at_matmul)]
        lines.append(f"- `{name}` at L = {L}, {MEASURES[key]}: {ours / theirs:.3f}; target {here:g} here "
                     f"(the peer {over[0]:.2f}× its floor), {target:g} at the matmul rate ({over[1]:.2f}×): "
                     f"{_met(ours / theirs, here)} here, {_met(ours / theirs, target)} there")
    return lines + [""]


def _met(ratio: float, target: float) -> str:
    return "met" if ratio <= target else "missed"


def report(doc: dict) -> str:
    m, cells = doc["machine"], doc["cells"]
    lengths = doc["lengths"]
    lines = [
        "# attnzoo beside the public implementations",
        "",
        f"Command: `{doc['command']}` ({doc['wall_s']} s). Date {doc['created']}.",
        "",
        *_partial(doc),
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['threads']} threads, torch {m['torch']}, "
        f"Python {m['python']}; float32 matmul {m['matmul_gflops']} GFLOP/s{_rates(m)}{_sdpa_rate(m)}."
        f"{_kernel_time(cells)}",
        "",
        f"Shape: B={B}, H={H}, D={D}, float32; module pairs on x (B, L, {D_MODEL}). Each side runs in "
        f"fresh processes, the side that goes first alternating from cell to cell, {doc['rounds']} round(s)"
        f"{_more_rounds(doc)}{_interleaved(doc)} of {doc['repeats']} timed calls after a warm-up"
        f"{_memory_calls(doc)}{_more_calls(doc)}; times are "
        f"medians of all timed calls, memory is the peak extra resident memory of a call (median over "
        f"{MEMORY_CALLS} calls a process where a call takes under {MEMORY_CALL_S:g} s, else one, and over "
        f"rounds){_memory_process(doc)}. Ratios are "
        "ours / peer: below 1 we are faster or leaner. Targets: ≤ 0.5 at L = 4096 and 16384 "
        "(in time, ≤ 1.0 where the peer's own is within 2× of the FLOP floor: the forward's, or a training "
        f"step's, {STEP_WORK:g}× it, at {floor_rate(doc)[1]}); ✓ meets it, ✗ misses it.{_paired_note(doc)}",
        "",
        *_summary(doc),
        "## Ours against the peer",
        "",
        "| pair | peer | L | fwd ms ours / peer | ratio | fwd+bwd ms ours / peer | ratio "
        "| fwd MiB ours / peer | ratio | fwd+bwd MiB ours / peer | ratio |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, pair in PAIRS.items():
        for L in lengths:
            c = cells.get(f"{name}/{L}")
            if not c or "peer" not in c:
                continue
            o, p = c["ours"], c["peer"]
            row = [name, pair.peer_label, str(L)]
            for key in MEASURES:
                fmt = _ms if key.endswith("_s") else (lambda c, k: f"{c[k]:.0f}" if k in c else "–")
                target = peer_target(name, p, L, doc, key) if L >= 4096 else None
                paired = _paired_ratio(c, key)
                row += [f"{fmt(o, key)} / {fmt(p, key)}",
                        _ratio(o, p, key, target) if paired is None else _marked(paired, target) + " ‡"]
            lines.append("| " + " | ".join(row) + " |")
    lines += ["", "Configurations:", ""]
    lines += [f"- `{n}` ({p.scope}): {p.config}{_agreement(doc, n)}" for n, p in PAIRS.items()
              if p.peer and p.config]
    lines += _floor_table(doc, [L for L in lengths if L >= 4096])
    lines += [
        "",
        "## Ours against SDPA full attention of the same causality",
        "",
        "Target: faster than SDPA at L = 4096 (ratio < 1) and ≤ 0.2 of it at L = 16384, forward.",
        "",
        "| mechanism | causal | " + " | ".join(f"L={L} ms | / SDPA" for L in lengths) + " |",
        "|---|---|" + "---|---|" * len(lengths),
    ]
    for name, pair in _sdpa_pairs():
        row = [name, "yes" if pair.causal else "no"]
        present = False
        for L in lengths:
            if not (sides := _against_sdpa(cells, name, pair, L)):
                row += ["–", "–"]
                continue
            present = True
            row += [_ms(sides[0], "fwd_s"), _ratio(*sides, "fwd_s", sdpa_target(L))]
        if present:
            lines.append("| " + " | ".join(row) + " |")
    lines += ["", "## Causal linear attention against its FLOP floor", "",
              "Floor: the algorithm's least work, 4·B·H·L·D·(Dv + 1) FLOPs (each key's φ(k)[v, 1]ᵀ into the "
              f"state, each query's φ(q) against it), at {floor_rate(doc)[1]}, as every floor here. "
              "Target ≤ 3× at L = 16384.", ""]
    for L in lengths:
        c = cells.get(f"linear_causal/{L}")
        if c and "fwd_s" in c["ours"]:
            floor = 4.0 * B * H * L * D * (D + 1) / (floor_rate(doc)[0] * 1e9)
            lines.append(f"- L={L}: {c['ours']['fwd_s'] * 1e3:.1f} ms forward, floor {floor * 1e3:.1f} ms: "
                         f"{c['ours']['fwd_s'] / floor:.1f}× the floor")
    return "\n".join(lines) + "\n"


def _floor_table(doc: dict, lengths: list[int]) -> list[str]:
    """The report's table of each pair's times over their FLOP floors (:func:`_over_floor`), both
    sides, forward and training step, with the time target the peer's sets (:func:`peer_target`)."""
    rows = []
    for name, pair in PAIRS.items():
        for L in lengths:
            c = doc["cells"].get(f"{name}/{L}", {})
            floor = floor_s(pair, L, doc)
            if not floor or "ours" not in c or "peer" not in c:
                continue
            row = [name, str(L), f"{floor * 1e3:.1f}"]
            for key in ("fwd_s", "fwdbwd_s"):
                if key not in c["ours"] or not c["peer"].get(key):
                    row += ["–"] * 3
                    continue
                row += [f"{_over_floor(doc, name, L, key, c[side][key]):.2f}" for side in ("ours", "peer")]
                row.append(f"{peer_target(name, c['peer'], L, doc, key):g}")
            rows.append("| " + " | ".join(row) + " |")
    if not rows:
        return []
    return ["", "## Time over the FLOP floor", "",
            "Floor: the mechanism's least work (its registry entry's FLOPs with the pair's options, plus "
            f"a module pair's projections) at {floor_rate(doc)[1]} ({floor_rate(doc)[0]} GFLOP/s), and a "
            "training step's "
            f"{STEP_WORK:g}× the forward's; softmax's exponentials and the other elementwise passes are "
            "not counted. The ratio target above is 1.0 where the peer's time is within 2× of its floor, "
            "else 0.5 (1.05 for full attention, SDPA on both sides)." + (
                " At SDPA's rate a floor is the time of the work at SDPA's efficiency, not a bound: work of "
                "large products runs under it." if "sdpa_gflops" in doc["machine"] else ""), "",
            "| pair | L | forward floor ms | fwd: ours × floor | peer × floor | target "
            "| training step: ours × floor | peer × floor | target |",
            "|---|---|---|---|---|---|---|---|---|", *rows]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default=[1024, 4096, 16384])
    ap.add_argument("--only", default="", help="comma-separated pair names (see --list)")
    ap.add_argument("--rounds", type=int, default=1, help="(ours, peer) alternations per length")
    ap.add_argument("--cheap-rounds", type=int, default=0,
                    help=f"rounds for a cell whose rounds each took under {CHEAP_S:.0f} s a side, "
                    "and for full attention's")
    ap.add_argument("--repeats", type=int, default=3, help="timed calls per side per round")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-backward", action="store_true")
    ap.add_argument("--child-timeout", type=float, default=1200.0)
    ap.add_argument("--out", default=str(ROOT / "docs" / "performance.md"))
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--render", action="store_true",
                    help="rewrite --out from the JSON beside it (that run, this code); run nothing")
    ap.add_argument("--child", nargs=3, metavar=("PAIR", "SIDE", "L"))
    ap.add_argument("--part", choices=("time", "memory"), default="time",
                    help="with --child: the timed calls, or the memory calls (needs memory_env)")
    args = ap.parse_args(argv)
    if args.list:
        for n, p in PAIRS.items():
            label = p.peer_label or '(SDPA only)'
            print(f"{n:20s} {'causal' if p.causal else '      '} {p.scope:6s} {label}")
    elif args.render:
        out = Path(args.out)
        out.write_text(report(json.loads(out.with_suffix(".json").read_text())))
    elif args.child:
        cap = 20 * 2**30  # an allocation past it fails as an exception, not the kernel's OOM killer
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
        if args.part == "memory":
            require_memory_env()
        pair, side, L = args.child
        result = child(pair, side, int(L), args.repeats, not args.no_backward, args.threads, args.part)
        print("RESULT:" + json.dumps(result), flush=True)
    else:
        main_parent(args)


if __name__ == "__main__":
    main()

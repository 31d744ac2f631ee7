"""Nyströmformer (Xiong et al., AAAI 2021): softmax attention through landmark queries and keys."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnzoo.mechanisms._few import attend_few_keys, attend_few_queries
from attnzoo.mechanisms._softmax import softmax_scale, wide
from attnzoo.mechanisms.full import masked_softmax, softmax_reference
from attnzoo.ops import operation
from attnzoo.registry import Capabilities, Mechanism, register


@dataclass(frozen=True)
class NystromOptions:
    num_landmarks: int = 64  # m: segment means of Q and K
    pinv_iterations: int = 6  # iterations of the Moore-Penrose pseudo-inverse (the paper's 6)

    def __post_init__(self):
        if self.num_landmarks < 1 or self.pinv_iterations < 1:
            raise ValueError("nystrom: need num_landmarks >= 1 and pinv_iterations >= 1")


@operation("segment_means")
def segment_means(x: torch.Tensor, m: int, key_mask: torch.Tensor | None = None) -> torch.Tensor:
    """(B, H, L, D) -> (B, H, m', D), m' = min(m, L): the means of m' contiguous segments of
    near-equal length (row i of L in segment i·m'//L: lengths differ by at most one when m'
    does not divide L). With a key_mask (B, L), the segments are over each batch entry's real
    rows alone, as if the others were not there: the r-th of its n real rows is in segment
    r·c//n, c = min(m', n); segments c..m'−1 are empty and give 0."""
    B, H, L, D = x.shape
    m = min(m, L)
    if key_mask is None:
        if L % m == 0:  # equal segments: a view
            return x.unflatten(2, (m, L // m)).mean(3)
        segment = torch.arange(L, device=x.device) * m // L  # segment of each position, 0..m-1
        counts = torch.bincount(segment, minlength=m).to(x.dtype)[:, None]  # (m, 1)
        return x.new_zeros(B, H, m, D).index_add_(2, segment, x) / counts
    n = key_mask.sum(-1, keepdim=True)  # (B, 1): real rows
    rank = key_mask.cumsum(-1) - 1  # (B, L): each real row's place among them
    segment = torch.where(key_mask, rank * n.clamp(max=m) // n.clamp(min=1), m)  # (B, L); m: dropped
    counts = key_mask.new_zeros(B, m + 1, dtype=x.dtype).scatter_add_(1, segment, key_mask.to(x.dtype))
    index = segment[:, None, :, None].expand(B, H, L, D)
    sums = x.new_zeros(B, H, m + 1, D).scatter_add(2, index, x)  # (B, H, m + 1, D)
    return sums[:, :, :m] / counts[:, None, :m, None].clamp(min=1)


def iterative_pinv(a: torch.Tensor, iterations: int) -> torch.Tensor:
    """Moore-Penrose pseudo-inverse of a (..., m, m) by the paper's iteration:
    Z ← ¼ Z (13I − AZ (15I − AZ (7I − AZ))), Z₀ = Aᵀ / (‖A‖₁ ‖A‖_∞).

    Departure: the norms are per matrix; the official code takes one maximum over
    the whole batch, which lets one sequence change another's result.

    Each step is four matmuls and one elementwise pass: with P = AZ, the factor ¼ moved
    onto the first bracket, ¼(7I − P), and the signs carried so that every other
    bracket is a product plus a constant on its diagonal.
    """
    abs_a = a.abs()
    norm = abs_a.sum(-1).amax(-1) * abs_a.sum(-2).amax(-1)  # (...,)
    norm = torch.where(norm > 0, norm, torch.ones_like(norm))  # (A = 0, no landmark key: Z = 0)
    z = a.transpose(-1, -2) / norm[..., None, None]  # (..., m, m)
    for _ in range(iterations):
        z = z @ _pinv_step(a @ z)
    return z


def pinv_times(a: torch.Tensor, b: torch.Tensor, iterations: int) -> torch.Tensor:
    """``iterative_pinv(a, iterations) @ b`` for a (..., m, m), b (..., m, n), n < m: the last
    two steps' brackets applied to b instead of formed. A step's bracket is a polynomial g of
    its P = AZ; these commute, and the last step's P is the one before's, P' g(P'). So
    Z_n b = Z_{n-2} g(P') g(P) b, where g(P) b = ¼(13b − P(15b − P(7b − Pb))) takes three
    (m × n) products and P = ¼(Q(7P' − Q − 15I) + 13P'), Q = P'², two (m × m) ones: three
    (m × m) products for the two steps, where forming their Z takes eight. The same iteration,
    grouped differently; not further back: each step's Z, multiplied by A afresh, corrects
    its own rounding, and a product of brackets does not (grouping all six steps so loses
    much of the float32 accuracy of the iteration; the last two keep nearly all of it)."""
    tail = _tail(iterations)
    z = iterative_pinv(a, iterations - tail)
    p = a @ z  # (..., m, m): P of the first of them
    if tail == 2:
        b = _bracket_times(_next_p(p), b)  # (..., m, n): the last step's (the brackets commute)
    return z @ _bracket_times(p, b)


def _tail(iterations: int) -> int:
    """How many of the last steps :func:`pinv_times` applies to b: two, or the one there is."""
    return min(2, iterations)


def _next_p(p):
    """The next step's P from this one's: P g(P) = ¼(Q(7P − Q − 15I) + 13P), Q = P²."""
    q = p @ p
    x = _add_eye(7.0 * p - q, -15.0)  # 7P − Q − 15I
    return (q @ x).add_(p, alpha=13.0).mul_(0.25)


def _bracket_times(p, b):
    """¼(13I − P(15I − P(7I − P))) b, the bracket of the step from P = AZ applied to b."""
    x = 7.0 * b - p @ b  # (7I − P) b
    x = 15.0 * b - p @ x  # (15I − P(7I − P)) b
    return (13.0 * b - p @ x).mul_(0.25)


def _pinv_step(p):
    """The bracket of one step from P = AZ: ¼(13I − P(15I − P(7I − P)))."""
    x = _add_eye(p * -0.25, 7 / 4)  # ¼(7I − P)
    x = _add_eye(p @ x, -15 / 4)  # −¼(15I − P(7I − P))
    return _add_eye(p @ x, 13 / 4)  # ¼(13I − P(15I − P(7I − P)))


def _add_eye(t: torch.Tensor, c: float) -> torch.Tensor:
    """t + c·I on its last two dims, in place (t is fresh)."""
    t.diagonal(dim1=-2, dim2=-1).add_(c)
    return t


def nystrom_attention(q, k, v, opts=NystromOptions(), *, causal=False, key_mask=None, scale=None,
                      generator=None):
    """softmax(Q K̃ᵀ) pinv(softmax(Q̃ K̃ᵀ)) softmax(Q̃ Kᵀ) V, Q̃ and K̃ the landmarks: the means of
    m' = min(m, Lq) contiguous segments of Q and of K (:func:`segment_means`); m >= Lk: softmax
    attention itself, softmax(Q Kᵀ) V (as the official code).

    Shapes: q (B, H, Lq, D), k (B, H, Lk, D), v (B, H, Lk, Dv) -> (B, H, Lq, Dv).
    Cost O(L·m·D + m³) time, O(L·m) memory at most: the two outer kernels are attention of the
    m landmark queries over the keys and of the queries over the m landmark keys, applied to
    the values without forming them (:func:`~attnzoo.mechanisms._few.attend_few_queries`,
    :func:`~attnzoo.mechanisms._few.attend_few_keys`); never an L×L matrix. The pseudo-inverse
    (:func:`pinv_times`) runs in float32 for float16 and bfloat16 inputs: in their precision its
    six steps lose too much accuracy.

    Padded keys take no part: each batch entry's result is that of its n real keys alone (with
    the same queries). K̃ is the means of min(m', n) segments of the real keys, so that no
    segment is padding only, and a landmark slot left empty (n < m') is a zero column of
    softmax(Q̃ K̃ᵀ), left out of softmax(Q K̃ᵀ); n <= m: softmax attention over the real keys.
    Departure: the official code averages segments of the padded length, padding as zeros. The
    key_mask masks keys only: every query is in Q̃. Non-causal. Xiong et al., AAAI 2021.
    """
    s = softmax_scale(q, scale)
    Lq, Lk, m = q.shape[2], k.shape[2], opts.num_landmarks
    if m >= Lk:  # exact: Lk <= m keys, the size of a landmark kernel
        if key_mask is None:
            return attend_few_keys(q, k, v, s)
        return attend_few_queries(q, k, v, key_mask[:, None, None, :], s)  # (a row with no key: 0)
    m = min(m, Lq)  # m' landmarks (< Lk)
    q_l, k_l = segment_means(q, m), segment_means(k, m, key_mask)  # (B, H, m', D)
    if key_mask is None:
        return attend_few_keys(q, k_l, _middle(q_l, k_l, k, v, None, None, s, opts), s)
    n = key_mask.sum(-1)  # (B,): real keys
    landmark = torch.arange(m, device=n.device) < n[:, None]  # (B, m'): slot holds a landmark key
    middle = _middle(q_l, k_l, k, v, key_mask, landmark, s, opts)  # (B, H, m', Dv)
    exact = n <= opts.num_landmarks  # (B,): n <= m: exact softmax over the real keys
    few_queries = Lq < opts.num_landmarks  # then some exact entries may hold more than m' real keys
    if not few_queries:  # m' = m >= n: the landmark keys of an exact entry are its real keys
        middle = torch.where(exact[:, None, None, None], segment_means(v, m, key_mask).to(middle.dtype),
                             middle)  # their values: kernel_1 alone is the softmax
    if bool(landmark.all()):
        out = attend_few_keys(q, k_l, middle, s)
    else:  # (some entry has fewer real keys than slots: only its landmarks take part)
        out = attend_few_queries(q, k_l, middle, landmark[:, None, None, :], s)
    if few_queries and bool(exact.any()):  # Lq < m: (Lq, Lk) is no larger than kernel_3
        dense = attend_few_queries(q, k, v, key_mask[:, None, None, :], s)
        out = torch.where(exact[:, None, None, None], dense, out)
    return out  # (an entry with no real key: no landmark, 0 from attend_few_queries)


def _middle(q_l, k_l, k, v, key_mask, landmark, s, opts):
    """pinv(softmax(Q̃ K̃ᵀ)) softmax(Q̃ Kᵀ) V (B, H, m', Dv), over the real keys and the landmark
    keys that hold some (``landmark`` (B, m'), None: all): a slot without one is a zero column
    of softmax(Q̃ K̃ᵀ), a zero row of its pseudo-inverse."""
    mask = None if key_mask is None else key_mask[:, None, None, :]  # (B, 1, 1, Lk)
    kernel_3 = attend_few_queries(q_l, k, v, mask, s)  # (B, H, m, Dv): kernel_3 V
    scores = (wide(q_l) @ wide(k_l).transpose(-1, -2)) * s  # (B, H, m, m)
    kernel_2 = masked_softmax(scores, None if landmark is None else landmark[:, None, None, :])
    return pinv_times(kernel_2, wide(kernel_3), opts.pinv_iterations).to(v.dtype)  # (B, H, m, Dv)


def nystrom_reference(q, k, v, opts=NystromOptions(), *, causal=False, key_mask=None, scale=None,
                      generator=None):
    """With a key_mask, each batch entry on its real keys alone; m >= Lk softmax attention, else
    the three (Lq, m'), (m', m'), (m', Lk) softmax kernels as plain matrices."""
    s = softmax_scale(q, scale)
    if key_mask is None:
        return _unpadded_reference(q, k, v, opts, s)
    return torch.cat([_unpadded_reference(q[b:b + 1], k[b:b + 1, :, real], v[b:b + 1, :, real], opts, s)
                      for b, real in enumerate(key_mask)])


def _unpadded_reference(q, k, v, opts, s):
    Lq, Lk = q.shape[2], k.shape[2]
    if Lk == 0:
        return q.new_zeros(*q.shape[:3], v.shape[-1])
    if opts.num_landmarks >= Lk:
        return softmax_reference(q, k, v, None, s)
    m = min(opts.num_landmarks, Lq)
    q_l, k_l = segment_means(q, m), segment_means(k, m)
    kernel_1 = torch.softmax((q @ k_l.transpose(-1, -2)) * s, -1)
    kernel_2 = torch.softmax((q_l @ k_l.transpose(-1, -2)) * s, -1)
    kernel_3 = torch.softmax((q_l @ k.transpose(-1, -2)) * s, -1)
    return kernel_1 @ iterative_pinv(kernel_2, opts.pinv_iterations) @ kernel_3 @ v


def nystrom_flops(B, H, Lq, Lk, D, Dv, causal, opts) -> float:
    """The three kernels' products, and the pseudo-inverse's as :func:`pinv_times` groups them:
    eight (m × m) products a step formed, the last steps' brackets applied to the values."""
    if opts.num_landmarks >= Lk:  # exact softmax attention
        return 2.0 * B * H * Lq * Lk * (D + Dv)
    m = min(opts.num_landmarks, Lq)  # (the segment means are sums, not products: uncounted)
    kernels = 2.0 * m * Lk * (D + Dv) + 2.0 * m * m * D + 2.0 * Lq * m * (D + Dv)
    tail = _tail(opts.pinv_iterations)
    pinv = ((opts.pinv_iterations - tail) * 8.0 + 2.0 * (2 * tail - 1)) * m**3 + (6 * tail + 2.0) * m * m * Dv
    return B * H * (kernels + pinv)


register(
    Mechanism(
        name="nystrom",
        summary="Nyström approximation of softmax attention with segment-mean landmarks",
        options=NystromOptions,
        fn=nystrom_attention,
        reference=nystrom_reference,
        capabilities=Capabilities(causal=False, cross=True, key_mask=True),
        time="O(L m d + m³)",
        memory="O(L m)",
        citation="Xiong et al., Nyströmformer: A Nyström-Based Algorithm for Approximating "
        "Self-Attention, AAAI 2021",
        reason_not_causal="landmarks average over segments that include future positions",
        flops=nystrom_flops,
    )
)

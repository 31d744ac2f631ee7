"""Reformer's LSH attention (Kitaev et al., ICLR 2020).

Angular LSH: for each of ``n_hashes`` rounds a random rotation R (D × b/2) gives
h(x) = argmax([xR; −xR]). Queries and keys are sorted by (bucket, position) and
cut into chunks of ``bucket_size``; each chunk attends to itself and the chunk
before. The rounds are combined by their log-sum-exp weights, each key counted
once (the paper's N_ij correction), so the result is exactly the softmax over
the union of the keys a query meets in any round.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from attnzoo.mechanisms._common import merge_partials, pad_to, partial_softmax, softmax_scale
from attnzoo.mechanisms.full import softmax_reference
from attnzoo.registry import Capabilities, Mechanism, register

SELF_PENALTY = 1e5  # the paper's m(i, i): a position attends to itself only if it has no other key


@dataclass(frozen=True)
class LSHOptions:
    bucket_size: int = 64  # m: chunk length after sorting
    n_hashes: int = 4  # hash rounds
    n_buckets: int | None = None  # b (1 or even); None = about L / bucket_size, as in the paper
    attend_across_buckets: bool = False  # True: keys of other buckets inside a chunk are kept
    shared_qk: bool = False  # keys = q/‖q‖ (pass k=q), and no attending to itself if avoidable

    def __post_init__(self):
        if self.bucket_size < 1 or self.n_hashes < 1:
            raise ValueError(f"lsh: bucket_size and n_hashes must be >= 1, got {self.bucket_size}, "
                             f"{self.n_hashes}")
        if self.n_buckets is not None and (self.n_buckets < 1 or
                                           (self.n_buckets > 1 and self.n_buckets % 2)):
            raise ValueError(f"lsh: n_buckets must be 1 or even (h = argmax([xR; -xR])), "
                             f"got {self.n_buckets}")


@dataclass(frozen=True)
class LSHLayerOptions:
    shared_qk: bool = True  # the module's default: one projection for queries and keys, as the paper

    def build(self, layer) -> None:
        if self.shared_qk:
            layer.k_proj = None  # keys come from the query projection, normalised by the mechanism
            layer.options = {**layer.options, "shared_qk": True}


def n_buckets_for(L: int, opts: LSHOptions) -> int:
    """b: given, or the even number nearest L / bucket_size (at least 2)."""
    if opts.n_buckets is not None:
        return opts.n_buckets
    return max(2, 2 * round(L / (2 * opts.bucket_size)))


def hash_buckets(x: torch.Tensor, rotations: torch.Tensor) -> torch.Tensor:
    """(B, H, L, D) -> (B, H, n_hashes, L) buckets: argmax([xR; -xR]) per round."""
    if rotations.shape[-1] == 0:  # one bucket
        return torch.zeros(*x.shape[:2], rotations.shape[0], x.shape[2], dtype=torch.long,
                           device=x.device)
    x = x if x.dtype == torch.float64 else x.float()  # hash in >= float32: half precision flips buckets
    rotated = torch.einsum("bhld,rdc->bhrlc", x, rotations.to(x.dtype))  # (B, H, n_hashes, L, b/2)
    return torch.cat([rotated, -rotated], -1).argmax(-1)


def _buckets_and_order(q, k, opts, generator):
    """Bucket ids and sort order of queries and keys, the random draw shared by fast and reference.

    Returns ``(q_buckets, k_buckets, q_order, k_order)``, each (B, H, n_hashes, L): order
    lists original positions sorted by (bucket, position).
    """
    L, D = q.shape[2], q.shape[3]
    b = n_buckets_for(L, opts)
    rotations = torch.randn(opts.n_hashes, D, b // 2 if b > 1 else 0, generator=generator,
                            device=q.device)  # shared by batch and heads
    positions = torch.arange(L, device=q.device)
    q_buckets = hash_buckets(q, rotations)
    k_buckets = q_buckets if opts.shared_qk else hash_buckets(k, rotations)
    q_order = (q_buckets * L + positions).argsort(-1)
    k_order = q_order if opts.shared_qk else (k_buckets * L + positions).argsort(-1)
    return q_buckets, k_buckets, q_order, k_order


def _meets(q_chunk_r, k_chunk_r, q_bucket_r, k_bucket_r, across: bool) -> torch.Tensor:
    """Whether query and key meet in a round: key's chunk is the query's or the one before."""
    met = (k_chunk_r <= q_chunk_r) & (k_chunk_r >= q_chunk_r - 1)
    return met if across else met & (k_bucket_r == q_bucket_r)


def _keys_of(q, k, opts):
    if not opts.shared_qk:
        return k
    if k is not q and not torch.equal(k, q):
        raise ValueError("lsh: shared_qk=True makes the keys q/‖q‖; pass k=q")
    return F.normalize(q, dim=-1)


def lsh_attention(q, k, v, opts=LSHOptions(), *, causal=False, key_mask=None, scale=None,
                  generator=None):
    """Softmax over the keys met in any hash round: same chunk or the one before after sorting
    by (bucket, position), same bucket unless ``attend_across_buckets``.

    Shapes: q, k (B, H, L, D), v (B, H, L, Dv) -> (B, H, L, Dv); self-attention only.
    Cost O(n_hashes·L·bucket_size·D) time (plus n_hashes²·L·bucket_size integer
    compares for the duplicate count) and O(L·bucket_size + n_hashes·L) memory,
    one round at a time; the sort is O(L log L). No L×L tensor.
    Choices: rotations are shared by batch and heads; chunk 0 has no chunk before
    it (no wrap-around); with ``shared_qk`` a query's own key scores −1e5, so it is
    attended only when nothing else is, as in the paper.
    """
    keys = _keys_of(q, k, opts)
    B, H, L, D = q.shape
    m = opts.bucket_size
    nc = -(-L // m)
    Lp = nc * m
    q_buckets, k_buckets, q_order, k_order = _buckets_and_order(q, keys, opts, generator)
    q_chunk = q_order.argsort(-1) // m  # (B, H, n_hashes, L): each query's chunk, by position
    k_chunk = k_order.argsort(-1) // m
    s = softmax_scale(q, scale)

    def window(t, pad=0):  # (B, H, Lp, X) sorted -> (B, H, nc, 2m, X): the chunk before, then the chunk
        t = t.view(B, H, nc, m, -1)
        return torch.cat([F.pad(t, (0, 0, 0, 0, 1, 0), value=pad)[:, :, :-1], t], 3)

    parts = []
    for r in range(opts.n_hashes):
        qi = pad_to(q_order[:, :, r], Lp, dim=2, value=-1)  # (B, H, Lp) query positions, -1 = pad
        kj = pad_to(k_order[:, :, r], Lp, dim=2, value=-1)
        q_sorted = _take(q, qi).view(B, H, nc, m, D)
        k_win = window(_take(keys, kj))  # (B, H, nc, 2m, D)
        v_win = window(_take(v, kj))  # (B, H, nc, 2m, Dv)
        i = qi.view(B, H, nc, m, 1)
        j = window(kj[..., None], pad=-1).view(B, H, nc, 1, 2 * m)  # chunk 0 has none before it
        scores = (q_sorted @ k_win.transpose(-1, -2)) * s  # (B, H, nc, m, 2m)
        valid = (i >= 0) & (j >= 0)
        if not opts.attend_across_buckets:
            valid = valid & (_take_int(q_buckets[:, :, r], i) == _take_int(k_buckets[:, :, r], j))
        if causal:
            valid = valid & (j <= i)
        if key_mask is not None:
            valid = valid & _take_int(key_mask[:, None].expand(B, H, L), j)
        i_c, j_c = i.clamp(min=0), j.clamp(min=0)
        met = 1 + sum(
            _meets(_take_int(q_chunk[:, :, t], i_c), _take_int(k_chunk[:, :, t], j_c),
                   _take_int(q_buckets[:, :, t], i_c), _take_int(k_buckets[:, :, t], j_c),
                   opts.attend_across_buckets).to(q.dtype)
            for t in range(opts.n_hashes) if t != r
        )  # N_ij: rounds in which this pair meets (this one and the others)
        if opts.n_hashes > 1:
            scores = scores - torch.log(met)
        if opts.shared_qk:
            scores = scores - SELF_PENALTY * (i == j).to(q.dtype)
        o, lse = partial_softmax(scores, valid, v_win)  # (B, H, nc, m, Dv), (B, H, nc, m)
        back = q_order[:, :, r].argsort(-1)  # unsort: sorted slot of each position
        parts.append((_take(o.reshape(B, H, Lp, -1), back), _take_int(lse.reshape(B, H, Lp), back)))
    return merge_partials(parts)[0].to(q.dtype)


def _take(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """t (B, H, L, X) gathered along L at idx (B, H, n) (-1 = padding, gives row 0)."""
    return torch.gather(t, 2, idx.clamp(min=0)[..., None].expand(-1, -1, -1, t.shape[-1]))


def _take_int(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """t (B, H, L) gathered at idx (B, H, ...) of any trailing shape (-1 = padding)."""
    flat = idx.clamp(min=0).reshape(*idx.shape[:2], -1)
    return torch.gather(t, 2, flat).view(idx.shape)


def lsh_flops(B, H, Lq, Lk, D, Dv, causal, opts) -> float:
    """Per round: hashing (2·L·D·b/2 for q, and for k unless shared) and the chunked scores and
    weighted values (2·Lp·2m·(D + Dv))."""
    L, m = Lq, opts.bucket_size
    b = n_buckets_for(L, opts)
    hashes = (1 if opts.shared_qk else 2) * 2.0 * L * D * (b // 2 if b > 1 else 0)
    chunks = 2.0 * (-(-L // m)) * m * 2 * m * (D + Dv)
    return B * H * opts.n_hashes * (hashes + chunks)


def lsh_mask(q, k, opts, causal, key_mask, scale, generator):
    """(B, H, L, L) bool: which keys each query meets in some round (and may attend)."""
    keys = _keys_of(q, k, opts)
    B, H, L, _ = q.shape
    q_buckets, k_buckets, q_order, k_order = _buckets_and_order(q, keys, opts, generator)
    m = opts.bucket_size
    mask = torch.zeros(B, H, L, L, dtype=torch.bool, device=q.device)
    for r in range(opts.n_hashes):
        qc = (q_order[:, :, r].argsort(-1) // m)[..., :, None]  # (B, H, L, 1) chunk of query i
        kc = (k_order[:, :, r].argsort(-1) // m)[..., None, :]  # (B, H, 1, L) chunk of key j
        mask |= _meets(qc, kc, q_buckets[:, :, r, :, None], k_buckets[:, :, r, None, :],
                       opts.attend_across_buckets)
    if causal:
        mask &= torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
    if key_mask is not None:
        mask &= key_mask[:, None, None, :]
    return mask


def lsh_reference(q, k, v, opts=LSHOptions(), *, causal=False, key_mask=None, scale=None,
                  generator=None):
    """Dense softmax over the union of keys met in any round (same draw of rotations)."""
    mask = lsh_mask(q, k, opts, causal, key_mask, scale, generator)
    bias = None
    if opts.shared_qk:  # the self penalty on the diagonal
        bias = -SELF_PENALTY * torch.eye(q.shape[2], dtype=q.dtype, device=q.device)
    return softmax_reference(q, _keys_of(q, k, opts), v, mask, scale, bias=bias)


register(
    Mechanism(
        name="lsh",
        summary="angular LSH by random rotations, sort by bucket, attend within chunk and the one before",
        options=LSHOptions,
        fn=lsh_attention,
        reference=lsh_reference,
        capabilities=Capabilities(causal=True, cross=False, key_mask=True),
        time="O(n_hashes L bucket_size d + L log L)",
        memory="O(L bucket_size)",
        citation="Kitaev et al., Reformer: The Efficient Transformer, ICLR 2020",
        randomized=True,
        data_pattern=lsh_mask,
        flops=lsh_flops,
        layer_options=LSHLayerOptions,
    )
)

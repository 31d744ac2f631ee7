"""NaN containment: a nan or an inf in one key or one value reaches only the outputs whose pattern
includes that key, for the pattern mechanisms that compute masked keys beside attended ones
(windows, residue classes, summary cells, LSH's chunks, LogSparse's offsets), on the default path
(the CPU backend) and on the portable one. Every other output row is finite and equals the run
without the poison; a key padded out by ``key_mask`` reaches no row.

Small options make the blocks small, so that a length of 70 crosses many of them.
"""

import math

import pytest
import torch

import attnzoo
from attnzoo import ops

B, H, L, D = 2, 2, 70, 8
POISONED = 1  # the batch entry that holds the poison; entry 0 is clean

CASES = {  # case: (mechanism, options, the poisoned position)
    "local": ("local", {"window": 9}, 29),
    "block_local": ("block_local", {"window": 8}, 29),
    "strided": ("strided", {"stride": 6}, 29),
    "strided split": ("strided", {"stride": 6, "heads": "split"}, 29),
    "fixed": ("fixed", {"stride": 8, "c": 2}, 30),  # a summary cell (30 mod 8 >= 6): A1 and A2 see it
    "fixed split": ("fixed", {"stride": 8, "c": 2, "heads": "split"}, 30),
    "lsh": ("lsh", {"bucket_size": 8, "n_hashes": 2}, 29),
    "log_sparse": ("log_sparse", {"local": 2}, 29),
    "log_sparse restart": ("log_sparse", {"restart": 16}, 29),
}


@pytest.fixture(params=["default", "portable"])
def path(request, monkeypatch):
    """The default path (the CPU backend's overrides on, whatever ATTNZOO_FAST the run has), or the
    portable one."""
    if request.param == "default":
        monkeypatch.setenv("ATTNZOO_FAST", "1")
        yield
    else:
        with ops.portable():
            yield


def _attention(name, q, k, v, options, *, causal, key_mask, grad, reference=False):
    leaves = [t.detach().requires_grad_(grad) for t in (q, k, v)]
    return attnzoo.attention(*leaves, name, causal=causal, key_mask=key_mask, reference=reference,
                             generator=torch.Generator().manual_seed(1), **options).detach()


def _sees(name, options, p, q, k, *, causal, key_mask):
    """(B, H, L) bool: the rows whose pattern includes key p of the poisoned batch entry."""
    if name == "lsh":  # the pattern depends on the data (the poisoned key's bucket too)
        pattern = attnzoo.connectivity(name, q=q, k=k, causal=causal, key_mask=key_mask,
                                       generator=torch.Generator().manual_seed(1), **options)
    else:
        pattern = attnzoo.connectivity(name, L, causal=causal, **options)  # (L, L), or (2, L, L) by head
        pattern = pattern[torch.arange(H) % pattern.shape[0]] if pattern.dim() == 3 else pattern
        if key_mask is not None:
            pattern = pattern & key_mask[:, None, None, :]
    sees = pattern[..., p].expand(B, H, L).clone()
    sees[1 - POISONED] = False
    return sees


@pytest.mark.parametrize("padded", [False, True], ids=["attended", "padded"])  # padded: key_mask drops it
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])  # the backend's paths differ
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("poisoned", ["k", "v"])
@pytest.mark.parametrize("causal", [False, True], ids=["two-sided", "causal"])
@pytest.mark.parametrize("case", CASES)
def test_a_nonfinite_key_or_value_reaches_only_the_rows_that_see_it(path, case, causal, poisoned, bad,
                                                                    grad, padded):
    name, options, p = CASES[case]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, L, D, generator=g) for _ in range(3))
    key_mask = None
    if padded:
        key_mask = torch.ones(B, L, dtype=torch.bool)
        key_mask[POISONED, p] = False
    k_bad, v_bad = k.clone(), v.clone()
    (k_bad if poisoned == "k" else v_bad)[POISONED, :, p, 3] = bad
    run = dict(causal=causal, key_mask=key_mask, grad=grad)
    out = _attention(name, q, k_bad, v_bad, options, **run)
    if name == "lsh" and poisoned == "k":  # the key's bucket moves: the dense reference of the same draw
        expected = _attention(name, q, k_bad, v_bad, options, reference=True, **run)
    else:
        expected = _attention(name, q, k, v, options, **run)

    sees = _sees(name, options, p, q, k_bad, causal=causal, key_mask=key_mask)
    others = out[~sees]  # (rows, D)
    leaked = int((~torch.isfinite(others)).any(-1).sum())
    assert leaked == 0, f"{leaked} rows whose pattern leaves out key {p} are not finite"
    torch.testing.assert_close(others, expected[~sees], rtol=1e-5, atol=1e-5)
    if poisoned == "v" or math.isnan(bad):  # (an inf key may score -inf for a row: that row leaves it out)
        assert not torch.isfinite(out[sees]).all(-1).any(), "a row that sees the poison is finite"


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("causal", [False, True], ids=["two-sided", "causal"])
@pytest.mark.parametrize("case", CASES)
def test_a_nan_query_reaches_only_its_own_row(path, case, causal, grad):
    """And is not lost: the CPU backend's LSH hash gave a row of nan bucket b, out of range (the
    rounds without gradients then gave that query 0; with gradients they failed)."""
    name, options, p = CASES[case]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, L, D, generator=g) for _ in range(3))
    q_bad = q.clone()
    q_bad[POISONED, :, p, 3] = float("nan")
    run = dict(causal=causal, key_mask=None, grad=grad)
    out = _attention(name, q_bad, k, v, options, **run)
    # LSH: the query's bucket moves, and with it the others' chunks: the reference of the same draw
    expected = _attention(name, q_bad if name == "lsh" else q, k, v, options, reference=name == "lsh", **run)

    own = torch.zeros(B, H, L, dtype=torch.bool)
    own[POISONED, :, p] = True
    assert torch.isnan(out[own]).all(-1).all(), "the nan query's row is not nan"
    torch.testing.assert_close(out[~own], expected[~own], rtol=1e-5, atol=1e-5)

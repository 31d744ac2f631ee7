"""swap_attention: torch's own transformer modules with an attnzoo mechanism swapped in."""

import copy

import pytest
import torch
from torch import nn

import attnzoo
from attnzoo.swap import SwappedMultiheadAttention

E, H = 32, 4


def _encoder(batch_first=True, dropout=0.0, layers=2):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(E, H, dim_feedforward=64, dropout=dropout, batch_first=batch_first)
    return nn.TransformerEncoder(layer, layers, enable_nested_tensor=True).eval()


def _swapped(model, mechanism="full", **options):
    return attnzoo.swap_attention(copy.deepcopy(model), mechanism, **options)


def _padding(B, L, real):
    return torch.arange(L).expand(B, L) >= torch.tensor(real)[:, None]  # True = padding


def _count_swapped(model) -> int:
    return sum(isinstance(m, SwappedMultiheadAttention) for m in model.modules())


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("mode", ["train", "eval", "eval_no_grad"])
def test_full_equals_the_original_encoder(batch_first, mode):
    model = _encoder(batch_first)
    swapped = _swapped(model)
    assert _count_swapped(swapped) == 2 and _count_swapped(model) == 0
    B, L = 3, 20
    x = torch.randn(B, L, E) if batch_first else torch.randn(L, B, E)
    padding = _padding(B, L, [20, 13, 7])
    causal = nn.Transformer.generate_square_subsequent_mask(L)
    for m in (model, swapped):
        m.train(mode == "train")
    with torch.set_grad_enabled(mode != "eval_no_grad"):
        for kwargs in ({}, {"src_key_padding_mask": padding}, {"mask": causal},
                       {"mask": causal, "is_causal": True, "src_key_padding_mask": padding}):
            want, got = model(x, **kwargs), swapped(x, **kwargs)
            real = ~padding.T if not batch_first else ~padding  # rows of padding differ: torch's
            if "src_key_padding_mask" in kwargs and mode == "eval_no_grad":  # nested path zeroes them
                want, got = want[real], got[real]
            torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_full_equals_the_original_transformer_with_every_mask():
    torch.manual_seed(0)
    model = nn.Transformer(E, H, num_encoder_layers=2, num_decoder_layers=2, dim_feedforward=64,
                           dropout=0.0, batch_first=True)
    swapped = _swapped(model)
    assert _count_swapped(swapped) == 2 + 2 * 2  # encoder self; decoder self and cross
    B, S, T = 2, 24, 16
    src, tgt = torch.randn(B, S, E), torch.randn(B, T, E)
    kwargs = dict(tgt_mask=nn.Transformer.generate_square_subsequent_mask(T), tgt_is_causal=True,
                  src_key_padding_mask=_padding(B, S, [24, 10]),
                  memory_key_padding_mask=_padding(B, S, [24, 10]),
                  tgt_key_padding_mask=_padding(B, T, [16, 12]))
    for train in (True, False):
        model.train(train), swapped.train(train)
        want = model(src, tgt, **kwargs)
        torch.testing.assert_close(swapped(src, tgt, **kwargs), want, atol=2e-5, rtol=1e-4)


def test_eval_no_grad_runs_the_mechanism_not_torchs_fused_fast_path():
    """torch's TransformerEncoderLayer in eval under no_grad would compute full attention in its own
    fused kernel from the layer's weights, never calling the module: the swap must not be bypassed."""
    model = _encoder()
    swapped = _swapped(model, "local", window=2)
    x = torch.randn(2, 40, E)
    padding = _padding(2, 40, [40, 30])
    with torch.no_grad():
        full = model(x, src_key_padding_mask=padding)
        local_no_grad = swapped(x, src_key_padding_mask=padding)
    local_grad = swapped(x, src_key_padding_mask=padding)  # parameters require grad: never the fast path
    real = ~padding
    assert (local_no_grad[real] - full[real]).abs().max() > 1e-2
    torch.testing.assert_close(local_no_grad, local_grad.detach())


def test_parameters_are_taken_over_and_state_dicts_load_across():
    model = _encoder()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = {n: p for n, p in model.named_parameters()}
    attnzoo.swap_attention(model, "local", window=4)
    assert {n: p for n, p in model.named_parameters()}.keys() == before.keys()
    assert all(p is before[n] for n, p in model.named_parameters())  # the optimizer still trains them
    x = torch.randn(2, 12, E)
    model.train()
    model(x).square().mean().backward()
    optimizer.step()
    fresh = _encoder()
    fresh.load_state_dict(model.state_dict())  # strict: the same names
    attnzoo.swap_attention(fresh, "local", window=4)
    fresh.load_state_dict(model.state_dict())


@pytest.mark.parametrize("separate", [False, True])
def test_one_module_every_input_form(separate):
    torch.manual_seed(0)
    kdim = 24 if separate else None  # separate q/k/v weights when kdim != embed_dim
    mha = nn.MultiheadAttention(E, H, kdim=kdim, vdim=kdim, batch_first=True)
    swapped = SwappedMultiheadAttention(mha, "full")
    q, kv = torch.randn(2, 9, E), torch.randn(2, 11, kdim or E)
    torch.testing.assert_close(swapped(q, kv, kv)[0], mha(q, kv, kv)[0])
    torch.testing.assert_close(swapped(q[0], kv[0], kv[0])[0], mha(q[0], kv[0], kv[0])[0])  # unbatched
    float_padding = torch.zeros(2, 11).masked_fill(_padding(2, 11, [11, 5]), float("-inf"))
    torch.testing.assert_close(swapped(q, kv, kv, key_padding_mask=float_padding)[0],
                               mha(q, kv, kv, key_padding_mask=float_padding)[0])


@pytest.mark.parametrize("average", [True, False])
def test_need_weights_gives_the_effective_weights(average):
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(E, H, batch_first=True)
    x = torch.randn(2, 10, E)
    padding = _padding(2, 10, [10, 6])
    kwargs = dict(key_padding_mask=padding, average_attn_weights=average)
    _, want = mha(x, x, x, **kwargs)
    _, got = SwappedMultiheadAttention(mha, "full")(x, x, x, **kwargs)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    local = SwappedMultiheadAttention(mha, "local", window=4)  # two-sided: |i - j| <= 2
    _, w = local(x, x, x, average_attn_weights=False)  # (B, H, L, L)
    far = (torch.arange(10)[:, None] - torch.arange(10)[None, :]).abs() > 2
    assert w[..., far].abs().max() < 1e-6 and w[..., ~far].abs().min() > 0
    torch.testing.assert_close(w.sum(-1), torch.ones(2, H, 10))


def test_randomized_mechanism_weights_come_from_the_same_draw():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(E, H, batch_first=True, bias=False)
    swapped = SwappedMultiheadAttention(mha, "performer", nb_features=16)
    x = torch.randn(1, 12, E)
    torch.manual_seed(1)
    out, w = swapped(x, x, x, average_attn_weights=False)
    v = nn.functional.linear(x, mha.in_proj_weight[2 * E:]).view(1, 12, H, E // H).transpose(1, 2)
    by_weights = mha.out_proj((w @ v).transpose(1, 2).reshape(1, 12, E))
    torch.testing.assert_close(by_weights, out, atol=1e-5, rtol=1e-4)
    torch.manual_seed(1)
    torch.testing.assert_close(swapped(x, x, x, need_weights=False)[0], out)  # reproducible


def test_masks_it_cannot_honour_are_refused():
    mha = nn.MultiheadAttention(E, H, batch_first=True)
    x = torch.randn(1, 6, E)
    band = torch.ones(6, 6, dtype=torch.bool).triu(3)  # True = blocked, not causal
    with pytest.raises(ValueError, match="attn_mask other than the causal mask"):
        SwappedMultiheadAttention(mha, "full")(x, x, x, attn_mask=band)
    with pytest.raises(ValueError, match="nystrom cannot honour.*local"):
        causal = nn.Transformer.generate_square_subsequent_mask(6)
        SwappedMultiheadAttention(mha, "nystrom")(x, x, x, attn_mask=causal)
    with pytest.raises(ValueError, match="0 \\(real key\\) or -inf"):
        SwappedMultiheadAttention(mha, "full")(x, x, x, key_padding_mask=torch.full((1, 6), -1.0))
    with pytest.raises(ValueError, match="add_bias_kv"):
        attnzoo.swap_attention(nn.Sequential(nn.MultiheadAttention(E, H, add_bias_kv=True)), "full")
    with pytest.raises(ValueError, match="unknown option"):
        attnzoo.swap_attention(nn.Sequential(mha), "local", windw=3)
    with pytest.raises(ValueError, match="MAX_WEIGHTS"):
        long = torch.randn(1, 4100, E)
        SwappedMultiheadAttention(mha, "local")(long, long, long)

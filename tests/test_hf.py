"""attnzoo.hf: mechanisms behind Hugging Face transformers' attention interface, on a tiny
randomly initialised Llama built from a config (nothing downloaded)."""

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import attnzoo
import attnzoo.hf


def _model(implementation):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    return AutoModelForCausalLM.from_config(config, attn_implementation=implementation).eval()


def _inputs(B=2, L=48):
    ids = torch.randint(0, 64, (B, L), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(B, L, dtype=torch.long)
    mask[1:, :11] = 0  # left padding of the second sequence
    return ids, mask


def test_register_names_every_mechanism():
    names = attnzoo.hf.register()
    assert names == [f"attnzoo_{m}" for m in attnzoo.mechanisms()]


def test_attnzoo_full_equals_the_models_own_sdpa():
    attnzoo.hf.register("full")
    ids, mask = _inputs()
    want = _model("sdpa")(input_ids=ids, attention_mask=mask).logits
    got = _model("attnzoo_full")(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()  # padded positions' outputs are not defined alike
    torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=1e-4)
    unpadded = [_model(name)(input_ids=ids).logits for name in ("attnzoo_full", "sdpa")]
    torch.testing.assert_close(*unpadded, atol=1e-5, rtol=1e-4)


def test_another_mechanism_really_runs(monkeypatch):
    attnzoo.hf.register("local", name="attnzoo_local8", window=8)
    calls = []
    attention = attnzoo.hf.attention
    monkeypatch.setattr(attnzoo.hf, "attention", lambda *a, **kw: calls.append(a[3]) or attention(*a, **kw))
    ids, mask = _inputs()
    full = _model("sdpa")(input_ids=ids, attention_mask=mask).logits
    local = _model("attnzoo_local8")(input_ids=ids, attention_mask=mask).logits
    assert calls == ["local", "local"]  # one call a layer
    assert torch.isfinite(local).all() and (local - full)[mask.bool()].abs().max() > 1e-3
    # the first 8 positions see the same keys under a causal window of 8: equal there
    torch.testing.assert_close(local[0, :8], full[0, :8], atol=1e-5, rtol=1e-4)


def test_generation_with_a_cache_matches_sdpa():
    attnzoo.hf.register("full")
    ids, _ = _inputs(B=1, L=12)
    kwargs = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    want = _model("sdpa").generate(ids, **kwargs)
    assert torch.equal(_model("attnzoo_full").generate(ids, **kwargs), want)


def test_what_it_cannot_honour_is_refused():
    attnzoo.hf.register("full")
    model = _model("attnzoo_full")
    ids, _ = _inputs(B=1, L=8)
    with pytest.raises(ValueError, match="attention mask"):  # a 4-D mask prepared by the caller
        model(input_ids=ids, attention_mask=torch.zeros(1, 1, 8, 8))
    model.config.attention_dropout = 0.1
    model.model.layers[0].self_attn.attention_dropout = 0.1
    with pytest.raises(ValueError, match="attention dropout"):
        model.train()(input_ids=ids)
    with pytest.raises(ValueError, match="unknown option"):
        attnzoo.hf.register("local", windw=3)

"""attnzoo's mechanisms inside Hugging Face transformers models: :func:`register`.

``attnzoo.hf.register()`` adds every mechanism to transformers' ``AttentionInterface`` as
``attnzoo_<name>``; a model whose attention dispatches through that interface (the Llama
family, Mistral, Qwen2/3, Gemma, Phi-3, GPT-2, BERT and most others in transformers 5) then
runs it with ``from_pretrained(..., attn_implementation="attnzoo_local")`` or
``model.set_attn_implementation("attnzoo_local")``. Decoder models need a mechanism that
supports ``causal=True``; generating with a key-value cache needs one that supports Lq != Lk
(queries are the last positions, as attnzoo's causal alignment has it).

A matching mask function is registered with ``AttentionMaskInterface``: it hands the
attention the (B, Lk) padding mask instead of the (B, 1, Lq, Lk) one no sub-quadratic
mechanism can use. Masks beyond causal plus padding (sliding windows, packed sequences,
chunked attention), attention dropout, soft-capping and attention sinks are refused with a
ValueError, never silently dropped. Pretrained softmax weights generally need fine-tuning
before an approximate mechanism matches the model's own attention.

Requires ``transformers`` (``pip install attnzoo[hf]``); importing this module imports it.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface
from transformers.masking_utils import (
    AttentionMaskInterface,
    bidirectional_mask_function,
    causal_mask_function,
)

from attnzoo.registry import attention, get, make_options, mechanisms

__all__ = ["register"]

# Keyword arguments of transformers' attention calls that change the attention itself; a
# mechanism here honours none of them, so a call that sets one is refused.
_UNSUPPORTED = ("sliding_window", "softcap", "position_bias", "s_aux", "head_mask")


def register(mechanism: str | None = None, *, name: str | None = None, **options: Any) -> list[str]:
    """Register attnzoo mechanisms with transformers; returns the implementation names.

    With no ``mechanism``: every registered mechanism, with its default options, as
    ``attnzoo_<name>``. With one: that mechanism with ``options`` (checked now), as ``name``
    (default ``attnzoo_<mechanism>``), e.g. ``register("local", name="local128", window=128)``.
    """
    if mechanism is None:
        if name is not None or options:
            raise ValueError("name and options apply to one mechanism: register(mechanism, name=..., ...)")
        return [registered for m in mechanisms() for registered in register(m)]
    make_options(get(mechanism), options)
    name = f"attnzoo_{mechanism}" if name is None else name
    AttentionInterface.register(name, _attention_function(mechanism, options))
    AttentionMaskInterface.register(name, _padding_mask)
    return [name]


def _attention_function(mechanism: str, options: dict):
    def attnzoo_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                          value: torch.Tensor, attention_mask: torch.Tensor | None, dropout: float = 0.0,
                          scaling: float | None = None, is_causal: bool | None = None, **kwargs):
        """transformers' attention signature: query (B, H, Lq, D), key and value (B, H_kv, Lk, D),
        attention_mask the (B, Lk) padding mask from :func:`_padding_mask`; returns the output
        (B, Lq, H, D) and no weights."""
        given = [k for k in _UNSUPPORTED if kwargs.get(k) is not None]
        if given or dropout:
            what = ", ".join(given + (["attention dropout"] if dropout else []))
            raise ValueError(f"attnzoo_{mechanism}: this model's attention uses {what}, which attnzoo "
                             "mechanisms do not take (attention dropout: set it to 0 in the config)")
        if attention_mask is not None and attention_mask.dim() != 2:
            raise ValueError(f"attnzoo_{mechanism}: a {attention_mask.dim()}-D attention mask; attnzoo "
                             "mechanisms take a (B, Lk) padding mask (the model prepares one for them)")
        groups = query.shape[1] // key.shape[1]  # grouped-query attention: each K/V head serves `groups`
        key, value = (t.repeat_interleave(groups, dim=1) if groups > 1 else t for t in (key, value))
        causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
        out = attention(query, key, value, mechanism, causal=bool(causal), key_mask=attention_mask,
                        scale=scaling, **options)  # (B, H, Lq, D)
        return out.transpose(1, 2).contiguous(), None

    return attnzoo_attention


def _padding_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                  mask_function=causal_mask_function, attention_mask: torch.Tensor | None = None,
                  **kwargs) -> torch.Tensor | None:
    """transformers' mask-interface signature; returns the (B, kv_length) bool padding mask (True
    = real key) of the keys the attention sees, or None where every key is real."""
    if mask_function not in (causal_mask_function, bidirectional_mask_function):
        raise ValueError("attnzoo mechanisms take causal or bidirectional attention with padding only; "
                         "this model asks for another mask (sliding window, packed sequences, chunks)")
    if attention_mask is None:
        return None
    mask = attention_mask.to(torch.bool)[:, kv_offset:kv_offset + kv_length]  # (B, <= kv_length)
    mask = torch.nn.functional.pad(mask, (0, kv_length - mask.shape[1]))  # cache slots past it: empty
    return None if bool(mask.all()) else mask

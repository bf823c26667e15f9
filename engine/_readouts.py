"""How each model family turns a prompt's cache and a canvas into slot logits.

- `DiffusionGemma`: the encoder prefills the prompt; one bidirectional decoder pass over
  the seed canvas gives a row per position (masks built as vLLM applies them).
- `CausalLM` (e.g. SmolLM2): a next-token readout; prompt + canvas run as one causal
  sequence and the row for canvas position `s` is the distribution after `s - 1`.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from transformers import DiffusionGemmaForBlockDiffusion, DynamicCache

from ._types import CanvasRead

__all__ = ["MAX_MODEL_LEN_CAP", "CausalLM", "DiffusionGemma"]

MAX_MODEL_LEN_CAP = 32768
"""The context assumed when a model states none."""


class DiffusionGemma:
    """Encoder prefill of the prompt, then one bidirectional decoder pass over the canvas.

    The attention masks are built here, as vLLM applies them: in sliding-window layers
    every query sees the keys less than `sliding_window` positions away, prompt and
    canvas alike. (transformers 5.24's own forward instead shows the canvas the last
    `sliding_window - 1` prompt tokens; the two differ, by up to 0.5 nats on the tiny
    checkpoint, once prompt + canvas exceed the window.)
    """

    def __init__(self, model: DiffusionGemmaForBlockDiffusion, canvas_width: int | None) -> None:
        text = model.config.text_config
        self.model = model
        self.window = int(text.sliding_window or 0)
        self.vocab = int(text.vocab_size)
        self.max_positions = int(text.max_position_embeddings)
        self.canvas_width = min(canvas_width or model.config.canvas_length, model.config.canvas_length)
        self.cache_kw = _cache_kwarg(model)

    def prefix(self, prompt: tuple[int, ...]) -> tuple[int, ...]:
        return prompt

    def canvas_inputs(self, prompt: tuple[int, ...], read: CanvasRead) -> tuple[int, ...]:
        return read.canvas

    def encode(self, ids: torch.Tensor, lengths: torch.Tensor) -> DynamicCache:
        n = ids.shape[1]
        steps = torch.arange(n, device=ids.device)
        valid = steps[None] >= (n - lengths)[:, None]
        causal = steps[None, :] <= steps[:, None]
        cache = DynamicCache()
        self.model.get_encoder()(
            input_ids=ids, attention_mask=self._masks(valid, steps, steps, causal),
            position_ids=(steps[None] - (n - lengths)[:, None]).clamp(min=0), **{self.cache_kw: cache},
        )
        return cache

    def logits(self, cache: DynamicCache, lengths: torch.Tensor, canvas: torch.Tensor, widths: torch.Tensor,
               rows: torch.Tensor) -> torch.Tensor:
        """`[batch, len(rows), vocab]`: the canvas rows at `rows` (every slot sees the whole canvas)."""
        p, c = cache.get_seq_length(), canvas.shape[1]
        steps = torch.arange(p + c, device=canvas.device)
        valid = torch.cat([steps[None, :p] >= (p - lengths)[:, None],
                           steps[None, :c] < widths[:, None]], dim=1)
        masks = self._masks(valid, steps[p:], steps, None)
        positions = lengths[:, None] + steps[None, :c]
        out = self.model(decoder_input_ids=canvas, decoder_attention_mask=masks, decoder_position_ids=positions,
                         **{self.cache_kw: cache}).logits
        return out[:, rows]

    def _masks(self, valid: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
               causal: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """Additive `[batch, 1, queries, keys]` masks per layer type. Every query may see
        itself, so padded rows stay finite."""
        allowed = valid[:, None, :] & (causal if causal is not None else True)
        allowed = allowed | (q[:, None] == k[None, :])
        near = (q[:, None] - k[None, :]).abs() < self.window if self.window else True
        dtype = self.model.dtype

        def additive(ok: torch.Tensor) -> torch.Tensor:
            mask = torch.zeros(ok.shape, dtype=dtype, device=ok.device)
            return mask.masked_fill(~ok, torch.finfo(dtype).min)[:, None]

        return {"full_attention": additive(allowed), "sliding_attention": additive(allowed & near)}


class CausalLM:
    """Next-token readout: the prompt minus its last token is the cached prefix; the
    canvas pass feeds `[last prompt token, canvas[:last slot]]`, so output `s` is the
    distribution over canvas position `s` (nothing after the last slot can change a row).

    The canvas runs as given, noise included, so an earlier slot's noise conditions the
    rows of later slots: the causal mirror of DiffusionGemma, where every slot sees the
    noise at every other slot, and re-reads with new noise average it out. Putting the
    template's label-0 id at earlier slots instead was measured on SmolLM2-135M (5 tickets,
    3 questions, 8 noise draws): noise moves later slots' label distributions by a mean
    total variation of 0.02 (max 0.09) from the label-0 fill and never changes their
    argmax, while a label at an earlier slot is copied (P(yes) at q3 is 1.0 after
    "q2: yes" but 0.76-0.99 after "q2: no"), a first-option bias the noise avoids.
    """

    def __init__(self, model: Any, canvas_width: int | None) -> None:
        if "sliding_attention" in (getattr(model.config, "layer_types", None) or ()):
            raise ValueError("causal LMs with sliding-window layers are not supported by TransformersEngine")
        self.model = model
        self.vocab = int(model.get_output_embeddings().weight.shape[0])
        self.max_positions = int(getattr(model.config, "max_position_embeddings", 0) or MAX_MODEL_LEN_CAP)
        self.canvas_width = canvas_width or 64
        self.cache_kw = _cache_kwarg(model)
        self.keeps_rows = "logits_to_keep" in inspect.signature(model.forward).parameters

    def prefix(self, prompt: tuple[int, ...]) -> tuple[int, ...]:
        return prompt[:-1]

    def canvas_inputs(self, prompt: tuple[int, ...], read: CanvasRead) -> tuple[int, ...]:
        """Up to the last slot: a causal row sees nothing after it, so the rest is not fed."""
        return (prompt[-1], *read.canvas[:max(read.slots, default=0)])

    def encode(self, ids: torch.Tensor, lengths: torch.Tensor, past: DynamicCache | None = None,
               past_lengths: torch.Tensor | None = None) -> DynamicCache:
        """Prefill left-padded `ids`, on top of `past` (left-padded cached prefixes of
        `past_lengths` tokens) when given: the suffixes then start at those positions."""
        n = ids.shape[1]
        steps = torch.arange(n, device=ids.device)
        valid = steps[None] >= (n - lengths)[:, None]
        positions = (steps[None] - (n - lengths)[:, None]).clamp(min=0)
        if past is not None and past_lengths is not None:
            p = past.get_seq_length()
            valid = torch.cat([torch.arange(p, device=ids.device)[None] >= (p - past_lengths)[:, None], valid], 1)
            positions = positions + past_lengths[:, None]
        cache = past if past is not None else DynamicCache()
        self.model.base_model(input_ids=ids, attention_mask=valid.long(), position_ids=positions,
                              use_cache=True, **{self.cache_kw: cache})
        return cache

    def logits(self, cache: DynamicCache, lengths: torch.Tensor, inputs: torch.Tensor, widths: torch.Tensor,
               rows: torch.Tensor) -> torch.Tensor:
        """`[batch, len(rows), vocab]`, projecting only those rows onto the vocabulary where
        the model takes `logits_to_keep`. `widths` goes unused: the causal mask already
        hides a canvas's right padding."""
        p, c = cache.get_seq_length(), inputs.shape[1]
        steps = torch.arange(p, device=inputs.device)
        mask = torch.cat([steps[None] >= (p - lengths)[:, None], inputs.new_ones(inputs.shape, dtype=torch.bool)], 1)
        positions = lengths[:, None] + torch.arange(c, device=inputs.device)[None]
        keep = {"logits_to_keep": rows} if self.keeps_rows else {}
        out = self.model(input_ids=inputs, attention_mask=mask.long(), position_ids=positions,
                         use_cache=True, **{self.cache_kw: cache}, **keep).logits
        return out if self.keeps_rows else out[:, rows]


def _cache_kwarg(model: Any) -> str:
    """transformers renamed `past_key_values` to `cache` (5.2x); use what this version takes."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

"""Build the tiny, randomly initialised DiffusionGemma checkpoint the test server serves.

    python tiny_dgemma.py OUT_DIR      (run with the vLLM venv's python: its transformers)

Everything is made here, offline: a byte-level BPE tokenizer trained on text every Debian
machine has (the common licences and the first 40 stdlib modules, so the same vocabulary on
every machine), the Gemma-4 chat special tokens at fixed ids, the chat template, a Gemma4
processor (vLLM's DiffusionGemma loads one even for text-only serving), and a
`DiffusionGemmaForBlockDiffusion` with a 2-layer MoE text backbone (one sliding-window and
one full-attention layer) and a 1-layer vision tower (transformers always builds one).
The weights are random (seed 0): this model checks protocol and plumbing, never quality.
"""

from __future__ import annotations

import glob
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion, PreTrainedTokenizerFast

VOCAB = 1024
CANVAS = 32
IMAGE_TOKENS = 280  # soft tokens per image (vLLM's gemma4_mm reads `default_output_length`)

# Gemma's ids: pad 0, eos 1, bos 2; then the Gemma-4 chat tokens. Order is the id.
SPECIAL_TOKENS = (
    "<pad>", "<eos>", "<bos>", "<unk>", "<mask>",
    "<|turn>", "<turn|>",              # 5, 6: open and close a turn (6 ends the model's turn)
    "<|channel>", "<channel|>",        # 7, 8: the thought channel
    "<|image>", "<image|>", "<|image|>",  # 9, 10, 11: begin, end, soft token
    "<|think|>",                       # 12
    "<|video|>",                       # 13: Gemma4Processor adds it when missing, so reserve it
    "<|audio|>", "<|audio>", "<audio|>",  # 14, 15, 16
)
NAMED_SPECIALS = {  # the attributes Gemma4Processor reads off the tokenizer
    "image_token": "<|image|>", "boi_token": "<|image>", "eoi_token": "<image|>",
    "audio_token": "<|audio|>", "boa_token": "<|audio>", "eoa_token": "<audio|>",
}

# The released DiffusionGemma template, as transformers' own integration test pins it. Thinking
# off (the default): the generation prompt already ends with the empty thought block
# `<|turn>model\n<|channel>thought\n<channel|>`. enable_thinking=True: a system turn opens with
# `<|think|>` and the generation prompt is `<|turn>model\n`.
TEMPLATE_VERSION = 2  # bump with any template change: provisioning rebuilds older checkpoints
_TEXT = ("{% if m is string %}{{ m }}{% else %}{% for c in m %}{% if c['type'] == 'text' %}{{ c['text'] }}"
         "{% endif %}{% endfor %}{% endif %}")
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% set thinking = enable_thinking is defined and enable_thinking %}"
    "{% set has_system = messages and messages[0]['role'] == 'system' %}"
    "{% set msgs = messages[1:] if has_system else messages %}"
    "{% if thinking or has_system %}<|turn>system\n{% if thinking %}<|think|>\n{% endif %}"
    "{% if has_system %}{% set m = messages[0]['content'] %}" + _TEXT + "{% endif %}<turn|>\n{% endif %}"
    "{% for message in msgs %}"
    "<|turn>{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
    "{% set m = message['content'] %}" + _TEXT + "<turn|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|turn>model\n{% if not thinking %}<|channel>thought\n<channel|>{% endif %}"
    "{% endif %}"
)

# vLLM's DiffusionGemma model state reads these keys (DiffusionGemmaGenerationConfig's shape).
GENERATION_CONFIG = {
    "max_denoising_steps": 48,
    "sampler_config": {"_cls_name": "EntropyBoundSamplerConfig", "entropy_bound": 0.1},
    "t_min": 0.4,
    "t_max": 0.8,
    "stability_threshold": 1,
    "confidence_threshold": 0.005,
    "bos_token_id": 2,
    "pad_token_id": 0,
    "eos_token_id": [1, 6],
}


def training_text() -> Iterator[str]:
    paths = sorted(glob.glob("/usr/share/common-licenses/*"))
    paths += sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py")))[:40]
    for path in paths:
        if os.path.isfile(path):
            yield Path(path).read_text(encoding="utf-8", errors="ignore")


def tokenizer() -> PreTrainedTokenizerFast:
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(training_text(), trainer=trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    wrong = [(t, bpe.token_to_id(t)) for i, t in enumerate(SPECIAL_TOKENS) if bpe.token_to_id(t) != i]
    if wrong or bpe.get_vocab_size() > VOCAB:
        sys.exit(f"tokenizer: special ids {wrong}, vocabulary {bpe.get_vocab_size()} (want <= {VOCAB})")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>",
        mask_token="<mask>", extra_special_tokens=NAMED_SPECIALS, model_max_length=4096, padding_side="left")
    fast.add_special_tokens({"additional_special_tokens": list(SPECIAL_TOKENS[5:])})
    fast.chat_template = CHAT_TEMPLATE
    fast.add_bos_token = False  # the template writes <bos>
    return fast


def processor(tok: PreTrainedTokenizerFast):  # -> a Gemma4Processor
    from transformers.models.gemma4 import (
        Gemma4AudioFeatureExtractor,
        Gemma4ImageProcessor,
        Gemma4Processor,
        Gemma4VideoProcessor,
    )

    return Gemma4Processor(
        feature_extractor=Gemma4AudioFeatureExtractor(), image_processor=Gemma4ImageProcessor(),
        tokenizer=tok, video_processor=Gemma4VideoProcessor(), chat_template=CHAT_TEMPLATE,
        image_seq_length=IMAGE_TOKENS)


def model() -> DiffusionGemmaForBlockDiffusion:
    text = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        layer_types=["sliding_attention", "full_attention"], sliding_window=64,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32,
        global_head_dim=64, num_global_key_value_heads=1, max_position_embeddings=4096,
        num_experts=4, top_k_experts=2, moe_intermediate_size=32,
        pad_token_id=0, eos_token_id=1, bos_token_id=2, tie_word_embeddings=True)
    vision = dict(
        model_type="gemma4_vision", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, head_dim=16, patch_size=16, pooling_kernel_size=3,
        position_embedding_size=1024, default_output_length=IMAGE_TOKENS)
    config = DiffusionGemmaConfig(text_config=text, vision_config=vision, boi_token_id=9, eoi_token_id=10,
                                  image_token_id=11, canvas_length=CANVAS, tie_word_embeddings=True)
    config.architectures = ["DiffusionGemmaForBlockDiffusion"]
    torch.manual_seed(0)
    return DiffusionGemmaForBlockDiffusion(config).to(torch.bfloat16).eval()


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tok = tokenizer()
    tok.save_pretrained(out)
    processor(tok).save_pretrained(out)
    net = model()
    net.save_pretrained(out, safe_serialization=True)
    (out / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=2))
    (out / "tiny_template_version.txt").write_text(f"{TEMPLATE_VERSION}\n")
    params = sum(p.numel() for p in net.parameters()) / 1e6
    print(f"tiny DiffusionGemma in {out}: {params:.2f}M parameters, vocabulary {len(tok)}, canvas {CANVAS}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tiny_dgemma.py OUT_DIR")
    main(Path(sys.argv[1]))

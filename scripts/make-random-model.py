#!/usr/bin/env python3
"""A random-weight Qwen2 model of a given size for speed benchmarks (no download: the GPU host
has torch + transformers and no network). Default: 7B-class (Qwen2.5-7B's shape) in bf16.
  scripts/make-random-model.py OUT_DIR [--tokenizer DIR_WITH_tokenizer.json] [--preset 7b|1.5b]
Weights are random, so the text is noise; shapes, bytes per token and speed are the real ones."""
import argparse, json, os, shutil

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

PRESETS = {
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
}

ap = argparse.ArgumentParser()
ap.add_argument("out")
ap.add_argument("--preset", default="7b", choices=PRESETS)
ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
ap.add_argument("--tokenizer", default=os.path.expanduser("~/.cache/shoal/models/qwen2.5-coder-1.5b"))
a = ap.parse_args()
cfg = Qwen2Config(max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6, torch_dtype=a.dtype, **PRESETS[a.preset])
torch.manual_seed(0)
with torch.device("cpu"):
    model = Qwen2ForCausalLM(cfg).to(getattr(torch, a.dtype))
model.save_pretrained(a.out, safe_serialization=True, max_shard_size="4GB")
tok = os.path.join(a.tokenizer, "tokenizer.json")
if os.path.exists(tok):
    shutil.copy(tok, os.path.join(a.out, "tokenizer.json"))
    json.dump({"bos_token": None, "eos_token": "<|endoftext|>"}, open(os.path.join(a.out, "tokenizer_config.json"), "w"))
print(a.out)

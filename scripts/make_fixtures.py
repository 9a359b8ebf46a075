#!/usr/bin/env python3
"""Generate tiny random-weight model fixtures and reference outputs for shoal.

What it does
------------
For each fixture name in FIXTURES it builds a *tiny* randomly initialised
Hugging Face `transformers` causal LM (hidden 64, vocab 512, a few layers),
re-initialises every weight with a fixed seed so that the logits are not
degenerate (norm weights random, not all ones; biases non-zero), and writes

    tests/fixtures/<name>/config.json          (exactly as `save_pretrained` writes it)
    tests/fixtures/<name>/model.safetensors    (or sharded: model-0000X-of-0000N.safetensors
                                                 + model.safetensors.index.json, for `llama`)
    tests/fixtures/<name>/reference.json       (reference logits, see below)

reference.json holds, all computed in float32 under torch.no_grad() with
attn_implementation="eager":

    family, dtype ("f32" | "bf16" | "f16": the dtype the weights are STORED in),
    transformers_version, torch_version,
    prompt_ids     : 20 token ids drawn from [3, vocab) with a fixed seed
    prefill_logits : logits (vocab floats) at every prompt position
    greedy_ids     : 16 ids generated greedily after the prompt
    step_logits    : 16 x vocab; step_logits[0] == prefill_logits[-1] (it chose
                     greedy_ids[0]); step_logits[i] are the logits after feeding
                     greedy_ids[i-1] incrementally through the KV cache
                     (past_key_values, one token at a time); they chose greedy_ids[i].

Floats are rounded to 7 significant digits. For the bf16 / f16 fixtures the
weights are first rounded to bf16 / f16 and the reference is computed in
float32 on those rounded weights, so an engine that widens the stored weights
to f32 at load time must match within 1e-4.

As a self-check the full sequence (prompt + generated ids) is re-run without a
cache and compared with the prefill and the incremental logits (must agree
within 1e-4; the max diff is printed).

What it does not do
-------------------
* It downloads nothing: no tokenizer, no pretrained weights (there is no
  tokenizer file in the fixtures; token ids are used directly).
* It is not run by the Rust test suite or CI; the fixtures it writes are
  committed. Re-running it with the versions below reproduces them
  (everything is seeded).
* It does not test sampling, batching, or any dtype other than f32 compute.

Generated with (pip install torch transformers safetensors numpy, PyPI):
    python 3.11.7, torch 2.15.0+cu132 (run on CPU), transformers 5.23.0,
    safetensors 0.8.0, numpy 2.4.6

Usage:  .venv/bin/python scripts/make_fixtures.py [name ...]
"""

import copy
import json
import math
import os
import shutil
import sys

import torch
import transformers
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT_DIR = os.path.join(ROOT, "tests", "fixtures")

VOCAB = 512
PROMPT_LEN = 20
GEN_LEN = 16
TOL = 1e-4

# Weight init (re-applied after from_config so the values are under our control).
# Projections are deliberately larger than the embeddings so that the layers,
# not the current token's embedding, dominate the residual stream: otherwise a
# random model just repeats one token and greedy decoding tests little.
EMBED_STD = 0.1  # embed_tokens (also the lm_head of tied models)
GEMMA_EMBED_STD = 0.03  # Gemma multiplies the embeddings by sqrt(hidden) = 8
PROJ_STD = 0.2  # q/k/v/o and MLP projections
LM_HEAD_STD = 0.15  # untied lm_head
BIAS_STD = 0.1  # q/k/v biases (qwen2)
NORM_STD = 0.2  # norm weights: 1 + N(0, NORM_STD), or N(0, NORM_STD) for Gemma's (1 + w)

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def fixture_specs():
    llama_cfg = LlamaConfig(
        **COMMON,
        hidden_act="silu",
        # Llama-3.1 style scaling. original_max_position_embeddings=64 (instead of
        # the real 8192) so that with head_dim 16 / theta 5e5 the wavelengths
        # (6.3, 32.4, 167, ...) fall into all three llama3 branches: kept
        # (< 16), smoothly interpolated (16..64) and divided by factor (> 64).
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
    )
    mistral_cfg = MistralConfig(
        **COMMON,
        hidden_act="silu",
        sliding_window=None,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
    )

    def qwen2_cfg():
        return Qwen2Config(
            **COMMON,
            hidden_act="silu",
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            use_sliding_window=False,
            sliding_window=None,
            tie_word_embeddings=True,
        )

    qwen3_common = dict(COMMON, head_dim=32)
    qwen3_cfg = Qwen3Config(
        **qwen3_common,
        hidden_act="silu",
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        attention_bias=False,
        use_sliding_window=False,
        sliding_window=None,
        tie_word_embeddings=False,
    )
    gemma3_common = dict(COMMON, head_dim=32, num_hidden_layers=6)
    gemma3_cfg = Gemma3TextConfig(
        **gemma3_common,
        hidden_activation="gelu_pytorch_tanh",
        query_pre_attn_scalar=32,
        sliding_window=8,
        layer_types=[
            "sliding_attention",
            "sliding_attention",
            "full_attention",
            "sliding_attention",
            "sliding_attention",
            "full_attention",
        ],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
        },
        final_logit_softcapping=None,
        attn_logit_softcapping=None,
        tie_word_embeddings=True,
    )
    return {
        # name: (family, model class, config, stored dtype, seed, save kwargs)
        "llama": ("llama", LlamaForCausalLM, llama_cfg, "f32", 1011, {"max_shard_size": "300KB"}),
        "mistral": ("mistral", MistralForCausalLM, mistral_cfg, "f32", 1002, {}),
        "qwen2": ("qwen2", Qwen2ForCausalLM, qwen2_cfg(), "f32", 1003, {}),
        "qwen2-bf16": ("qwen2", Qwen2ForCausalLM, qwen2_cfg(), "bf16", 1004, {}),
        "qwen2-f16": ("qwen2", Qwen2ForCausalLM, qwen2_cfg(), "f16", 1005, {}),
        "qwen3": ("qwen3", Qwen3ForCausalLM, qwen3_cfg, "f32", 1006, {}),
        "gemma3": ("gemma3", Gemma3ForCausalLM, gemma3_cfg, "f32", 1007, {}),
    }


TORCH_DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}


def reinit_(model, family, gen):
    """Deterministically overwrite every parameter (sorted by name)."""
    gemma = family == "gemma3"
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if p.ndim == 1 and "norm" in name:
                noise = torch.randn(p.shape, generator=gen) * NORM_STD
                # Gemma RMSNorm computes x * (1 + w): keep w around 0 (scale ~1).
                p.copy_(noise if gemma else 1.0 + noise)
            elif p.ndim == 1 and name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * BIAS_STD)
            elif p.ndim == 2 and "embed_tokens" in name:
                std = GEMMA_EMBED_STD if gemma else EMBED_STD
                p.copy_(torch.randn(p.shape, generator=gen) * std)
            elif p.ndim == 2 and name.startswith("lm_head"):
                p.copy_(torch.randn(p.shape, generator=gen) * LM_HEAD_STD)
            elif p.ndim == 2:
                p.copy_(torch.randn(p.shape, generator=gen) * PROJ_STD)
            else:
                raise RuntimeError(f"unexpected parameter {name} {tuple(p.shape)}")


def round_weights_(model, dtype):
    """Round parameters (not buffers such as rope inv_freq) through `dtype`."""
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.copy_(p.to(dtype).to(torch.float32))


def r7(x):
    return float(f"{x:.7g}")


def rows(t):
    return [[r7(v) for v in row] for row in t.tolist()]


@torch.no_grad()
def reference(model, prompt_ids):
    ids = torch.tensor([prompt_ids], dtype=torch.long)
    out = model(input_ids=ids, use_cache=True)
    prefill = out.logits[0].float()  # [P, V]
    past = out.past_key_values

    step_logits = [prefill[-1]]
    greedy = [int(torch.argmax(prefill[-1]))]
    for _ in range(GEN_LEN - 1):
        out = model(
            input_ids=torch.tensor([[greedy[-1]]], dtype=torch.long),
            past_key_values=past,
            use_cache=True,
        )
        past = out.past_key_values
        logits = out.logits[0, -1].float()
        step_logits.append(logits)
        greedy.append(int(torch.argmax(logits)))
    step = torch.stack(step_logits)  # [G, V]

    # Self-check: whole sequence, no cache.
    full_ids = torch.tensor([prompt_ids + greedy[:-1]], dtype=torch.long)
    full = model(input_ids=full_ids, use_cache=False).logits[0].float()
    d_prefill = (full[:PROMPT_LEN] - prefill).abs().max().item()
    d_step = (full[PROMPT_LEN - 1 :] - step).abs().max().item()

    top2 = torch.topk(step, 2, dim=-1).values
    margin = (top2[:, 0] - top2[:, 1]).min().item()
    return prefill, greedy, step, d_prefill, d_step, margin


def make(name, spec):
    family, cls, config, dtype, seed, save_kwargs = spec
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = cls._from_config(config, attn_implementation="eager", dtype=torch.float32)
    model.eval()
    reinit_(model, family, gen)
    if dtype != "f32":
        round_weights_(model, TORCH_DTYPES[dtype])

    out = os.path.join(OUT_DIR, name)
    if os.path.isdir(out):
        shutil.rmtree(out)
    os.makedirs(out)
    to_save = copy.deepcopy(model).to(TORCH_DTYPES[dtype])
    to_save.save_pretrained(out, **save_kwargs)
    del to_save
    # save_pretrained may write a generation_config.json; the fixtures do not need it.
    gc = os.path.join(out, "generation_config.json")
    if os.path.exists(gc):
        os.remove(gc)

    pgen = torch.Generator().manual_seed(seed + 7)
    prompt_ids = torch.randint(3, VOCAB, (PROMPT_LEN,), generator=pgen).tolist()
    prefill, greedy, step, d_prefill, d_step, margin = reference(model, prompt_ids)
    assert torch.equal(step[0], prefill[-1])
    print(
        f"{name:11s} self-check max|diff| prefill={d_prefill:.3e} incremental={d_step:.3e}  "
        f"logit range [{prefill.min().item():.2f}, {prefill.max().item():.2f}]  "
        f"min greedy top1-top2 margin={margin:.4f}  greedy={greedy}"
    )
    assert d_prefill < TOL and d_step < TOL, (name, d_prefill, d_step)
    if len(set(greedy)) < 4:
        print(f"WARNING {name}: greedy output is nearly constant: {greedy}")
    if margin < 5e-3:
        print(f"WARNING {name}: greedy top1-top2 margin {margin} is small")

    ref = {
        "family": family,
        "dtype": dtype,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "prompt_ids": prompt_ids,
        "prefill_logits": rows(prefill),
        "greedy_ids": greedy,
        "step_logits": rows(step),
    }
    with open(os.path.join(out, "reference.json"), "w") as f:
        json.dump(ref, f, separators=(",", ":"))
        f.write("\n")
    return d_prefill, d_step


def main(argv):
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    specs = fixture_specs()
    names = argv or list(specs)
    for n in names:
        if n not in specs:
            sys.exit(f"unknown fixture {n!r}; known: {', '.join(specs)}")
        make(n, specs[n])


if __name__ == "__main__":
    main(sys.argv[1:])

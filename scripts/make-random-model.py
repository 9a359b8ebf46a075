#!/usr/bin/env python3
"""make-random-model.py — write a random-weight Hugging Face model of a real architecture's shape.

Usage: make-random-model.py --shape qwen2.5-0.5b|qwen2.5-1.5b|qwen2.5-3b|qwen2.5-7b|llama3-8b --out DIR
                            [--dtype f16|bf16|f32] [--tokenizer tokenizer.json] [--peaky] [--seed N]

For benchmarks and device checks where the real weights cannot travel (the GPU machine has no
network): the shapes (and so bytes per token and FLOPs) are those of the released models; the
weights are random (transformers' own initialisation), built on a CUDA GPU when there is one.
--peaky scales the embedding/LM head so that greedy picks have clear margins (device-vs-CPU
comparisons then test the arithmetic, not near-ties). It does not download anything.
"""
import argparse, json, os, shutil, time

SHAPES = {
    "qwen2.5-0.5b": dict(arch="Qwen2ForCausalLM", model_type="qwen2", hidden_size=896, intermediate_size=4864,
                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                         max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(arch="Qwen2ForCausalLM", model_type="qwen2", hidden_size=1536, intermediate_size=8960,
                         num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                         max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True),
    "qwen2.5-3b": dict(arch="Qwen2ForCausalLM", model_type="qwen2", hidden_size=2048, intermediate_size=11008,
                       num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2, vocab_size=151936,
                       max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True),
    "qwen2.5-7b": dict(arch="Qwen2ForCausalLM", model_type="qwen2", hidden_size=3584, intermediate_size=18944,
                       num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                       max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False),
    "llama3-8b": dict(arch="LlamaForCausalLM", model_type="llama", hidden_size=4096, intermediate_size=14336,
                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                      max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False),
}

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", required=True, choices=sorted(SHAPES))
    ap.add_argument("--out", required=True)
    ap.add_argument("--dtype", default="f16", choices=["f16", "bf16", "f32"])
    ap.add_argument("--tokenizer")
    ap.add_argument("--peaky", action="store_true")
    ap.add_argument("--seed", type=int, default=1234)
    a = ap.parse_args()
    import torch, transformers
    torch.manual_seed(a.seed)
    s = dict(SHAPES[a.shape])
    arch = s.pop("arch")
    cfg = transformers.AutoConfig.for_model(s.pop("model_type"), **s)
    cfg.architectures = [arch]
    dtype = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}[a.dtype]
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    t0 = time.time()
    with torch.device(dev):
        model = getattr(transformers, arch)(cfg).to(dtype)
    if a.peaky:
        with torch.no_grad():
            model.get_output_embeddings().weight.mul_(8.0)
    model.eval()
    os.makedirs(a.out, exist_ok=True)
    model.save_pretrained(a.out, safe_serialization=True, max_shard_size="4GB")
    if a.tokenizer:
        shutil.copy(a.tokenizer, os.path.join(a.out, "tokenizer.json"))
        with open(os.path.join(a.out, "tokenizer_config.json"), "w") as f:
            json.dump({"bos_token": None, "eos_token": "<|endoftext|>", "add_bos_token": False}, f)
    n = sum(p.numel() for p in model.parameters())
    print(f"{a.shape}: {n/1e9:.2f}B parameters ({a.dtype}) in {a.out}, {time.time()-t0:.1f}s", flush=True)

if __name__ == "__main__":
    main()

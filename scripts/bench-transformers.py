#!/usr/bin/env python3
"""bench-transformers.py — the baseline for `shoal bench` on a GPU: Hugging Face transformers
(PyTorch, f16) on the same model directory, same prompt length and generated tokens.

Usage: bench-transformers.py --model DIR [--prompt-tokens 256] [--gen-tokens 128] [--repetitions 3]
Prints one JSON line: {"prefill_tok_s", "decode_tok_s", ...}. Prefill is one forward pass over the
prompt; decode is `generate` (greedy, exactly gen-tokens new tokens, KV cache on) after a short
prompt, minus nothing: what a transformers user gets. Medians after a warm-up. No downloads.
"""
import argparse, json, statistics, time

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--gen-tokens", type=int, default=128)
    ap.add_argument("--repetitions", type=int, default=3)
    a = ap.parse_args()
    import torch, transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float16).to("cuda").eval()
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, min(vocab, 30000), (1, a.prompt_tokens), generator=g).to("cuda")
    short = prompt[:, :4]
    def prefill():
        torch.cuda.synchronize(); t = time.perf_counter()
        with torch.no_grad():
            model(prompt, use_cache=False)
        torch.cuda.synchronize(); return a.prompt_tokens / (time.perf_counter() - t)
    def decode():
        torch.cuda.synchronize(); t = time.perf_counter()
        with torch.no_grad():
            out = model.generate(short, max_new_tokens=a.gen_tokens, min_new_tokens=a.gen_tokens, do_sample=False, pad_token_id=0)
        torch.cuda.synchronize(); dt = time.perf_counter() - t
        return (out.shape[1] - short.shape[1]) / dt
    prefill(); decode()
    p = [prefill() for _ in range(a.repetitions)]
    d = [decode() for _ in range(a.repetitions)]
    print(json.dumps({"engine": "transformers " + transformers.__version__, "torch": torch.__version__, "model": a.model,
                      "prefill_tok_s": statistics.median(p), "decode_tok_s": statistics.median(d),
                      "prefill_runs": p, "decode_runs": d}), flush=True)

if __name__ == "__main__":
    main()

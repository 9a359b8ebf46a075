#!/usr/bin/env bash
# What the HTTP API costs: time to first token and decode tok/s for the same model, prompt
# and greedy settings through `shoal run` (engine only) and through `shoal serve` (a streamed
# /v1/completions read by a Python client as it arrives), runs interleaved, medians printed
# with the API/run ratios. Usage: scripts/bench-api.sh [model id] [runs] [max tokens]
# It measures one machine as it is: on a shared machine, other load shows up as noise, so the
# last line pairs each API run with serve's own engine figures for that same generation: that
# difference is the API's cost. `shoal run` is a fresh process each time, so its first prefill
# also pays the first touch of the memory-mapped weights, which a warm server does not.
set -euo pipefail
cd "$(dirname "$0")/.."
model="${1:-gemma3-270m}"
runs="${2:-5}"
max_tokens="${3:-64}"
prompt="The history of the lighthouse begins in ancient Egypt, where"
dir="$(scripts/fetch-model.sh "$model")"
cargo build --release --bin shoal >&2
data="$(mktemp -d)"
# A private copy: another build cannot replace the binary halfway through the runs.
cp "${CARGO_TARGET_DIR:-target}/release/shoal" "$data/shoal"
bin="$data/shoal"
log="$data/serve.log"
"$bin" serve --host 127.0.0.1 --api-port 0 --no-discovery --listen /ip4/127.0.0.1/tcp/0 --data-dir "$data" --model "$dir/model.gguf" 2>"$log" &
server=$!
trap 'kill "$server" 2>/dev/null; wait "$server" 2>/dev/null; rm -rf "$data"' EXIT
for _ in $(seq 300); do
    url="$(sed -n 's|^web UI and API: \(http://[^ ]*\)/$|\1|p' "$log")"
    [ -n "$url" ] && curl -sf "$url/v1/cluster" | grep -q '"strategy"' && break
    sleep 0.1
done
[ -n "$url" ] || { echo "shoal serve did not start:" >&2; cat "$log" >&2; exit 1; }

python3 - "$bin" "$dir/model.gguf" "$url" "$prompt" "$max_tokens" "$runs" <<'EOF'
import json, re, statistics, subprocess, sys, time, urllib.request

binary, model, url, prompt, max_tokens, runs = sys.argv[1:7]
max_tokens, runs = int(max_tokens), int(runs)

def run_once():
    out = subprocess.run([binary, "run", "--model", model, "--prompt", prompt, "--max-tokens", str(max_tokens)], capture_output=True, text=True, check=True)
    m = re.search(r"generated (\d+) tokens at ([\d.]+) tok/s, first token after ([\d.]+)s", out.stderr)
    return {"ttft": float(m.group(3)), "decode": float(m.group(2)), "tokens": int(m.group(1)), "text": out.stdout.rstrip("\n")}

def api_once():
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body, headers={"content-type": "application/json"})
    sent = time.perf_counter()
    first = last = None
    pieces, shoal, usage = [], {}, None
    with urllib.request.urlopen(req) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            text = chunk["choices"][0]["text"] if chunk.get("choices") else ""
            if text:
                now = time.perf_counter()
                first = first or now
                last = now
                pieces.append(text)
            shoal = chunk.get("shoal", shoal)
            if chunk.get("usage"):
                usage = chunk["usage"]
    n = len(pieces)
    # The engine's own time to first token in this very run: prompt tokens at its prefill rate.
    shoal["engine_ttft"] = usage["prompt_tokens"] / shoal["prefill_tok_s"]
    return {"ttft": first - sent, "decode": (n - 1) / (last - first) if n > 1 else 0.0, "tokens": n, "text": "".join(pieces), "server": shoal}

results = {"run": [], "api": []}
run_once(); api_once()  # warm the page cache and both processes
for i in range(runs):
    results["run"].append(run_once())
    results["api"].append(api_once())
if results["run"][0]["text"] != results["api"][0]["text"]:
    print("warning: the API's text differs from shoal run's", file=sys.stderr)
med = lambda k, key: statistics.median(r[key] for r in results[k])
ttft_run, ttft_api = med("run", "ttft"), med("api", "ttft")
dec_run, dec_api = med("run", "decode"), med("api", "decode")
print(f"model {model}, {runs} runs each, {max_tokens} tokens, prompt of {len(prompt)} chars")
print(f"time to first token: run {ttft_run*1000:.1f} ms, api {ttft_api*1000:.1f} ms (client-side), api/run {ttft_api/ttft_run:.3f}")
print(f"decode tok/s:        run {dec_run:.2f}, api {dec_api:.2f} (client-side, token arrival), api/run {dec_api/dec_run:.3f}")
# Paired within each API run (same generation, so other load on the machine cancels out):
# what the client saw vs what serve's engine measured for itself.
ttft_over = statistics.median(r["ttft"] - r["server"]["engine_ttft"] for r in results["api"])
dec_ratio = statistics.median(r["decode"] / r["server"]["decode_tok_s"] for r in results["api"])
print(f"paired, same generation: client TTFT - engine TTFT = {ttft_over*1000:.2f} ms; client/engine decode tok/s = {dec_ratio:.4f}")
EOF

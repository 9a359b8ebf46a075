#!/usr/bin/env bash
# gpu-check.sh — run on a CUDA machine (with the binaries from scripts/build-cuda.sh): fidelity,
# benchmarks against Hugging Face transformers, and a mixed CPU + GPU swarm. Model weights are
# generated there (scripts/make-random-model.py, real shapes, random values); only the binaries
# and tokenizer.json travel.
#   scripts/gpu-check.sh fidelity [fixtures]   fixtures vs transformers on the GPU; Qwen2.5-1.5B-shaped
#                                   f16 and Q4_K_M: 16 greedy tokens on the GPU equal the CPU's
#                                   (f16), the fused decode step agrees with candle's ops (also
#                                   over a 3,000-token cache, attention shared out over blocks of one
#                                   tile and of six, and a
#                                   bf16 0.5B-shaped model's over 1,500); decoding
#                                   with the GPU picking each token gives the host loop's (and the
#                                   LM head's own greedy pick, .gpu/pick_check, the host's argmax
#                                   over ties and NaN); two
#                                   sequences decoded turn about equal each decoded alone; a
#                                   600-token Q4_K_M prompt dequantized to f16 is at least as
#                                   close to f32 as candle's MMQ kernels; the
#                                   GPU's sampling (temperature, top-k, top-p, min-p) agrees with the CPU sampler;
#                                   Q4_K / Q6_K matrices dequantized on the GPU equal the CPU's
#   scripts/gpu-check.sh bench [SHAPE...]   shoal bench (f16, Q4_K_M) vs transformers f16 on the
#                                   same GPU, one run, printed as a table; shapes q15 (Qwen2.5-1.5B),
#                                   q7 (Qwen2.5-7B; these two by default), q05 (0.5B), q3 (3B), l8
#                                   (Llama-3-8B); each model's decode also after DEPTH (4096)
#                                   tokens of context (rows "@4096", KV cache bytes counted)
#   scripts/gpu-check.sh swarm      a CUDA node and two CPU-only nodes (network namespaces when
#                                   `ip netns` works, loopback otherwise) serve one model; the
#                                   plan and the output are compared with one node
#   scripts/gpu-check.sh models [SHAPE...]   only generate (and quantize) the models, side by side
#   scripts/gpu-check.sh ab "MODELS" "SETTINGS" [ROUNDS]   for A/B tuning: decode tok/s, roofline
#                                   and prompt tok/s (AB_PROMPT tokens, 64 by default; quantized
#                                   prompts are dequantized from 128) of each model (SHAPE-f16 or
#                                   SHAPE-q4km: q15-f16 q7-q4km ...) under each
#                                   setting in turn, ROUNDS times (2); SETTINGS are ';'-separated,
#                                   each a list of VAR=value (SHOAL_BIN=path: another build), '' the
#                                   defaults: ab "q15-f16" "SHOAL_FUSED_PRELOAD=0;"
#   scripts/gpu-check.sh trace MODEL...   the fused step's per-launch timeline (SHOAL_FUSED_TRACE=1;
#                                   TRACE=2: every launch's line too)
# Environment: SHOAL_BIN (default .gpu/shoal), DEVICE_CHECK (.gpu/device_check), PICK_CHECK
# (.gpu/pick_check), TOKENIZER
# (.gpu/tokenizer.json), WORK (/tmp/shoal-gpu: generated models, kept between stages), OUT,
# DEVICE (ab and trace: cuda).
set -uo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
BIN=${SHOAL_BIN:-$here/.gpu/shoal}
CHECK=${DEVICE_CHECK:-$here/.gpu/device_check}
TOK=${TOKENIZER:-$here/.gpu/tokenizer.json}
WORK=${WORK:-/tmp/shoal-gpu}
OUT=${OUT:-$WORK/out}
mkdir -p "$WORK" "$OUT"
for b in shoal device_check; do  # unpack what scripts/build-cuda.sh packed
  [[ -f $here/.gpu/$b.gz && ! -x $here/.gpu/$b ]] && gunzip -c "$here/.gpu/$b.gz" > "$here/.gpu/$b" && chmod +x "$here/.gpu/$b"
done
for lib in /usr/local/cuda/lib64 /usr/local/cuda-13.0/targets/x86_64-linux/lib /usr/local/cuda/targets/x86_64-linux/lib; do
  [[ -d $lib ]] && export LD_LIBRARY_PATH="$lib:${LD_LIBRARY_PATH:-}"
done
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
# A machine without iproute2 can be lent one (a wrapper with its libraries, see the README).
[[ -x $here/.gpu/netns/ip ]] && ! command -v ip >/dev/null && export PATH="$here/.gpu/netns:$PATH"
fail=0

model() { # model NAME SHAPE [--peaky]: a generated f16 HF dir and its Q4_K_M GGUF
  local name=$1 shape=$2; shift 2
  if [[ ! -f $WORK/$name-f16/config.json ]]; then
    python3 "$here/scripts/make-random-model.py" --shape "$shape" --out "$WORK/$name-f16" --tokenizer "$TOK" "$@" || return 1
  fi
  if [[ ! -f $WORK/$name-q4km/model.gguf ]]; then
    "$BIN" models quantize "$WORK/$name-f16" --type q4_k_m --out "$WORK/$name-q4km" >/dev/null || return 1
  fi
}

shape() { # shape q15|q7|q05|q3|l8: that shape's f16 model and Q4_K_M GGUF, generated if missing
  case $1 in
    q15) model q15 qwen2.5-1.5b --peaky ;;
    q7) model q7 qwen2.5-7b ;;
    q05) model q05 qwen2.5-0.5b ;;
    q3) model q3 qwen2.5-3b ;;
    l8) model l8 llama3-8b ;;
    *) echo "unknown shape $1 (q15, q7, q05, q3, l8)" >&2; return 1 ;;
  esac
}

fidelity() {
  "$CHECK" fixtures "$here/tests/fixtures" --device cuda || fail=1
  [[ ${1:-} == fixtures ]] && return
  "$CHECK" sample --device cuda || fail=1
  # The greedy pick inside the LM head's launch: ties, NaN, a vocabulary shorter than the head.
  "${PICK_CHECK:-$here/.gpu/pick_check}" || fail=1
  # Prompts' Q4_K and Q6_K matrices dequantized on the GPU equal the CPU's dequantization.
  "$CHECK" dequant --device cuda || fail=1
  shape q15 || { echo "FAIL making the 1.5B model"; fail=1; return; }
  "$CHECK" same "$WORK/q15-f16" --device cuda --tokens 16 || fail=1
  # Not the Q4_K_M GGUF: its free-running greedy tokens part from the CPU's at the first near-tie
  # (the GPU quantizes activations in blocks of 32, the CPU in blocks of 256, each as llama.cpp
  # does there), which fell at 4 to 9 of 16 in sessions 31-36; the `fused` checks below judge
  # that path against candle's kernels instead. (`device_check same` still takes a GGUF.)
  "$CHECK" fused "$WORK/q15-f16" --device cuda --tokens 32 || fail=1
  # Q4_K and Q6_K rows take int8 activations: without them (SHOAL_FUSED_RING=0) the step matches
  # candle's f32-activation result; with them, it must be as close to it as candle's own
  # 8-bit-activation kernels are.
  SHOAL_FUSED_RING=0 "$CHECK" fused "$WORK/q15-q4km/model.gguf" --device cuda --tokens 32 || fail=1
  "$CHECK" fused "$WORK/q15-q4km/model.gguf" --device cuda --tokens 32 --int8 || fail=1
  # Decoding one step ahead of the host (the GPU picks each token) gives the host loop's tokens.
  "$CHECK" chain "$WORK/q15-f16" --device cuda --tokens 64 || fail=1
  "$CHECK" chain "$WORK/q15-q4km/model.gguf" --device cuda --tokens 64 || fail=1
  "$CHECK" interleave "$WORK/q15-f16" --device cuda --tokens 64 || fail=1
  "$CHECK" interleave "$WORK/q15-q4km/model.gguf" --device cuda --tokens 64 || fail=1
  # Prompts of 128 tokens and more multiply quantized matrices dequantized to f16 (cuBLAS).
  "$CHECK" prompt "$WORK/q15-q4km/model.gguf" --device cuda --tokens 600 || fail=1
  # Decode over a long cache: each KV head's keys shared out over blocks that each attend for
  # all its query heads and merge their states together (`attend_group`; 3,000 keys: 94 blocks
  # of about 32 keys a KV head, one tile each); then 8 blocks a KV head (375 keys each: six tiles
  # a block, each loaded while the one before is used); then about 120 blocks of 6 keys; then the
  # per-query-head split kept for shapes the grouped kernel does not take.
  "$CHECK" fused "$WORK/q15-f16" --device cuda --tokens 16 --context 3000 || fail=1
  SHOAL_FUSED_ATTEND_GROUP_SPLITS=8 "$CHECK" fused "$WORK/q15-f16" --device cuda --tokens 16 --context 3000 || fail=1
  SHOAL_FUSED_RING=0 "$CHECK" fused "$WORK/q15-q4km/model.gguf" --device cuda --tokens 16 --context 3000 || fail=1
  SHOAL_FUSED_ATTEND_GROUP_KEYS=1 "$CHECK" fused "$WORK/q15-f16" --device cuda --tokens 16 --context 700 || fail=1
  SHOAL_FUSED_ATTEND_GROUP=0 "$CHECK" fused "$WORK/q15-f16" --device cuda --tokens 16 --context 3000 || fail=1
  # The grouped kernel's bf16 tensor-core products: a 0.5B-shaped bf16 model (d = 64, 7 query
  # heads a KV head).
  if [[ ! -f $WORK/q05-bf16/config.json ]]; then
    python3 "$here/scripts/make-random-model.py" --shape qwen2.5-0.5b --out "$WORK/q05-bf16" --dtype bf16 --tokenizer "$TOK" >/dev/null || fail=1
  fi
  "$CHECK" fused "$WORK/q05-bf16" --device cuda --tokens 16 --context 1500 || fail=1
}

bench() { # bench [SHAPE...]: which model shapes (q15, q7, q05, q3, l8; default q15 q7)
  local shapes=("$@"); [[ ${#shapes[@]} -eq 0 ]] && shapes=(q15 q7)
  local runs=()
  for s in "${shapes[@]}"; do
    shape "$s" || { echo "FAIL making $s"; fail=1; return; }
    runs+=("$s-f16" "$s-q4km")
  done
  : > "$OUT/bench.jsonl"
  for m in "${runs[@]}"; do
    "$BIN" bench --model "$WORK/$m" --device cuda --json | sed "s/^{/{\"name\":\"shoal $m\",/" >> "$OUT/bench.jsonl" || fail=1
    # Decode after a long context (DEPTH tokens, 4,096 by default): the roofline counts the KV
    # cache read too; no transformers figure beside it.
    "$BIN" bench --model "$WORK/$m" --device cuda --json --prompt-tokens 16 --gen-tokens 64 --depth "${DEPTH:-4096}" | sed "s/^{/{\"name\":\"shoal $m @${DEPTH:-4096}\",/" >> "$OUT/bench.jsonl" || fail=1
    case $m in *-f16) python3 "$here/scripts/bench-transformers.py" --model "$WORK/$m" | sed "s/^{/{\"name\":\"transformers $m\",/" >> "$OUT/bench.jsonl" || fail=1 ;; esac
  done
  python3 - "$OUT/bench.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
by = {r["name"]: r for r in rows}
print(f"{'run':28} {'prompt tok/s':>12} {'decode tok/s':>12} {'MB/token':>9} {'roofline':>8} {'vs transformers':>16}")
for r in rows:
    base = by.get("transformers " + r["name"].split()[1].replace("q4km", "f16"))
    ratio = f"{r['decode_tok_s']/base['decode_tok_s']:.2f}x / {r['prefill_tok_s']/base['prefill_tok_s']:.2f}x" if base and r is not base and r.get("depth", 0) < 16 else ""
    mb = f"{(r['bytes_per_token'] + r.get('kv_bytes_per_token', 0))/1e6:.0f}" if "bytes_per_token" in r else ""
    roof = f"{r['roofline_fraction']:.2f}" if "roofline_fraction" in r else ""
    print(f"{r['name']:28} {r['prefill_tok_s']:12.1f} {r['decode_tok_s']:12.1f} {mb:>9} {roof:>8} {ratio:>16}")
if rows and "mem_bw_bytes_s" in rows[0]:
    print(f"device copy bandwidth (read+write): {rows[0]['mem_bw_bytes_s']/1e9:.0f} GB/s; ratios are decode / prompt vs transformers f16")
PY
}

model_path() { # model_path SHAPE-f16|SHAPE-q4km: generated if missing; prints its path
  [[ $1 == *-f16 || $1 == *-q4km ]] || { echo "unknown model $1 (SHAPE-f16 or SHAPE-q4km)" >&2; return 1; }
  shape "${1%-*}" >&2 || return 1
  case $1 in *-q4km) echo "$WORK/$1/model.gguf" ;; *) echo "$WORK/$1" ;; esac
}

ab() { # ab "MODELS" "SETTINGS" [ROUNDS]: settings alternate within each round, so drift hits all alike
  local models=() settings=() paths=() rounds=${3:-2}
  read -ra models <<< "${1:-}"
  IFS=';' read -ra settings <<< "${2:-}"
  [[ ${2:-} == *';' ]] && settings+=("")  # (read drops a trailing empty field)
  [[ ${#settings[@]} -eq 0 ]] && settings=("")
  for m in "${models[@]}"; do
    local p; p=$(model_path "$m") || { fail=1; return; }
    paths+=("$p")
  done
  for r in $(seq "$rounds"); do
    for i in "${!models[@]}"; do
      for s in "${settings[@]}"; do
        local json
        json=$( [[ -n ${s// } ]] && export $s; "${SHOAL_BIN:-$BIN}" bench --model "${paths[$i]}" --device "${DEVICE:-cuda}" --prompt-tokens "${AB_PROMPT:-64}" --repetitions 3 --json 2>/dev/null | tail -1 )
        python3 -c 'import json, sys
r, m, s, j = sys.argv[1:5]
try:
    d = json.loads(j)
    print("round %s  %-12s [%s]  decode %.1f tok/s  roofline %.3f  prompt %.1f tok/s" % (r, m, s, d["decode_tok_s"], d["roofline_fraction"], d["prefill_tok_s"]))
except ValueError:
    print("round %s  %-12s [%s]  FAILED (no benchmark result)" % (r, m, s)); sys.exit(1)' "$r" "${models[$i]}" "$s" "$json" || fail=1
      done
    done
  done
}

trace() { # trace MODEL...: one traced benchmark each (64 prompt tokens), its per-launch table
  for m in "$@"; do
    local p; p=$(model_path "$m") || { fail=1; continue; }
    echo "$m:"
    # TRACE=2: also every launch's line (layer by layer).
    SHOAL_FUSED_TRACE=${TRACE:-1} "$BIN" bench --model "$p" --device "${DEVICE:-cuda}" --prompt-tokens 64 --repetitions 1 2>&1 | grep -A "$([[ ${TRACE:-1} == 2 ]] && echo 1200 || echo 8)" "fused step trace" | grep -E "^ |fused step" || { echo "  no trace (not a fused CUDA step?)"; fail=1; }
  done
}

swarm() {
  shape q15 || { fail=1; return; }
  # f16 weights: the GPU computes in f16, the CPUs in f32, and greedy still agrees (fidelity).
  local m="$WORK/q15-f16" prompt="Once upon a time" n=16
  local one_gpu one_cpu
  one_gpu=$("$BIN" run --model "$m" --device cuda --prompt "$prompt" --max-tokens $n 2>/dev/null)
  one_cpu=$("$BIN" run --model "$m" --device cpu --prompt "$prompt" --max-tokens $n 2>/dev/null)
  local ips=() ns=()
  if "$here/scripts/netns.sh" up 3 mix >/dev/null 2>&1; then
    ips=(10.77.0.1 10.77.0.2 10.77.0.3); ns=(mix-1 mix-2 mix-3); echo "network namespaces mix-1..3"
  else
    ips=(127.0.0.1 127.0.0.1 127.0.0.1); echo "no network namespaces here: loopback with --peer"
  fi
  # 3.55 GB of f16 weights as stored (the tied embedding counts twice) and a KV cache reserved
  # for 4,096 positions: a layer takes 97.8 MB on the GPU (f16, its cache at half width) and
  # 195.6 MB on a CPU (widened to f32), the embedding and the head 0.47 GB each on the GPU and
  # 0.93 GB on a CPU. No node holds it alone (3.67 GB on the GPU, 7.3 on a CPU); the GPU, first
  # as the node with the most memory, gets all the 21 layers its 2.6 GB allow.
  local devices=(cuda cpu cpu) limits=(2.6GB 2.0GB 2.0GB) pids=() first=""
  for i in 0 1 2; do
    local args=(serve --data-dir "$WORK/node$i" --model "$m" --device "${devices[$i]}" --memory-limit "${limits[$i]}" --max-queue 4)
    rm -rf "$WORK/node$i"
    if [[ ${#ns[@]} -gt 0 ]]; then
      ip netns exec "${ns[$i]}" "$BIN" "${args[@]}" --host 0.0.0.0 > "$OUT/node$i.log" 2>&1 &
    else
      local peer=(); [[ -n $first ]] && peer=(--peer "$first")
      "$BIN" "${args[@]}" --host 127.0.0.1 --api-port $((52500 + i)) --no-discovery --listen /ip4/127.0.0.1/tcp/$((53400 + i)) "${peer[@]}" > "$OUT/node$i.log" 2>&1 &
      # The others dial the first node by its full address (with its /p2p/ id).
      for _ in $(seq 1 600); do
        first=$(grep -o '/ip4/127.0.0.1/tcp/53400/p2p/[A-Za-z0-9]*' "$OUT/node0.log" | head -1); [[ -n $first ]] && break; sleep 0.1
      done
    fi
    pids+=($!)
  done
  python3 - "${ips[1]}" "$([[ ${#ns[@]} -gt 0 ]] && echo 52415 || echo 52501)" "${ns[1]:-}" "$prompt" $n "$one_gpu" "$one_cpu" "$OUT" <<'PY' || fail=1
import json, subprocess, sys, time
ip, port, ns, prompt, n, one_gpu, one_cpu, out = sys.argv[1:9]
def http(path, body=None):
    cmd = (["ip", "netns", "exec", ns] if ns else []) + ["python3", "-c",
        "import sys,urllib.request;d=sys.argv[2].encode() if len(sys.argv)>2 else None;"
        "import urllib.error\ntry: r=urllib.request.urlopen(urllib.request.Request(sys.argv[1],data=d,headers={'content-type':'application/json'}),timeout=300)\nexcept urllib.error.HTTPError as e: r=e\nprint(r.read().decode())",
        f"http://{ip}:{port}{path}"] + ([json.dumps(body)] if body else [])
    return json.loads(subprocess.run(cmd, capture_output=True, text=True, timeout=320).stdout or "null")
deadline = time.time() + 120
while time.time() < deadline:
    try:
        c = http("/v1/cluster")
        if c and len(c.get("nodes", [])) == 3: break
    except Exception: pass
    time.sleep(1)
else:
    print("FAIL: three nodes never agreed"); sys.exit(1)
t = time.time()
model = http("/v1/models")["data"][0]["id"]
r = http("/v1/completions", {"model": model, "prompt": prompt, "max_tokens": int(n), "temperature": 0})
text = r["choices"][0]["text"] if r and "choices" in r else None
if text is None:
    print("no completion:", json.dumps(r)[:400])
c = http("/v1/cluster")
json.dump(c, open(f"{out}/cluster.json", "w"), indent=1)
names = {m["id"]: (m.get("backend"), m.get("memory_available") or 0, m.get("mem_bandwidth") or 0) for m in c["nodes"]}
for p in c.get("plans", []):
    for s in p.get("stages", []):
        b, mem, bw = names.get(s["node"], ("?", 0, 0))
        # The answering node reports its own free memory; its peers', their advertised offers.
        what = "free" if s["node"] == c.get("self") else "offers"
        print(f"stage {s['node'][-6:]} {b:7} layers {s['start']:2}..{s['end']:2} ({what} {mem/1e6:.0f} MB, {bw/1e9:.0f} GB/s)")
print(f"swarm ({time.time()-t:.1f}s): {text!r}\none GPU:    {one_gpu!r}\none CPU:    {one_cpu!r}")
ok = text is not None and text.strip() == one_gpu.strip() == one_cpu.strip()
print("PASS: the mixed swarm's output equals one node's" if ok else "FAIL: outputs differ")
sys.exit(0 if ok else 1)
PY
  kill "${pids[@]}" 2>/dev/null; wait 2>/dev/null
  [[ ${#ns[@]} -gt 0 ]] && "$here/scripts/netns.sh" down mix >/dev/null 2>&1
}

case "${1:-}" in
  fidelity) shift; fidelity "$@" ;;
  bench) shift; bench "$@" ;;
  swarm) swarm ;;
  models) shift  # the shapes side by side: one's generation on the GPU beside another's quantization
    pids=(); for s in "$@"; do shape "$s" & pids+=($!); done
    for p in "${pids[@]}"; do wait "$p" || fail=1; done ;;
  ab) shift; ab "$@" ;;
  trace) shift; trace "$@" ;;
  all) fidelity; bench; swarm ;;
  *) sed -n '2,/^set /p' "$0" | sed '$d; s/^# \{0,1\}//' >&2; exit 2 ;;
esac
exit $fail

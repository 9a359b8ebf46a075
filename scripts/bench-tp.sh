#!/usr/bin/env bash
# Tensor-parallel benchmark: all-reduce latency per data-plane transport against raw TCP RTT,
# then greedy decode tok/s of MODEL with 1, 2 and 4 `shoal tp-member` processes, each pinned
# (taskset) to its own THREADS cores, with bytes per token on the data plane and the cost
# model's prediction beside the measurement, the time per token each member spends inside
# all-reduces (sending, receiving, waiting for the slower member), and a control: n independent
# one-member processes run at once on the same cores ("solo"), the cost of sharing the host
# without any all-reduce. All figures come from this one run.
#   scripts/bench-tp.sh MODEL [THREADS per member] [STEPS] [MEMBERS...]
# e.g. scripts/bench-tp.sh ~/qwen7b-random 4 64 1 2 4   (needs 16 cores for 4 × 4)
set -euo pipefail
model=${1:?usage: bench-tp.sh MODEL [THREADS] [STEPS] [MEMBERS...]}
threads=${2:-4}
steps=${3:-32}
shift $(( $# < 3 ? $# : 3 ))
members=("${@:-1 2 4}")
[ ${#members[@]} -eq 1 ] && read -r -a members <<<"${members[0]}"
shoal=${SHOAL_BIN:-$(dirname "$0")/../target/release/shoal}
cores=$(nproc)

echo "== data plane: 2 members, one all-reduce of a decode step's hidden state (median of 200)"
rtt=$(python3 - <<'PY'
import socket, threading, time, statistics
srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(1)
port = srv.getsockname()[1]
def echo():
    c, _ = srv.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while True:
        b = c.recv(1)
        if not b: break
        c.sendall(b)
threading.Thread(target=echo, daemon=True).start()
s = socket.create_connection(("127.0.0.1", port)); s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
ts = []
for i in range(1200):
    t = time.perf_counter(); s.sendall(b"x"); s.recv(1); ts.append(time.perf_counter() - t)
print(f"{statistics.median(ts[200:]) * 1e6:.1f}")
PY
)
printf "%-10s %12s %12s\n" transport values "median µs"
printf "%-10s %12s %12s\n" "raw TCP RTT" 1 "$rtt"
for values in 1 1536 4096; do
  for t in shm tcp; do
    dir=$(mktemp -d)
    out=$( for r in 0 1; do taskset -c $(( r * threads ))-$(( r * threads + threads - 1 < cores ? r * threads + threads - 1 : cores - 1 )) \
      "$shoal" tp-member --rank $r --size 2 --threads 1 --rendezvous "$dir" --transports $t --allreduce-values $values & done; wait )
    med=$(echo "$out" | python3 -c 'import sys,json; v=[json.loads(l)["allreduce_us_median"] for l in sys.stdin if l.strip()]; print(f"{max(v):.1f}")')
    printf "%-10s %12s %12s\n" "$t" "$values" "$med"
    rm -rf "$dir"
  done
done

echo
echo "== decode: $model, $threads threads per member, $steps greedy steps"
printf "%-8s %12s %10s %14s %14s %10s %8s %14s %12s\n" members "decode tok/s" speedup "bytes/token" "predicted t/s" transport fallback "all-reduce ms" "solo tok/s"
base=
for n in "${members[@]}"; do
  if (( n * threads > cores )); then echo "$n members × $threads threads need $(( n * threads )) cores; this machine has $cores (skipped)"; continue; fi
  dir=$(mktemp -d)
  out=$( for (( r = 0; r < n; r++ )); do taskset -c $(( r * threads ))-$(( r * threads + threads - 1 )) \
    "$shoal" tp-member --model "$model" --rank $r --size $n --threads $threads --rendezvous "$dir" --steps "$steps" & done; wait )
  rm -rf "$dir"
  # Control: n independent one-member processes at once on the same cores (what sharing the
  # host's memory bus and caches costs without any all-reduce).
  solo=-
  if (( n > 1 )); then
    solo=$( for (( r = 0; r < n; r++ )); do d=$(mktemp -d); taskset -c $(( r * threads ))-$(( r * threads + threads - 1 )) \
      "$shoal" tp-member --model "$model" --rank 0 --size 1 --threads $threads --rendezvous "$d" --steps "$steps" & done; wait )
    solo=$(echo "$solo" | python3 -c 'import sys,json; print("%.2f" % min(json.loads(l)["decode_tok_s"] for l in sys.stdin if l.strip().startswith("{")))')
  fi
  read -r tps bpt pred tr fb ar < <(echo "$out" | python3 -c '
import sys, json
rows = [json.loads(l) for l in sys.stdin if l.strip().startswith("{")]
r0 = min(rows, key=lambda r: r["rank"])
assert all(r["tokens"] == r0["tokens"] for r in rows), "members disagree"
steps = len(r0["tokens"])
tr = ",".join(sorted({t[1] for t in r0["transports"]})) or "-"
tps = min(r["decode_tok_s"] for r in rows)
ar = max(r.get("allreduce_ms_per_token", 0) for r in rows)
print("%.2f %d %.2f %s %d %.1f" % (tps, r0["bytes_sent"] // max(steps, 1), r0["predicted_tok_s"], tr, r0["fallbacks"], ar))')
  [ -z "$base" ] && base=$tps
  printf "%-8s %12s %10s %14s %14s %10s %8s %14s %12s\n" "$n" "$tps" "$(python3 -c "print(f'{$tps / $base:.2f}x')")" "$bpt" "$pred" "$tr" "$fb" "$ar" "$solo"
done

#!/usr/bin/env python3
"""bench-strategies.py — the cost model's prediction beside the measurement, per strategy.

For each strategy (single, pipeline, tensor, hybrid) it starts N real `shoal serve` processes on
loopback (--no-discovery, a --peer chain: nothing touches the host's network), each pinned with
taskset to its own THREADS cores, each given only the first node as `--peer` (a star: peer exchange
makes the mesh), and pinned to that strategy (`--strategy`), sends one greedy
completion, and prints the plan the leader chose, the measured decode tok/s and the cost
model's predicted tok/s for that plan (and its predictions for every strategy).

  scripts/bench-strategies.py --model FILE_OR_DIR [--nodes 4] [--threads 4] [--tokens 32]
                              [--strategies single,pipeline,tensor,hybrid] [--bin PATH]

All figures come from one run on one machine; it asserts nothing about speed.
"""
import argparse, importlib.util, os, signal, subprocess, sys, tempfile, time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("bench_swarm", os.path.join(ROOT, "scripts", "bench-swarm.py"))
bench_swarm = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_swarm)
get, post, wait = bench_swarm.get, bench_swarm.post, bench_swarm.wait


def start(binary, model, strategy, cores, threads, peers, data):
    os.makedirs(data, exist_ok=True)
    log = os.path.join(data, "serve.log")
    args = ["taskset", "-c", cores, binary, "serve", "--host", "127.0.0.1", "--api-port", "0", "--no-discovery",
            "--listen", "/ip4/127.0.0.1/tcp/0", "--data-dir", data, "--model", model, "--strategy", strategy, "--device", "cpu"]
    for p in peers[:1]:  # only the first node: the others are learnt from its gossip (peer exchange)
        args += ["--peer", p]
    proc = subprocess.Popen(args, stderr=open(log, "w"), stdout=subprocess.DEVNULL, env=dict(os.environ, SHOAL_THREADS=str(threads)))
    url = p2p = None
    deadline = time.time() + 120
    while time.time() < deadline and not url:
        for line in open(log).read().splitlines():
            if line.startswith("swarm listening on ") and "/tcp/" in line:
                p2p = line.split()[-1]
            if line.startswith("web UI and API: "):
                url = line.split()[-1].rstrip("/")
        if proc.poll() is not None:
            sys.exit(f"a node exited at start:\n{open(log).read()}")
        time.sleep(0.05)
    return proc, url, p2p


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--strategies", default="single,pipeline,tensor,hybrid")
    ap.add_argument("--bin", default=os.path.join(ROOT, "target", "release", "shoal"))
    a = ap.parse_args()
    if a.nodes * a.threads > os.cpu_count():
        sys.exit(f"{a.nodes} nodes × {a.threads} threads need {a.nodes * a.threads} cores; this machine has {os.cpu_count()}")
    print(f"{'strategy':9} {'plan':34} {'measured tok/s':>15} {'predicted tok/s':>16}  predictions")
    for strategy in a.strategies.split(","):
        tmp = tempfile.mkdtemp(prefix=f"shoal-{strategy}-")
        procs, urls, addrs = [], [], []
        try:
            for i in range(a.nodes):
                cores = f"{i * a.threads}-{(i + 1) * a.threads - 1}"
                p, url, p2p = start(a.bin, a.model, strategy, cores, a.threads, addrs, os.path.join(tmp, f"n{i}"))
                procs.append(p)
                urls.append(url)
                addrs.append(p2p)
            wait("membership", lambda: len(get(urls[0] + "/v1/cluster").get("nodes", [])) == a.nodes, 60)
            model = get(urls[0] + "/v1/models")["data"][0]["id"]
            body = {"model": model, "prompt": bench_swarm.PROMPT, "temperature": 0}
            r, error = None, None
            for _ in range(3):  # a plan that changes while stages load (a late joiner) fails a request
                try:
                    post(urls[0] + "/v1/completions", dict(body, max_tokens=4))  # places, loads, warms up
                    r = post(urls[0] + "/v1/completions", dict(body, max_tokens=a.tokens))
                    break
                except Exception as e:  # a pinned strategy that cannot place the model says why
                    error = getattr(e, "read", lambda: str(e).encode())().decode()[:160]
                    time.sleep(5)
            if r is None:
                print(f"{strategy:9} {'-':34} {'-':>15} {'-':>16}  {error}")
                continue
            plan = get(urls[0] + "/v1/cluster")["plans"][0]
            shape = " | ".join(f"{s['start']}..{s['end']}" + (f" x{len(s['group'])}" if s.get("group") else "") for s in plan["stages"])
            preds = ", ".join(f"{p['strategy']}({p['members']}) {p['tok_s']:.1f}" for p in plan.get("predictions") or [])
            predicted = plan.get("predicted_tok_s")
            print(f"{strategy:9} {plan['strategy'] + ' ' + shape:34} {r['shoal']['decode_tok_s']:15.2f} {predicted if predicted is None else round(predicted, 2)!s:>16}  {preds}")
        finally:
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGKILL)
                p.wait()


if __name__ == "__main__":
    main()

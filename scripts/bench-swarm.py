#!/usr/bin/env python3
"""What the swarm costs and how fast it heals, on one machine, over loopback (discovery off,
--peer chains, so nothing touches the host's network):
  - decode tok/s of the same greedy completion on 1, 2 and 3 pipeline stages (memory limits
    force the split), medians of interleaved runs, with each ratio to 1 stage and the time per
    hop per token derived from them;
  - join time: last node started -> every node shows every member and one leader;
  - leader failover: SIGKILL of the leader -> the others agree on a new leader and a new plan.
Usage: scripts/bench-swarm.py [--model gemma3-270m] [--runs 3] [--tokens 48] [--bin PATH]
A benchmark, not a test: it prints figures and asserts nothing about speed. On a shared
machine other load is noise: runs are interleaved so that it falls on every configuration.
"""
import argparse, json, os, shutil, signal, statistics, subprocess, sys, tempfile, time, urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT = "The history of the lighthouse begins in ancient Egypt, where"


def get(url, timeout=5):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.load(r)


def post(url, body, timeout=600):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.load(r)


class Node:
    def __init__(self, binary, model, limit, peers, tmp, name):
        self.data = os.path.join(tmp, name)
        os.makedirs(self.data)
        self.log_path = os.path.join(self.data, "serve.log")
        args = [binary, "serve", "--host", "127.0.0.1", "--api-port", "0", "--no-discovery", "--listen", "/ip4/127.0.0.1/tcp/0",
                "--data-dir", self.data, "--model", model]
        if limit:
            args += ["--memory-limit", limit]
        for p in peers:
            args += ["--peer", p]
        self.proc = subprocess.Popen(args, stderr=open(self.log_path, "w"), stdout=subprocess.DEVNULL)
        self.url = self.p2p = self.id = None
        deadline = time.time() + 120
        while time.time() < deadline and not self.url:
            log = open(self.log_path).read()
            for line in log.splitlines():
                if line.startswith("shoal node "):
                    self.id = line.split()[-1]
                if line.startswith("swarm listening on ") and "/tcp/" in line:
                    self.p2p = line.split()[-1]
                if line.startswith("web UI and API: "):
                    self.url = line.split()[-1].rstrip("/")
            if self.proc.poll() is not None:
                sys.exit(f"a node exited at start:\n{log}")
            time.sleep(0.05)
        if not self.url:
            sys.exit("a node did not start in 120 s")
        self.started = time.time()

    def cluster(self):
        try:
            return get(self.url + "/v1/cluster")
        except Exception:
            return {}

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()


def wait(what, check, seconds):
    start = time.time()
    while time.time() - start < seconds:
        v = check()
        if v:
            return v, time.time() - start
        time.sleep(0.02)
    sys.exit(f"timed out: {what}")


def start_swarm(binary, model, limits, tmp, tag):
    nodes = []
    for i, limit in enumerate(limits):
        nodes.append(Node(binary, model, limit, [n.p2p for n in nodes], tmp, f"{tag}-{i}"))
    ids = sorted(n.id for n in nodes)

    def agreed():
        views = [n.cluster() for n in nodes]
        return all(sorted(x["id"] for x in v.get("nodes", [])) == ids for v in views) and len({v.get("leader") for v in views}) == 1
    _, joined = wait("membership", agreed, 30)
    return nodes, joined


def stages_of(node, n):
    def placed():
        plans = node.cluster().get("plans", [])
        return plans and len(plans[0]["stages"]) == n and plans[0]["stages"]
    return wait(f"a {n}-stage plan", placed, 120)[0]


def decode_tok_s(node, tokens):
    r = post(node.url + "/v1/completions", {"prompt": PROMPT, "max_tokens": tokens, "temperature": 0})
    return r["shoal"]["decode_tok_s"], r["choices"][0]["text"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--bin", default=os.path.join(os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target")), "release", "shoal"))
    # Memory limits that force 1, 2 and 3 stages for the default model (about 430 MB of weights
    # and 151 MB of KV cache placed).
    ap.add_argument("--limits", default=",|350MB,350MB|250MB,250MB,250MB")
    args = ap.parse_args()
    model_dir = subprocess.run([os.path.join(ROOT, "scripts/fetch-model.sh"), args.model], check=True, capture_output=True, text=True).stdout.strip()
    model = os.path.join(model_dir, "model.gguf")
    tmp = tempfile.mkdtemp()
    binary = os.path.join(tmp, "shoal")
    shutil.copy(args.bin, binary)  # a private copy: a rebuild cannot replace it mid-run
    configs = [[l or None for l in c.split(",")] if c != "," else [None] for c in args.limits.split("|")]
    swarms = []
    try:
        for k, limits in enumerate(configs):
            nodes, joined = start_swarm(binary, model, limits, tmp, f"s{k}")
            stages = stages_of(nodes[0], len(limits))
            swarms.append((nodes, joined))
            print(f"{len(limits)} stage(s): joined in {joined*1e3:.0f} ms; plan {[(s['start'], s['end']) for s in stages]}", flush=True)
        speeds = [[] for _ in swarms]
        texts = [None for _ in swarms]
        for _ in range(args.runs + 1):  # the first round warms up
            for i, (nodes, _) in enumerate(swarms):
                tps, text = decode_tok_s(nodes[0], args.tokens)
                speeds[i].append(tps)
                texts[i] = text
        same = all(t == texts[0] for t in texts)
        base = statistics.median(speeds[0][1:])
        print(f"\ndecode, {args.tokens} tokens, median of {args.runs} interleaved runs (greedy text identical: {same})")
        print(f"{'stages':>6} {'tok/s':>8} {'ratio':>6} {'ms/token':>9} {'ms per hop':>11}")
        for i, s in enumerate(speeds):
            tps = statistics.median(s[1:])
            hops = len(configs[i]) - 1
            per_hop = (1e3 / tps - 1e3 / base) / hops if hops else 0.0
            print(f"{len(configs[i]):>6} {tps:>8.2f} {tps / base:>6.2f} {1e3 / tps:>9.1f} {per_hop:>11.2f}")
        # Leader failover on the largest swarm.
        nodes, _ = swarms[-1]
        leader = nodes[0].cluster()["leader"]
        epoch = nodes[0].cluster()["epoch"]
        victim = next(n for n in nodes if n.id == leader)
        rest = [n for n in nodes if n is not victim]
        victim.stop()
        _, took = wait("a new leader", lambda: all((c := n.cluster()).get("leader") not in (None, leader) and c.get("epoch", 0) > epoch and leader not in [x["id"] for x in c.get("nodes", [])] for n in rest), 30)
        print(f"\nleader failover: SIGKILL of the leader -> {len(rest)} nodes agree on a new leader and a new plan in {took*1e3:.0f} ms")
    finally:
        for nodes, _ in swarms:
            for n in nodes:
                n.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()

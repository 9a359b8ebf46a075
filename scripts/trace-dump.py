#!/usr/bin/env python3
"""trace-dump.py — reads one fused CUDA step's block records, as `SHOAL_FUSED_TRACE_DUMP=FILE`
writes them (with `SHOAL_FUSED_TRACE=1`; plain or gzipped), and prints what the per-kind trace
summary cannot show:
  - per kind of launch, averaged over its launches: when the median block ended and when each
    SM's last block ended (min, 10th percentile, median, max), in µs after the previous launch's
    end. Blocks sharing an SM finish in turn, so the SMs' last ends, not the last block's end after
    the median block's, say how long the GPU idles at a launch's end;
  - with --kind KIND, one line per launch of that kind: its span and its blocks' work (end minus
    input ready: median, 90th percentile, max).
It does not run anything on a GPU.

Usage: trace-dump.py FILE [--kind qkv|attend|o|gate/up|down|head]
"""
import argparse
import gzip
import statistics
from collections import defaultdict


def read(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        lines = f.read().split("\n")[1:]
    launches = defaultdict(list)
    for line in lines:
        if not line:
            continue
        launch, kind, sm, block, *times = line.split()
        start, waited, ready, end = map(int, times)
        launches[int(launch)].append((kind, int(sm), int(block), start, waited, ready, end))
    return [launches[k] for k in sorted(launches)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("file")
    ap.add_argument("--kind", help="also one line per launch of this kind")
    args = ap.parse_args()
    per_kind = defaultdict(lambda: defaultdict(list))
    prev_end = None
    for blocks in read(args.file):
        kind, end = blocks[0][0], max(b[6] for b in blocks)
        if prev_end is not None:
            last = defaultdict(int)
            for b in blocks:
                last[b[1]] = max(last[b[1]], b[6])
            ends = sorted(last.values())
            us = lambda t: (t - prev_end) / 1e3
            k = per_kind[kind]
            k["block median"].append(us(statistics.median(b[6] for b in blocks)))
            for name, t in (("min", ends[0]), ("p10", ends[len(ends) // 10]), ("median", statistics.median(ends)), ("max", ends[-1])):
                k[name].append(us(t))
            k["SMs"].append(len(ends))
            if kind == args.kind:
                work = sorted((b[6] - b[5]) / 1e3 for b in blocks)
                print(f"{kind} ({len(blocks)} blocks): span {us(end):6.2f} | work median {work[len(work) // 2]:5.2f}, p90 {work[9 * len(work) // 10]:5.2f}, max {work[-1]:5.2f}")
        prev_end = end
    print("kind: median block's end | each SM's last block's end: min, p10, median, max (SMs) — µs after the previous launch's end, mean over the kind's launches")
    for kind, k in per_kind.items():
        m = {name: statistics.mean(v) for name, v in k.items()}
        print(f"  {kind}: {m['block median']:.2f} | {m['min']:.2f}, {m['p10']:.2f}, {m['median']:.2f}, {m['max']:.2f} ({m['SMs']:.0f})")


if __name__ == "__main__":
    main()

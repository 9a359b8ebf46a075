#!/usr/bin/env bash
# Network namespaces for multi-node tests with mDNS: a bridge and N namespaces on 10.77.0.0/24,
# each with one veth into the bridge, so that nodes discover each other without ever
# multicasting on the host's own network. Needs root (or CAP_NET_ADMIN).
#   scripts/netns.sh up N [PREFIX]      create PREFIX-br and namespaces PREFIX-1..N (10.77.0.1..N)
#   scripts/netns.sh down [PREFIX]      remove them (idempotent)
#   scripts/netns.sh cut I [PREFIX]     take namespace I's link down (a partition, no FIN/RST)
#   scripts/netns.sh heal I [PREFIX]    bring it back
#   scripts/netns.sh exec I [PREFIX] -- CMD...   run CMD inside namespace I
# PREFIX defaults to "shoal" (at most 8 characters: interface names are limited to 15).
set -euo pipefail

usage() { sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }

cmd=${1:-}; shift || true

up() {
  local n=$1 p=$2
  [[ $n =~ ^[0-9]+$ ]] && (( n >= 1 && n <= 200 )) || { echo "netns.sh: N must be 1..200" >&2; exit 2; }
  down "$p"
  ip link add "$p-br" type bridge
  ip link set "$p-br" up
  for i in $(seq 1 "$n"); do
    ip netns add "$p-$i"
    ip link add "$p-v$i" type veth peer name eth0 netns "$p-$i"
    ip link set "$p-v$i" master "$p-br" up
    ip -n "$p-$i" addr add "10.77.0.$i/24" dev eth0
    ip -n "$p-$i" link set eth0 up
    ip -n "$p-$i" link set lo up
    # mDNS goes to 224.0.0.251 on eth0, the only non-loopback interface here.
    ip -n "$p-$i" route add 224.0.0.0/4 dev eth0
  done
  echo "netns.sh: $n namespaces $p-1..$p-$n on $p-br (10.77.0.1..$n)"
}

down() {
  local p=$1
  for ns in $(ip netns list | awk '{print $1}' | grep -E "^$p-[0-9]+$" || true); do
    ip netns pids "$ns" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
    ip netns del "$ns"
  done
  if ip link show "$p-br" >/dev/null 2>&1; then ip link del "$p-br"; fi
}

case "$cmd" in
  up) up "${1:?N}" "${2:-shoal}" ;;
  down) down "${1:-shoal}" ;;
  cut) ip link set "${2:-shoal}-v${1:?I}" down ;;
  heal) ip link set "${2:-shoal}-v${1:?I}" up ;;
  exec)
    i=${1:?I}; shift
    p=shoal
    if [[ ${1:-} != "--" ]]; then p=$1; shift; fi
    [[ ${1:-} == "--" ]] && shift
    exec ip netns exec "$p-$i" "$@"
    ;;
  *) usage ;;
esac

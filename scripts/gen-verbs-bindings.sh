#!/usr/bin/env bash
# Regenerates node/src/dataplane/rdma/sys_{x86_64,aarch64}.rs, the struct layouts of rdma-core's
# <infiniband/verbs.h> that the verbs link uses (cargo feature `rdma`). Not part of any build:
# the generated files are committed and the crate never runs bindgen or links rdma-core.
# Needs (Debian 12): apt-get install libibverbs-dev libclang-dev libc6-dev-arm64-cross
# linux-libc-dev-arm64-cross; cargo install bindgen-cli --locked (0.73.2 made the committed files).
# The two targets differ only in glibc's pthread_mutex_t/pthread_cond_t sizes, which move the
# tails of ibv_context, ibv_qp, ibv_cq and ibv_srq (never the fields shoal reads).
set -euo pipefail
cd "$(dirname "$0")/.."
out=node/src/dataplane/rdma
version=$(dpkg-query -W -f='${Version}' libibverbs-dev 2>/dev/null || echo unknown)
types="ibv_device ibv_context ibv_context_ops ibv_pd ibv_mr ibv_cq ibv_qp ibv_qp_init_attr ibv_qp_cap
ibv_qp_attr ibv_ah_attr ibv_global_route ibv_gid ibv_gid_entry ibv_send_wr ibv_recv_wr ibv_sge ibv_wc
ibv_port_attr ibv_device_attr ibv_qp_type ibv_qp_state ibv_qp_attr_mask ibv_access_flags ibv_wr_opcode
ibv_send_flags ibv_wc_status ibv_wc_opcode ibv_mtu ibv_port_state ibv_gid_type"
args=()
for t in $types; do args+=(--allowlist-type "$t"); done
args+=(--allowlist-var 'IBV_LINK_LAYER_.*' --no-prepend-enum-name --no-doc-comments --use-core --rust-target 1.85)
header=$(mktemp --suffix .h)
trap 'rm -f "$header"' EXIT
echo '#include <infiniband/verbs.h>' > "$header"
for arch in x86_64 aarch64; do
    clang_args=()
    [ "$arch" = aarch64 ] && clang_args=(--target=aarch64-linux-gnu -isystem /usr/aarch64-linux-gnu/include)
    file="$out/sys_$arch.rs"
    {
        echo "//! Generated: rdma-core's <infiniband/verbs.h> layouts for $arch Linux (libibverbs-dev $version,"
        echo "//! bindgen-cli $(bindgen --version | awk '{print $2}'), by scripts/gen-verbs-bindings.sh). Types and constants only:"
        echo "//! no functions are declared, so nothing links against libibverbs. The \`const _\` blocks are"
        echo "//! bindgen's layout tests, checked by the compiler on every build with the feature. Do not edit."
        echo
        bindgen "$header" "${args[@]}" -- "${clang_args[@]}"
    } > "$file"
done

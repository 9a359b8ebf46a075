#!/usr/bin/env bash
# Builds shoal's double-click launchers into target/launchers/ (or --out DIR):
#   Shoal.app       macOS app bundle; Contents/MacOS/shoal-launcher starts a node in the
#                   background and opens the browser on its UI once /health answers
#   Shoal.command   macOS Terminal script: the node runs in that window (Ctrl+C stops it)
#   shoal.desktop   Linux desktop entry; its Exec runs shoal-launcher beside it
#   shoal-launcher, shoal.svg   the Linux launcher script and icon
# All three run scripts/launcher/shoal-launcher.sh. --bin PATH copies a shoal binary into the
# bundle; without it, on a Mac target/release/shoal is copied when it exists, on Linux nothing
# (a Linux build would not run on a Mac). --install copies shoal.desktop to ~/.local/share/applications.
# The app icon is the committed scripts/launcher/Shoal.icns (make-icon.mjs regenerates it).
# It does not sign or notarise the .app and does not build shoal.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT="$ROOT/target/launchers"
BIN=""
INSTALL=0
while [ $# -gt 0 ]; do
    case "$1" in
        --out) OUT="$2"; shift 2 ;;
        --bin) BIN="$2"; shift 2 ;;
        --install) INSTALL=1; shift ;;
        -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
        *) echo "make-launchers: unknown argument $1" >&2; exit 2 ;;
    esac
done
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
case "$OUT" in
    *[\"\`\$\\]*) echo "make-launchers: the output path may not contain \" \` \$ or \\ (it goes into Exec=)" >&2; exit 2 ;;
esac
if [ -z "$BIN" ] && [ "$(uname -s)" = Darwin ] && [ -x "$ROOT/target/release/shoal" ]; then
    BIN="$ROOT/target/release/shoal"
fi
VERSION="$(sed -n 's/^version *= *"\(.*\)"/\1/p' "$ROOT/Cargo.toml" | head -n 1)"
VERSION="${VERSION:-0.0.0}"
SRC="$ROOT/scripts/launcher/shoal-launcher.sh"

# The launcher with this checkout's release build as the last place to look for shoal.
write_launcher() {
    local escaped
    escaped="$(printf '%s' "$ROOT/target/release/shoal" | sed 's/[&|\\]/\\&/g')"
    sed "s|@REPO_BIN@|$escaped|" "$SRC" >"$1"
    chmod 755 "$1"
}

# ---- macOS: Shoal.app ----
APP="$OUT/Shoal.app"
rm -rf "$APP"
mkdir -p "$APP/Contents/MacOS" "$APP/Contents/Resources"
write_launcher "$APP/Contents/MacOS/shoal-launcher"
cp "$ROOT/scripts/launcher/Shoal.icns" "$APP/Contents/Resources/Shoal.icns"
printf 'APPL????' >"$APP/Contents/PkgInfo"
if [ -n "$BIN" ]; then
    cp "$BIN" "$APP/Contents/MacOS/shoal"
    chmod 755 "$APP/Contents/MacOS/shoal"
fi
cat >"$APP/Contents/Info.plist" <<EOF
<?xml version="1.0" encoding="UTF-8"?>
<!DOCTYPE plist PUBLIC "-//Apple//DTD PLIST 1.0//EN" "http://www.apple.com/DTDs/PropertyList-1.0.dtd">
<plist version="1.0">
<dict>
	<key>CFBundleDevelopmentRegion</key>
	<string>en</string>
	<key>CFBundleDisplayName</key>
	<string>Shoal</string>
	<key>CFBundleExecutable</key>
	<string>shoal-launcher</string>
	<key>CFBundleIconFile</key>
	<string>Shoal.icns</string>
	<key>CFBundleIdentifier</key>
	<string>dev.shoal.launcher</string>
	<key>CFBundleInfoDictionaryVersion</key>
	<string>6.0</string>
	<key>CFBundleName</key>
	<string>Shoal</string>
	<key>CFBundlePackageType</key>
	<string>APPL</string>
	<key>CFBundleShortVersionString</key>
	<string>$VERSION</string>
	<key>CFBundleSignature</key>
	<string>????</string>
	<key>CFBundleVersion</key>
	<string>$VERSION</string>
	<key>LSApplicationCategoryType</key>
	<string>public.app-category.developer-tools</string>
	<key>LSMinimumSystemVersion</key>
	<string>11.0</string>
	<key>LSUIElement</key>
	<true/>
	<key>NSHighResolutionCapable</key>
	<true/>
</dict>
</plist>
EOF

# ---- macOS: Shoal.command (same script; the .command name selects the foreground mode) ----
write_launcher "$OUT/Shoal.command"

# ---- Linux: shoal.desktop ----
write_launcher "$OUT/shoal-launcher"
cp "$ROOT/web/favicon.svg" "$OUT/shoal.svg"
cat >"$OUT/shoal.desktop" <<EOF
[Desktop Entry]
Type=Application
Version=1.4
Name=Shoal
GenericName=LLM chat
Comment=Start a shoal node and open its chat UI in the browser
Exec="$OUT/shoal-launcher"
TryExec=$OUT/shoal-launcher
Icon=$OUT/shoal.svg
Terminal=false
Categories=Network;Chat;
Keywords=LLM;AI;chat;inference;swarm;
StartupNotify=false
Actions=stop;

[Desktop Action stop]
Name=Stop the shoal node
Exec="$OUT/shoal-launcher" --stop
EOF
chmod 755 "$OUT/shoal.desktop"

if [ "$INSTALL" = 1 ]; then
    APPS="${XDG_DATA_HOME:-$HOME/.local/share}/applications"
    mkdir -p "$APPS"
    cp "$OUT/shoal.desktop" "$APPS/shoal.desktop"
    echo "make-launchers: installed $APPS/shoal.desktop" >&2
fi
echo "$OUT"

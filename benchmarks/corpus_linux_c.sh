#!/usr/bin/env bash
# The second corpus of issue 54 (benchmarks/schedules_cpu.sh): C sources of the Linux kernel, from Debian's
# linux-source-6.1 package (a registry this machine reaches), as one JSON-lines file with a document per source
# file. No tuning in this repository has touched it. The toolkit holds out the documents that hash into
# validation (5%), so validation spans the corpus.
#
#   bash benchmarks/corpus_linux_c.sh [DIR]        # default /root/gwt-data/linux-c; idempotent
#   LINUX_C_VERSION=6.1.176-1 bash benchmarks/corpus_linux_c.sh [DIR]   # that version, where the index has it
#
# Debian's index moves: without LINUX_C_VERSION the version is the candidate of this machine's index (two
# machines of this project built 6.1.192-3 and 6.1.176-1), so a study names the version its runs used.
# kernel/, mm/, fs/ and net/: about 90 MB of C, some 25M tokens of a 4,096-token BPE, more than the 16M of a
# budget run. DIR/SOURCE names the package version it was built from.
set -euo pipefail
DIR=$(realpath -m "${1:-/root/gwt-data/linux-c}")
PACKAGE=linux-source-6.1
SPEC=$PACKAGE${LINUX_C_VERSION:+=$LINUX_C_VERSION}  # what apt-get is asked for
[ -s "$DIR/linux-c.jsonl" ] && { echo "$DIR/linux-c.jsonl exists ($(cat "$DIR/SOURCE"))"; exit 0; }
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
cd "$WORK"
# no retries and a short timeout: offline, the one line below comes at once, not after minutes of retries
apt-get -o Acquire::Retries=0 -o Acquire::http::Timeout=10 download "$SPEC" >/dev/null 2>&1 ||
  { echo "corpus_linux_c.sh: cannot download $SPEC (offline, or apt-get update first?)" >&2; exit 2; }
DEB=$(ls ./*.deb)
TARBALL=$(dpkg-deb -c "$DEB" | grep -o './usr/src/linux-source-[^ ]*\.tar\.xz' | head -1)
dpkg-deb --fsys-tarfile "$DEB" | tar -xO "$TARBALL" | tar -xJ --wildcards '*/kernel/*' '*/mm/*' '*/fs/*' '*/net/*'
mkdir -p "$DIR"
python3 - "$WORK" "$DIR/linux-c.jsonl.tmp" <<'EOF'
import json, os, sys
root, out = sys.argv[1], sys.argv[2]
n = 0
with open(out, "w", encoding="utf-8") as f:
    for top in sorted(os.listdir(root)):
        base = os.path.join(root, top)
        if not os.path.isdir(base):
            continue
        for sub in ("kernel", "mm", "fs", "net"):
            for dirpath, dirnames, filenames in os.walk(os.path.join(base, sub)):
                dirnames.sort()
                for name in sorted(filenames):
                    if name.endswith((".c", ".h")):
                        path = os.path.join(dirpath, name)
                        with open(path, encoding="utf-8", errors="replace") as src:
                            text = src.read()
                        if text.strip():
                            f.write(json.dumps({"text": text}) + "\n")
                            n += 1
print(f"{n} files")
EOF
mv "$DIR/linux-c.jsonl.tmp" "$DIR/linux-c.jsonl"
echo "$(basename "$DEB") ($TARBALL: kernel, mm, fs, net; *.c and *.h)" > "$DIR/SOURCE"
echo "wrote $DIR/linux-c.jsonl ($(du -h "$DIR/linux-c.jsonl" | cut -f1)) from $(cat "$DIR/SOURCE")"

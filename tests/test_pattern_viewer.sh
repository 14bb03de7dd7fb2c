#!/usr/bin/env bash
# test_pattern_viewer.sh: runs mtrain-pattern on a small pattern file it
# writes (a vertical-slash head and a block-mask head): the PNG must exist,
# start with the PNG signature and have the expected size; bad inputs
# (missing file, head out of range, unwritable output) must exit 1 with a
# message, a bad command line exit 2.
# usage: test_pattern_viewer.sh PATH/TO/mtrain-pattern TMPDIR
set -euo pipefail
bin=$1
work=$2/pattern_viewer
rm -rf "$work"
mkdir -p "$work"

fail() {
  echo "test_pattern_viewer: FAIL: $*" >&2
  exit 1
}

# 1000 tokens, G = 100: 10 blocks. Head 0: diagonals 0, 2 and verticals
# (sinks and a few later keys); head 1: a generic block mask.
cat > "$work/p.json" <<'EOF'
{"granularity": 100, "seq_len": 1000,
 "heads": [{"diagonals": [0, 2], "verticals": [0, 1, 2, 3, 350, 351, 720]},
           {"block_mask": [[3, 0], [5, 2], [9, 9]]}]}
EOF

# PNG signature (8 bytes) and IHDR width and height (bytes 16..23, big endian).
check_png() { # file width
  local f=$1 want=$2
  [ -s "$f" ] || fail "$f missing or empty"
  local sig
  sig=$(od -An -tx1 -N8 "$f" | tr -d ' \n')
  [ "$sig" = "89504e470d0a1a0a" ] || fail "$f does not start with the PNG signature ($sig)"
  local wh
  wh=$(od -An -tu1 -j16 -N8 "$f" | tr -s ' ' | sed 's/^ //')
  read -r a b c d e f2 g h <<< "$wh"
  local w=$(((a << 24) | (b << 16) | (c << 8) | d)) hh=$(((e << 24) | (f2 << 16) | (g << 8) | h))
  if [ "$w" != "$want" ] || [ "$hh" != "$want" ]; then
    fail "$f is ${w}x${hh}, expected ${want}x${want}"
  fi
}

# expect_exit CODE NEEDLE args...: exit status and a stderr message containing NEEDLE
expect_exit() {
  local want=$1 needle=$2
  shift 2
  local rc=0
  "$bin" "$@" > "$work/out.txt" 2> "$work/err.txt" || rc=$?
  [ "$rc" = "$want" ] || fail "'$*' exited $rc, expected $want; stderr: $(cat "$work/err.txt")"
  grep -q -- "$needle" "$work/err.txt" || fail "'$*': stderr lacks '$needle': $(cat "$work/err.txt")"
}

"$bin" --pattern "$work/p.json" --head 0 --out "$work/h0.png" > "$work/out.txt"
check_png "$work/h0.png" 10
grep -q "7 verticals" "$work/out.txt" || fail "summary line: $(cat "$work/out.txt")"
"$bin" --pattern "$work/p.json" --head 1 --out "$work/h1.png" --size 64 > /dev/null
check_png "$work/h1.png" 64
"$bin" --pattern "$work/p.json" --head 0 --out "$work/small.png" --size 3 > /dev/null
check_png "$work/small.png" 3

# an estimated pattern: structured inputs, top-k budgets (512 tokens, G 32: 16 blocks)
"$bin" --estimate --v-size 8 --s-size 40 --seq-len 512 --heads 2 --kv-heads 1 --head-dim 16 \
  --granularity 32 --head 1 --out "$work/est.png" > "$work/out.txt"
check_png "$work/est.png" 16
grep -q "the estimated pattern" "$work/out.txt" || fail "estimate summary: $(cat "$work/out.txt")"
expect_exit 2 "exactly one of" --pattern "$work/p.json" --estimate --v-size 1 --s-size 1 --head 0 \
  --out "$work/x.png"
expect_exit 2 "needs --budgets" --estimate --head 0 --out "$work/x.png"

expect_exit 1 "cannot open" --pattern "$work/missing.json" --head 0 --out "$work/x.png"
expect_exit 1 "out of range" --pattern "$work/p.json" --head 2 --out "$work/x.png"
expect_exit 1 "cannot write PNG" --pattern "$work/p.json" --head 0 --out "$work/no/such/dir/x.png"
echo '{"granularity": 100, "seq_len": 1000, "heads": [{"diagonals": [3, 1]}]}' > "$work/bad.json"
expect_exit 1 "bad.json" --pattern "$work/bad.json" --head 0 --out "$work/x.png"
[ ! -e "$work/x.png" ] || fail "an image was written although the command failed"
expect_exit 2 "--out FILE.png is required" --pattern "$work/p.json" --head 0
expect_exit 2 "--size" --pattern "$work/p.json" --head 0 --out "$work/x.png" --size 0
expect_exit 2 "unknown" --pattern "$work/p.json" --head 0 --out "$work/x.png" --bogus
"$bin" --help | grep -q "usage: mtrain-pattern" || fail "--help prints no usage"
echo "test_pattern_viewer: all checks passed"

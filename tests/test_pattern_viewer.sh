#!/usr/bin/env bash
# test_pattern_viewer.sh: runs mtrain-pattern on a small pattern file it
# writes (a vertical-slash head and a block-mask head): the PNG must exist,
# start with the PNG signature and have the size the tool reports; the
# default plot has whole pixels per block and at least 512 px a side, with
# a title and legend around it (--no-legend: the plot alone, exactly
# --size); bad inputs (missing file, head out of range, unwritable output)
# must exit 1 with a message, a bad command line exit 2.
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
check_png() { # file width height
  local f=$1 want_w=$2 want_h=$3
  [ -s "$f" ] || fail "$f missing or empty"
  local sig
  sig=$(od -An -tx1 -N8 "$f" | tr -d ' \n')
  [ "$sig" = "89504e470d0a1a0a" ] || fail "$f does not start with the PNG signature ($sig)"
  local wh a b c d e f2 g h
  wh=$(od -An -tu1 -j16 -N8 "$f" | tr -s ' ' | sed 's/^ //')
  read -r a b c d e f2 g h <<< "$wh"
  local w=$(((a << 24) | (b << 16) | (c << 8) | d)) hh=$(((e << 24) | (f2 << 16) | (g << 8) | h))
  if [ "$w" != "$want_w" ] || [ "$hh" != "$want_h" ]; then
    fail "$f is ${w}x${hh}, expected ${want_w}x${want_h}"
  fi
}

# check_drawn FILE PLOT: the summary line in out.txt reports the image size
# (checked against the file) and a plot of PLOT x PLOT px; with a legend the
# image is larger than the plot on both sides (title above, legend below).
check_drawn() {
  local f=$1 plot=$2 line w h p
  line=$(grep -o "image [0-9]* x [0-9]* px, plot [0-9]* x [0-9]* px" "$work/out.txt") ||
    fail "no image and plot sizes in the summary: $(cat "$work/out.txt")"
  read -r w h p <<< "$(echo "$line" | sed -E 's/image ([0-9]+) x ([0-9]+) px, plot ([0-9]+) x.*/\1 \2 \3/')"
  [ "$p" = "$plot" ] || fail "$f: plot of $p px, expected $plot: $line"
  check_png "$f" "$w" "$h"
  if grep -q "with legend" "$work/out.txt"; then
    if [ "$w" -le "$p" ] || [ "$h" -le $((p + 100)) ]; then
      fail "$f: ${w}x${h} has no room for a legend"
    fi
  else
    if [ "$w" != "$p" ] || [ "$h" != "$p" ]; then
      fail "$f: without legend ${w}x${h}, expected ${p}x${p}"
    fi
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

# default: 10 blocks drawn 52 px each (whole pixels per block, >= 512 px), with a legend
"$bin" --pattern "$work/p.json" --head 0 --out "$work/h0.png" > "$work/out.txt"
check_drawn "$work/h0.png" 520
grep -q "7 verticals" "$work/out.txt" || fail "summary line: $(cat "$work/out.txt")"
grep -q "52 px per block" "$work/out.txt" || fail "not 52 px per block: $(cat "$work/out.txt")"

# a non-causal pattern: its blocks above the diagonal are computed and counted
# (10 diagonal blocks and 3 listed: 13; nothing is drawn as 'not causal')
cat > "$work/nc.json" <<'EOF'
{"granularity": 64, "seq_len": 640, "causal": false,
 "heads": [{"block_mask": [[0, 9], [3, 0], [5, 7]]}]}
EOF
"$bin" --pattern "$work/nc.json" --head 0 --out "$work/nc.png" > "$work/out.txt"
check_drawn "$work/nc.png" 520
grep -q "13 computed" "$work/out.txt" || fail "non-causal summary: $(cat "$work/out.txt")"
"$bin" --pattern "$work/p.json" --head 1 --out "$work/h1.png" --size 64 > "$work/out.txt"
check_drawn "$work/h1.png" 64
"$bin" --pattern "$work/p.json" --head 1 --out "$work/h1n.png" --size 64 --no-legend > "$work/out.txt"
check_drawn "$work/h1n.png" 64
check_png "$work/h1n.png" 64 64
"$bin" --pattern "$work/p.json" --head 0 --out "$work/small.png" --size 3 --no-legend > "$work/out.txt"
check_png "$work/small.png" 3 3
grep -q "max-pooled" "$work/out.txt" || fail "3 px for 10 blocks not pooled: $(cat "$work/out.txt")"

# an estimated pattern: structured inputs, top-k budgets (512 tokens, G 32: 16 blocks of 32 px)
"$bin" --estimate --v-size 8 --s-size 40 --seq-len 512 --heads 2 --kv-heads 1 --head-dim 16 \
  --granularity 32 --head 1 --out "$work/est.png" > "$work/out.txt"
check_drawn "$work/est.png" 512
grep -q "the estimated pattern" "$work/out.txt" || fail "estimate summary: $(cat "$work/out.txt")"
# 1000 blocks: one pixel per block; 2000 blocks: pooled to 1024 px
echo '{"granularity": 1, "seq_len": 1000, "heads": [{"diagonals": [0, 5]}]}' > "$work/big.json"
"$bin" --pattern "$work/big.json" --head 0 --out "$work/big.png" > "$work/out.txt"
check_drawn "$work/big.png" 1000
echo '{"granularity": 1, "seq_len": 2000, "heads": [{"diagonals": [0, 5]}]}' > "$work/big2.json"
"$bin" --pattern "$work/big2.json" --head 0 --out "$work/big2.png" > "$work/out.txt"
check_drawn "$work/big2.png" 1024
expect_exit 2 "exactly one of" --pattern "$work/p.json" --estimate --v-size 1 --s-size 1 --head 0 \
  --out "$work/x.png"
expect_exit 2 "needs --budgets" --estimate --head 0 --out "$work/x.png"
expect_exit 2 "top-p-forced applies" --estimate --v-size 8 --s-size 8 --top-p-forced --head 0 \
  --out "$work/x.png"
# --top-p-forced on a budget file's top-p heads: the 30 sinks are among the verticals
printf '%s' '[{"0": ["flex_vertical_and_slash", [0.3, 500], [0.3, 500], 0.9],' \
  ' "1": ["flex_vertical_and_slash", [0.3, 500], [0.3, 500], 0.9]}]' > "$work/topp.json"
for forced in "" --top-p-forced; do
  "$bin" --estimate --budgets "$work/topp.json" --layer 0 --seq-len 512 --heads 2 --kv-heads 1 \
    --head-dim 16 --granularity 32 --head 0 --out "$work/topp.png" $forced > "$work/out.txt" ||
    fail "top-p budgets $forced: $(cat "$work/out.txt")"
  nv=$(sed -n 's/.* \([0-9]*\) verticals .*/\1/p' "$work/out.txt")
  if [ -n "$forced" ]; then
    [ "${nv:-0}" -ge 30 ] || fail "--top-p-forced kept ${nv:-no} verticals, fewer than the 30 sinks"
  else
    [ "${nv:-99}" -lt 30 ] || fail "top-p 0.3 alone kept ${nv:-no} verticals: the forced check above proves nothing"
  fi
done

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

#!/usr/bin/env bash
# test_block_curves_png.sh: mtrain-block-curves recall --png writes the recall
# against density chart (a PNG file) beside its table (34 rows: every method,
# budget and vertical-slash row of docs/PATTERNS.md), and refuses an argument
# that is neither a seed nor --png FILE. A build without libpng must say so
# (the test is then skipped: exit 77).
# usage: test_block_curves_png.sh MTRAIN_BLOCK_CURVES TMPDIR
set -uo pipefail
tool=$1
tmp=$2
mkdir -p "$tmp"
png=$tmp/recall_density_test.png
rm -f "$png"
out=$("$tool" recall --png "$png" 2> "$tmp/block_curves.err")
rc=$?
if grep -q "this build has no libpng" "$tmp/block_curves.err"; then
  echo "test_block_curves_png: built without libpng: skipped"
  exit 77
fi
[ $rc -eq 0 ] || { echo "FAIL: recall --png exited $rc: $(cat "$tmp/block_curves.err")"; exit 1; }
rows=$(grep -c '^| [a-z]' <<< "$out")
[ "$rows" -eq 35 ] || { echo "FAIL: $rows table lines (header + 34 rows expected)"; exit 1; }
magic=$(head -c 8 "$png" | od -An -tx1 | tr -d ' \n')
[ "$magic" = 89504e470d0a1a0a ] || { echo "FAIL: $png is not a PNG ($magic)"; exit 1; }
if "$tool" recall not-a-seed > /dev/null 2> "$tmp/block_curves.err"; then
  echo "FAIL: recall not-a-seed was accepted"
  exit 1
fi
grep -q "neither a seed nor --png FILE" "$tmp/block_curves.err" || {
  echo "FAIL: no message naming the bad argument: $(cat "$tmp/block_curves.err")"
  exit 1
}
echo "test_block_curves_png: passed ($rows table lines, $(stat -c %s "$png") bytes of PNG)"

# The help text of tools/balance_measure.py: its description (the first paragraph) and the
# method (the rest), as `--help` prints them.

TEXT = """\
balance_measure.py: measured per-rank times of the assignments mtrain.balance_batch predicts.

SparseBalance (docs/BALANCE.md, "Measured rank times (tool)") deals a global batch's documents
to data-parallel ranks by predicted seconds. This tool runs the attention those assignments give
each rank, for real, on one device (cpu or cuda), and sets the measured rank times beside the
predicted ones.

Method (every figure is on one device, ranks run one after another):
  1. The workload: a length distribution (--long-tail, the generator of `mtrain-balance batch
     --long-tail` reproduced bit for bit; --lengths FILE; or --equal N --count C), each length
     divided by --scale S and rounded up to a multiple of the granularity (S = 1 on a GPU).
  2. The budgets: the file's heads (--heads H of them per layer, evenly spaced, when H is
     smaller than the file's), counts divided by S with --scale-budgets; written to a derived
     budget file that both the predictor and the measurement use.
  3. For each method, mtrain.balance_batch on the (scaled) lengths gives every document's
     rank(s), every rank's per-head budget scales (tuned methods) and the predicted rank seconds.
  4. A document's attention time depends on its length and its layer's budgets (static top-k
     budgets: the pattern's size does not depend on the inputs), so each distinct (length,
     layer, head budgets) is measured once: mtrain.estimate_pattern then mtrain.attention's
     forward and backward through autograd, as a training step calls them, on structured inputs
     (mtrain_generate_structured, one input per length), warm (--warmup), median of --reps.
     With --grid G a group (layer, budgets) with more than G distinct lengths is measured at G
     log-spaced lengths and interpolated in log-log; --grid-check lengths off the grid are
     measured too and the interpolation error is reported. With top-p budgets the pattern
     depends on the inputs: every document is measured on its own inputs (seed and structure
     strengths drawn per document and layer), no deduplication. --fit-calibration first fits
     the cost model's pair_s, row_s and seq_s on these measurements and balances with them;
     --fit-objective picks what its least squares minimise (and the linear layers' fit):
     relative (x/y - 1, every call the same; the default), log (log(x/y)), seconds (x - y: the
     longest calls dominate) or share (x/y - 1 weighted by the call's share of the workload's
     time: its seconds times the workload's tokens nearest its length, over its tokens).
  5. A document's time = the sum over the measured --layers times (layers / measured layers)
     (the rest extrapolated, printed); plus, with --linear, the model's projection matmuls
     (torch, forward + backward, the predictor's shapes; norms and activations not counted),
     timed at the lengths up to --linear-chunk and in proportion to the tokens above it.
     A rank's time = its split phase replayed in the solver's order (a split document costs
     each of its k ranks its time / k; the ring's overhead is NOT measured) + its whole
     documents. The proxy prediction prices exactly that with the predictor (the measured
     layers at each document's head scales on its rank, times layers / measured layers, plus
     the linear layers): the errors are proxy / measured - 1, like for like when a tuner moved
     other layers' budgets than the measured ones; mtrain.balance_batch's all-layers
     prediction and its error are printed beside them.
  6. --validate K runs K ranks' whole workloads (the last method's, measured layers) for real,
     document after document on fresh inputs with one synchronisation at the end, and compares
     the wall time with the sum of the per-length medians (additivity).

usage: python tools/balance_measure.py --budgets FILE --calibration FILE
       (--long-tail | --lengths FILE | --equal N --count C) --world R [--methods LIST]
       [--backend cpu|cuda] [--scale S] [--layers 0,15,31] [--json OUT] (see --help)
"""

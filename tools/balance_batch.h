/* balance_batch.h: the `batch` mode of mtrain-balance (SparseBalance:
 * sparsity-aware batching and bidirectional sparsity tuning, predicted with
 * the calibrated cost predictor; docs/BALANCE.md). In balance_batch.c. */
#ifndef MTRAIN_TOOLS_BALANCE_BATCH_H
#define MTRAIN_TOOLS_BALANCE_BATCH_H

/** Runs `mtrain-balance batch ARGS...` (argv[0] is "batch"). Returns the exit
 *  status: 0, 1 when the work fails, 2 on a bad command line. */
int balance_batch_main(int argc, char **argv);

#endif /* MTRAIN_TOOLS_BALANCE_BATCH_H */

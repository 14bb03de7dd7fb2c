/* balanced_layout.h (private): the balanced layout's choice among owner
 * maps under the cost model, called by mtrain_layout_create. */
#ifndef MTRAIN_CORE_BALANCED_LAYOUT_H
#define MTRAIN_CORE_BALANCED_LAYOUT_H

#include "core/layout/owner_maps.h"
#include "mtrain/mtrain_layout.h"

/** Checks the workload of the balance options against the layout's shape. */
mtrain_status_t mtrain_balanced_layout_check(const mtrain_balance_options_t *b, int64_t seq_len,
                                             int32_t granularity);
/** Picks the owner map and bars mode for nbp padded blocks over W ranks and
 *  leaves the chosen map in owner[0..nbp). */
mtrain_status_t mtrain_balanced_layout_choose(const mtrain_balance_options_t *b, int64_t seq_len,
                                              int32_t G, int32_t W, int64_t nbp, int32_t *owner,
                                              mtrain_owner_map_t *best_map,
                                              mtrain_bars_mode_t *best_mode);

#endif /* MTRAIN_CORE_BALANCED_LAYOUT_H */

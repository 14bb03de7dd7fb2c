/* pattern.c: the sparse pattern of one sequence (SPEC.md section 1): per head
 * block diagonals and verticals, or a generic block mask; validation, the
 * allowed(h, i, j) predicate and exact pair counts. Estimation of patterns
 * from q and k lives elsewhere. */
#include <stdlib.h>
#include <string.h>

#include "core/runtime/pattern_internal.h"
#include "mtrain/mtrain_error.h"

static void head_clear(mtrain_pattern_head_t *h) {
  free(h->diagonals);
  free(h->verticals);
  free(h->mask_off);
  free(h->mask_idx);
  memset(h, 0, sizeof *h);
}

/* Puts the head in its initial state: only diagonal 0. */
static mtrain_status_t head_init_diag0(mtrain_pattern_head_t *h) {
  head_clear(h);
  h->diagonals = malloc(sizeof(int32_t));
  if (!h->diagonals) return mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "pattern: out of memory");
  h->diagonals[0] = 0;
  h->num_diagonals = 1;
  return MTRAIN_SUCCESS;
}

mtrain_status_t mtrain_pattern_create(int64_t seq_len, int32_t num_heads, int32_t granularity,
                                      mtrain_pattern_t **out) {
  MTRAIN_CHECK_NOT_NULL(out);
  if (seq_len < 1)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT, "pattern: seq_len must be >= 1, got %lld",
                        (long long)seq_len);
  if (num_heads < 1)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT, "pattern: num_heads must be >= 1, got %d",
                        num_heads);
  if (granularity < 1)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT, "pattern: granularity must be >= 1, got %d",
                        granularity);
  if ((seq_len + granularity - 1) / granularity > INT32_MAX)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                        "pattern: seq_len %lld / granularity %d gives more than 2^31 blocks",
                        (long long)seq_len, granularity);
  mtrain_pattern_t *p = calloc(1, sizeof *p);
  if (!p) return mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "pattern: out of memory");
  p->seq_len = seq_len;
  p->num_heads = num_heads;
  p->granularity = granularity;
  p->num_blocks = (seq_len + granularity - 1) / granularity;
  p->causal = 1;
  p->heads = calloc((size_t)num_heads, sizeof *p->heads);
  if (!p->heads) {
    free(p);
    return mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "pattern: out of memory");
  }
  for (int32_t h = 0; h < num_heads; h++) {
    mtrain_status_t st = head_init_diag0(&p->heads[h]);
    if (st != MTRAIN_SUCCESS) {
      mtrain_pattern_destroy(p);
      return st;
    }
  }
  *out = p;
  return MTRAIN_SUCCESS;
}

mtrain_status_t mtrain_pattern_create_dense(int64_t seq_len, int32_t num_heads, int32_t granularity,
                                            mtrain_pattern_t **out) {
  MTRAIN_CHECK_NOT_NULL(out);
  mtrain_pattern_t *p = NULL;
  mtrain_status_t st = mtrain_pattern_create(seq_len, num_heads, granularity, &p);
  if (st != MTRAIN_SUCCESS) return st;
  int32_t nb = (int32_t)p->num_blocks;
  int32_t *diags = malloc((size_t)nb * sizeof *diags);
  if (!diags) {
    mtrain_pattern_destroy(p);
    return mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "pattern: out of memory");
  }
  for (int32_t t = 0; t < nb; t++) diags[t] = t;
  for (int32_t h = 0; h < num_heads && st == MTRAIN_SUCCESS; h++)
    st = mtrain_pattern_set_head(p, h, diags, nb, NULL, 0);
  free(diags);
  if (st != MTRAIN_SUCCESS) {
    mtrain_pattern_destroy(p);
    return st;
  }
  *out = p;
  return MTRAIN_SUCCESS;
}

mtrain_status_t mtrain_pattern_create_noncausal(int64_t seq_len, int32_t num_heads,
                                                int32_t granularity, mtrain_pattern_t **out) {
  MTRAIN_CHECK_NOT_NULL(out);
  /* every head is a block mask: refuse before allocating O(blocks) */
  if (granularity >= 1 && seq_len >= 1 &&
      (seq_len + granularity - 1) / granularity > MTRAIN_PATTERN_MAX_MASK_BLOCKS)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                        "pattern: a non-causal pattern holds block masks, whose memory grows with "
                        "the %lld query blocks (seq_len %lld / granularity %d), more than the 2^24 "
                        "supported; use a larger granularity",
                        (long long)((seq_len + granularity - 1) / granularity), (long long)seq_len,
                        granularity);
  mtrain_pattern_t *p = NULL;
  mtrain_status_t st = mtrain_pattern_create(seq_len, num_heads, granularity, &p);
  if (st != MTRAIN_SUCCESS) return st;
  p->causal = 0;
  const int64_t nb = p->num_blocks;
  int64_t *off = malloc((size_t)(nb + 1) * sizeof *off);
  int32_t *idx = malloc((size_t)nb * sizeof *idx);
  if (!off || !idx) st = mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "pattern: out of memory");
  for (int64_t qb = 0; st == MTRAIN_SUCCESS && qb <= nb; qb++) {
    off[qb] = qb;
    if (qb < nb) idx[qb] = (int32_t)qb;
  }
  for (int32_t h = 0; h < num_heads && st == MTRAIN_SUCCESS; h++)
    st = mtrain_pattern_set_block_csr(p, h, off, idx);
  free(off);
  free(idx);
  if (st != MTRAIN_SUCCESS) {
    mtrain_pattern_destroy(p);
    return st;
  }
  *out = p;
  return MTRAIN_SUCCESS;
}

int mtrain_pattern_is_causal(const mtrain_pattern_t *p) { return p ? p->causal : 1; }

void mtrain_pattern_destroy(mtrain_pattern_t *p) {
  if (!p) return;
  if (p->heads)
    for (int32_t h = 0; h < p->num_heads; h++) head_clear(&p->heads[h]);
  free(p->heads);
  free(p);
}

static mtrain_status_t check_head(const mtrain_pattern_t *p, int32_t head, const char *fn) {
  if (!p) return mtrain_error(MTRAIN_ERR_NULL_POINTER, "%s: argument 'pattern' is NULL", fn);
  if (head < 0 || head >= p->num_heads)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT, "%s: head %d out of range [0, %d)", fn, head,
                        p->num_heads);
  return MTRAIN_SUCCESS;
}

mtrain_status_t mtrain_pattern_set_head(mtrain_pattern_t *p, int32_t head, const int32_t *diagonals,
                                        int32_t num_diagonals, const int64_t *verticals,
                                        int32_t num_verticals) {
  mtrain_status_t st = check_head(p, head, __func__);
  if (st != MTRAIN_SUCCESS) return st;
  if (!p->causal)
    return mtrain_error(MTRAIN_ERR_INVALID_PATTERN,
                        "pattern head %d: a non-causal pattern holds block-mask heads only "
                        "(vertical-slash heads are causal)",
                        head);
  if (num_diagonals < 0 || num_verticals < 0)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                        "pattern head %d: negative count (diagonals %d, verticals %d)", head,
                        num_diagonals, num_verticals);
  if (num_diagonals > 0 && !diagonals)
    return mtrain_error(MTRAIN_ERR_NULL_POINTER, "pattern head %d: 'diagonals' is NULL", head);
  if (num_verticals > 0 && !verticals)
    return mtrain_error(MTRAIN_ERR_NULL_POINTER, "pattern head %d: 'verticals' is NULL", head);
  for (int32_t i = 0; i < num_diagonals; i++) {
    if (diagonals[i] < 0 || diagonals[i] >= p->num_blocks)
      return mtrain_error(MTRAIN_ERR_INVALID_PATTERN,
                          "pattern head %d: diagonal[%d] = %d out of range [0, %lld)", head, i,
                          diagonals[i], (long long)p->num_blocks);
    if (i > 0 && diagonals[i] <= diagonals[i - 1])
      return mtrain_error(MTRAIN_ERR_INVALID_PATTERN,
                          "pattern head %d: diagonals not strictly increasing at index %d "
                          "(%d after %d)",
                          head, i, diagonals[i], diagonals[i - 1]);
  }
  for (int32_t i = 0; i < num_verticals; i++) {
    if (verticals[i] < 0 || verticals[i] >= p->seq_len)
      return mtrain_error(MTRAIN_ERR_INVALID_PATTERN,
                          "pattern head %d: vertical[%d] = %lld out of range [0, %lld)", head, i,
                          (long long)verticals[i], (long long)p->seq_len);
    if (i > 0 && verticals[i] <= verticals[i - 1])
      return mtrain_error(MTRAIN_ERR_INVALID_PATTERN,
                          "pattern head %d: verticals not strictly increasing at index %d "
                          "(%lld after %lld)",
                          head, i, (long long)verticals[i], (long long)verticals[i - 1]);
  }
  int add0 = (num_diagonals == 0 || diagonals[0] != 0);
  int32_t nd = num_diagonals + add0;
  int32_t *d = malloc((size_t)nd * sizeof *d);
  int64_t *v = num_verticals ? malloc((size_t)num_verticals * sizeof *v) : NULL;
  if (!d || (num_verticals && !v)) {
    free(d);
    free(v);
    return mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "pattern: out of memory");
  }
  if (add0) d[0] = 0;
  if (num_diagonals) memcpy(d + add0, diagonals, (size_t)num_diagonals * sizeof *d);
  if (num_verticals) memcpy(v, verticals, (size_t)num_verticals * sizeof *v);
  mtrain_pattern_head_t *h = &p->heads[head];
  head_clear(h);
  h->diagonals = d;
  h->num_diagonals = nd;
  h->verticals = v;
  h->num_verticals = num_verticals;
  return MTRAIN_SUCCESS;
}

/* Block masks are O(blocks): refuses patterns of too many blocks. */
static mtrain_status_t check_mask_blocks(const mtrain_pattern_t *p, int32_t head) {
  if (p->num_blocks <= MTRAIN_PATTERN_MAX_MASK_BLOCKS) return MTRAIN_SUCCESS;
  return mtrain_error(MTRAIN_ERR_INVALID_PATTERN,
                      "pattern head %d: a block mask takes memory in proportion to its %lld query "
                      "blocks (seq_len %lld / granularity %d), more than the 2^24 supported; use "
                      "a larger granularity or a vertical-slash head",
                      head, (long long)p->num_blocks, (long long)p->seq_len, p->granularity);
}

mtrain_status_t mtrain_pattern_set_block_csr(mtrain_pattern_t *p, int32_t head,
                                             const int64_t *mask_off, const int32_t *mask_idx) {
  mtrain_status_t st = check_head(p, head, __func__);
  if (st != MTRAIN_SUCCESS) return st;
  st = check_mask_blocks(p, head);
  if (st != MTRAIN_SUCCESS) return st;
  MTRAIN_CHECK_NOT_NULL(mask_off);
  int64_t nb = p->num_blocks;
  if (mask_off[0] != 0)
    return mtrain_error(MTRAIN_ERR_INVALID_PATTERN,
                        "pattern head %d: block mask offsets start at %lld, not 0", head,
                        (long long)mask_off[0]);
  for (int64_t qb = 0; qb < nb; qb++) {
    if (mask_off[qb + 1] < mask_off[qb])
      return mtrain_error(MTRAIN_ERR_INVALID_PATTERN,
                          "pattern head %d: block mask offsets decrease at query block %lld", head,
                          (long long)qb);
    for (int64_t e = mask_off[qb]; e < mask_off[qb + 1]; e++) {
      int32_t kb = mask_idx[e];
      if (kb < 0 || kb >= nb || (p->causal && kb > qb))
        return mtrain_error(MTRAIN_ERR_INVALID_PATTERN,
                            "pattern head %d: block mask entry (%lld, %d) %s (key block must be "
                            "in [0, %lld])",
                            head, (long long)qb, kb,
                            kb >= 0 && kb < nb ? "is not causal" : "is out of range",
                            p->causal ? (long long)qb : (long long)nb - 1);
      if (e > mask_off[qb] && kb <= mask_idx[e - 1])
        return mtrain_error(MTRAIN_ERR_INVALID_PATTERN,
                            "pattern head %d: block mask key blocks of query block %lld not "
                            "strictly increasing (%d after %d)",
                            head, (long long)qb, kb, mask_idx[e - 1]);
    }
  }
  /* Copy, forcing the diagonal block (qb, qb) on. */
  int64_t total = mask_off[nb] + nb;
  int64_t *off = malloc((size_t)(nb + 1) * sizeof *off);
  int32_t *idx = malloc((size_t)total * sizeof *idx);
  if (!off || !idx) {
    free(off);
    free(idx);
    return mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "pattern: out of memory");
  }
  int64_t n = 0;
  for (int64_t qb = 0; qb < nb; qb++) {
    off[qb] = n;
    int placed = 0; /* the diagonal block, in key-block order */
    for (int64_t e = mask_off[qb]; e < mask_off[qb + 1]; e++) {
      if (!placed && mask_idx[e] >= qb) {
        if (mask_idx[e] > qb) idx[n++] = (int32_t)qb;
        placed = 1;
      }
      idx[n++] = mask_idx[e];
    }
    if (!placed) idx[n++] = (int32_t)qb;
  }
  off[nb] = n;
  mtrain_pattern_head_t *h = &p->heads[head];
  head_clear(h);
  h->mask_off = off;
  h->mask_idx = idx;
  return MTRAIN_SUCCESS;
}

mtrain_status_t mtrain_pattern_set_block_mask(mtrain_pattern_t *p, int32_t head,
                                              const uint8_t *mask) {
  mtrain_status_t st = check_head(p, head, __func__);
  if (st != MTRAIN_SUCCESS) return st;
  st = check_mask_blocks(p, head);
  if (st != MTRAIN_SUCCESS) return st;
  MTRAIN_CHECK_NOT_NULL(mask);
  int64_t nb = p->num_blocks;
  int64_t count = 0;
  for (int64_t qb = 0; qb < nb; qb++)
    for (int64_t kb = 0; kb < nb; kb++) {
      if (!mask[qb * nb + kb]) continue;
      if (p->causal && kb > qb)
        return mtrain_error(MTRAIN_ERR_INVALID_PATTERN,
                            "pattern head %d: block mask entry (%lld, %lld) lies above the "
                            "causal diagonal",
                            head, (long long)qb, (long long)kb);
      count++;
    }
  int64_t *off = malloc((size_t)(nb + 1) * sizeof *off);
  int32_t *idx = malloc((size_t)(count > 0 ? count : 1) * sizeof *idx);
  if (!off || !idx) {
    free(off);
    free(idx);
    return mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "pattern: out of memory");
  }
  int64_t n = 0;
  for (int64_t qb = 0; qb < nb; qb++) {
    off[qb] = n;
    for (int64_t kb = 0; kb < (p->causal ? qb + 1 : nb); kb++)
      if (mask[qb * nb + kb]) idx[n++] = (int32_t)kb;
  }
  off[nb] = n;
  st = mtrain_pattern_set_block_csr(p, head, off, idx);
  free(off);
  free(idx);
  return st;
}

mtrain_status_t mtrain_pattern_clone(const mtrain_pattern_t *src, mtrain_pattern_t **out) {
  MTRAIN_CHECK_NOT_NULL(src);
  MTRAIN_CHECK_NOT_NULL(out);
  mtrain_pattern_t *p = NULL;
  mtrain_status_t st =
      src->causal
          ? mtrain_pattern_create(src->seq_len, src->num_heads, src->granularity, &p)
          : mtrain_pattern_create_noncausal(src->seq_len, src->num_heads, src->granularity, &p);
  for (int32_t h = 0; h < src->num_heads && st == MTRAIN_SUCCESS; h++) {
    const mtrain_pattern_head_t *sh = &src->heads[h];
    if (sh->mask_off)
      st = mtrain_pattern_set_block_csr(p, h, sh->mask_off, sh->mask_idx);
    else
      st = mtrain_pattern_set_head(p, h, sh->diagonals, sh->num_diagonals, sh->verticals,
                                   sh->num_verticals);
  }
  if (st != MTRAIN_SUCCESS) {
    mtrain_pattern_destroy(p);
    return st;
  }
  *out = p;
  return MTRAIN_SUCCESS;
}

int64_t mtrain_pattern_seq_len(const mtrain_pattern_t *p) { return p ? p->seq_len : 0; }
int32_t mtrain_pattern_num_heads(const mtrain_pattern_t *p) { return p ? p->num_heads : 0; }
int32_t mtrain_pattern_granularity(const mtrain_pattern_t *p) { return p ? p->granularity : 0; }
int64_t mtrain_pattern_num_blocks(const mtrain_pattern_t *p) { return p ? p->num_blocks : 0; }

int mtrain_pattern_head_is_block_mask(const mtrain_pattern_t *p, int32_t head) {
  if (!p || head < 0 || head >= p->num_heads) return 0;
  return p->heads[head].mask_off != NULL;
}

mtrain_status_t mtrain_pattern_get_head(const mtrain_pattern_t *p, int32_t head,
                                        const int32_t **diagonals, int32_t *num_diagonals,
                                        const int64_t **verticals, int32_t *num_verticals) {
  mtrain_status_t st = check_head(p, head, __func__);
  if (st != MTRAIN_SUCCESS) return st;
  const mtrain_pattern_head_t *h = &p->heads[head];
  if (diagonals) *diagonals = h->diagonals;
  if (num_diagonals) *num_diagonals = h->num_diagonals;
  if (verticals) *verticals = h->verticals;
  if (num_verticals) *num_verticals = h->num_verticals;
  return MTRAIN_SUCCESS;
}

int mtrain_pattern_head_has_diagonal(const mtrain_pattern_head_t *h, int64_t t) {
  int32_t lo = 0, hi = h->num_diagonals;
  while (lo < hi) {
    int32_t mid = lo + (hi - lo) / 2;
    if (h->diagonals[mid] < t)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo < h->num_diagonals && h->diagonals[lo] == t;
}

static int has_vertical(const mtrain_pattern_head_t *h, int64_t j) {
  int32_t lo = 0, hi = h->num_verticals;
  while (lo < hi) {
    int32_t mid = lo + (hi - lo) / 2;
    if (h->verticals[mid] < j)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo < h->num_verticals && h->verticals[lo] == j;
}

static int block_mask_has(const mtrain_pattern_head_t *h, int64_t qb, int64_t kb) {
  for (int64_t e = h->mask_off[qb]; e < h->mask_off[qb + 1]; e++)
    if (h->mask_idx[e] == kb) return 1;
  return 0;
}

int mtrain_pattern_allowed(const mtrain_pattern_t *p, int32_t head, int64_t i, int64_t j) {
  if (!p || head < 0 || head >= p->num_heads) return 0;
  if (i < 0 || j < 0 || i >= p->seq_len || j >= p->seq_len || (p->causal && j > i)) return 0;
  const mtrain_pattern_head_t *h = &p->heads[head];
  int64_t qb = i / p->granularity, kb = j / p->granularity;
  if (h->mask_off) return block_mask_has(h, qb, kb);
  if (mtrain_pattern_head_has_diagonal(h, qb - kb)) return 1;
  return kb < qb && has_vertical(h, j);
}

/* Valid pairs between query block qb and key block kb (causal: below the
 * diagonal). */
static int64_t block_pairs(const mtrain_pattern_t *p, int64_t qb, int64_t kb) {
  int64_t G = p->granularity;
  int64_t rows = p->seq_len - qb * G < G ? p->seq_len - qb * G : G;
  if (kb != qb || !p->causal) {
    int64_t cols = p->seq_len - kb * G < G ? p->seq_len - kb * G : G;
    return rows * cols;
  }
  return rows * (rows + 1) / 2; /* diagonal block: lower triangle */
}

int64_t mtrain_pattern_count_pairs(const mtrain_pattern_t *p, int32_t head) {
  if (!p || head < 0 || head >= p->num_heads) return 0;
  const mtrain_pattern_head_t *h = &p->heads[head];
  int64_t G = p->granularity, nb = p->num_blocks, total = 0;
  for (int64_t qb = 0; qb < nb; qb++) {
    int64_t rows = p->seq_len - qb * G < G ? p->seq_len - qb * G : G;
    if (h->mask_off) {
      for (int64_t e = h->mask_off[qb]; e < h->mask_off[qb + 1]; e++)
        total += block_pairs(p, qb, h->mask_idx[e]);
      continue;
    }
    for (int32_t d = 0; d < h->num_diagonals && h->diagonals[d] <= qb; d++)
      total += block_pairs(p, qb, qb - h->diagonals[d]);
    /* bars: verticals in earlier blocks whose block diagonal is not listed */
    for (int32_t v = 0; v < h->num_verticals; v++) {
      int64_t kb = h->verticals[v] / G;
      if (kb >= qb) break;
      if (!mtrain_pattern_head_has_diagonal(h, qb - kb)) total += rows;
    }
  }
  return total;
}

/* run_inputs.h: mtrain-run's tensors: inputs read from .npy or generated
 * from a seed, outputs allocated to match, their device copies for the
 * "cuda" backend, comparison and writing. */
#ifndef MTRAIN_RUN_INPUTS_H
#define MTRAIN_RUN_INPUTS_H

#include "mtrain/mtrain.h"
#include "run_options.h"

typedef struct run_inputs {
  mtrain_tensor_t q, k, v, dout; /* malloc'ed data, owned */
  int64_t tokens;
  int32_t heads, kv_heads, head_dim;
} run_inputs_t;

typedef struct run_outputs {
  mtrain_tensor_t o, lse, dq, dk, dv; /* malloc'ed data, owned */
} run_outputs_t;

/** Reads --q/--k/--v/--do (converted to --dtype) or generates the inputs
 *  (--input structured|normal, --seq-len tokens from --seed). dout is
 *  generated when no --do is given. Returns 0 or 1 (message printed). */
int run_inputs_load_or_generate(const run_options_t *o, run_inputs_t *in);
/** Generated inputs (not files) for `count` tokens of the --seq-len sequence:
 *  row r of every tensor is token index[r] (r when index is NULL),
 *  bitwise what run_inputs_load_or_generate makes for that token; an index
 *  >= --seq-len gives a zero row (a layout's padding slot). Work O(count),
 *  OpenMP over the rows: a rank makes only its own slots. in->tokens =
 *  count. Returns 0 or 1 (message printed). */
int run_inputs_generate_rows(const run_options_t *o, const int64_t *index, int64_t count,
                             run_inputs_t *in);
/** The scales of --check's floor: the largest L2 norm over head_dim of a
 *  row (over tokens and heads) of q, k, v and dout into norms[0..3], and the
 *  largest |element| of q and k into norms[4..5] (zero rows, a layout's
 *  padding, count as 0). */
void run_inputs_norms(const run_inputs_t *in, double norms[6]);
/** fp64 copies of the inputs (the values the run used, widened exactly). */
int run_inputs_widen(const run_inputs_t *in, run_inputs_t *out);
void run_inputs_free(run_inputs_t *in);

/** Outputs for the inputs' shapes: o/dq/dk/dv of `dtype`, lse fp32 (fp64
 *  when dtype is fp64). */
int run_outputs_alloc(const run_inputs_t *in, mtrain_dtype_t dtype, run_outputs_t *out);
/** Output t in the order o, lse, dq, dk, dv. */
const mtrain_tensor_t *run_outputs_get(const run_outputs_t *out, int t);
void run_outputs_free(run_outputs_t *out);

/** Device copies (the "cuda" backend's memory) of the inputs: same shapes
 *  and dtype, data in device memory. Returns 0 or 1 (message printed). */
int run_inputs_to_device(const run_inputs_t *host, run_inputs_t *dev);
/** Frees device inputs from run_inputs_to_device. */
void run_inputs_free_device(run_inputs_t *dev);
/** Outputs like run_outputs_alloc, in device memory. */
int run_outputs_alloc_device(const run_inputs_t *in, mtrain_dtype_t dtype, run_outputs_t *out);
/** Copies the first `count` device outputs (in the order o, lse, dq, dk, dv)
 *  into host outputs of the same shapes. Returns 0 or 1 (message printed). */
int run_outputs_download(const run_outputs_t *dev, run_outputs_t *host, int count);
/** Frees device outputs from run_outputs_alloc_device. */
void run_outputs_free_device(run_outputs_t *out);

/** max |a - ref| and max |ref| over the tensors (any dtypes, same shape);
 *  NaN gives an infinite error. */
void run_compare(const mtrain_tensor_t *a, const mtrain_tensor_t *ref, double *err,
                 double *ref_max);
/** Writes a tensor as float32 .npy. */
mtrain_status_t run_write_f32(const char *path, const mtrain_tensor_t *t);

#endif /* MTRAIN_RUN_INPUTS_H */

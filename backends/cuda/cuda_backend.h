/* cuda_backend.h (private): the "cuda" backend table, for the registry. */
#ifndef MTRAIN_CUDA_BACKEND_H
#define MTRAIN_CUDA_BACKEND_H

#include "mtrain/mtrain_backend.h"

extern const mtrain_backend_ops_t mtrain_cuda_backend;

/** The stream (cudaStream_t) a "cuda" backend state queues its work on. */
void *mtrain_cuda_state_stream(void *state);

#endif /* MTRAIN_CUDA_BACKEND_H */

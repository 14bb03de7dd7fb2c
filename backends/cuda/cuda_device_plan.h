/* cuda_device_plan.h (private): the device_plan slots of the "cuda" backend
 * (cuda_device_plan.c; mtrain_backend.h says what each does) and the step
 * of one sequence of a device-built plan, which the attention slots use in
 * place of an uploaded host-packed step. */
#ifndef MTRAIN_CUDA_DEVICE_PLAN_H
#define MTRAIN_CUDA_DEVICE_PLAN_H

#include "backends/cuda/cuda_internal.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct cuda_device_plan cuda_device_plan_t;

mtrain_status_t cuda_device_plan_size(void *state, const mtrain_device_plan_args_t *args,
                                      size_t *bytes);
mtrain_status_t cuda_device_plan_build(void *state, const mtrain_device_plan_args_t *args,
                                       void *memory, void **handle);
mtrain_status_t cuda_device_plan_read(void *state, void *handle,
                                      const mtrain_device_plan_args_t *args, int64_t *pairs);
void cuda_device_plan_release(void *state, void *handle);

/** The device step of sequence `seq` of a device plan's handle (the
 *  mtrain_step_view_t.device_tables of its views): the tables in device
 *  memory, `d` and `scale` left for the caller. */
mtrain_status_t cuda_device_plan_step(const void *handle, int32_t seq, cuda_step_t *out);

#ifdef __cplusplus
}
#endif

#endif /* MTRAIN_CUDA_DEVICE_PLAN_H */

/* fuzz_npy.c: libFuzzer target: any bytes written to a file and read as
 * .npy either give a tensor whose size agrees with its shape, or an error
 * with a message. */
#define _POSIX_C_SOURCE 200809L
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "mtrain/mtrain.h"
#include "mtrain/mtrain_io.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  char path[64];
  snprintf(path, sizeof path, "/tmp/mtrain_fuzz_%d.npy", (int)getpid());
  FILE *f = fopen(path, "wb");
  if (!f) return 0;
  fwrite(data, 1, size, f);
  fclose(f);
  mtrain_npy_t npy;
  mtrain_status_t st = mtrain_npy_read(path, &npy);
  if (st == MTRAIN_SUCCESS) {
    const int64_t n = mtrain_tensor_numel(&npy.tensor);
    volatile double sum = 0; /* touch every element: the buffer must hold them */
    double x;
    for (int64_t i = 0; i < n; i++) {
      mtrain_convert((const char *)npy.tensor.data +
                         i * (int64_t)mtrain_dtype_size(npy.tensor.dtype),
                     npy.tensor.dtype, &x, MTRAIN_F64, 1);
      sum += x;
    }
    mtrain_npy_free(&npy);
  } else if (mtrain_last_error()[0] == '\0') {
    abort();
  }
  return 0;
}

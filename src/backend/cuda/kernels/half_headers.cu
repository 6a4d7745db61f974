// The half-precision program (kernels.rs `HALF_SOURCE`): the CUDA toolkit's headers for __half
// and __nv_bfloat16 first (NVRTC 13 has them built in no longer: the toolkit's include directory
// is passed with -I), then common.cu, device.cu and half.cu.
#include <cuda_fp16.h>
#include <cuda_bf16.h>

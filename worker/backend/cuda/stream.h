// cudaStream_t without a CUDA header, for the host-only launcher headers: the
// same declaration as the runtime's driver_types.h (a repeated identical typedef
// is legal C++), so .cu files may include both.
#ifndef KVCACHE_WORKER_BACKEND_CUDA_STREAM_H_
#define KVCACHE_WORKER_BACKEND_CUDA_STREAM_H_

typedef struct CUstream_st* cudaStream_t;

#endif  // KVCACHE_WORKER_BACKEND_CUDA_STREAM_H_

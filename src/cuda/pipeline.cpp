#include "cuda/pipeline.h"

#include <cuda_runtime.h>

#include <cstdlib>
#include <cstring>

namespace flce::cuda {

TilePipeline::~TilePipeline() {
  // Stream-ordered: resources are released once the queued work completes.
  for (cudaEvent_t e : {produced_[0], produced_[1], consumed_[0], consumed_[1], sync_})
    if (e) cudaEventDestroy(e);
  if (side_) cudaStreamDestroy(side_);
}

std::string TilePipeline::open(cudaStream_t main) {
  main_ = main;
  // FLCE_CUDA_STREAMS=1 queues the tile kernels on the call's stream too
  // (no overlap): the A/B switch of the benchmark.
  if (const char* env = std::getenv("FLCE_CUDA_STREAMS"); env && std::strcmp(env, "1") == 0) {
    side_ = nullptr;
    single_ = true;
    return "";
  }
  cudaError_t e = cudaStreamCreateWithFlags(&side_, cudaStreamNonBlocking);
  for (cudaEvent_t* ev : {&produced_[0], &produced_[1], &consumed_[0], &consumed_[1], &sync_})
    if (e == cudaSuccess) e = cudaEventCreateWithFlags(ev, cudaEventDisableTiming);
  if (e != cudaSuccess) return std::string("cuda backend: creating a stream: ") + cudaGetErrorString(e);
  fork();
  return "";
}

int TilePipeline::next() {
  const int k = count_++ % 2;
  if (single_) return k;
  cudaStreamWaitEvent(main_, consumed_[k], 0);  // a no-op before the first record
  return k;
}

void TilePipeline::produced(int k) {
  if (single_) return;
  cudaEventRecord(produced_[k], main_);
  cudaStreamWaitEvent(side_, produced_[k], 0);
}

void TilePipeline::consumed(int k) {
  if (!single_) cudaEventRecord(consumed_[k], side_);
}

void TilePipeline::join() {
  if (single_) return;
  cudaEventRecord(sync_, side_);
  cudaStreamWaitEvent(main_, sync_, 0);
}

void TilePipeline::fork() {
  if (single_) return;
  cudaEventRecord(sync_, main_);
  cudaStreamWaitEvent(side_, sync_, 0);
}

}  // namespace flce::cuda

// src/cuda/pipeline.h: score tiles in flight on two streams (internal).
//
// The GEMM that fills a score tile runs on the call's stream; the kernel that
// reads it (tile_states or dlogits) runs on a side stream, so the kernel of
// tile n overlaps the GEMM of tile n + 1. Two score buffers alternate; events
// order each buffer's producer after its previous consumer. The work and its
// order are the same as on one stream, so are the bits.
#pragma once

#include <string>

typedef struct CUstream_st* cudaStream_t;
typedef struct CUevent_st* cudaEvent_t;

namespace flce::cuda {

class TilePipeline {
 public:
  TilePipeline() = default;
  TilePipeline(const TilePipeline&) = delete;
  TilePipeline& operator=(const TilePipeline&) = delete;
  ~TilePipeline();

  // Creates the side stream and events; the side stream starts after the
  // work already queued on `main`. "" or the error.
  std::string open(cudaStream_t main);
  cudaStream_t main() const { return main_; }
  cudaStream_t side() const { return single_ ? main_ : side_; }

  // The buffer (0 or 1) for the next tile; `main` waits until that buffer's
  // previous consumer is done with it.
  int next();
  // After the producer of buffer k was queued on main.
  void produced(int k);
  // After the consumer of buffer k was queued on side.
  void consumed(int k);
  // main waits for everything queued on side so far; fork() the reverse.
  void join();
  void fork();

 private:
  cudaStream_t main_ = nullptr, side_ = nullptr;
  cudaEvent_t produced_[2] = {}, consumed_[2] = {}, sync_ = nullptr;
  int count_ = 0;
  bool single_ = false;  // FLCE_CUDA_STREAMS=1: everything on main
};

}  // namespace flce::cuda

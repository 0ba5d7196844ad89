// src/cuda/sm90/wgmma.cuh: the Hopper (sm_90a) instructions the fused
// kernels use, as inline PTX (internal; device code, compiled only for
// sm_90a): mbarriers, TMA tile loads and stores, warpgroup MMAs and register
// reallocation. The PTX ISA manual (sections "mbarrier", "cp.async.bulk.tensor",
// "wgmma" and "setmaxnreg") defines each; the shared-memory descriptor's bit
// fields are its "Matrix Descriptor Format".
#pragma once

#include <cstdint>

namespace flce::cuda::sm90 {

inline __device__ uint32_t shared_address(const void* p) {
  return uint32_t(__cvta_generic_to_shared(p));
}

// ---- mbarriers (one 64-bit word in shared memory each) ---------------------

inline __device__ void barrier_init(uint64_t* bar, uint32_t arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(shared_address(bar)), "r"(arrivals));
}
// Makes the initialized barriers visible to the TMA unit (async proxy).
inline __device__ void barrier_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
// One arrival that also announces `bytes` of TMA transfers to come.
inline __device__ void barrier_arrive_expect(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(shared_address(bar)),
               "r"(bytes)
               : "memory");
}
inline __device__ void barrier_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(shared_address(bar)) : "memory");
}
// One arrival on the barrier at bar's offset in the shared memory of cluster
// block `cta` (this block's own too).
inline __device__ void barrier_arrive_in(uint64_t* bar, uint32_t cta) {
  asm volatile(
      "{\n.reg .b32 remote;\n"
      "mapa.shared::cluster.u32 remote, %0, %1;\n"
      "mbarrier.arrive.shared::cluster.b64 _, [remote];\n}\n" ::"r"(shared_address(bar)),
      "r"(cta)
      : "memory");
}
// Waits until the barrier's phase of this parity has completed. A fresh
// barrier counts its (never run) phase of parity 1 as completed.
inline __device__ void barrier_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred done;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n}\n" ::"r"(shared_address(bar)),
      "r"(parity)
      : "memory");
}

// ---- clusters ------------------------------------------------------------

inline __device__ uint32_t cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
// Every thread of every block of the cluster waits for all the others
// (release/acquire: e.g. barriers initialized before a peer signals them).
inline __device__ void cluster_sync() {
  asm volatile(
      "barrier.cluster.arrive.release.aligned;\n"
      "barrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// ---- TMA -----------------------------------------------------------------

inline __device__ void prefetch_tensor_map(const void* map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}
// The box of `map` at element coordinates (c0 innermost, c1) into shared
// memory at dst; completion is counted in bytes on `bar`. Parts of the box
// outside the tensor arrive as zeros.
inline __device__ void tma_load_2d(void* dst, const void* map, uint64_t* bar, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3}], [%4];" ::"r"(shared_address(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(shared_address(bar))
      : "memory");
}

// The same box into the shared memory of every cluster block in `ctas` (a
// bit mask), at dst's offset, each completing on its barrier at bar's offset.
inline __device__ void tma_load_2d_multicast(void* dst, const void* map, uint64_t* bar, int c0,
                                             int c1, uint16_t ctas) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      ".multicast::cluster [%0], [%1, {%2, %3}], [%4], %5;" ::"r"(shared_address(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(shared_address(bar)), "h"(ctas)
      : "memory");
}

// The box of `map` at element coordinates (c0 innermost, c1) from shared
// memory at src to global memory, as one bulk async-group of this thread's;
// parts of the box outside the tensor are not written.
inline __device__ void tma_store_2d(const void* map, const void* src, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];" ::"l"(
          reinterpret_cast<uint64_t>(map)),
      "r"(shared_address(src)), "r"(c0), "r"(c1)
      : "memory");
}
inline __device__ void tma_store_3d(const void* map, const void* src, int c0, int c1, int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%2, %3, %4}], [%1];" ::"l"(
          reinterpret_cast<uint64_t>(map)),
      "r"(shared_address(src)), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}
inline __device__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
// Until at most kPending of this thread's bulk groups are still reading
// their shared memory (the buffer of older ones may be rewritten).
template <int kPending>
inline __device__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(kPending) : "memory");
}
// Until all of this thread's bulk groups have written global memory.
inline __device__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }
// Four 8 x 8 matrices of 16-bit values from the mma fragment layout (thread
// t holds row t / 4, columns 2 (t % 4), +1 of matrix i in r_i) to shared
// memory: lanes 8 i .. 8 i + 7 give the addresses of matrix i's rows, 16
// bytes each.
inline __device__ void stmatrix_x4(uint32_t address, uint32_t r0, uint32_t r1, uint32_t r2,
                                   uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(address),
               "r"(r0), "r"(r1), "r"(r2), "r"(r3)
               : "memory");
}
// Makes this thread's shared-memory writes visible to the TMA (async proxy).
inline __device__ void fence_shared_for_tma() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
// A barrier for `threads` threads (a multiple of 32) under id (1-15; 0 is
// __syncthreads').
inline __device__ void named_barrier(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// ---- warpgroup MMA --------------------------------------------------------

// x, through a move the compiler cannot see through: a new register.
inline __device__ float opaque_copy(float x) {
  float y;
  asm volatile("mov.b32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// The descriptor of a K-major tile in shared memory whose rows are 128 bytes
// (64 bf16) with the TMA's 128-byte swizzle: 8-row groups 1024 bytes apart
// (stride byte offset), leading byte offset unused (1), layout 1 = 128B
// swizzle. Stepping K by 16 elements inside the row adds 32 bytes to the
// start address; the swizzle is applied to the address bits, so the tile
// must start 1024-byte aligned.
inline __device__ uint64_t swizzled_k_major_desc(const void* tile) {
  const uint64_t addr = shared_address(tile);
  return ((addr & 0x3FFFF) >> 4) | (uint64_t(1) << 16) | (uint64_t(1024 >> 4) << 32) |
         (uint64_t(1) << 62);
}

inline __device__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
inline __device__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int kPending>
inline __device__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(kPending) : "memory");
}

// One wgmma of input type TYPE ("bf16" or "f16") on d, desc_a, desc_b and
// accumulate, d read and written (OUT "+f") or only written (OUT "=f").
#define FLCE_WGMMA_M64N128K16(TYPE, OUT) \
asm volatile( \
    "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n" \
    "wgmma.mma_async.sync.aligned.m64n128k16.f32." TYPE "." TYPE " " \
    "{" \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n" \
    : \
    OUT(d[0]), OUT(d[1]), OUT(d[2]), OUT(d[3]), OUT(d[4]), OUT(d[5]), OUT(d[6]), OUT(d[7]), \
    OUT(d[8]), OUT(d[9]), OUT(d[10]), OUT(d[11]), OUT(d[12]), OUT(d[13]), OUT(d[14]), OUT(d[15]), \
    OUT(d[16]), OUT(d[17]), OUT(d[18]), OUT(d[19]), OUT(d[20]), OUT(d[21]), OUT(d[22]), OUT(d[23]), \
    OUT(d[24]), OUT(d[25]), OUT(d[26]), OUT(d[27]), OUT(d[28]), OUT(d[29]), OUT(d[30]), OUT(d[31]), \
    OUT(d[32]), OUT(d[33]), OUT(d[34]), OUT(d[35]), OUT(d[36]), OUT(d[37]), OUT(d[38]), OUT(d[39]), \
    OUT(d[40]), OUT(d[41]), OUT(d[42]), OUT(d[43]), OUT(d[44]), OUT(d[45]), OUT(d[46]), OUT(d[47]), \
    OUT(d[48]), OUT(d[49]), OUT(d[50]), OUT(d[51]), OUT(d[52]), OUT(d[53]), OUT(d[54]), OUT(d[55]), \
    OUT(d[56]), OUT(d[57]), OUT(d[58]), OUT(d[59]), OUT(d[60]), OUT(d[61]), OUT(d[62]), OUT(d[63]) \
    : "l"(desc_a), "l"(desc_b), "r"(accumulate));

// d[64 x 128] (+)= A[64 x 16] B[128 x 16]^T, both K-major in shared memory;
// accumulate = 0 overwrites d. d's register r holds row
// 16 warp + lane/4 + 8 ((r/2) % 2), column 8 (r/4) + 2 (lane % 4) + r % 2.
template <bool kHalf>
inline __device__ void wgmma_m64n128k16(float (&d)[64], uint64_t desc_a, uint64_t desc_b,
                                        int accumulate) {
  if constexpr (kHalf) {
    FLCE_WGMMA_M64N128K16("f16", "+f");
  } else {
    FLCE_WGMMA_M64N128K16("bf16", "+f");
  }
}

// d = A[64 x 16] B[128 x 16]^T: as above with accumulate = 0, but d's old
// values are not an input, so that what an epilogue wrote there while other
// products were in flight is dead (else ptxas serializes the products,
// C7515).
template <bool kHalf>
inline __device__ void wgmma_m64n128k16_first(float (&d)[64], uint64_t desc_a, uint64_t desc_b) {
  const int accumulate = 0;
  if constexpr (kHalf) {
    FLCE_WGMMA_M64N128K16("f16", "=f");
  } else {
    FLCE_WGMMA_M64N128K16("bf16", "=f");
  }
}
#undef FLCE_WGMMA_M64N128K16

// Register reallocation between warpgroups (the producer gives its
// registers to the consumers).
template <int kRegs>
inline __device__ void registers_release() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegs));
}
template <int kRegs>
inline __device__ void registers_claim() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegs));
}

}  // namespace flce::cuda::sm90

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
// accumulate (the asm is the same but for the type).
#define FLCE_WGMMA_M64N256K16(TYPE) \
asm volatile( \
    "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n" \
    "wgmma.mma_async.sync.aligned.m64n256k16.f32." TYPE "." TYPE " " \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, " \
    "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
    "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, " \
    "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, " \
    "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, %128, %129, p, 1, 1, 0, 0;\n}\n" \
    : \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
    "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
    "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
    "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
    "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
    "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
    "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
    "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), \
    "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), \
    "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), \
    "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), \
    "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), \
    "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), \
    "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), \
    "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), \
    "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127]) \
    : "l"(desc_a), "l"(desc_b), "r"(accumulate));

// d[64 x 256] (+)= A[64 x 16] B[256 x 16]^T, both K-major in shared memory;
// accumulate = 0 overwrites d. d's register r holds row
// 16 warp + lane/4 + 8 ((r/2) % 2), column 8 (r/4) + 2 (lane % 4) + r % 2.
template <bool kHalf>
inline __device__ void wgmma_m64n256k16(float (&d)[128], uint64_t desc_a, uint64_t desc_b,
                                        int accumulate) {
  if constexpr (kHalf) {
    FLCE_WGMMA_M64N256K16("f16");
  } else {
    FLCE_WGMMA_M64N256K16("bf16");
  }
}
#undef FLCE_WGMMA_M64N256K16

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

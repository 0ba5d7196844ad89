# src/cuda/cuda.cmake: the `cuda` backend.
#
# Included by the top-level CMakeLists.txt after the `flce` target exists.
# FLCE_CUDA=AUTO builds it when CMake finds a CUDA compiler (PATH, CUDACXX,
# or /usr/local/cuda/bin/nvcc), ON requires one, OFF never builds it. Either
# way a backend named `cuda` is registered: without the toolkit it is
# src/cuda/cuda_unavailable.cpp, which declines every problem and says why.
# Defines FLCE_HAVE_CUDA=1 (PUBLIC) when the real backend is in.
# Architectures: CMAKE_CUDA_ARCHITECTURES, default 80;90 (A100, H100).

set(_flce_cuda_dir ${CMAKE_CURRENT_LIST_DIR})
set(FLCE_HAVE_CUDA OFF)
if(NOT FLCE_CUDA STREQUAL "OFF")
  if(NOT CMAKE_CUDA_COMPILER AND NOT DEFINED ENV{CUDACXX} AND EXISTS /usr/local/cuda/bin/nvcc)
    set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
  endif()
  include(CheckLanguage)
  check_language(CUDA)
  # The fused Hopper kernels need nvcc 12 or newer (sm_90a): an older one
  # stops the build under ON and is left out, with the reason, under AUTO.
  if(CMAKE_CUDA_COMPILER)
    execute_process(COMMAND ${CMAKE_CUDA_COMPILER} --version OUTPUT_VARIABLE _flce_nvcc_out
                    ERROR_QUIET RESULT_VARIABLE _flce_nvcc_rc)
    string(REGEX MATCH "release ([0-9]+)\\.([0-9]+)" _flce_nvcc_release "${_flce_nvcc_out}")
    if(_flce_nvcc_release AND CMAKE_MATCH_1 LESS 12)
      string(CONCAT _flce_cuda_missing "${CMAKE_CUDA_COMPILER} is CUDA "
             "${CMAKE_MATCH_1}.${CMAKE_MATCH_2}, and the cuda backend needs 12.0 or newer for sm_90a")
      if(FLCE_CUDA STREQUAL "ON")
        message(FATAL_ERROR "FLCE_CUDA=ON but ${_flce_cuda_missing}")
      endif()
      message(STATUS "flce: ${_flce_cuda_missing}: building without it")
      unset(CMAKE_CUDA_COMPILER)
      unset(CMAKE_CUDA_COMPILER CACHE)
    endif()
  endif()
  if(CMAKE_CUDA_COMPILER)
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      set(CMAKE_CUDA_ARCHITECTURES 80 90)
    endif()
    enable_language(CUDA)
    find_package(CUDAToolkit REQUIRED)
    set(FLCE_HAVE_CUDA ON)
  elseif(FLCE_CUDA STREQUAL "ON")
    message(FATAL_ERROR "FLCE_CUDA=ON but no CUDA compiler was found "
                        "(put nvcc on PATH or set CUDACXX)")
  endif()
endif()

if(FLCE_HAVE_CUDA)
  target_sources(flce PRIVATE
    ${_flce_cuda_dir}/cuda_backend.cpp
    ${_flce_cuda_dir}/plan.cpp
    ${_flce_cuda_dir}/passes.cpp
    ${_flce_cuda_dir}/gemm.cpp
    ${_flce_cuda_dir}/cublas_library.cpp
    ${_flce_cuda_dir}/kernels.cu
    ${_flce_cuda_dir}/device_copy.cpp
    ${_flce_cuda_dir}/device_guard.cpp)
  # The fused Hopper kernels (src/cuda/sm90/) use wgmma and TMA, which only
  # sm_90a has: their own object library, built for that architecture alone
  # whatever CMAKE_CUDA_ARCHITECTURES says (nvcc 12 or newer). Pass 1's
  # kernels are split over four files so that they compile in parallel.
  add_library(flce_sm90 OBJECT ${_flce_cuda_dir}/sm90/score_gemms.cu
                               ${_flce_cuda_dir}/sm90/score_states_0.cu
                               ${_flce_cuda_dir}/sm90/score_states_1.cu
                               ${_flce_cuda_dir}/sm90/score_states_2.cu
                               ${_flce_cuda_dir}/sm90/score_states_3.cu)
  target_include_directories(flce_sm90 PRIVATE ${PROJECT_SOURCE_DIR}/include
                                               ${PROJECT_SOURCE_DIR}/src)
  set_target_properties(flce_sm90 PROPERTIES CUDA_ARCHITECTURES OFF CUDA_STANDARD 17
                                             CUDA_STANDARD_REQUIRED ON
                                             POSITION_INDEPENDENT_CODE ON)
  target_compile_options(flce_sm90 PRIVATE --generate-code=arch=compute_90a,code=sm_90a
                                           --expt-relaxed-constexpr -lineinfo)
  target_link_libraries(flce_sm90 PRIVATE CUDA::cudart)
  target_sources(flce PRIVATE $<TARGET_OBJECTS:flce_sm90>)
  set_source_files_properties(${_flce_cuda_dir}/kernels.cu TARGET_DIRECTORY flce
    PROPERTIES COMPILE_OPTIONS "--expt-relaxed-constexpr;-lineinfo;-Xcompiler=-Wall")
  # flce was created before CUDA was enabled: set what the target missed.
  set_target_properties(flce PROPERTIES CUDA_ARCHITECTURES "${CMAKE_CUDA_ARCHITECTURES}"
                                        CUDA_STANDARD 17 CUDA_STANDARD_REQUIRED ON)
  # cuBLAS is loaded when the backend first needs it (cublas_library.h), not
  # linked; its headers are cudart's. The path CMake found is the fallback.
  target_link_libraries(flce PUBLIC CUDA::cudart PRIVATE ${CMAKE_DL_LIBS})
  if(TARGET CUDA::cublas)
    target_compile_definitions(flce PRIVATE FLCE_CUBLAS_PATH="$<TARGET_FILE:CUDA::cublas>")
  endif()
  target_compile_definitions(flce PUBLIC FLCE_HAVE_CUDA=1)
  message(STATUS "flce cuda backend: nvcc ${CMAKE_CUDA_COMPILER_VERSION}, "
                 "architectures ${CMAKE_CUDA_ARCHITECTURES}")
else()
  target_sources(flce PRIVATE ${_flce_cuda_dir}/cuda_unavailable.cpp
                              ${_flce_cuda_dir}/device_copy.cpp)
  if(DEFINED _flce_cuda_missing)  # why, for the stand-in's message
    set_source_files_properties(${_flce_cuda_dir}/cuda_unavailable.cpp TARGET_DIRECTORY flce
      PROPERTIES COMPILE_DEFINITIONS "FLCE_CUDA_MISSING=\"${_flce_cuda_missing}\"")
  endif()
  message(STATUS "flce cuda backend: not built (FLCE_CUDA=${FLCE_CUDA})")
endif()

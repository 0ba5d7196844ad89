# src/cpu/gemm/gemm.cmake: the GEMM engines of the cpu backend.
#
# Included by the top-level CMakeLists.txt after the `flce` target exists:
#   include(src/cpu/gemm/gemm.cmake)
# Adds src/cpu/gemm/*.cpp to `flce` for each library found, defines
# FLCE_HAVE_OPENBLAS / FLCE_HAVE_ONEDNN / FLCE_HAVE_EIGEN (PUBLIC, so tests
# and benchmarks can tell what was compiled in), and links the libraries.
#
#   OpenBLAS  OpenBLASConfig.cmake (Debian ships one per variant behind the
#             alternatives), else pkg-config `openblas`, else find_path(cblas.h)
#             + find_library(openblas). Its cblas.h must be OpenBLAS's own,
#             which Debian keeps in /usr/include/<triplet>/openblas-<variant>/.
#   oneDNN    find_package(dnnl CONFIG) -> DNNL::dnnl. Debian's config is for
#             a build with the OpenCL GPU runtime and does
#             find_package(OpenCL REQUIRED), a fatal error without the OpenCL
#             headers; so it is tried only when OpenCL is found, else the
#             header and library are found by hand.
#   Eigen3    find_package(Eigen3 3.3 NO_MODULE) -> Eigen3::Eigen; required
#             (header-only, the fallback engine).
#
# Options FLCE_GEMM_OPENBLAS and FLCE_GEMM_ONEDNN (ON: use it when found).

if(NOT TARGET flce)
  message(FATAL_ERROR "gemm.cmake: include it after add_library(flce ...)")
endif()

option(FLCE_GEMM_OPENBLAS "cpu backend: the OpenBLAS gemm engine, when found" ON)
option(FLCE_GEMM_ONEDNN "cpu backend: the oneDNN gemm engine, when found" ON)

set(_flce_gemm_dir ${CMAKE_CURRENT_LIST_DIR})
set(_flce_gemm_found "")

# Eigen: always.
find_package(Eigen3 3.3 REQUIRED NO_MODULE)
target_sources(flce PRIVATE ${_flce_gemm_dir}/gemm.cpp ${_flce_gemm_dir}/gemm_eigen.cpp)
target_link_libraries(flce PRIVATE Eigen3::Eigen)
target_compile_definitions(flce PUBLIC FLCE_HAVE_EIGEN=1)
# Baseline ISA like the rest of the library (no -march=native: the binary must
# run on any x86-64), but always optimized: Eigen at -O0 is unusably slow.
set_source_files_properties(${_flce_gemm_dir}/gemm_eigen.cpp
  TARGET_DIRECTORY flce PROPERTIES COMPILE_OPTIONS "-O3")

# OpenBLAS: the first candidate whose cblas.h is OpenBLAS's own (declares
# openblas_set_num_threads; netlib's cblas.h does not) and that has a library.
function(_flce_openblas_candidate inc lib how)
  if(_flce_openblas_how OR NOT lib)
    return()
  endif()
  foreach(_dir ${inc})
    if(EXISTS ${_dir}/cblas.h)
      file(STRINGS ${_dir}/cblas.h _decl REGEX "openblas_set_num_threads")
      if(_decl)
        set(_flce_openblas_inc "${inc}" PARENT_SCOPE)
        set(_flce_openblas_lib "${lib}" PARENT_SCOPE)
        set(_flce_openblas_how "${how}" PARENT_SCOPE)
        return()
      endif()
    endif()
  endforeach()
endfunction()

if(FLCE_GEMM_OPENBLAS)
  set(_flce_openblas_how "")
  find_package(OpenBLAS CONFIG QUIET)
  if(OpenBLAS_FOUND)
    _flce_openblas_candidate("${OpenBLAS_INCLUDE_DIRS}" "${OpenBLAS_LIBRARIES}"
                             "OpenBLASConfig.cmake")
  endif()
  if(NOT _flce_openblas_how)
    find_package(PkgConfig QUIET)
    if(PKG_CONFIG_FOUND)
      pkg_check_modules(FLCE_PC_OPENBLAS QUIET openblas)
      if(FLCE_PC_OPENBLAS_FOUND)
        _flce_openblas_candidate("${FLCE_PC_OPENBLAS_INCLUDE_DIRS}"
                                 "${FLCE_PC_OPENBLAS_LINK_LIBRARIES}" "pkg-config")
      endif()
    endif()
  endif()
  if(NOT _flce_openblas_how)
    find_path(FLCE_OPENBLAS_INCLUDE_DIR cblas.h
              PATH_SUFFIXES openblas-pthread openblas openblas-openmp openblas-serial)
    find_library(FLCE_OPENBLAS_LIBRARY NAMES openblas
                 PATH_SUFFIXES openblas-pthread openblas-openmp openblas-serial)
    if(FLCE_OPENBLAS_INCLUDE_DIR AND FLCE_OPENBLAS_LIBRARY)
      _flce_openblas_candidate("${FLCE_OPENBLAS_INCLUDE_DIR}" "${FLCE_OPENBLAS_LIBRARY}"
                               "find_library")
    endif()
  endif()
  if(_flce_openblas_how)
    target_sources(flce PRIVATE ${_flce_gemm_dir}/gemm_openblas.cpp)
    set_source_files_properties(${_flce_gemm_dir}/gemm_openblas.cpp
      TARGET_DIRECTORY flce PROPERTIES INCLUDE_DIRECTORIES "${_flce_openblas_inc}")
    target_link_libraries(flce PRIVATE ${_flce_openblas_lib})
    target_compile_definitions(flce PUBLIC FLCE_HAVE_OPENBLAS=1)
    list(APPEND _flce_gemm_found "openblas (${_flce_openblas_how}: ${_flce_openblas_lib})")
  endif()
endif()

# oneDNN.
if(FLCE_GEMM_ONEDNN)
  set(_flce_dnnl_target "")
  find_package(OpenCL QUIET)
  if(OpenCL_FOUND)
    find_package(dnnl CONFIG QUIET)
  endif()
  if(dnnl_FOUND AND TARGET DNNL::dnnl)
    set(_flce_dnnl_target DNNL::dnnl)
    set(_flce_dnnl_how "dnnl-config.cmake ${dnnl_VERSION}")
  else()
    find_path(FLCE_DNNL_INCLUDE_DIR oneapi/dnnl/dnnl.hpp)
    find_library(FLCE_DNNL_LIBRARY NAMES dnnl)
    if(FLCE_DNNL_INCLUDE_DIR AND FLCE_DNNL_LIBRARY)
      add_library(flce_dnnl INTERFACE IMPORTED)
      set_target_properties(flce_dnnl PROPERTIES
        INTERFACE_INCLUDE_DIRECTORIES ${FLCE_DNNL_INCLUDE_DIR}
        INTERFACE_LINK_LIBRARIES ${FLCE_DNNL_LIBRARY})
      set(_flce_dnnl_target flce_dnnl)
      set(_flce_dnnl_how "find_library")
    endif()
  endif()
  if(_flce_dnnl_target)
    target_sources(flce PRIVATE ${_flce_gemm_dir}/gemm_onednn.cpp)
    target_link_libraries(flce PRIVATE ${_flce_dnnl_target})
    target_compile_definitions(flce PUBLIC FLCE_HAVE_ONEDNN=1)
    list(PREPEND _flce_gemm_found "onednn (${_flce_dnnl_how})")
  endif()
endif()

list(APPEND _flce_gemm_found "eigen ${Eigen3_VERSION} (fallback)")
list(JOIN _flce_gemm_found ", " _flce_gemm_line)
message(STATUS "flce cpu gemm engines: ${_flce_gemm_line}")

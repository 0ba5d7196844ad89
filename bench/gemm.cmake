# bench/gemm.cmake: flce_gemm_engines, the GFLOP/s of each cpu gemm engine on
# the backend's tile shapes (see the comment at the top of gemm_engines.cpp).
# Include after src/cpu/gemm/gemm.cmake.
add_executable(flce_gemm_engines ${CMAKE_CURRENT_LIST_DIR}/gemm_engines.cpp)
target_include_directories(flce_gemm_engines PRIVATE ${CMAKE_CURRENT_LIST_DIR}/../src ${CMAKE_CURRENT_LIST_DIR}/..)
target_compile_options(flce_gemm_engines PRIVATE -Wall -Wextra)
target_link_libraries(flce_gemm_engines PRIVATE flce)

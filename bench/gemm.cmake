# bench/gemm.cmake: flce_gemm_engines, the GFLOP/s of each cpu gemm engine on
# the backend's tile shapes (see the comment at the top of gemm_engines.cpp).
# Include after src/cpu/gemm/gemm.cmake.
add_executable(flce_gemm_engines ${CMAKE_CURRENT_LIST_DIR}/gemm_engines.cpp)
target_include_directories(flce_gemm_engines PRIVATE ${CMAKE_CURRENT_LIST_DIR}/../src ${CMAKE_CURRENT_LIST_DIR}/..)
target_compile_options(flce_gemm_engines PRIVATE -Wall -Wextra)
target_link_libraries(flce_gemm_engines PRIVATE flce)
if(FLCE_BUILD_TESTS)
  # Bad arguments exit 2 naming the flag and the value (--hidden 0 was a
  # SIGFPE, --threads 0 a SIGSEGV, --rows abc an uncaught exception).
  add_test(NAME gemm_engines_arguments
           COMMAND sh -c "for a in '--hidden 0' '--threads 0' '--rows abc' '--kinds logits,foo'; do \
out=$('$<TARGET_FILE:flce_gemm_engines>' --seconds 0.01 --repeats 1 $a 2>&1); rc=$?; \
echo \"$a: rc $rc: $out\"; [ $rc = 2 ] || exit 1; \
echo \"$out\" | grep -q \"^flce_gemm_engines: $(echo $a | cut -d' ' -f1): \" || exit 1; done")
endif()

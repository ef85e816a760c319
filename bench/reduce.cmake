# Reduce benchmark; included by bench/CMakeLists.txt.
add_executable(paramsync-bench-reduce ${CMAKE_CURRENT_LIST_DIR}/bench_reduce.c
                                      ${CMAKE_CURRENT_LIST_DIR}/bench_args.c)
target_link_libraries(paramsync-bench-reduce PRIVATE paramsync_reduce)

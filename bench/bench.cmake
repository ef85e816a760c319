# paramsync-bench: nccl-tests-style figures for every collective of libparamsync
# (one process per rank); included by bench/CMakeLists.txt. bench/compare runs it.
add_executable(paramsync-bench ${CMAKE_CURRENT_LIST_DIR}/paramsync_bench.c)
target_link_libraries(paramsync-bench PRIVATE paramsync paramsync_gpu m)

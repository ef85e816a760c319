# Unit tests of reduce/ (libparamsync_reduce); included by tests/unit/CMakeLists.txt.
add_executable(test_reduce ${CMAKE_CURRENT_LIST_DIR}/test_reduce.c)
# ps_elementwise.h is the single definition of the arithmetic; the test checks its conversions directly.
target_include_directories(test_reduce PRIVATE ${PROJECT_SOURCE_DIR}/reduce)
target_link_libraries(test_reduce PRIVATE paramsync_reduce PkgConfig::CMOCKA)
add_test(NAME unit.reduce COMMAND test_reduce)
# LABELS: scripts/check reruns the `unit` label under ASan+UBSan. TIMEOUT: well above the
# 5-40 s it takes (Debug sanitizer builds included), so a hang fails instead of stalling CI.
set_tests_properties(unit.reduce PROPERTIES LABELS unit TIMEOUT 300)

# Unit tests of server/rpc/task.c (kept threads); included by tests/unit/CMakeLists.txt.
if(TARGET PkgConfig::CMOCKA)
  add_executable(test_task ${CMAKE_CURRENT_LIST_DIR}/test_task.c)
  target_link_libraries(test_task PRIVATE paramsync_rpc PkgConfig::CMOCKA)
  add_test(NAME unit.task COMMAND test_task)
  set_tests_properties(unit.task PROPERTIES TIMEOUT 60 LABELS unit)
endif()

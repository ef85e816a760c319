# Unit tests of server/rpc/rpc.c over a real gRPC server on loopback; included by
# tests/unit/CMakeLists.txt.
if(TARGET PkgConfig::CMOCKA)
  add_executable(test_rpc ${CMAKE_CURRENT_LIST_DIR}/test_rpc.c)
  target_link_libraries(test_rpc PRIVATE paramsync_rpc PkgConfig::CMOCKA)
  add_test(NAME unit.rpc COMMAND test_rpc)
  set_tests_properties(unit.rpc PROPERTIES TIMEOUT 90 LABELS unit)
endif()

# Unit tests of server/rpc/ (paramsync_rpc); included by tests/unit/CMakeLists.txt.
#   unit.rpc   rpc.c over a real gRPC server on loopback: handler threads, held headers
#   unit.task  task.c: kept threads that never make a task wait for a busy one
#   unit.frame frame.c's encoder: a frame of received slices equals one of the same bytes
#   unit.malloc ps__malloc_arenas_init: one malloc arena for every thread of a daemon
if(TARGET PkgConfig::CMOCKA)
  foreach(t rpc task frame malloc)
    add_executable(test_${t} ${CMAKE_CURRENT_LIST_DIR}/test_${t}.c)
    target_link_libraries(test_${t} PRIVATE paramsync_rpc PkgConfig::CMOCKA)
    add_test(NAME unit.${t} COMMAND test_${t})
  endforeach()
  set_tests_properties(unit.rpc unit.task unit.frame unit.malloc PROPERTIES TIMEOUT 90 LABELS unit)
endif()

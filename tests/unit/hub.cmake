# Unit tests of server/hub.c (the collective engine) with a stand-in coordinator; included by
# tests/unit/CMakeLists.txt. The sources are compiled into the test, as paramsyncd links them.
if(TARGET PkgConfig::CMOCKA AND TARGET PkgConfig::MHD)
  add_executable(test_hub ${CMAKE_CURRENT_LIST_DIR}/test_hub.c ${PROJECT_SOURCE_DIR}/server/hub.c
                 ${PROJECT_SOURCE_DIR}/server/metrics.c ${PROJECT_SOURCE_DIR}/server/log.c)
  target_link_libraries(test_hub PRIVATE paramsync_rpc paramsync_reduce paramsync_gpu
                                         PkgConfig::CMOCKA PkgConfig::MHD m)
  add_test(NAME unit.hub COMMAND test_hub)
  set_tests_properties(unit.hub PROPERTIES TIMEOUT 120 LABELS unit)
endif()

# Unit tests of server/metrics.c and server/health.c; included by tests/unit/CMakeLists.txt.
# The sources are compiled into the tests directly: paramsyncd links them as its own objects.
if(TARGET PkgConfig::CMOCKA AND TARGET PkgConfig::MHD)
  add_executable(test_metrics ${CMAKE_CURRENT_LIST_DIR}/test_metrics.c
                 ${PROJECT_SOURCE_DIR}/server/metrics.c)
  target_include_directories(test_metrics PRIVATE ${PROJECT_SOURCE_DIR}/server ${PS_INCLUDE_DIR})
  target_link_libraries(test_metrics PRIVATE PkgConfig::CMOCKA PkgConfig::MHD Threads::Threads m)
  add_test(NAME unit.metrics COMMAND test_metrics)
  set_tests_properties(unit.metrics PROPERTIES TIMEOUT 120 LABELS "unit;metrics")

  add_executable(test_health ${CMAKE_CURRENT_LIST_DIR}/test_health.c
                 ${PROJECT_SOURCE_DIR}/server/health.c ${PROJECT_SOURCE_DIR}/server/log.c)
  target_link_libraries(test_health PRIVATE paramsync_rpc PkgConfig::CMOCKA)
  add_test(NAME unit.health COMMAND test_health)
  set_tests_properties(unit.health PROPERTIES TIMEOUT 120 LABELS "unit;metrics")
endif()

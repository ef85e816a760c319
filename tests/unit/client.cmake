# Unit tests of client/device.c (device buffers in collectives); included by tests/unit/CMakeLists.txt.
#
#   unit.client_device   host buffers are never staged; without usable CUDA   always
#                        a device-flagged buffer fails cleanly (PS_EUNAVAIL);
#                        on a GPU host, real pinned copies
#   unit.client_staging  the staging logic over a fake CUDA: every host/device  always
#                        mix, failure injection, the pinned cache
# Both reach the client's internals through libparamsync.a.
if(NOT TARGET paramsync_static)
  return()
endif()

set(ps_client_test_dir ${CMAKE_CURRENT_LIST_DIR})

# ps_client_unit_test(NAME SOURCES...): test_NAME from SOURCES, with the
# client's internal headers, linked to libparamsync.a; ctest unit.NAME.
function(ps_client_unit_test name)
  add_executable(test_${name} ${ARGN})
  target_include_directories(test_${name} PRIVATE ${PROJECT_SOURCE_DIR}/client
                             ${PROJECT_SOURCE_DIR}/server/rpc)
  target_link_libraries(test_${name} PRIVATE paramsync_static paramsync_proto PkgConfig::CMOCKA)
  add_test(NAME unit.${name} COMMAND test_${name})
  set_tests_properties(unit.${name} PROPERTIES LABELS unit TIMEOUT 60)
endfunction()

ps_client_unit_test(client_device ${ps_client_test_dir}/test_client_device.c)
# device.c compiled again, without PS_HAVE_CUDA, next to the fake ps_gpu_*
# functions of the test: the archive's own device.c and gpu objects are not
# pulled in.
ps_client_unit_test(client_staging ${ps_client_test_dir}/test_client_staging.c
                    ${PROJECT_SOURCE_DIR}/client/device.c)

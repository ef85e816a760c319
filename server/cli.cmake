# The `paramsync` operator command (server/cli/); included by server/CMakeLists.txt.
# The target is paramsync_cli because `paramsync` is the client library's;
# the installed program is still called paramsync.
add_executable(paramsync_cli ${CMAKE_CURRENT_LIST_DIR}/cli/main.c
               ${CMAKE_CURRENT_LIST_DIR}/cli/status.c ${CMAKE_CURRENT_LIST_DIR}/cli/out.c)
set_target_properties(paramsync_cli PROPERTIES OUTPUT_NAME paramsync)
target_compile_definitions(paramsync_cli PRIVATE PS_VERSION="${PROJECT_VERSION}")
# paramsync_reduce holds ps_strerror (reduce/common.c); only that object is linked in.
target_link_libraries(paramsync_cli PRIVATE paramsync_rpc paramsync_reduce m)
install(TARGETS paramsync_cli RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})

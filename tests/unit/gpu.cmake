# Unit tests of gpu/ (libparamsync_gpu); included by tests/unit/CMakeLists.txt.
#
#   unit.gpu_elementwise  the kernels' arithmetic, host C, against the CPU engine    always
#   unit.gpu_api          argument checks, error mapping, no-device behaviour, stub  always
#   unit.gpu_emulate      the kernels' loop (vectors, tails, threads) run on the host CUDA builds
#   gpu.kernels           the kernels on a device against the CPU engine; SKIPPED    always
#                         (exit 77) when there is no device, never a vacuous pass
# test_gpu_api and test_gpu_kernels link paramsync_gpu, whatever it is (CUDA or stub).

set(ps_gpu_test_dir ${CMAKE_CURRENT_LIST_DIR})

add_executable(test_gpu_elementwise ${ps_gpu_test_dir}/test_gpu_elementwise.c)
target_include_directories(test_gpu_elementwise PRIVATE ${PROJECT_SOURCE_DIR}/reduce
                           ${PROJECT_SOURCE_DIR}/gpu)
target_link_libraries(test_gpu_elementwise PRIVATE paramsync_reduce PkgConfig::CMOCKA)
add_test(NAME unit.gpu_elementwise COMMAND test_gpu_elementwise)
set_tests_properties(unit.gpu_elementwise PROPERTIES LABELS unit TIMEOUT 300)

add_executable(test_gpu_api ${ps_gpu_test_dir}/test_gpu_api.c)
target_include_directories(test_gpu_api PRIVATE ${PROJECT_SOURCE_DIR}/gpu)
target_link_libraries(test_gpu_api PRIVATE paramsync_gpu PkgConfig::CMOCKA)
# The CUDA objects in paramsync_gpu need nothing but cudart: link with the C compiler.
set_property(TARGET test_gpu_api PROPERTY LINKER_LANGUAGE C)
add_test(NAME unit.gpu_api COMMAND test_gpu_api)
set_tests_properties(unit.gpu_api PROPERTIES LABELS unit TIMEOUT 120)

add_executable(test_gpu_kernels ${ps_gpu_test_dir}/test_gpu_kernels.c)
target_include_directories(test_gpu_kernels PRIVATE ${PROJECT_SOURCE_DIR}/reduce)
target_link_libraries(test_gpu_kernels PRIVATE paramsync_gpu paramsync_reduce PkgConfig::CMOCKA)
set_property(TARGET test_gpu_kernels PROPERTY LINKER_LANGUAGE C)
add_test(NAME gpu.kernels COMMAND test_gpu_kernels)
set_tests_properties(gpu.kernels PROPERTIES LABELS gpu SKIP_RETURN_CODE 77 TIMEOUT 600)

if(PS_HAVE_CUDA)
  # CUDA is enabled in gpu/; a directory that compiles .cu files enables it again.
  enable_language(CUDA)
  add_executable(test_gpu_emulate ${ps_gpu_test_dir}/test_gpu_emulate.cu)
  target_include_directories(test_gpu_emulate PRIVATE ${PROJECT_SOURCE_DIR}/reduce
                             ${PROJECT_SOURCE_DIR}/gpu)
  target_link_libraries(test_gpu_emulate PRIVATE paramsync_reduce CUDA::cudart_static
                        PkgConfig::CMOCKA)
  ps_gpu_cuda_flags(test_gpu_emulate)
  add_test(NAME unit.gpu_emulate COMMAND test_gpu_emulate)
  set_tests_properties(unit.gpu_emulate PROPERTIES LABELS unit TIMEOUT 300)
endif()

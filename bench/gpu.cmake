# paramsync-bench-gpu: CUDA reduce GB/s beside device-to-device cudaMemcpy; included by
# bench/CMakeLists.txt. Built only with CUDA (PS_HAVE_CUDA, from gpu/); without a
# device it prints SKIPPED and exits 77.
if(PS_HAVE_CUDA)
  # CUDA is enabled in gpu/; a directory that compiles .cu files enables it again.
  enable_language(CUDA)
  add_executable(paramsync-bench-gpu ${CMAKE_CURRENT_LIST_DIR}/bench_gpu.cu
                                    ${CMAKE_CURRENT_LIST_DIR}/bench_args.c)
  target_link_libraries(paramsync-bench-gpu PRIVATE paramsync_gpu paramsync_reduce
                        CUDA::cudart_static)
  ps_gpu_cuda_flags(paramsync-bench-gpu)
endif()

/* The fake CUDA of ps-test-worker-fakegpu (fake_client_gpu.c). */
#ifndef PS_FAKE_CLIENT_GPU_H
#define PS_FAKE_CLIENT_GPU_H

/** The pinned host memory of the last copy between a device buffer and
 * pinned memory (where the client staged its last call), or NULL when there
 * was none since the last ask; asking forgets it. */
const void *fake_client_gpu_last_pinned(void);

/* How many copies read another process's device buffer (device peer copies
 * over the fake CUDA IPC) since the last call. */
int fake_client_gpu_ipc_reads(void);

#endif

// Which record of an event does a CUDA graph's external event-wait node wait
// for, and when does a stream that waits for a graph's external event-record
// node start? (A question for ordering a communicator's graph replays with
// its eager calls through events: docs/experiments.md.) Build and run on a
// GPU machine: nvcc -O2 -o geo graph_event_order.cu && ./geo
#include <cstdio>
#include <cuda_runtime.h>

#define CK(x) do { cudaError_t rc_ = (x); if (rc_ != cudaSuccess) { printf("%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(rc_)); return 1; } } while (0)

__device__ unsigned long long now_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Waits `ns`, then writes `value` (one thread).
__global__ void slow_write(volatile int* flag, int value, unsigned long long ns) {
  unsigned long long t0 = now_ns();
  while (now_ns() - t0 < ns) {}
  *flag = value;
}

// Copies the flag as it is when this runs.
__global__ void read_flag(volatile const int* flag, int* out) { *out = *flag; }

int main() {
  cudaStream_t a, b;
  CK(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking));
  CK(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking));
  cudaEvent_t e, done;
  CK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  CK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
  int *flag, *out;
  CK(cudaMalloc(&flag, sizeof(int)));
  CK(cudaMalloc(&out, sizeof(int)));
  const unsigned long long slow = 300ull * 1000 * 1000;  // 300 ms
  int got = 0;

  // g: [wait e (external)] -> read_flag -> [record done (external)]
  cudaGraph_t g;
  cudaGraphExec_t ge;
  CK(cudaEventRecord(e, a));  // a first record, so that the capture's wait has one
  CK(cudaStreamSynchronize(a));
  CK(cudaStreamBeginCapture(b, cudaStreamCaptureModeThreadLocal));
  CK(cudaStreamWaitEvent(b, e, cudaEventWaitExternal));
  read_flag<<<1, 1, 0, b>>>(flag, out);
  CK(cudaEventRecordWithFlags(done, b, cudaEventRecordExternal));
  CK(cudaStreamEndCapture(b, &g));
  CK(cudaGraphInstantiate(&ge, g, 0));

  auto reset = [&]() -> int {
    CK(cudaMemset(flag, 0, sizeof(int)));
    CK(cudaMemset(out, 0xff, sizeof(int)));
    CK(cudaDeviceSynchronize());
    return 0;
  };

  // 1. e recorded behind a slow write, then the graph launched: 1 if the
  //    wait node waits for the record made before the launch.
  if (reset()) return 1;
  slow_write<<<1, 1, 0, a>>>(flag, 1, slow);
  CK(cudaEventRecord(e, a));
  CK(cudaGraphLaunch(ge, b));
  CK(cudaDeviceSynchronize());
  CK(cudaMemcpy(&got, out, sizeof(int), cudaMemcpyDeviceToHost));
  printf("1. record before the launch, behind a 300 ms write: the graph read %d (1: it waited for that record)\n", got);

  // 2. e recorded (done at once), the graph launched, then e recorded again
  //    behind a slow write: 0 if the wait node ignores records after the launch.
  if (reset()) return 1;
  CK(cudaEventRecord(e, a));
  CK(cudaStreamSynchronize(a));
  CK(cudaGraphLaunch(ge, b));
  slow_write<<<1, 1, 0, a>>>(flag, 2, slow);
  CK(cudaEventRecord(e, a));
  CK(cudaDeviceSynchronize());
  CK(cudaMemcpy(&got, out, sizeof(int), cudaMemcpyDeviceToHost));
  printf("2. record after the launch, behind a 300 ms write: the graph read %d (0: it did not wait for the later record)\n", got);

  // 3. The graph held behind a slow write on b (its own stream), then a
  //    waits for `done` and writes 3 at once: 1 if a waited for the replay's
  //    record node (the read ran before a's write).
  if (reset()) return 1;
  slow_write<<<1, 1, 0, b>>>(flag, 1, slow);
  CK(cudaGraphLaunch(ge, b));
  CK(cudaStreamWaitEvent(a, done, 0));
  slow_write<<<1, 1, 0, a>>>(flag, 3, 0);
  CK(cudaDeviceSynchronize());
  CK(cudaMemcpy(&got, out, sizeof(int), cudaMemcpyDeviceToHost));
  int fl = 0;
  CK(cudaMemcpy(&fl, flag, sizeof(int), cudaMemcpyDeviceToHost));
  printf("3. a stream waiting for the replay's record node: the graph read %d, the flag is %d (1 and 3: it waited for the replay)\n", got, fl);

  return 0;
}

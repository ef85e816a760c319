"""One rank of a test job, speaking paramsync.v1.Worker over gRPC from Python.

Joins (a bidi stream kept open while a member), runs --iters float32 SUM
all_reduces of --count elements on group 0, checks every result, leaves.
Prints progress for the test on stdout: READY, SLOW <i> (before a
deliberate delay), HALF (then waits for --hold-file if given), DONE.
"""

import argparse
import array
import os
import queue
import sys
import threading
import time


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--stubs", required=True)
    p.add_argument("--addr", required=True)
    p.add_argument("--job", required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--iters", type=int, default=1)
    p.add_argument("--count", type=int, default=1)
    p.add_argument("--slow-rank", type=int, default=-1)
    p.add_argument("--slow-seconds", type=float, default=0.0)
    p.add_argument("--hold-file", default="")
    a = p.parse_args()
    sys.path.insert(0, a.stubs)
    import grpc
    from paramsync.v1 import paramsync_pb2 as pb
    from paramsync.v1 import paramsync_pb2_grpc as pbg

    channel = grpc.insecure_channel(a.addr)
    stub = pbg.WorkerStub(channel)

    # Join: one request, then the request side stays open until we leave.
    leaving = threading.Event()

    def join_requests():
        yield pb.JoinRequest(job=a.job, world_size=a.world, rank=a.rank, timeout_ms=60000)
        leaving.wait()

    events = stub.Join(join_requests())
    first = next(events)
    if first.kind != pb.JoinEvent.READY:
        sys.exit(f"rank {a.rank}: join answered {first}")
    incarnation = first.incarnation
    # Later events (MEMBER_LOST, JOB_ABORTED) end the test with a message.
    later = queue.Queue()

    def drain():
        try:
            for ev in events:
                later.put(ev)
        except grpc.RpcError as e:
            later.put(e)

    t = threading.Thread(target=drain, daemon=True)
    t.start()
    print("READY", flush=True)

    n = a.world
    for i in range(a.iters):
        if i == a.iters // 2 and a.iters > 1:
            print("HALF", flush=True)
            while a.hold_file and not os.path.exists(a.hold_file):
                time.sleep(0.02)
        if a.rank == a.slow_rank:
            print(f"SLOW {i}", flush=True)
            time.sleep(a.slow_seconds)
        data = array.array("f", [a.rank + 1 + (j % 7) + i for j in range(a.count)])
        header = pb.CollectiveHeader(job=a.job, group=0, seq=i, kind=pb.ALL_REDUCE, op=pb.SUM,
                                     dtype=pb.FLOAT32, count=a.count, rank=a.rank,
                                     incarnation=incarnation, timeout_ms=120000)
        frames = stub.Collective(iter([pb.Frame(header=header, data=data.tobytes())]))
        got = bytearray()
        result = None
        for f in frames:
            if f.HasField("result"):
                result = f.result
            got += f.data
        if result is None or result.code != 0:
            sys.exit(f"rank {a.rank} iteration {i}: result {result}")
        out = array.array("f")
        out.frombytes(bytes(got))
        want = [n * (n + 1) / 2 + n * ((j % 7) + i) for j in range(a.count)]
        if list(out) != want:
            sys.exit(f"rank {a.rank} iteration {i}: wrong sum {list(out)[:4]}..., "
                     f"want {want[:4]}...")
        if not later.empty():
            sys.exit(f"rank {a.rank}: membership event during the job: {later.get()}")

    stub.Leave(pb.LeaveRequest(job=a.job, rank=a.rank))
    leaving.set()
    t.join(10)
    channel.close()
    print("DONE", flush=True)


if __name__ == "__main__":
    main()

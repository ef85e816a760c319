#!/usr/bin/python3
"""One rank of an all_reduce through a paramsync agent, on bare gRPC stubs.

Used by image_test.sh against daemons running in containers. It speaks the
wire contract directly (proto/paramsync/v1/paramsync.proto), so it depends on
nothing but Debian's python3-grpcio and stubs made at test time:

  allreduce_worker.py --stubs DIR --addr HOST:PORT --job J --world N --rank R --count C
  allreduce_worker.py --stubs DIR --addr COORDINATOR --wait-agents N

Rank r contributes [i * (r + 1) for i in range(C)] as float32; every rank
must receive [i * N(N+1)/2 for i in range(C)], exactly (the values stay below
2**24). Exit 0 on the right result, 1 with a message otherwise.
"""
import argparse
import array
import sys
import threading

CHUNK = 1 << 20  # payload bytes per request frame


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--stubs", required=True, help="folder holding paramsync/v1/*_pb2*.py")
    ap.add_argument("--addr", required=True)
    ap.add_argument("--job")
    ap.add_argument("--world", type=int)
    ap.add_argument("--rank", type=int)
    ap.add_argument("--wait-agents", type=int, metavar="N",
                    help="instead: wait until the coordinator at --addr lists N agents")
    ap.add_argument("--count", type=int, default=1 << 20)
    ap.add_argument("--timeout", type=float, default=60.0)
    a = ap.parse_args()
    sys.path.insert(0, a.stubs)
    import grpc
    from paramsync.v1 import paramsync_pb2 as pb
    from paramsync.v1 import paramsync_pb2_grpc as pbg

    opts = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]
    ch = grpc.insecure_channel(a.addr, options=opts)
    grpc.channel_ready_future(ch).result(timeout=a.timeout)
    if a.wait_agents is not None:
        return wait_agents(a, grpc, pb, pbg, ch)
    if a.job is None or a.world is None or a.rank is None:
        raise SystemExit("--job, --world and --rank are needed")
    stub = pbg.WorkerStub(ch)

    # Join: one request, then the request side stays open while we are a member.
    leave = threading.Event()

    def join_requests():
        yield pb.JoinRequest(job=a.job, world_size=a.world, rank=a.rank,
                             timeout_ms=int(a.timeout * 1000))
        leave.wait()

    events = stub.Join(join_requests(), timeout=a.timeout * 2)
    ev = next(events)
    if ev.kind != pb.JoinEvent.READY:
        raise SystemExit("rank %d: Join answered %s: %s"
                         % (a.rank, pb.JoinEvent.Kind.Name(ev.kind), ev.message))
    if ev.rank != a.rank or ev.world_size != a.world:
        raise SystemExit("rank %d: READY says rank %d of %d" % (a.rank, ev.rank, ev.world_size))

    mine = array.array("f", (float(i * (a.rank + 1)) for i in range(a.count)))
    payload = mine.tobytes()
    header = pb.CollectiveHeader(job=a.job, group=0, seq=1, kind=pb.ALL_REDUCE, op=pb.SUM,
                                 dtype=pb.FLOAT32, count=a.count, rank=a.rank,
                                 incarnation=ev.incarnation, chunk_bytes=CHUNK)

    def frames():
        for off in range(0, len(payload), CHUNK):
            f = pb.Frame(offset=off, data=payload[off:off + CHUNK])
            if off == 0:
                f.header.CopyFrom(header)
            yield f

    got = bytearray()
    result = None
    for f in stub.Collective(frames(), timeout=a.timeout):
        if f.HasField("result"):
            result = f.result
            if result.code != 0:
                raise SystemExit("rank %d: all_reduce failed: code %d: %s"
                                 % (a.rank, result.code, result.message))
        if f.data:
            if f.offset != len(got):
                raise SystemExit("rank %d: frame at offset %d, expected %d"
                                 % (a.rank, f.offset, len(got)))
            got += f.data
    if result is None:
        raise SystemExit("rank %d: no result frame" % a.rank)
    if len(got) != len(payload):
        raise SystemExit("rank %d: got %d bytes, expected %d" % (a.rank, len(got), len(payload)))
    out = array.array("f")
    out.frombytes(bytes(got))
    k = a.world * (a.world + 1) // 2
    for i, v in enumerate(out):
        if v != float(i * k):
            raise SystemExit("rank %d: element %d is %r, expected %r" % (a.rank, i, v, float(i * k)))

    stub.Leave(pb.LeaveRequest(job=a.job, rank=a.rank), timeout=a.timeout)
    leave.set()  # half-close the Join stream: a graceful leave
    try:
        for _ in events:
            pass
    except grpc.RpcError as e:
        if e.code() not in (grpc.StatusCode.CANCELLED, grpc.StatusCode.OK):
            raise SystemExit("rank %d: Join stream ended with %s" % (a.rank, e.code()))
    ch.close()
    print("rank %d: all_reduce of %d float32 through %s: OK (element 1 = %g)"
          % (a.rank, a.count, a.addr, out[1] if a.count > 1 else out[0]))


def wait_agents(a, grpc, pb, pbg, ch):
    """Polls Admin.Status until the coordinator lists a.wait_agents agents."""
    import time
    admin = pbg.AdminStub(ch)
    end = time.monotonic() + a.timeout
    agents = []
    while time.monotonic() < end:
        agents = list(admin.Status(pb.StatusRequest(), timeout=5).agents)
        if len(agents) >= a.wait_agents:
            print("coordinator %s lists %d agents: %s" % (a.addr, len(agents), ", ".join(agents)))
            return
        time.sleep(0.2)
    raise SystemExit("coordinator %s lists %d agents (%s) after %.0f s, expected %d"
                     % (a.addr, len(agents), ", ".join(agents), a.timeout, a.wait_agents))


if __name__ == "__main__":
    main()

"""grpc.health.v1.Health on real daemons, as Kubernetes gRPC probes see it:
SERVING when all is well; an agent whose coordinator is unreachable is
NOT_SERVING for paramsync.v1.Worker, turns SERVING when the coordinator comes
up and NOT_SERVING again when it dies; a draining daemon (SIGTERM) reports
NOT_SERVING, or is gone, and never SERVING again."""

import os
import queue
import signal
import threading
import time

import harness as h

WORKER = "paramsync.v1.Worker"


def main():
    args = h.parse_args()
    wd = h.Workdir("health")
    h.make_stubs(args.proto_dir, wd.path)
    import grpc
    from pshealth import health_pb2 as hpb
    from pshealth import health_pb2_grpc as hpbg

    SERVING = hpb.HealthCheckResponse.SERVING
    NOT_SERVING = hpb.HealthCheckResponse.NOT_SERVING
    name = hpb.HealthCheckResponse.ServingStatus.Name

    def check(addr, service):
        """The status name, or the gRPC code name when the call fails."""
        with grpc.insecure_channel(addr) as ch:
            try:
                r = hpbg.HealthStub(ch).Check(hpb.HealthCheckRequest(service=service), timeout=5)
                return name(r.status)
            except grpc.RpcError as e:
                return e.code().name

    class Watch:
        """A Watch stream read by a thread; statuses (or the end) land in a queue."""

        def __init__(self, addr, service):
            self.ch = grpc.insecure_channel(addr)
            self.q = queue.Queue()
            self.call = hpbg.HealthStub(self.ch).Watch(hpb.HealthCheckRequest(service=service))
            threading.Thread(target=self._read, daemon=True).start()

        def _read(self):
            try:
                for r in self.call:
                    self.q.put(name(r.status))
                self.q.put("END OK")
            except grpc.RpcError as e:
                self.q.put(f"END {e.code().name}")

        def until(self, want, timeout):
            """Statuses seen until one in want (returned) or the timeout (None)."""
            deadline = time.time() + timeout
            seen = []
            while time.time() < deadline:
                try:
                    s = self.q.get(timeout=max(0.01, deadline - time.time()))
                except queue.Empty:
                    break
                seen.append(s)
                if s in want:
                    return s, seen
            return None, seen

        def close(self):
            self.call.cancel()
            self.ch.close()

    daemons = []
    try:
        # 1. An embedded daemon serves everything.
        d = h.Daemon(args.paramsyncd, wd, "embedded", metrics=False)
        daemons.append(d)
        deadline = time.time() + 10
        while check(d.addr, WORKER) != "SERVING" and time.time() < deadline:
            time.sleep(0.1)
        h.expect_equal("embedded: Check('')", check(d.addr, ""), "SERVING")
        h.expect_equal(f"embedded: Check({WORKER})", check(d.addr, WORKER), "SERVING")
        h.expect_equal("embedded: Check(paramsync.v1.Coordinator)",
                       check(d.addr, "paramsync.v1.Coordinator"), "SERVING")
        h.expect_equal("embedded: Check(unknown)", check(d.addr, "no.such.Service"), "NOT_FOUND")
        w = Watch(d.addr, "no.such.Service")
        h.expect_equal("embedded: Watch(unknown) first", w.until({"SERVICE_UNKNOWN"}, 5)[0],
                       "SERVICE_UNKNOWN")
        w.close()

        # 2. SIGTERM: a Watch open on "" sees NOT_SERVING or the end; never SERVING after.
        w = Watch(d.addr, "")
        h.expect_equal("embedded: Watch('') first", w.until({"SERVING"}, 5)[0], "SERVING")
        d.proc.send_signal(signal.SIGTERM)
        got, seen = w.until({"NOT_SERVING", "END OK", "END UNAVAILABLE", "END CANCELLED"}, 10)
        h.log(f"Watch('') after SIGTERM: {seen}")
        h.check(got is not None, f"draining: Watch saw neither NOT_SERVING nor its end: {seen}")
        h.check("SERVING" not in seen, f"draining: SERVING after SIGTERM: {seen}")
        # A Check that lands while the server shuts down is cancelled by it:
        # the daemon is going, which is as good as gone.
        after = check(d.addr, "")
        h.check(after in ("NOT_SERVING", "UNAVAILABLE", "CANCELLED"),
                f"draining: Check('') after SIGTERM is {after}")
        h.log(f"ok: draining daemon: Watch {got}, then Check {after}")
        w.close()
        status = d.stop()
        h.expect_equal("embedded exit status after SIGTERM", status, 0)

        # 3. An agent whose coordinator is not there.
        coord_port = h.free_port()
        coord_addr = f"127.0.0.1:{coord_port}"
        a = h.Daemon(args.paramsyncd, wd, "agent", role="agent", metrics=False,
                     extra=["--coordinator", coord_addr, "--liveness-timeout-ms", "1000"])
        daemons.append(a)
        time.sleep(1.0)
        h.expect_equal(f"agent, no coordinator: Check({WORKER})", check(a.addr, WORKER),
                       "NOT_SERVING")
        h.log(f"agent, no coordinator: Check('') = {check(a.addr, '')}")
        w = Watch(a.addr, WORKER)
        h.expect_equal("agent, no coordinator: Watch first", w.until({"NOT_SERVING"}, 5)[0],
                       "NOT_SERVING")

        # ... comes up: SERVING.
        c = h.Daemon(args.paramsyncd, wd, "coordinator", role="coordinator", metrics=False,
                     port=coord_port)
        daemons.append(c)
        t0 = time.time()
        got, seen = w.until({"SERVING"}, 60)
        h.expect_equal("agent, coordinator up: Watch", got, "SERVING")
        h.log(f"agent turned SERVING {time.time() - t0:.1f} s after the coordinator started")
        h.expect_equal(f"agent, coordinator up: Check({WORKER})", check(a.addr, WORKER),
                       "SERVING")

        # ... dies: NOT_SERVING again.
        c.kill()
        t0 = time.time()
        got, seen = w.until({"NOT_SERVING"}, 60)
        h.expect_equal("agent, coordinator killed: Watch", got, "NOT_SERVING")
        h.log(f"agent turned NOT_SERVING {time.time() - t0:.1f} s after the coordinator died")
        h.expect_equal(f"agent, coordinator killed: Check({WORKER})", check(a.addr, WORKER),
                       "NOT_SERVING")
        w.close()
        status = a.stop()
        h.expect_equal("agent exit status after SIGTERM", status, 0)
    except BaseException:
        for d in daemons:
            d.kill()
            print(f"--- {d.name} log:\n{d.text()}")
        print(f"(files kept in {wd.path})")
        raise
    wd.cleanup()
    h.finish()


if __name__ == "__main__":
    main()

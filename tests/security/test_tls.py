#!/usr/bin/python3
"""TLS and mutual TLS, with a throwaway CA made by openssl at test time.

A. Server TLS (--tls-cert/--tls-key): a client that trusts the CA joins and
   all_reduces correctly; a plaintext client and a client that trusts only
   another CA are refused (UNAVAILABLE: no handshake) and never join.
B. Mutual TLS (--tls-ca as well): a client without a certificate, one whose
   certificate another CA signed, and a plaintext one are refused; a client
   with a certificate of the right CA works.
C. Coordinator and two agents, all with mutual TLS: a job across both agents
   (collectives forwarded agent to agent) works; an agent without TLS, and
   one with a certificate of another CA, never register with the coordinator,
   and a worker joining through the plaintext one gets UNAVAILABLE naming
   the coordinator.
"""
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "faults"))
sys.path.insert(0, HERE)
import psworker as P  # noqa: E402
import pki  # noqa: E402


def refused(what, results):
    """Every rank must have been refused at join with UNAVAILABLE."""
    P.expect(all(r["stage"] == "join" and r["code"] == "UNAVAILABLE" for r in results),
             "%s: want every join refused with UNAVAILABLE, got %s" % (what, results))


def accepted(what, results):
    P.expect(P.all_ok(results), "%s: want a correct all_reduce, got %s" % (what, results))


def no_jobs(conn, what, jobs):
    st = conn.status()
    held = [j.job for j in st.jobs if j.job in jobs]
    P.expect(not held, "%s: the refused clients' jobs exist on the daemon: %s" % (what, held))


def main():
    binary = P.paramsyncd_path()
    work = P.workdir("ps-security-tls-")
    c = pki.make(os.path.join(work, "pki"))
    srv = ["--tls-cert", c["server"], "--tls-key", c["server_key"]]
    trusting = {"ca": c["ca"]}
    with_cert = {"ca": c["ca"], "cert": c["client"], "key": c["client_key"]}
    with P.Cleanup() as cl:
        # A. Server TLS.
        # Without --tls-ca the daemon's own clients (here the embedded agent calling its
        # coordinator) verify servers against the default roots; a private CA has to be
        # added there (gRPC reads GRPC_DEFAULT_SSL_ROOTS_FILE_PATH), as it would be to the
        # system store in a deployment. --tls-ca would also demand client certificates.
        d = cl.add(P.Daemon(binary, work, "tls", srv,
                            env={"GRPC_DEFAULT_SSL_ROOTS_FILE_PATH": c["ca"]})).start()
        accepted("A: TLS client", P.run_ranks(d.addr, "a-ok", 2, tls=trusting))
        refused("A: plaintext client", P.run_ranks(d.addr, "a-plain", 1))
        refused("A: client trusting another CA",
                P.run_ranks(d.addr, "a-other", 1, tls={"ca": c["other_ca"]}))
        no_jobs(P.Conn(d.addr, tls=trusting), "A", ["a-plain", "a-other"])
        P.expect(d.stop() == 0, "A: paramsyncd did not exit 0 on SIGTERM")
        P.log("checked A: server TLS (TLS client; plaintext and wrong-CA clients)")

        # B. Mutual TLS.
        d = cl.add(P.Daemon(binary, work, "mtls", srv + ["--tls-ca", c["ca"]])).start()
        refused("B: TLS client without a certificate", P.run_ranks(d.addr, "b-nocert", 1,
                                                                   tls=trusting))
        refused("B: client certificate of another CA",
                P.run_ranks(d.addr, "b-rogue", 1,
                            tls={"ca": c["ca"], "cert": c["rogue"], "key": c["rogue_key"]}))
        refused("B: plaintext client", P.run_ranks(d.addr, "b-plain", 1))
        accepted("B: client certificate of the right CA",
                 P.run_ranks(d.addr, "b-ok", 2, tls=with_cert))
        no_jobs(P.Conn(d.addr, tls=with_cert), "B", ["b-nocert", "b-rogue", "b-plain"])
        P.expect(d.stop() == 0, "B: paramsyncd did not exit 0 on SIGTERM")
        P.log("checked B: mutual TLS (no cert, rogue cert, plaintext, right cert)")

        # C. Coordinator and agents over mutual TLS.
        mtls = srv + ["--tls-ca", c["ca"]]
        coord, agents = P.cluster(cl, binary, work, 2, common=mtls, tag="-mtls")
        cconn = P.Conn(coord.addr, tls=with_cert)
        P.wait_registered(cconn, [a.addr for a in agents])
        # Rank 0 (so the hub) on agent0, ranks 1 and 2 on agent1: forwarded over mTLS.
        at = [agents[0].addr, agents[1].addr, agents[1].addr]
        results = P.run_ranks(at, "c-ok", 3, tls=with_cert)
        accepted("C: a job over two mutual-TLS agents", results)

        plain = cl.add(P.Daemon(binary, work, "agent-plaintext",
                                ["--role", "agent", "--coordinator", coord.addr])).start()
        rogue = cl.add(P.Daemon(binary, work, "agent-rogue",
                                ["--role", "agent", "--coordinator", coord.addr,
                                 "--tls-cert", c["rogue"], "--tls-key", c["rogue_key"],
                                 "--tls-ca", c["ca"]])).start()
        # The join asks for a 3 s rendezvous deadline: it must end by then, with an error
        # that points at the coordinator, not hang.
        t = time.monotonic()
        r = P.run_ranks(plain.addr, "c-plain", 1, join_timeout_ms=3000, wait_s=10)
        dt = time.monotonic() - t
        P.expect(r[0]["stage"] == "join" and r[0]["code"] in ("UNAVAILABLE",
                                                              "DEADLINE_EXCEEDED") and
                 "coordinator" in r[0]["message"] and dt < 6,
                 "C: a join (3 s rendezvous deadline) through the plaintext agent: want "
                 "UNAVAILABLE or DEADLINE_EXCEEDED naming the coordinator within 6 s, got %s "
                 "after %.1fs" % (r, dt))
        time.sleep(2)
        st = P.Conn(coord.addr, tls=with_cert).status()  # a new channel: cconn sat idle
        for a in (plain, rogue):
            P.expect(a.addr not in st.agents, "C: the coordinator registered %s (%s) without "
                     "a certificate of its CA: %s" % (a.name, a.addr, list(st.agents)))
        P.expect(not [j for j in st.jobs if j.job == "c-plain"],
                 "C: the job tried through the plaintext agent exists")
        P.log("checked C: mutual TLS between agents and coordinator (job over 2 agents; "
              "plaintext and rogue agents)")
        for dmn in (plain, rogue, agents[0], agents[1], coord):
            rc = dmn.stop(timeout=8)
            P.expect(rc == 0, "%s exited %s on SIGTERM" % (dmn.name, rc))
    P.done()


if __name__ == "__main__":
    main()

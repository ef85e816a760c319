"""The `paramsync` command: help and usage errors, a clear and quick error
when the daemon is not there, --json that stays valid JSON whatever a job is
called, --job filtering, and agents that do not answer reported as warnings."""

import json
import os
import subprocess
import time

import harness as h


def run(cli, *argv, env=None, timeout=30):
    e = dict(os.environ)
    e.pop("PARAMSYNC_ADDR", None)
    e.update(env or {})
    t0 = time.time()
    r = subprocess.run([cli, *argv], capture_output=True, text=True, timeout=timeout, env=e)
    return r.returncode, r.stdout, r.stderr, time.time() - t0


def main():
    args = h.parse_args()
    cli = h.need_cli(args)
    wd = h.Workdir("cli")

    # Help and usage.
    rc, out, err, _ = run(cli, "--help")
    h.expect_equal("paramsync --help exit", rc, 0)
    h.check("status" in out, f"--help lists the status command: {out}")
    rc, out, err, _ = run(cli, "status", "--help")
    h.expect_equal("paramsync status --help exit", rc, 0)
    for word in ("--addr", "--job", "--json", "PARAMSYNC_ADDR", "waiting"):
        h.check(word in out, f"status --help mentions {word}: {out}")
    for argv in ((), ("bogus",), ("status", "--bogus"), ("status", "extra"),
                 ("status", "--timeout", "x")):
        rc, out, err, _ = run(cli, *argv)
        h.expect_equal(f"paramsync {' '.join(argv)} exit (usage)", rc, 2)
        h.check(err.strip() != "", f"paramsync {' '.join(argv)}: says why on stderr")

    # No daemon: exit 1 at once, naming the address, for --addr and PARAMSYNC_ADDR.
    dead = f"127.0.0.1:{h.free_port()}"
    rc, out, err, took = run(cli, "status", "--addr", dead)
    h.expect_equal("no daemon: exit", rc, 1)
    h.check(dead in err and "cannot connect" in err, f"no daemon: message {err!r}")
    h.check(took < 3, f"no daemon: took {took:.1f} s")
    h.log(f"ok: no daemon: {err.strip()} ({took * 1e3:.0f} ms)")
    rc, out, err, _ = run(cli, "status", env={"PARAMSYNC_ADDR": dead})
    h.expect_equal("no daemon via PARAMSYNC_ADDR: exit", rc, 1)
    h.check(dead in err, f"PARAMSYNC_ADDR used: {err!r}")
    rc, out, err, _ = run(cli, "status", "--addr", f"unix:{wd.file('none.sock')}")
    h.expect_equal("no daemon on a unix socket: exit", rc, 1)

    stubs = h.make_stubs(args.proto_dir, wd.path)
    import grpc
    from paramsync.v1 import paramsync_pb2 as pb
    from paramsync.v1 import paramsync_pb2_grpc as pbg

    d = h.Daemon(args.paramsyncd, wd, "embedded", metrics=False)
    workers = []
    try:
        rc, out, err, _ = run(cli, "status", "--addr", d.addr)
        h.expect_equal("idle daemon: exit", rc, 0)
        h.check("(embedded)" in out and "no jobs" in out, f"idle daemon text: {out}")
        rc, out, err, _ = run(cli, "status", "--addr", d.addr, "--json")
        st = json.loads(out)
        h.expect_equal("idle daemon: jobs", st["jobs"], [])
        h.expect_equal("idle daemon: address", st["daemon"]["address"], d.addr)

        # Two held jobs, one with a name full of things JSON and terminals mind.
        odd = 'we"ird\\job\n\ttab \x1b[31mred\x1b[0m ünïcödé ☃'
        hold = wd.file("go")
        for job in (odd, "plain"):
            workers += [h.Worker(stubs, d.addr, job, 2, r, iters=2, count=8, hold_file=hold,
                                 log_dir=wd.path) for r in range(2)]
        for w in workers:
            w.wait_line("HALF")
        rc, out, err, _ = run(cli, "status", "--addr", d.addr, "--json")
        h.expect_equal("two jobs: exit", rc, 0)
        st = json.loads(out)  # fails the test if the escaping is wrong
        h.expect_equal("job names round-trip through --json",
                       sorted(j["job"] for j in st["jobs"]), sorted([odd, "plain"]))
        rc, out, err, _ = run(cli, "status", "--addr", d.addr)
        h.expect_equal("two jobs text: exit", rc, 0)
        h.check("\x1b" not in out, "no escape character reaches the terminal")
        h.check("plain" in out and "ünïcödé ☃" in out, f"both jobs in the text: {out}")
        rc, out, err, _ = run(cli, "status", "--addr", d.addr, "--json", "--job", "plain")
        st = json.loads(out)
        h.expect_equal("--job plain: jobs", [j["job"] for j in st["jobs"]], ["plain"])
        # Each rank's agent's machine: by default this host's boot id.
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        h.expect_equal("--job plain: each rank's machine is the boot id",
                       [r["machine"] for r in st["jobs"][0]["ranks"]], [boot, boot])
        rc, out, err, _ = run(cli, "status", "--addr", d.addr, "--job", "plain")
        h.check("MACHINE" in out and boot[:9] in out, f"the text shows the machine: {out}")
        h.check(all(c["job"] == "plain" for c in st["collectives"]),
                f"--job plain: collectives {st['collectives']}")
        open(hold, "w").close()
        for w in workers:
            w.finish()

        # An agent registered with the coordinator that does not answer.
        gone = f"127.0.0.1:{h.free_port()}"
        with grpc.insecure_channel(d.addr) as ch:
            pbg.CoordinatorStub(ch).RegisterAgent(pb.RegisterAgentRequest(address=gone),
                                                  timeout=5)
        rc, out, err, _ = run(cli, "status", "--addr", d.addr, "--json", "--timeout", "2")
        h.expect_equal("silent agent: exit", rc, 0)
        st = json.loads(out)
        h.check(gone in st["agents"], f"the registered agent is listed: {st['agents']}")
        h.expect_equal("silent agent: errors", [e["agent"] for e in st["errors"]], [gone])
        h.check("warning" in err and gone in err, f"silent agent: warning on stderr: {err!r}")
        check_refused(d, cli, pb, pbg, grpc)
        check_wire(args, wd, pb, pbg, grpc)
        status = d.stop()
        h.expect_equal("daemon exit after SIGTERM", status, 0)
    except BaseException:
        for w in workers:
            w.kill()
        d.kill()
        print(f"daemon log:\n{d.text()}\n(files kept in {wd.path})")
        raise
    check_tls(args, cli, wd)
    wd.cleanup()
    h.finish()


def check_refused(d, cli, pb, pbg, grpc):
    """Agents that register with different settings are warned of at once, and
    a job whose ranks come through them (the JoinRequest.agent_settings agents
    fill in; sent here as agents would) is refused: the waiting rank and the one that differs both end with
    FAILED_PRECONDITION naming the flag, and status shows the job refused, why,
    and its ranks as refused."""
    import threading
    settings = "--ring auto --ring-min-bytes 1048576 --rd-max-bytes %d --step-bytes 1048576"
    hold = threading.Event()

    def requests(rank, agent, rd):
        yield pb.JoinRequest(job="refused", world_size=3, rank=rank, timeout_ms=10000,
                             agent=agent, agent_settings=settings % rd)
        hold.wait(20)  # the stream stays open, as a rank's does

    with grpc.insecure_channel(d.addr) as ch:
        stub = pbg.CoordinatorStub(ch)
        # The coordinator says so as soon as the second agent registers.
        for agent, rd in (("127.0.0.1:1", 65536), ("127.0.0.1:2", 0)):
            stub.RegisterAgent(pb.RegisterAgentRequest(address=agent,
                                                       agent_settings=settings % rd), timeout=5)
        warn = ("agent 127.0.0.1:2 registered with --rd-max-bytes 0, but agent 127.0.0.1:1 "
                "with --rd-max-bytes 65536")
        h.check(warn in d.text(), f"agents' settings differ: no warning at registration:\n{d.text()}")
        codes = {}
        first = stub.Join(requests(0, "127.0.0.1:1", 65536), timeout=15)
        time.sleep(0.3)  # rank 0 waits in the rendezvous
        second = stub.Join(requests(1, "127.0.0.1:2", 0), timeout=15)
        for rank, call in ((1, second), (0, first)):
            try:
                for _ in call:
                    pass
                codes[rank] = ("OK", "")
            except grpc.RpcError as e:
                codes[rank] = (e.code().name, e.details())
        for rank in (0, 1):
            code, msg = codes[rank]
            h.expect_equal(f"refused job: rank {rank}'s code", code, "FAILED_PRECONDITION")
            h.check("--rd-max-bytes 65536" in msg and "--rd-max-bytes 0" in msg
                    and "127.0.0.1:2" in msg, f"refused job: rank {rank}'s message {msg!r}")
        rc, out, err, _ = run(cli, "status", "--addr", d.addr, "--json", "--job", "refused")
        h.expect_equal("refused job: status exit", rc, 0)
        job = json.loads(out)["jobs"][0]
        h.expect_equal("refused job: state", job["state"], "refused")
        h.check("--rd-max-bytes 0" in job.get("message", ""),
                f"refused job: status says why: {job}")
        h.expect_equal("refused job: rank states", [r["state"] for r in job["ranks"]],
                       ["refused"] * 3)
        rc, out, err, _ = run(cli, "status", "--addr", d.addr, "--job", "refused")
        h.check("refused" in out and "different settings" in out,
                f"refused job: the text says so: {out}")
        hold.set()
    h.log("ok: a job whose agents' settings differ is refused, and status says why")


def check_wire(args, wd, pb, pbg, grpc):
    """A real agent names its release's wire revision in its settings (--wire 3), so an
    agent of an older release (settings without it, registered here as one would) is warned
    of at once as one whose jobs with the new one will be refused."""
    coord = h.Daemon(args.paramsyncd, wd, "wire-coord", role="coordinator", metrics=False)
    agent = None
    try:
        agent = h.Daemon(args.paramsyncd, wd, "wire-agent", role="agent", metrics=False,
                         extra=("--coordinator", coord.addr))
        deadline = time.time() + 10
        while agent.addr not in coord.text() and time.time() < deadline:
            time.sleep(0.1)
        old = "--ring auto --ring-min-bytes 1048576 --rd-max-bytes 65536 --step-bytes 1048576"
        with grpc.insecure_channel(coord.addr) as ch:
            pbg.CoordinatorStub(ch).RegisterAgent(
                pb.RegisterAgentRequest(address="127.0.0.1:3", agent_settings=old), timeout=5)
        deadline = time.time() + 10
        while "agent 127.0.0.1:3 registered" not in coord.text() and time.time() < deadline:
            time.sleep(0.1)
        log = coord.text()
        h.check(f"agent 127.0.0.1:3 registered with {old}, but agent {agent.addr} with" in log
                and "--step-bytes 1048576 --wire 3:" in log and "one release of paramsyncd" in log,
                f"an older agent beside a new one: no warning naming --wire 3:\n{log}")
    finally:
        if agent:
            agent.stop()
        coord.stop()
    h.log("ok: agents name their wire revision, and an older one is warned of")


def make_certs(wd):
    """A CA and one certificate for localhost/127.0.0.1, good for server and client."""
    import shutil
    openssl = shutil.which("openssl")
    if not openssl:
        return None
    ext = wd.file("ext.cnf")
    with open(ext, "w") as f:
        f.write("subjectAltName=DNS:localhost,IP:127.0.0.1\n"
                "extendedKeyUsage=serverAuth,clientAuth\n")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    for cmd in (
        [openssl, "req", "-x509", *ec, "-keyout", wd.file("ca.key"), "-out", wd.file("ca.pem"),
         "-days", "2", "-subj", "/CN=paramsync test CA"],
        [openssl, "req", *ec, "-keyout", wd.file("node.key"), "-out", wd.file("node.csr"),
         "-subj", "/CN=localhost"],
        [openssl, "x509", "-req", "-in", wd.file("node.csr"), "-CA", wd.file("ca.pem"),
         "-CAkey", wd.file("ca.key"), "-CAcreateserial", "-out", wd.file("node.pem"),
         "-days", "2", "-extfile", ext]):
        subprocess.run(cmd, check=True, capture_output=True)
    return wd.file("ca.pem"), wd.file("node.pem"), wd.file("node.key")


def check_tls(args, cli, wd):
    """A daemon with mutual TLS: the command says to pass --tls-ca without it,
    and answers with --tls-ca/--tls-cert/--tls-key (or PARAMSYNC_TLS_*)."""
    certs = make_certs(wd)
    if not certs:
        h.log("openssl missing: the TLS case is not run")  # the rest of the test still counts
        return
    ca, cert, key = certs
    d = h.Daemon(args.paramsyncd, wd, "tls", metrics=False,
                 extra=["--tls-cert", cert, "--tls-key", key, "--tls-ca", ca])
    try:
        rc, out, err, _ = run(cli, "status", "--addr", d.addr, "--timeout", "2")
        h.expect_equal("TLS daemon without --tls-ca: exit", rc, 1)
        h.check("--tls-ca" in err, f"TLS daemon without --tls-ca: the hint: {err!r}")
        rc, out, err, _ = run(cli, "status", "--addr", d.addr, "--json", "--tls-ca", ca,
                              "--tls-cert", cert, "--tls-key", key)
        h.expect_equal(f"TLS daemon with certificates: exit ({err.strip()})", rc, 0)
        if rc == 0:
            h.expect_equal("TLS daemon: address", json.loads(out)["daemon"]["address"], d.addr)
        rc, out, err, _ = run(cli, "status", "--addr", d.addr, env={
            "PARAMSYNC_TLS_CA": ca, "PARAMSYNC_TLS_CERT": cert, "PARAMSYNC_TLS_KEY": key})
        h.expect_equal(f"TLS daemon with PARAMSYNC_TLS_*: exit ({err.strip()})", rc, 0)
        rc, out, err, _ = run(cli, "status", "--addr", d.addr, "--tls-ca", wd.file("none.pem"))
        h.expect_equal("unreadable CA file: exit", rc, 1)
        h.check("TLS files" in err, f"unreadable CA file: message {err!r}")
        rc, out, err, _ = run(cli, "status", "--addr", d.addr, "--tls-cert", cert)
        h.expect_equal("--tls-cert without --tls-key: exit", rc, 2)
        rc = d.stop()
        h.expect_equal("TLS daemon exit after SIGTERM", rc, 0)
        if rc != 0:  # say why (a sanitizer's report, say)
            print(f"tls daemon log:\n{d.text()}")
    except BaseException:
        d.kill()
        print(f"tls daemon log:\n{d.text()}")
        raise


if __name__ == "__main__":
    main()

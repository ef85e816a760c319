#!/usr/bin/python3
"""Bad input to a running paramsyncd: it must not crash, hang, or stop serving.

    robustness.py --case NAME [--paramsyncd PATH]     one case (ctest runs each)
    robustness.py --list                              the cases

Each case starts its own daemon (embedded role, free ports), abuses it, then
checks that the process is alive and still runs a real 2-rank all_reduce
with the right result. Cases:

  garbage          random bytes on raw TCP to the gRPC port
  h2_junk          a valid HTTP/2 preface followed by malformed frames
  huge_headers     a 1 MiB header value, 20000 headers, a HEADERS block never ended
  half_open        connections that stop mid-preface, mid-frame or mid-message,
                   held open while the daemon must serve a collective
  stream_flood     4000 calls opened and never sent a message, then dropped:
                   threads and memory come back
  metrics_garbage  random bytes and malformed HTTP to the metrics port
  malformed_calls  well-framed gRPC calls to every method with bad messages:
                   each must end with a clean status (INVALID_ARGUMENT or
                   RESOURCE_EXHAUSTED where the input is at fault) within its
                   deadline, never UNKNOWN/INTERNAL and never a hang
  cancelled_calls  collectives whose client cancels while the daemon waits for
                   peers: the daemon lets go of them, and SIGTERM still exits
  refused_calls_leak  2200 refused collective calls of 256 KiB each: the
                   daemon's memory must not grow
  shrunk_segment   a worker shrinks its shared-memory segment (ftruncate) after
                   the agent mapped it: the agent, touching the pages that are
                   gone, must not die of SIGBUS; both ranks of the all_reduce
                   get DATA_LOSS, never a result made of zeros
  foreign_segment  a collective naming another rank's segment: refused, the
                   segment untouched (at the hub and at a forwarding agent)
  many_doorbells   five doorbells attached for one rank: the agent keeps four
                   (the oldest is closed), and the four serve at once
  payload_slots    payload segments in slots: a new one replaces only its own
                   slot's; slots past the agent's, or on other kinds, refused
  tiny_frames      an all_reduce sent in frames of 3 and 5 bytes (elements split
                   between frames): the right sum, and the daemon's memory
                   does not grow with the number of frames

Uses the paramsync.v1 worker harness of tests/faults/psworker.py (Debian's
/usr/bin/python3 with python3-grpcio; stubs generated at run time from proto/).
Exit status: 0 PASS, 1 FAIL, 77 SKIPPED.
"""
import os
import random
import socket
import struct
import sys
import subprocess
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "faults"))
import psworker as pw  # noqa: E402

# Every case is seeded, so a failure replays the same bytes.
SEED = int(os.environ.get("PARAMSYNC_ROBUSTNESS_SEED", "20240607"))

# A call that takes longer than this has hung.
CALL_DEADLINE_S = 15


# ---------------------------------------------------------------- raw TCP and HTTP/2

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, \
    CONTINUATION = range(10)
END_STREAM, ACK, END_HEADERS, PADDED, PRIO = 0x1, 0x1, 0x4, 0x8, 0x20


def h2frame(ftype, flags, stream, payload=b"", length=None):
    """One HTTP/2 frame; length overrides the header's length field (to lie)."""
    n = len(payload) if length is None else length
    return struct.pack(">I", n)[1:] + bytes([ftype, flags]) + struct.pack(">I", stream) + payload


def settings(*pairs):
    return h2frame(SETTINGS, 0, 0, b"".join(struct.pack(">HI", k, v) for k, v in pairs))


def hpack_int(value, prefix_bits, first=0):
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes([first | value])
    out = bytearray([first | limit])
    value -= limit
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def hpack_literal(name, value):
    """Literal header field without indexing, new name, no Huffman (RFC 7541 6.2.2)."""
    name = name.encode() if isinstance(name, str) else name
    value = value.encode() if isinstance(value, str) else value
    return b"\x00" + hpack_int(len(name), 7) + name + hpack_int(len(value), 7) + value


def grpc_request_headers(path, extra=()):
    block = b"".join(hpack_literal(k, v) for k, v in [
        (":method", "POST"), (":scheme", "http"), (":path", path), (":authority", "localhost"),
        ("content-type", "application/grpc"), ("te", "trailers")] + list(extra))
    return block


def grpc_message(payload, length=None):
    """A gRPC length-prefixed message (uncompressed)."""
    return b"\x00" + struct.pack(">I", len(payload) if length is None else length) + payload


class Raw:
    """A raw TCP connection; every send tolerates the daemon having hung up."""

    def __init__(self, port):
        self.s = socket.create_connection(("127.0.0.1", port), timeout=5)
        self.closed_by_peer = False

    def send(self, data):
        try:
            self.s.sendall(data)
            return True
        except OSError:
            self.closed_by_peer = True
            return False

    def drain(self, seconds=0.5):
        """Reads what the daemon says for a while (so its writes never block)."""
        end = time.monotonic() + seconds
        got = 0
        while time.monotonic() < end:
            self.s.settimeout(max(0.01, end - time.monotonic()))
            try:
                b = self.s.recv(65536)
            except socket.timeout:
                break
            except OSError:
                self.closed_by_peer = True
                break
            if not b:
                self.closed_by_peer = True
                break
            got += len(b)
        return got

    def close(self):
        try:
            self.s.close()
        except OSError:
            pass


def h2_open(port):
    """A connection past the preface and the settings exchange."""
    c = Raw(port)
    c.send(PREFACE + settings())
    c.send(h2frame(SETTINGS, ACK, 0))
    return c


# ---------------------------------------------------------------- the liveness check

_job_counter = [0]


def still_serves(d, what):
    """The daemon is alive and runs a 2-rank all_reduce correctly, within a deadline."""
    if not pw.expect(d.alive(), "%s: paramsyncd died (exit %s); log:\n%s"
                     % (what, d.proc.returncode, d.log_text()[-4000:])):
        pw.done()
    _job_counter[0] += 1
    job = "alive-%d" % _job_counter[0]
    count = 4096
    members, results = [], [None, None]

    def rank_main(i):
        conn = pw.Conn(d.addr)
        m = pw.Member(conn)
        members.append(m)
        ready = m.join(job, 2, i, timeout_ms=20000, wait_s=25)
        if isinstance(ready, pw.RpcOutcome):
            results[i] = ready
            return
        results[i] = m.collective("ALL_REDUCE", count, pw.rank_tensor(i, count),
                                  rpc_timeout=CALL_DEADLINE_S)
        m.leave()
        conn.close()

    t0 = time.monotonic()
    ts = [threading.Thread(target=rank_main, args=(i,)) for i in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(40)
    want = pw.sum_tensor([0, 1], count)
    for i, r in enumerate(results):
        ok = r is not None and r.code == 0 and r.data == want
        pw.expect(ok, "%s: afterwards rank %d's all_reduce: %r" % (what, i, r))
    pw.expect(d.alive(), "%s: paramsyncd died during the check" % what)
    pw.log("%s: daemon alive, all_reduce of 2 ranks correct in %.2fs"
           % (what, time.monotonic() - t0))


# ---------------------------------------------------------------- cases on raw sockets

def case_garbage(d, rng):
    port = d.port
    sizes = [1, 7, 24, 100, 4096, 65536, 1 << 20]
    for i, n in enumerate(sizes * 3):
        c = Raw(port)
        c.send(bytes(rng.getrandbits(8) for _ in range(min(n, 4096))) * max(1, n // 4096))
        if i % 3 == 1:
            try:
                c.s.shutdown(socket.SHUT_WR)  # half-close, then see what the daemon does
            except OSError:
                pass  # it hung up already
        c.drain(0.2)
        c.close()
    # Things that look almost like HTTP: HTTP/1.1, a TLS ClientHello, the
    # preface with one byte wrong, the preface repeated.
    for junk in [b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
                 b"POST /paramsync.v1.Worker/Join HTTP/1.1\r\nContent-Length: 99999999\r\n\r\n",
                 b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(500),
                 PREFACE[:-1] + b"X" + settings(),
                 PREFACE * 50]:
        c = Raw(port)
        c.send(junk)
        c.drain(0.3)
        c.close()
    still_serves(d, "garbage")


def case_h2_junk(d, rng):
    port = d.port
    path = "/paramsync.v1.Worker/Collective"
    hdrs = grpc_request_headers(path)
    junk = {
        "data_on_stream_0": h2frame(DATA, 0, 0, b"x" * 10),
        "data_on_idle_stream": h2frame(DATA, END_STREAM, 1, b"x" * 10),
        "headers_garbage_hpack": h2frame(HEADERS, END_HEADERS, 1, b"\xff" * 64),
        "headers_index_out_of_table": h2frame(HEADERS, END_HEADERS, 1, b"\xbf\xff\xff\xff\x0f"),
        "headers_even_stream": h2frame(HEADERS, END_HEADERS, 2, hdrs),
        "headers_stream_0": h2frame(HEADERS, END_HEADERS, 0, hdrs),
        "headers_bad_padding": h2frame(HEADERS, END_HEADERS | PADDED, 1, b"\xff" + hdrs),
        "headers_self_dependency": h2frame(HEADERS, END_HEADERS | PRIO, 1,
                                           struct.pack(">IB", 1, 16) + hdrs),
        "frame_over_max_size": h2frame(DATA, 0, 1, b"y" * 100, length=(1 << 24) - 1),
        "continuation_without_headers": h2frame(CONTINUATION, END_HEADERS, 1, hdrs),
        "window_update_zero": h2frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", 0)),
        "window_update_overflow": h2frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", 0x7FFFFFFF)) * 3,
        "window_update_bad_length": h2frame(WINDOW_UPDATE, 0, 0, b"\0\0\0\1\0"),
        "settings_bad_values": settings((4, 0x80000000), (5, 100), (2, 7), (3, 0)),
        "settings_max_frame_huge": settings((5, 0xFFFFFFFF)),
        "settings_ack_with_payload": h2frame(SETTINGS, ACK, 0, b"\0\0\0\0\0\0"),
        "settings_on_stream": h2frame(SETTINGS, 0, 3, b""),
        "settings_bad_length": h2frame(SETTINGS, 0, 0, b"\0\1\0"),
        "ping_bad_length": h2frame(PING, 0, 0, b"\0" * 7),
        "ping_flood": h2frame(PING, 0, 0, b"\0" * 8) * 5000,
        "rst_idle_stream": h2frame(RST_STREAM, 0, 5, struct.pack(">I", 8)),
        "rst_stream_0": h2frame(RST_STREAM, 0, 0, struct.pack(">I", 8)),
        "priority_bad_length": h2frame(PRIORITY, 0, 1, b"\0\0"),
        "push_promise_from_client": h2frame(PUSH_PROMISE, END_HEADERS, 1,
                                            struct.pack(">I", 2) + hdrs),
        "goaway_then_headers": h2frame(GOAWAY, 0, 0, struct.pack(">II", 0, 0)) +
        h2frame(HEADERS, END_HEADERS, 1, hdrs),
        "unknown_frame_types": b"".join(h2frame(t, 0xFF, 1, b"z" * 9) for t in range(10, 40)),
        # Open calls and reset them at once, many times (the "rapid reset" pattern).
        "rapid_reset": b"".join(h2frame(HEADERS, END_HEADERS, s, hdrs) +
                                h2frame(RST_STREAM, 0, s, struct.pack(">I", 8))
                                for s in range(1, 4000, 2)),
        # A call whose gRPC message lies about its length, then ends the stream.
        "grpc_length_lies": h2frame(HEADERS, END_HEADERS, 1, hdrs) +
        h2frame(DATA, END_STREAM, 1, grpc_message(b"\x0a\x01x", length=1 << 30)),
        "grpc_compressed_flag_without_encoding": h2frame(HEADERS, END_HEADERS, 1, hdrs) +
        h2frame(DATA, END_STREAM, 1, b"\x01" + struct.pack(">I", 3) + b"abc"),
        "data_after_end_stream": h2frame(HEADERS, END_HEADERS | END_STREAM, 1, hdrs) +
        h2frame(DATA, 0, 1, b"late"),
    }
    for name, payload in junk.items():
        c = h2_open(port)
        c.send(payload)
        c.drain(0.3)
        c.close()
        if not d.alive():
            pw.fail("h2_junk: paramsyncd died after %s; log:\n%s" % (name, d.log_text()[-4000:]))
    # Seeded random frames: well-formed headers, random types, flags, streams, payloads.
    for conn_i in range(30):
        c = h2_open(port)
        out = bytearray()
        for _ in range(200):
            n = rng.choice([0, 1, 4, 8, 9, 16, 100, 1000])
            out += h2frame(rng.randrange(12), rng.getrandbits(8), rng.choice([0, 1, 2, 3, 5,
                                                                             0x7FFFFFFF]),
                           bytes(rng.getrandbits(8) for _ in range(n)))
        c.send(bytes(out))
        c.drain(0.2)
        c.close()
    still_serves(d, "h2_junk")


def case_huge_headers(d, rng):
    port = d.port
    path = "/paramsync.v1.Worker/Join"
    # One 1 MiB header value, split across CONTINUATION frames of 16 KiB.
    block = grpc_request_headers(path, [("x-huge", "v" * (1 << 20))])
    c = h2_open(port)
    pieces = [block[i:i + 16384] for i in range(0, len(block), 16384)]
    out = h2frame(HEADERS, 0, 1, pieces[0])
    for i, p in enumerate(pieces[1:]):
        out += h2frame(CONTINUATION, END_HEADERS if i == len(pieces) - 2 else 0, 1, p)
    c.send(out)
    c.drain(0.5)
    c.close()
    # 20000 small headers.
    block = grpc_request_headers(path, [("x-h%d" % i, "v") for i in range(20000)])
    c = h2_open(port)
    pieces = [block[i:i + 16384] for i in range(0, len(block), 16384)]
    out = h2frame(HEADERS, 0, 1, pieces[0])
    for i, p in enumerate(pieces[1:]):
        out += h2frame(CONTINUATION, END_HEADERS if i == len(pieces) - 2 else 0, 1, p)
    c.send(out)
    c.drain(0.5)
    c.close()
    # A header block that never ends: CONTINUATION frames for as long as the
    # daemon reads them (about 64 MiB at most).
    c = h2_open(port)
    c.send(h2frame(HEADERS, 0, 1, grpc_request_headers(path)))
    chunk = h2frame(CONTINUATION, 0, 1, hpack_literal("x-more", "m" * 16000))
    sent = 0
    while sent < 64 << 20 and c.send(chunk):
        sent += len(chunk)
    pw.log("huge_headers: endless CONTINUATION: %d KiB sent before the daemon hung up"
           % (sent >> 10))
    c.close()
    # A single HPACK string literal claiming 2 GiB.
    c = h2_open(port)
    c.send(h2frame(HEADERS, END_HEADERS, 1, b"\x00" + hpack_int(1 << 31, 7) + b"abc"))
    c.drain(0.3)
    c.close()
    still_serves(d, "huge_headers")


def case_half_open(d, rng):
    port = d.port
    hdrs = grpc_request_headers("/paramsync.v1.Worker/Collective")
    join_hdrs = grpc_request_headers("/paramsync.v1.Worker/Join")
    conns = []
    kinds = {
        "silent": lambda c: None,
        "half_preface": lambda c: c.send(PREFACE[:10]),
        "preface_no_settings": lambda c: c.send(PREFACE),
        "half_frame_header": lambda c: c.send(PREFACE + settings() + b"\x00\x00"),
        "headers_never_ended": lambda c: c.send(PREFACE + settings() +
                                                h2frame(HEADERS, 0, 1, hdrs)),
        "call_without_message": lambda c: c.send(PREFACE + settings() +
                                                 h2frame(HEADERS, END_HEADERS, 1, hdrs)),
        "call_half_message": lambda c: c.send(
            PREFACE + settings() + h2frame(HEADERS, END_HEADERS, 1, hdrs) +
            h2frame(DATA, 0, 1, grpc_message(b"", length=1000) + b"\x0a\x02")),
        "join_without_message": lambda c: c.send(PREFACE + settings() +
                                                 h2frame(HEADERS, END_HEADERS, 1, join_hdrs)),
    }
    for name, start in kinds.items():
        for _ in range(20):
            c = Raw(port)
            start(c)
            conns.append(c)
    pw.log("half_open: %d connections held open" % len(conns))
    time.sleep(1)
    still_serves(d, "half_open (while %d connections hang)" % len(conns))
    for c in conns:
        c.close()
    time.sleep(0.5)
    still_serves(d, "half_open (after they closed)")


def proc_threads(pid):
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            if line.startswith("Threads:"):
                return int(line.split()[1])
    return -1


def sanitized(d):
    """True when the daemon runs under AddressSanitizer: its quarantine keeps
    freed memory, so RSS says nothing there; LeakSanitizer checks for leaks
    when the daemon exits instead (a leak fails the exit-0 check)."""
    try:
        with open("/proc/%d/maps" % d.proc.pid) as f:
            return "libasan" in f.read()
    except OSError:
        return False


def case_stream_flood(d, rng):
    """Thousands of calls opened and never sent a message, then dropped.

    Each is a stream whose headers name a real method; the daemon must keep
    serving while they are open, and give back what they took once their
    connections close: threads and memory return near where they were."""
    hdrs = grpc_request_headers("/paramsync.v1.Worker/Collective")
    join_hdrs = grpc_request_headers("/paramsync.v1.Worker/Join")
    still_serves(d, "stream_flood (before)")
    threads0, rss0 = proc_threads(d.proc.pid), d.rss_kb()
    conns = []
    for k in range(4):
        c = h2_open(d.port)
        h = join_hdrs if k == 3 else hdrs
        c.send(b"".join(h2frame(HEADERS, END_HEADERS, s, h) for s in range(1, 2001, 2)))
        conns.append(c)
    time.sleep(2)
    pw.log("stream_flood: 4000 open streams: %d threads (were %d), RSS %.1f MiB (was %.1f)"
           % (proc_threads(d.proc.pid), threads0, d.rss_kb() / 1024.0, rss0 / 1024.0))
    still_serves(d, "stream_flood (4000 streams open)")
    for c in conns:
        c.close()
    # Idle handler threads end 5 s after their last call (PS_RPC_POOL_IDLE_MS); under ASan,
    # with other tests beside it, 4000 of them took longer than 10 s to go (124 left once).
    wait_s = 30 if sanitized(d) else 10
    end = time.monotonic() + wait_s
    while time.monotonic() < end and proc_threads(d.proc.pid) > threads0 + 64:
        time.sleep(0.2)
    threads1, rss1 = proc_threads(d.proc.pid), d.rss_kb()
    pw.log("stream_flood: connections closed: %d threads, RSS %.1f MiB"
           % (threads1, rss1 / 1024.0))
    pw.expect(threads1 <= threads0 + 64,
              "stream_flood: %d s after 4000 abandoned calls closed, the daemon has %d threads "
              "(%d before): each call's handler thread stays for good"
              % (wait_s, threads1, threads0))
    if sanitized(d):
        pw.log("stream_flood: RSS not checked under ASan (LeakSanitizer checks at exit)")
    else:
        pw.expect(rss1 - rss0 < 64 * 1024, "stream_flood: RSS %.1f MiB after, %.1f before"
                  % (rss1 / 1024.0, rss0 / 1024.0))
    still_serves(d, "stream_flood (after)")


def case_metrics_garbage(d, rng):
    if not d.metrics_port:
        pw.skip("paramsyncd has no --metrics-addr")
    port = d.metrics_port
    junk = [
        b"", b"\r\n\r\n", b"GET /metrics HTTP/1.1\r\n\r\n",  # no Host: still must not crash
        b"GET " + b"/" * 100000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
        b"GET /metrics HTTP/1.1\r\nHost: x\r\n" + b"X-A: b\r\n" * 20000 + b"\r\n",
        b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Big: " + b"v" * (1 << 20) + b"\r\n\r\n",
        b"POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 10000000\r\n\r\n" + b"z" * 100000,
        b"POST /metrics HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"fffffffffffffff\r\nabc\r\n0\r\n\r\n",
        b"GET /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n",
        b"GET /metrics HTTP/9.9\r\n\r\n", b"BREW /metrics HTCPCP/1.0\r\n\r\n",
        b"GET /metrics?" + b"a=b&" * 50000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
        b"GET /%00%ff/../../etc/passwd HTTP/1.1\r\nHost: x\r\n\r\n",
        b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n" * 500,  # pipelined
        PREFACE + settings(),
    ]
    for j in junk:
        c = Raw(port)
        c.send(j)
        c.drain(0.3)
        c.close()
    for _ in range(40):
        c = Raw(port)
        c.send(bytes(rng.getrandbits(8) for _ in range(rng.choice([1, 10, 1000, 20000]))))
        c.drain(0.1)
        c.close()
    # Slow clients must not lock the scraper out: a request never finished,
    # on more connections than the server's limit (256 today), while
    # Prometheus scrapes with its default scrape_timeout of 10 s.
    held = []
    for _ in range(300):
        c = Raw(port)
        c.send(b"GET /metr")
        held.append(c)
    scrape(d, "with 300 half-open requests held", METRICS_SCRAPE_TIMEOUT_S)
    for c in held:
        c.close()
    scrape(d, "afterwards", METRICS_SCRAPE_TIMEOUT_S)
    still_serves(d, "metrics_garbage")


# Prometheus' default scrape_timeout.
METRICS_SCRAPE_TIMEOUT_S = 10


def scrape(d, when, timeout):
    import urllib.request
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % d.metrics_port,
                                    timeout=timeout) as r:
            text = r.read().decode(errors="replace")
    except Exception as e:  # noqa: BLE001 (any failure to scrape is the finding)
        pw.expect(False, "metrics_garbage: GET /metrics %s: no answer in %ds (%r)"
                  % (when, timeout, e))
        return
    pw.expect("paramsync_" in text, "metrics_garbage: /metrics %s has no paramsync_ metrics"
              % when)
    pw.log("metrics_garbage: scraped %s in %.2fs" % (when, time.monotonic() - t0))


# ---------------------------------------------------------------- well-framed bad calls

# Codes that say "your input is wrong" (or "not now"), and the ones that mean
# the daemon broke or hung.
CLEAN = {"INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "NOT_FOUND", "FAILED_PRECONDITION",
         "OUT_OF_RANGE", "ALREADY_EXISTS", "PERMISSION_DENIED", "UNAUTHENTICATED",
         "UNIMPLEMENTED"}
BAD_INPUT = {"INVALID_ARGUMENT", "RESOURCE_EXHAUSTED"}

UNARY = ["/paramsync.v1.Worker/Leave", "/paramsync.v1.Worker/NewGroup",
         "/paramsync.v1.Coordinator/RegisterAgent", "/paramsync.v1.Coordinator/Leave",
         "/paramsync.v1.Coordinator/NewGroup", "/paramsync.v1.Coordinator/DescribeJob",
         "/paramsync.v1.Admin/Status", "/grpc.health.v1.Health/Check"]
STREAMS = ["/paramsync.v1.Worker/Join", "/paramsync.v1.Coordinator/Join",
           "/paramsync.v1.Worker/Collective", "/grpc.health.v1.Health/Watch"]

# Bytes no protobuf parser takes, whatever the message type.
UNPARSEABLE = {
    "truncated_string": b"\x0a\x05ab",
    "varint_11_bytes": b"\x10" + b"\xff" * 10 + b"\x01",
    "truncated_varint": b"\x10\xff",
    "start_group": b"\x0b",
    "end_group": b"\x0c",
    "field_number_0": b"\x00\x01",
    "wire_type_7": b"\x0f\x01",
    "length_over_message": b"\x0a\xff\xff\xff\xff\x0f",
}


class Caller:
    """Raw-bytes calls: what the daemon gets is exactly what the test says."""

    def __init__(self, d):
        self.conn = pw.Conn(d.addr)
        self.grpc = pw.grpc

    def unary(self, method, payload, deadline=CALL_DEADLINE_S):
        f = self.conn.channel.unary_unary(method)
        t0 = time.monotonic()
        try:
            f(payload, timeout=deadline)
            return "OK", "", time.monotonic() - t0
        except self.grpc.RpcError as e:
            return e.code().name, e.details() or "", time.monotonic() - t0

    def stream(self, method, payloads, hold_s=0.0, want_first=False):
        """Sends payloads, keeps the request side open hold_s more, then half-closes.
        Returns (code, message, seconds, responses)."""
        f = self.conn.channel.stream_stream(method)
        closed = threading.Event()

        def reqs():
            for p in payloads:
                yield p
            closed.wait(hold_s)

        t0 = time.monotonic()
        got = []
        try:
            call = f(reqs(), timeout=CALL_DEADLINE_S)
            for r in call:
                got.append(r)
                if want_first:
                    call.cancel()
                    closed.set()
                    return "RESPONSE", "", time.monotonic() - t0, got
            return "OK", "", time.monotonic() - t0, got
        except self.grpc.RpcError as e:
            return e.code().name, e.details() or "", time.monotonic() - t0, got
        finally:
            closed.set()

    def close(self):
        self.conn.close()


def judge(what, got, allowed, elapsed, deadline=CALL_DEADLINE_S):
    """A call's outcome against what the test allows ("OK" may be in allowed)."""
    code, message = got
    if code == "DEADLINE_EXCEEDED" and elapsed >= deadline - 0.5:
        pw.expect(False, "%s: hung (no answer in %ss)" % (what, deadline))
        return
    pw.expect(code in allowed, "%s: got %s %r, want one of %s"
              % (what, code, message[:200], "/".join(sorted(allowed))))


def hdr(pb, job, **kw):
    kw.setdefault("kind", pb.ALL_REDUCE)
    return pb.CollectiveHeader(job=job, **kw)


def frame_bytes(pb, header=None, offset=0, data=b""):
    f = pb.Frame(offset=offset, data=data)
    if header is not None:
        f.header.CopyFrom(header)
    return f.SerializeToString()


def case_malformed_calls(d, rng):
    pb, _ = pw.stubs()
    c = Caller(d)

    # A joined job of one rank: the collectives below reach the hub's checks.
    conn = pw.Conn(d.addr)
    member = pw.Member(conn)
    ready = member.join("rb", 1, 0, wait_s=20)
    pw.check(not isinstance(ready, pw.RpcOutcome), "cannot join job rb: %r" % (ready,))
    inc = ready.incarnation

    # ---- unary methods
    for m in UNARY:
        for name, payload in UNPARSEABLE.items():
            code, msg, el = c.unary(m, payload)
            judge("%s %s" % (m, name), (code, msg), {"INVALID_ARGUMENT"}, el)
        for name, payload in [("empty", b""),
                              ("a_frame", frame_bytes(pb, hdr(pb, "rb"), data=b"x" * 64)),
                              ("a_join_event", pb.JoinEvent(kind=1, hub="x").SerializeToString()),
                              ("random_1", bytes(rng.getrandbits(8) for _ in range(64))),
                              ("random_2", bytes(rng.getrandbits(8) for _ in range(4096))),
                              ("garbage_4m", bytes(rng.getrandbits(8) for _ in range(4096)) * 1024)]:
            code, msg, el = c.unary(m, payload)
            judge("%s %s" % (m, name), (code, msg), CLEAN | {"OK"}, el)
        code, msg, el = c.unary(m, b"\x0a" + b"\x80\x80\x80\x0a" + bytes(20 << 20))
        judge("%s 20 MiB message" % m, (code, msg), {"RESOURCE_EXHAUSTED"}, el)

    # ---- NewGroup with bad ranks, on a real job
    for m in ["/paramsync.v1.Worker/NewGroup", "/paramsync.v1.Coordinator/NewGroup"]:
        cases = {
            "group_0": dict(group=0, ranks=[0], rank=0),
            "duplicate_ranks": dict(group=1, ranks=[0, 0], rank=0),
            "rank_outside_job": dict(group=1, ranks=[0, 5], rank=0),
            "negative_rank": dict(group=1, ranks=[-1], rank=0),
            "caller_outside_job": dict(group=1, ranks=[0], rank=7),
            "100k_ranks": dict(group=1, ranks=list(range(100000)), rank=0),
        }
        for name, kw in cases.items():
            req = pb.NewGroupRequest(job="rb", **kw).SerializeToString()
            code, msg, el = c.unary(m, req)
            judge("%s %s" % (m, name), (code, msg), BAD_INPUT, el)

    # ---- Join streams
    for m in ["/paramsync.v1.Worker/Join", "/paramsync.v1.Coordinator/Join"]:
        for name, payload in UNPARSEABLE.items():
            code, msg, el, _ = c.stream(m, [payload], hold_s=CALL_DEADLINE_S)
            judge("%s %s" % (m, name), (code, msg), {"INVALID_ARGUMENT"}, el)
        code, msg, el, _ = c.stream(m, [], hold_s=0)
        judge("%s no request" % m, (code, msg), {"INVALID_ARGUMENT"}, el)
        bad_joins = {
            "empty_request": pb.JoinRequest(),
            "no_job": pb.JoinRequest(world_size=1, rank=0),
            "world_0": pb.JoinRequest(job="j0", world_size=0),
            "world_negative": pb.JoinRequest(job="j1", world_size=-4),
            "world_2g": pb.JoinRequest(job="j2", world_size=0x7FFFFFFF),
            "rank_over_world": pb.JoinRequest(job="j3", world_size=2, rank=2),
            "rank_minus_2": pb.JoinRequest(job="j4", world_size=2, rank=-2),
        }
        for name, req in bad_joins.items():
            code, msg, el, _ = c.stream(m, [req.SerializeToString()], hold_s=CALL_DEADLINE_S)
            judge("%s %s" % (m, name), (code, msg), BAD_INPUT, el)
        # Odd but legal: a very long job id, one with a NUL. Either READY
        # (world 1) or a clean refusal; never a crash or a hang.
        for name, job in [("job_64k", "j" * 65536), ("job_with_nul", "a\0b")]:
            req = pb.JoinRequest(job=job, world_size=1).SerializeToString()
            code, msg, el, _ = c.stream(m, [req], hold_s=CALL_DEADLINE_S, want_first=True)
            judge("%s %s" % (m, name), (code, msg), CLEAN | {"RESPONSE"}, el)

    # ---- Collective: first frames the agent or the hub must refuse
    coll = "/paramsync.v1.Worker/Collective"
    good = dict(job="rb", kind=pb.ALL_REDUCE, dtype=pb.FLOAT32, count=4, rank=0,
                incarnation=inc)
    seq = [100]

    def h(**kw):
        x = dict(good)
        x.update(kw)
        x.setdefault("seq", seq[0])
        seq[0] += 1
        return pb.CollectiveHeader(**x)

    data16 = pw.floats([1, 2, 3, 4])
    # The positive control: the harness's frames are right.
    code, msg, el, resp = c.stream(coll, [frame_bytes(pb, h(), data=data16)])
    pw.check(code == "OK", "collective control (world 1 all_reduce): %s %r" % (code, msg))

    firsts = {
        "first_frame_unparseable": [b"\x0a\x05ab"],
        "first_frame_no_header": [frame_bytes(pb, None, data=data16)],
        "header_without_job": [frame_bytes(pb, h(job=""), data=data16)],
        "kind_unspecified": [frame_bytes(pb, h(kind=0), data=data16)],
        "kind_12": [frame_bytes(pb, h(kind=12), data=data16)],
        "kind_99": [frame_bytes(pb, h(kind=99), data=data16)],
        "kind_negative": [frame_bytes(pb, h(kind=-1), data=data16)],
        "dtype_10": [frame_bytes(pb, h(dtype=10), data=data16)],
        "dtype_negative": [frame_bytes(pb, h(dtype=-3), data=data16)],
        "op_8": [frame_bytes(pb, h(op=8), data=data16)],
        "op_99": [frame_bytes(pb, h(op=99), data=data16)],
        "op_band_on_float": [frame_bytes(pb, h(op=pb.BAND), data=data16)],
        "op_avg_on_int": [frame_bytes(pb, h(op=pb.AVG, dtype=pb.INT32), data=data16)],
        "rank_1_of_1": [frame_bytes(pb, h(rank=1), data=data16)],
        "rank_negative": [frame_bytes(pb, h(rank=-1), data=data16)],
        "root_out_of_range": [frame_bytes(pb, h(kind=pb.BROADCAST, root=3), data=data16)],
        "root_negative": [frame_bytes(pb, h(kind=pb.REDUCE, root=-1), data=data16)],
        "send_to_self": [frame_bytes(pb, h(kind=pb.SEND, peer=0), data=data16)],
        "send_out_of_range": [frame_bytes(pb, h(kind=pb.SEND, peer=9), data=data16)],
        "recv_out_of_range": [frame_bytes(pb, h(kind=pb.RECV, peer=-2))],
        "count_2_60": [frame_bytes(pb, h(count=1 << 60))],
        "count_2_62_int64_gather": [frame_bytes(pb, h(kind=pb.ALL_GATHER, dtype=pb.INT64,
                                                      count=1 << 62))],
        "count_max_u64": [frame_bytes(pb, h(count=(1 << 64) - 1))],
        "count_2_60_all_to_all": [frame_bytes(pb, h(kind=pb.ALL_TO_ALL, count=1 << 60))],
        "too_many_bytes_first_frame": [frame_bytes(pb, h(), data=data16 + b"\0\0\0\0")],
        "too_many_bytes_second_frame": [frame_bytes(pb, h(), data=data16[:8]),
                                        frame_bytes(pb, offset=8, data=data16[8:] + b"\0" * 4)],
        "extra_frame_after_input": [frame_bytes(pb, h(), data=data16),
                                    frame_bytes(pb, offset=16, data=b"\0" * 4)],
        "bad_offset_second_frame": [frame_bytes(pb, h(), data=data16[:8]),
                                    frame_bytes(pb, offset=100, data=data16[8:])],
        "offset_backwards": [frame_bytes(pb, h(), data=data16[:8]),
                             frame_bytes(pb, offset=0, data=data16[8:])],
        "bad_offset_first_frame": [frame_bytes(pb, h(), offset=8, data=data16)],
        "second_frame_unparseable": [frame_bytes(pb, h(), data=data16[:8]), b"\x7a\x09abc"],
        "input_ends_early": [frame_bytes(pb, h(), data=data16[:8])],
        "data_in_barrier": [frame_bytes(pb, h(kind=pb.BARRIER, count=0), data=b"\1" * 8)],
        # RECV sends nothing: refused on arrival, not after matching (its
        # timeout_ms would turn a wait into DEADLINE_EXCEEDED, not a hang).
        "data_in_recv": [frame_bytes(pb, h(kind=pb.RECV, peer=-1, timeout_ms=3000),
                                     data=b"\1" * 8)],
        "unknown_group": [frame_bytes(pb, h(group=77), data=data16)],
        "group_max": [frame_bytes(pb, h(group=0xFFFFFFFF), data=data16)],
    }
    for name, frames in firsts.items():
        code, msg, el, _ = c.stream(coll, frames)
        judge("Collective %s" % name, (code, msg), BAD_INPUT | {"NOT_FOUND"}
              if name in ("unknown_group", "group_max") else BAD_INPUT, el)
    for name, frames in {
        "unknown_job": [frame_bytes(pb, h(job="no-such-job"), data=data16)],
        "stale_incarnation": [frame_bytes(pb, h(incarnation=inc + 1000), data=data16)],
        "no_frames": [],
        "random_first_frame": [bytes(rng.getrandbits(8) for _ in range(200))],
        # Nobody can ever send to the only rank: refused, or its own deadline.
        "recv_any_alone": [frame_bytes(pb, h(kind=pb.RECV, peer=-1, timeout_ms=2000))],
    }.items():
        code, msg, el, _ = c.stream(coll, frames)
        judge("Collective %s" % name, (code, msg), CLEAN | {"DEADLINE_EXCEEDED"}
              if name == "recv_any_alone" else CLEAN, el)
    # CollectiveHeader.block_used and block_out_used: all_to_all only, one
    # count per rank of the group, none over the block's count; refused
    # naming the field.
    a2a = dict(kind=pb.ALL_TO_ALL)
    for field in ("block_used", "block_out_used"):
        for name, kw, words in (("on an all_reduce", {field: [4]}, "it is for all_to_all"),
                                ("two counts for a group of one", dict(a2a, **{field: [1, 1]}),
                                 "one count per rank of the group (1)"),
                                ("a count over the block's", dict(a2a, **{field: [5]}),
                                 "more than the block's 4")):
            code, msg, el, _ = c.stream(coll, [frame_bytes(pb, h(**kw), data=data16)])
            judge("Collective %s %s" % (field, name), (code, msg), {"INVALID_ARGUMENT"}, el)
            pw.expect(field in msg and words in msg,
                      "Collective %s %s: %r, want it named with %r" % (field, name, msg, words))
    code, msg, el, resp = c.stream(coll, [frame_bytes(pb, h(block_used=[2], block_out_used=[2],
                                                         **a2a), data=data16)])
    data = b"".join(pb.Frame.FromString(r).data for r in resp)
    pw.expect(code == "OK" and data[:8] == data16[:8],
              "Collective all_to_all with block_used and block_out_used [2]: %s %r, data %r"
              % (code, msg, data))
    big = 5 << 20  # over the frame size the clients use, under the message limit
    code, msg, el, _ = c.stream(coll, [frame_bytes(pb, h(count=big // 4), data=bytes(big))])
    judge("Collective one 5 MiB frame", (code, msg), BAD_INPUT | {"OK"}, el)
    code, msg, el, _ = c.stream(coll, [frame_bytes(pb, h(count=(20 << 20) // 4),
                                                   data=bytes(20 << 20))])
    judge("Collective one 20 MiB frame", (code, msg), {"RESOURCE_EXHAUSTED"}, el)

    # ---- Health.Watch and unknown methods
    code, msg, el, _ = c.stream("/grpc.health.v1.Health/Watch", [b"\x0a\x05ab"])
    judge("Health.Watch unparseable", (code, msg), {"INVALID_ARGUMENT"}, el)
    for m in ["/paramsync.v1.Worker/NoSuchMethod", "/no.such.Service/Call", "/", "//",
              "/paramsync.v1.Worker/Join/extra"]:
        code, msg, el = c.unary(m, b"", deadline=5)
        judge("unknown method %s" % m, (code, msg), {"UNIMPLEMENTED"}, el, deadline=5)

    # The job survived all of that: its rank still runs a collective.
    code, msg, el, resp = c.stream(coll, [frame_bytes(pb, h(), data=data16)])
    pw.expect(code == "OK", "collective on job rb after the bad calls: %s %r" % (code, msg))
    member.leave()
    conn.close()
    c.close()
    still_serves(d, "malformed_calls")


def join_ranks(addrs, job):
    """Job `job` of len(addrs) ranks, rank i joining through addrs[i] on a
    connection of its own: (conns, members, incarnation)."""
    members = pw.join_all(list(addrs), job, len(addrs), wait_s=30)
    return [m.conn for m in members], members, members[0].incarnation


def leave_job(members, conns):
    """Every rank of a job from join_ranks leaves, and its connection closes."""
    for m in members:
        m.leave()
    for c in conns:
        c.close()


def two_ranks(d, job):
    """Job `job` of 2 ranks on daemon d: (conns, members, incarnation)."""
    return join_ranks([d.addr, d.addr], job)


def case_cancelled_calls(d, rng):
    """Calls the client gives up on while the daemon waits for their peers.

    A worker whose deadline passes (or that is interrupted) cancels its call
    but stays a member; the daemon must drop what the call held: nothing of
    it left in Admin.Status, and SIGTERM still exits at once."""
    pb, _ = pw.stubs()
    conns, members, inc = two_ranks(d, "cx")
    coll = conns[0].channel.stream_stream("/paramsync.v1.Worker/Collective")
    # Rank 0 alone: each waits for rank 1, which never comes; the client
    # cancels after 1 s (the daemon's own timeout is the default 30 minutes).
    pending = {
        "all_reduce": pb.CollectiveHeader(job="cx", seq=0, kind=pb.ALL_REDUCE, count=2, rank=0,
                                          incarnation=inc),
        "recv": pb.CollectiveHeader(job="cx", seq=0, kind=pb.RECV, peer=1, count=2, rank=0,
                                    incarnation=inc),
        "send": pb.CollectiveHeader(job="cx", seq=0, kind=pb.SEND, peer=1, count=2, rank=0,
                                    incarnation=inc),
    }
    for name, header in pending.items():
        data = b"" if name == "recv" else b"\1" * 8
        f = pb.Frame(data=data)
        f.header.CopyFrom(header)
        t0 = time.monotonic()
        try:
            list(coll(iter([f.SerializeToString()]), timeout=1))
            code = "OK"
        except pw.grpc.RpcError as e:
            code = e.code().name
        pw.expect(code == "DEADLINE_EXCEEDED" and time.monotonic() - t0 < 5,
                  "cancelled_calls: %s alone: want the client's deadline, got %s" % (name, code))
    # What the daemon still holds for job cx, a little after the cancels.
    left = None
    for _ in range(50):
        st = conns[0].status("cx")
        left = [(c.kind, c.seq, c.state) for c in st.collectives if c.job == "cx"]
        if not left:
            break
        time.sleep(0.1)
    pw.expect(not left, "cancelled_calls: 5 s after their callers cancelled, the daemon still "
              "holds collectives %s (kind, seq, state), until their timeout (30 min by "
              "default)" % left)
    leave_job(members, conns)
    still_serves(d, "cancelled_calls")


def attach_segment(conn, job, rank, nbytes, rng, registered=False, pattern=0, doorbell=False,
                   resps=None, slot=0, refused=None):
    """A /dev/shm segment of `nbytes` (the agent's magic first, then bytes of
    `pattern`) that rank `rank` of job attaches over conn (as a doorbell with
    doorbell=True; a payload segment in `slot`): (name, fd), and the
    ShmAttachResponse appended to resps. The caller closes fd and unlinks the
    name. With refused (a list), a refusal is appended there and (name, fd)
    returned, where it would fail the test."""
    import mmap
    pb, _ = pw.stubs()
    name = "/ps-robust-%d-%d" % (os.getpid(), rng.randrange(1 << 30))
    fd = os.open("/dev/shm" + name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        with mmap.mmap(fd, nbytes) as mm:
            magic = rng.getrandbits(63)
            mm[0:8] = magic.to_bytes(8, sys.byteorder)
            mm[8:nbytes] = bytes([pattern]) * (nbytes - 8)
        resp = conn.worker.ShmAttach(pb.ShmAttachRequest(
            job=job, rank=rank, name=name, size=nbytes, magic=magic, registered=registered,
            doorbell=doorbell, slot=slot), timeout=CALL_DEADLINE_S)
        if refused is not None and not resp.attached:
            refused.append(resp.reason)
        else:
            pw.check(resp.attached, "ShmAttach of %s by rank %d refused: %s"
                     % (name, rank, resp.reason))
        if resps is not None:
            resps.append(resp)
    except BaseException:
        os.close(fd)
        os.unlink("/dev/shm" + name)
        raise
    return name, fd


def drop_segment(name, fd):
    os.close(fd)
    try:
        os.unlink("/dev/shm" + name)
    except OSError:
        pass


def foreign_calls(conns, members, inc, job, caller, owner, rng, where):
    """Rank `caller` names rank `owner`'s segment (payload, then registered)
    in an all_reduce: INVALID_ARGUMENT at once, the segment untouched; then
    the job's next all_reduce still works."""
    nbytes = 4096 + 64
    for registered in (False, True):
        what = "%s, %s" % (where, "registered" if registered else "payload")
        name, fd = attach_segment(conns[owner], job, owner, nbytes, rng, registered,
                                  pattern=0x5a)
        try:
            before = os.pread(fd, nbytes, 0)
            t0 = time.monotonic()
            got = pw.collective(conns[caller], "ALL_REDUCE", 16, job=job, rank=caller,
                                incarnation=inc, shm=name, shm_in_offset=64,
                                shm_out_offset=64, rpc_timeout=5)
            pw.log("foreign_segment (%s): rank %d naming rank %d's segment: %r after %.2fs"
                   % (what, caller, owner, got, time.monotonic() - t0))
            pw.expect(got.name == "INVALID_ARGUMENT" and "another rank" in got.message,
                      "foreign_segment (%s): rank %d's call naming rank %d's segment got %r, "
                      "want INVALID_ARGUMENT saying it is another rank's"
                      % (what, caller, owner, got))
            pw.expect(os.pread(fd, nbytes, 0) == before,
                      "foreign_segment (%s): rank %d's segment changed" % (what, owner))
        finally:
            drop_segment(name, fd)
    # The job still works: every rank, seq 0 never started.
    outs = pw.in_threads([lambda m=m: m.collective("ALL_REDUCE", 4, bytes(16), seq=0,
                                                   rpc_timeout=CALL_DEADLINE_S)
                          for m in members], CALL_DEADLINE_S + 5)
    pw.expect(all(o is not None and o.name == "OK" for o in outs),
              "foreign_segment (%s): the job's next all_reduce: %r" % (where, outs))
    leave_job(members, conns)


def case_foreign_segment(d, rng):
    """A collective call naming a segment another rank attached is refused.

    Agents find segments by job and name; a call that names rank 1's segment
    as rank 0's must not read or write it (a client bug, or ranks mixing up
    their names), and the segment keeps its bytes. Checked at the agent that
    hosts the job, and at one that forwards to it from the segment (a
    coordinator and two agents: rank 0, so the hub, on the first; ranks 1
    and 2 on the second)."""
    if not os.path.isdir("/dev/shm"):
        pw.skip("no /dev/shm")
    conns, members, inc = two_ranks(d, "fs")
    foreign_calls(conns, members, inc, "fs", 0, 1, rng, "the hub")
    with pw.Cleanup() as cl:
        coord, agents = pw.cluster(cl, d.binary, d.workdir, 2, common=["--log-level", "warn"],
                                   tag="-fs")
        cc = pw.Conn(coord.addr)
        pw.wait_registered(cc, [a.addr for a in agents])
        cc.close()
        conns, members, inc = join_ranks([agents[0].addr, agents[1].addr, agents[1].addr],
                                         "fs2")
        foreign_calls(conns, members, inc, "fs2", 1, 2, rng, "a forwarding agent")
    still_serves(d, "foreign_segment")


def case_shrunk_segment(d, rng):
    """A segment shrunk under the agent: DATA_LOSS for the collective, the daemon lives."""
    if not os.path.isdir("/dev/shm"):
        pw.skip("no /dev/shm")
    count = 1 << 20  # 4 MiB of float32
    conns, members, inc = two_ranks(d, "sb")

    def segment(registered):
        """A segment of rank 0's, attached, then shrunk to nothing; returns its name."""
        name, fd = attach_segment(conns[0], "sb", 0, 4 * count, rng, registered)
        os.ftruncate(fd, 0)  # the agent's mapping now reaches past the end
        drop_segment(name, fd)
        return name

    def rank0(name, seq, out):
        out[0] = pw.collective(conns[0], "ALL_REDUCE", count, job="sb", seq=seq, rank=0,
                               incarnation=inc, shm=name, rpc_timeout=CALL_DEADLINE_S)

    for seq, (what, registered) in enumerate((("registered", True), ("payload", False))):
        name = segment(registered)
        out = [None]
        t = threading.Thread(target=rank0, args=(name, seq, out))
        t.start()
        other = members[1].collective("ALL_REDUCE", count, bytes(4 * count), seq=seq,
                                      rpc_timeout=CALL_DEADLINE_S)
        t.join(CALL_DEADLINE_S + 5)
        pw.check(d.alive(), "shrunk_segment (%s): paramsyncd died (exit %s); log:\n%s"
                 % (what, d.proc.returncode, d.log_text()[-3000:]))
        for r, got in ((0, out[0]), (1, other)):
            pw.expect(got is not None and got.name == "DATA_LOSS" and "shrank" in got.message,
                      "shrunk_segment (%s): rank %d got %r, want DATA_LOSS naming the shrunk "
                      "segment" % (what, r, got))
        pw.log("shrunk_segment (%s): both ranks: %r" % (what, other))
        if registered:  # the broken segment again: refused at once
            again = [None]
            rank0(name, 99, again)
            pw.expect(again[0] is not None and again[0].name == "DATA_LOSS" and
                      "make a new one" in again[0].message,
                      "shrunk_segment: the shrunk segment again: %r" % (again[0],))
    leave_job(members, conns)
    still_serves(d, "shrunk_segment")


# The doorbell segment (proto/paramsync/v1/doorbell.h, part of the wire contract).
DB_SIZE, DB_OUT, DB_CTL = 8192, 2048, 4096
DB_REQ, DB_RESP, DB_CLOSED, DB_HLEN, DB_HEADER, DB_CODE, DB_MSG = 0, 4, 8, 12, 16, 1040, 1052


def case_many_doorbells(d, rng):
    """A worker attaching more doorbells than the agent keeps for a rank.

    The agent says how many it keeps (ShmAttachResponse.doorbells, 4); a
    client makes no more, but one that does (or a stale one) must not grow
    the agent's threads without end: past the limit the oldest doorbell is
    closed (its `closed` word set), and the others serve requests, all four
    at once: a barrier rung on each, matched by rank 1's calls."""
    import mmap
    if not os.path.isdir("/dev/shm"):
        pw.skip("no /dev/shm")
    pb, _ = pw.stubs()
    conns, members, inc = two_ranks(d, "md")
    resps, segs = [], []
    for _ in range(5):
        segs.append(attach_segment(conns[0], "md", 0, DB_SIZE, rng, doorbell=True, resps=resps))
    maps = [mmap.mmap(fd, DB_SIZE) for _, fd in segs]

    def word(m, off):
        return struct.unpack_from("=I", m, DB_CTL + off)[0]

    pw.expect([r.doorbells for r in resps] == [4] * 5,
              "many_doorbells: ShmAttachResponse.doorbells %s, want 4 each"
              % [r.doorbells for r in resps])
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not word(maps[0], DB_CLOSED):
        time.sleep(0.05)
    # Bit 0: closed; bit 1 (PS_DOORBELL_STOPPED) follows once its thread ended.
    closed = [word(m, DB_CLOSED) & 1 for m in maps]
    pw.expect(closed == [1, 0, 0, 0, 0],
              "many_doorbells: closed words %s after 5 doorbells, want the oldest closed" % closed)
    # Rank 0 rings a barrier (seqs 0..3) on each of the four kept, all at once;
    # rank 1 makes its four as calls. The agent's threads wake within 1 s
    # without a futex wake (their backstop).
    for seq, ((name, _), m) in enumerate(zip(segs[1:], maps[1:])):
        hd = pb.CollectiveHeader(job="md", seq=seq, kind=pb.BARRIER, rank=0, incarnation=inc,
                                 shm=name, shm_out_offset=DB_OUT).SerializeToString()
        m[DB_CTL + DB_HEADER:DB_CTL + DB_HEADER + len(hd)] = hd
        struct.pack_into("=I", m, DB_CTL + DB_HLEN, len(hd))
        struct.pack_into("=I", m, DB_CTL + DB_REQ, 1)
    got = [members[1].collective("BARRIER", seq=seq, rpc_timeout=CALL_DEADLINE_S)
           for seq in range(4)]
    pw.expect(all(g.name == "OK" for g in got),
              "many_doorbells: rank 1's barriers: %s" % [(g.name, g.message) for g in got])
    deadline = time.monotonic() + CALL_DEADLINE_S
    while time.monotonic() < deadline and any(word(m, DB_RESP) != 1 for m in maps[1:]):
        time.sleep(0.05)
    answers = [(word(m, DB_RESP), struct.unpack_from("=i", m, DB_CTL + DB_CODE)[0],
                bytes(m[DB_CTL + DB_MSG:DB_CTL + DB_MSG + 200]).split(b"\0")[0].decode())
               for m in maps[1:]]
    pw.expect(all(a[:2] == (1, 0) for a in answers),
              "many_doorbells: the four doorbells kept answered (resp, code, message) %s, want "
              "(1, 0) each" % answers)
    pw.log("many_doorbells: oldest of 5 closed; 4 barriers rung at once answered %s" % answers)
    for m in maps:
        m.close()
    for name, fd in segs:
        drop_segment(name, fd)
    leave_job(members, conns)
    still_serves(d, "many_doorbells")


def case_payload_slots(d, rng):
    """Payload segments in slots (ShmAttachRequest.slot): a new one replaces
    only its own slot's; a slot past the agent's (payload_slots, 4), or a
    slot on another kind of segment, is refused with a reason."""
    if not os.path.isdir("/dev/shm"):
        pw.skip("no /dev/shm")
    conns, members, inc = two_ranks(d, "ps")
    nbytes, resps, segs = 4096 + 64, [], {}
    for slot in (0, 1, 1):  # slot 1 twice: the second replaces the first of slot 1
        segs.setdefault(slot, []).append(attach_segment(conns[0], "ps", 0, nbytes, rng,
                                                        resps=resps, slot=slot))
    pw.expect([r.payload_slots for r in resps] == [4] * 3,
              "payload_slots: ShmAttachResponse.payload_slots %s, want 4 each"
              % [r.payload_slots for r in resps])
    refused = []
    for kw in ({"slot": 4}, {"slot": 1, "doorbell": True}, {"slot": 1, "registered": True}):
        size = DB_SIZE if kw.get("doorbell") else nbytes
        segs.setdefault("bad", []).append(attach_segment(conns[0], "ps", 0, size, rng,
                                                         refused=refused, **kw))
    pw.expect(len(refused) == 3 and all("slot" in r for r in refused),
              "payload_slots: slot 4, and slots on a doorbell and registered memory: refused "
              "%s, want 3 refusals naming the slot" % refused)

    def all_reduce(seq, name):
        """Rank 0's all_reduce through segment `name` (16 floats at offset 64),
        rank 1's as frames: rank 0's outcome."""
        out = pw.in_threads([
            lambda: pw.collective(conns[0], "ALL_REDUCE", 16, job="ps", seq=seq, rank=0,
                                  incarnation=inc, shm=name, shm_in_offset=64,
                                  shm_out_offset=64, rpc_timeout=CALL_DEADLINE_S),
            lambda: members[1].collective("ALL_REDUCE", 16, bytes(64), seq=seq,
                                          rpc_timeout=CALL_DEADLINE_S)], CALL_DEADLINE_S + 5)
        return out[0]

    # Slot 0 stays beside slot 1; slot 1's first segment was replaced.
    for seq, (what, name, want) in enumerate((("slot 0", segs[0][0][0], "OK"),
                                              ("slot 1, the newer", segs[1][1][0], "OK"))):
        got = all_reduce(seq, name)
        pw.expect(got is not None and got.name == want,
                  "payload_slots: an all_reduce through %s: %r, want %s" % (what, got, want))
    got = pw.collective(conns[0], "ALL_REDUCE", 16, job="ps", seq=2, rank=0, incarnation=inc,
                        shm=segs[1][0][0], shm_in_offset=64, shm_out_offset=64, rpc_timeout=5)
    pw.expect(got.name == "INVALID_ARGUMENT" and "not attached" in got.message,
              "payload_slots: naming slot 1's replaced segment: %r, want INVALID_ARGUMENT "
              "(not attached)" % (got,))
    pw.log("payload_slots: refusals %s; the replaced segment: %r" % (refused, got))
    for group in segs.values():
        for name, fd in group:
            drop_segment(name, fd)
    leave_job(members, conns)
    still_serves(d, "payload_slots")


def pp_pair(conns, members, inc, kind, count, other, seq, **kw):
    """One collective of job "pp" (case_process_segment): rank 0's header as kw say,
    rank 1's data `other` as frames. Both outcomes."""
    return pw.in_threads([
        lambda: pw.collective(conns[0], kind, count, job="pp", seq=seq, rank=0,
                              incarnation=inc, rpc_timeout=CALL_DEADLINE_S, **kw),
        lambda: members[1].collective(kind, count, other, seq=seq,
                                      rpc_timeout=CALL_DEADLINE_S)], CALL_DEADLINE_S + 5)


def case_process_segment(d, rng):
    """The process segment (ShmAttachRequest.process): the agent reads and
    writes the worker's own memory only after checking that the pid given
    maps the segment at the address given and that it may read it; a wrong
    pid or address is refused with a reason. A collective naming it reads
    the input from the caller's buffer and writes the output there
    (CollectiveHeader.shm_process); naming it without shm_process, or
    shm_process with a payload segment, an address the caller does not
    have, or own_block where the input is not the rank's own block of the
    output, is refused with INVALID_ARGUMENT, and the daemon serves on."""
    import ctypes
    import mmap
    if not os.path.isdir("/dev/shm"):
        pw.skip("no /dev/shm")
    pb, _ = pw.stubs()
    conns, members, inc = two_ranks(d, "pp")
    size, kept, refused, accepted = 4096, [], [], []

    def offer(pid=None, shift=0):
        """A process segment of this process, offered with `pid` (default
        ours) and its address + shift: the response; mappings stay mapped."""
        name = "/ps-robust-p-%d-%d" % (os.getpid(), rng.randrange(1 << 30))
        fd = os.open("/dev/shm" + name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(fd, size)
        mm = mmap.mmap(fd, size)
        magic = rng.getrandbits(63)
        mm[0:8] = magic.to_bytes(8, sys.byteorder)
        addr = ctypes.addressof(ctypes.c_char.from_buffer(mm))
        kept.append((name, fd, mm))
        resp = conns[0].worker.ShmAttach(pb.ShmAttachRequest(
            job="pp", rank=0, name=name, size=size, magic=magic, process=True,
            pid=os.getpid() if pid is None else pid, address=addr + shift),
            timeout=CALL_DEADLINE_S)
        (accepted if resp.attached else refused).append(resp)
        return name, resp

    # Another process (our parent maps no such segment), then a wrong address.
    _, bad_pid = offer(pid=os.getppid())
    _, bad_addr = offer(shift=4096)
    pw.expect(not bad_pid.attached and "does not map" in bad_pid.reason and
              not bad_pid.process_memory,
              "process_segment: another pid: %r, want refused (does not map)" % (bad_pid,))
    pw.expect(not bad_addr.attached and "does not map" in bad_addr.reason,
              "process_segment: another address: %r, want refused (does not map)" % (bad_addr,))
    name, good = offer()
    if not good.attached and ("may not read" in good.reason or
                              "not readable here" in good.reason):
        for nm, fd, mm in kept:
            mm.close()
            drop_segment(nm, fd)
        leave_job(members, conns)
        pw.skip("the agent may not read this process's memory here: %s" % good.reason)
    pw.expect(good.attached and good.process_memory and good.own_block and good.block_lists,
              "process_segment: our own pid and address: %r, want attached, process_memory, "
              "own_block, block_lists" % (good,))

    count = 1024
    buf = (ctypes.c_float * count)(*[float(i % 97) for i in range(count)])
    at = ctypes.addressof(buf)
    other = pw.floats([1000.0 + i for i in range(count)])

    def all_reduce(seq, **kw):
        return pp_pair(conns, members, inc, "ALL_REDUCE", count, other, seq, **kw)

    got = all_reduce(0, shm=name, shm_in_offset=at, shm_out_offset=at, shm_process=True)
    want = [float(i % 97) + 1000.0 + i for i in range(count)]
    pw.expect(got[0] is not None and got[0].name == "OK" and list(buf) == want and
              got[1] is not None and list(pw.unfloats(got[1].data)) == want,
              "process_segment: an all_reduce in this process's own buffer: %r, buffer %s..., "
              "want OK and the sums in place and at rank 1" % (got, list(buf)[:4]))
    # Headers naming the wrong kind of segment are refused at once, alone
    # (seqs rank 1 never reaches); memory the caller does not have fails
    # the collective for both ranks, since it is found while running.
    pay, pay_fd = attach_segment(conns[0], "pp", 0, 4096 + 64, rng)
    kept.append((pay, pay_fd, None))
    cases = (("the process segment without shm_process",
              dict(shm=name, shm_in_offset=64, shm_out_offset=64), "holds no payload"),
             ("shm_process on a payload segment",
              dict(shm=pay, shm_in_offset=64, shm_out_offset=64, shm_process=True),
              "not its process segment"))
    for seq, (what, kw, words) in enumerate(cases, start=100):
        got = [pw.collective(conns[0], "ALL_REDUCE", count, job="pp", seq=seq, rank=0,
                             incarnation=inc, rpc_timeout=5, **kw)]
        pw.expect(got[0].name == "INVALID_ARGUMENT" and words in got[0].message,
                  "process_segment: %s: %r, want INVALID_ARGUMENT (%s)" % (what, got[0], words))
        pw.log("process_segment: %s: %r" % (what, got[0]))
    got = all_reduce(1, shm=name, shm_in_offset=4096, shm_out_offset=4096, shm_process=True)
    pw.expect(got[0] is not None and got[0].name == "INVALID_ARGUMENT" and
              "Bad address" in got[0].message and got[1] is not None and got[1].name != "OK",
              "process_segment: an address this process does not have: %r, want "
              "INVALID_ARGUMENT (Bad address) and rank 1 failed too" % (got,))
    pw.log("process_segment: an address this process does not have: %r" % (got,))
    # own_block says the input is the rank's own block of the output (an
    # all_gather in place): on an all_reduce it is not, and is refused.
    got = all_reduce(2, shm=name, shm_in_offset=at, shm_out_offset=at, shm_process=True,
                     own_block=True)
    pw.expect(got[0] is not None and got[0].name == "INVALID_ARGUMENT" and
              "sets own_block" in got[0].message and got[1] is not None and got[1].name != "OK",
              "process_segment: own_block on an all_reduce: %r, want INVALID_ARGUMENT (sets "
              "own_block) and rank 1 failed too" % (got,))
    pw.log("process_segment: own_block on an all_reduce: %r" % (got[0],))
    block_lists(conns, members, inc, name, pay)
    # A process segment whose process then exits: another process (a child
    # that maps the same segment and says where) offers it, exits, and the
    # collective naming it is ABORTED (its process is gone), at once.
    cname = "/ps-robust-c-%d-%d" % (os.getpid(), rng.randrange(1 << 30))
    cfd = os.open("/dev/shm" + cname, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.ftruncate(cfd, size)
    cmagic = rng.getrandbits(63)
    os.pwrite(cfd, cmagic.to_bytes(8, sys.byteorder), 0)
    kept.append((cname, cfd, None))
    child = subprocess.Popen(
        [sys.executable, "-c",
         "import ctypes, mmap, os, sys\n"
         "f = os.open(sys.argv[1], os.O_RDWR)\n"
         "m = mmap.mmap(f, %d)\n"
         "print(os.getpid(), ctypes.addressof(ctypes.c_char.from_buffer(m)), flush=True)\n"
         "sys.stdin.read()\n" % size, "/dev/shm" + cname],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        cpid, caddr = (int(x) for x in child.stdout.readline().split())
        resp = conns[0].worker.ShmAttach(pb.ShmAttachRequest(
            job="pp", rank=0, name=cname, size=size, magic=cmagic, process=True, pid=cpid,
            address=caddr), timeout=CALL_DEADLINE_S)
        pw.expect(resp.attached and resp.process_memory,
                  "process_segment: a child's process segment: %r, want attached" % (resp,))
    finally:
        child.stdin.close()
        child.wait(timeout=10)
    got = all_reduce(3, shm=cname, shm_in_offset=caddr, shm_out_offset=caddr, shm_process=True)
    pw.expect(got[0] is not None and got[0].name == "ABORTED" and
              "No such process" in got[0].message and got[1] is not None and got[1].name != "OK",
              "process_segment: its process gone: %r, want ABORTED (No such process) and rank 1 "
              "failed too" % (got,))
    pw.log("process_segment: its process gone: %r" % (got[0],))
    pw.log("process_segment: refused %s" % ([r.reason for r in refused],))
    for nm, fd, mm in kept:
        if mm is not None:
            mm.close()
        drop_segment(nm, fd)
    leave_job(members, conns)
    still_serves(d, "process_segment")


def block_lists(conns, members, inc, name, pay):
    """The list form of case_process_segment: rank 0's all_gather output in two
    buffers of its own (CollectiveHeader.shm_out_blocks), each filled in
    place and nothing beside them; lists the agent must refuse (on a payload
    segment, not splitting the output evenly, overlapping, at address 0, with
    own_block) fail the collective, for rank 1 too, with the reason."""
    import ctypes
    count = 256
    mine = pw.floats([float(i) for i in range(count)])
    other = pw.floats([-1.0 - i for i in range(count)])
    bufs = [(ctypes.c_float * (count + 1))(*([0.0] * count + [7.0])) for _ in range(2)]
    at = [ctypes.addressof(b) for b in bufs]
    src = ctypes.create_string_buffer(mine, len(mine))

    def all_gather(seq, **kw):
        return pp_pair(conns, members, inc, "ALL_GATHER", count, other, seq, **kw)

    direct = dict(shm=name, shm_process=True, shm_in_offset=ctypes.addressof(src))
    got = all_gather(10, shm_out_blocks=at, **direct)
    filled = [bytes(b)[:4 * count] for b in bufs] == [mine, other] and \
        [b[count] for b in bufs] == [7.0, 7.0]
    pw.expect(got[0] is not None and got[0].name == "OK" and filled and got[1] is not None and
              got[1].data == mine + other,
              "process_segment: an all_gather into two buffers of rank 0's: %r, blocks %s, "
              "want OK and each block in its buffer" % (got, filled))
    cases = (("a list on a payload segment", dict(shm=pay, shm_out_blocks=at),
              "only its process segment takes"),
             ("three blocks for two ranks' output", dict(direct, shm_out_blocks=at + [at[0] + 8]),
              "split them evenly"),
             ("blocks that overlap", dict(direct, shm_out_blocks=[at[0], at[0] + 4]),
              "overlap"),
             ("a block at address 0", dict(direct, shm_out_blocks=[0, at[1]]),
              "not a valid range"),
             ("a list with own_block", dict(direct, shm_out_blocks=at, own_block=True),
              "do not go together"))
    for seq, (what, kw, words) in enumerate(cases, start=11):
        got = all_gather(seq, **kw)
        pw.expect(got[0] is not None and got[0].name == "INVALID_ARGUMENT" and
                  words in got[0].message and got[1] is not None and got[1].name != "OK",
                  "process_segment: %s: %r, want INVALID_ARGUMENT (%s) and rank 1 failed too"
                  % (what, got, words))
        pw.log("process_segment: %s: %r" % (what, got[0]))


def case_two_segments(d, rng):
    """Input in one registered segment, output in another (CollectiveHeader.shm_out).

    The agent says it takes that (ShmAttachResponse.two_segments), reads the
    input where the header puts it in the first and writes the output where it
    puts it in the second, leaving the rest of both as they were. A header whose
    shm_out names a segment that is not attached, a payload segment, another
    rank's, one too small for the output, or comes with own_block or without
    shm, is refused with INVALID_ARGUMENT and the reason, nothing written; the
    daemon serves on."""
    if not os.path.isdir("/dev/shm"):
        pw.skip("no /dev/shm")
    conns, members, inc = two_ranks(d, "ts")
    count = 1024
    nbytes = 4096 + 8 * count
    resps, kept = [], []
    a, afd = attach_segment(conns[0], "ts", 0, nbytes, rng, registered=True, pattern=0x11,
                            resps=resps)
    kept.append((a, afd))
    b, bfd = attach_segment(conns[0], "ts", 0, nbytes, rng, registered=True, pattern=0x22,
                            resps=resps)
    kept.append((b, bfd))
    pw.expect(all(r.two_segments for r in resps),
              "two_segments: registered segments attached without two_segments: %r" % (resps,))
    mine = [float(i % 89) for i in range(2 * count)]
    theirs = [1000.0 + i for i in range(2 * count)]
    os.pwrite(afd, pw.floats(mine), 64)

    def pair(kind, seq, n, **kw):
        """Rank 0's call from the segments as kw say, rank 1's by frames: both outcomes."""
        inputs = 2 * n if kind == "REDUCE_SCATTER" else n
        return pw.in_threads([
            lambda: pw.collective(conns[0], kind, n, job="ts", seq=seq, rank=0, incarnation=inc,
                                  rpc_timeout=CALL_DEADLINE_S, shm=a, shm_in_offset=64, **kw),
            lambda: members[1].collective(kind, n, pw.floats(theirs[:inputs]), seq=seq,
                                          rpc_timeout=CALL_DEADLINE_S)], CALL_DEADLINE_S + 5)

    a_before, b_before = os.pread(afd, nbytes, 0), os.pread(bfd, nbytes, 0)
    sums = [x + y for x, y in zip(mine, theirs)]
    for seq, (kind, want) in enumerate((("ALL_REDUCE", sums[:count]),
                                       ("REDUCE_SCATTER", sums[:count]))):
        got = pair(kind, seq, count, shm_out=b, shm_out_offset=128)
        out = os.pread(bfd, 4 * count, 128)
        pw.expect(got[0] is not None and got[0].name == "OK" and
                  list(pw.unfloats(out)) == want and got[1] is not None and
                  got[1].name == "OK" and list(pw.unfloats(got[1].data)) ==
                  (want if kind == "ALL_REDUCE" else sums[count:]),
                  "two_segments: %s from one segment into another: %r, output %s..., want OK "
                  "and the sums at offset 128 of the second" % (kind, got, list(pw.unfloats(out))[:4]))
        a_now, b_now = os.pread(afd, nbytes, 0), os.pread(bfd, nbytes, 0)
        pw.expect(a_now == a_before and b_now[:128] == b_before[:128] and
                  b_now[128 + 4 * count:] == b_before[128 + 4 * count:],
                  "two_segments: %s wrote outside its output (input segment %s, the rest of "
                  "the output's %s)" % (kind, "unchanged" if a_now == a_before else "changed",
                                        "unchanged" if b_now[:128] == b_before[:128] else "changed"))
        pw.log("two_segments: %s from one segment into another: %r" % (kind, got[0]))
        b_before = b_now

    pay, pay_fd = attach_segment(conns[0], "ts", 0, nbytes, rng)
    kept.append((pay, pay_fd))
    theirs_seg, theirs_fd = attach_segment(conns[1], "ts", 1, nbytes, rng, registered=True)
    kept.append((theirs_seg, theirs_fd))
    alone = (("a segment not attached", dict(shm=a, shm_out="/ps-robust-none"), "not attached"),
             ("a payload segment", dict(shm=a, shm_out=pay), "only two registered segments"),
             ("another rank's segment", dict(shm=a, shm_out=theirs_seg), "another rank"),
             ("its own segment with own_block", dict(shm=a, shm_out=b, own_block=True),
              "own_block does not go"),
             ("its own segment without shm", dict(shm_out=b), "both, or neither"))
    for seq, (what, kw, words) in enumerate(alone, start=100):
        got = pw.collective(conns[0], "ALL_REDUCE", count, job="ts", seq=seq, rank=0,
                            incarnation=inc, rpc_timeout=5, shm_in_offset=64, **kw)
        pw.expect(got.name == "INVALID_ARGUMENT" and words in got.message and
                  ("shm_out" in got.message),
                  "two_segments: shm_out naming %s: %r, want INVALID_ARGUMENT (%s, naming "
                  "shm_out)" % (what, got, words))
        pw.log("two_segments: shm_out naming %s: %r" % (what, got))
    got = pair("ALL_REDUCE", 2, count, shm_out=b, shm_out_offset=nbytes - 64)
    pw.expect(got[0] is not None and got[0].name == "INVALID_ARGUMENT" and
              "of the other (shm_out" in got[0].message and got[1] is not None and
              got[1].name != "OK",
              "two_segments: an output past the end of its segment: %r, want INVALID_ARGUMENT "
              "(of the other, shm_out) and rank 1 failed too" % (got,))
    pw.log("two_segments: an output past the end of its segment: %r" % (got[0],))
    pw.expect(os.pread(bfd, nbytes, 0) == b_before,
              "two_segments: a refused call wrote into the output's segment")
    # The job goes on: the next seq, from the segments again.
    got = pair("ALL_REDUCE", 3, count, shm_out=b, shm_out_offset=128)
    pw.expect(got[0] is not None and got[0].name == "OK" and got[1] is not None and
              got[1].name == "OK", "two_segments: the job's next all_reduce: %r" % (got,))
    for name, fd in kept:
        drop_segment(name, fd)
    leave_job(members, conns)
    still_serves(d, "two_segments")


def case_refused_calls_leak(d, rng):
    """Every refused call gives back what it took.

    Collective calls refused at their first or second frame, each carrying
    256 KiB, sent 200 times per kind: were one refusal path to keep the
    frame, the daemon would grow by 50 MiB. The same calls first run 20 times
    so that the allocator's own high-water mark is reached before measuring."""
    pb, _ = pw.stubs()
    conn = pw.Conn(d.addr)
    member = pw.Member(conn)
    ready = member.join("lk", 1, 0, wait_s=20)
    pw.check(not isinstance(ready, pw.RpcOutcome), "cannot join job lk: %r" % (ready,))
    inc = ready.incarnation
    coll = conn.channel.stream_stream("/paramsync.v1.Worker/Collective")
    blob = bytes(rng.getrandbits(8) for _ in range(4096)) * 64  # 256 KiB
    n_el = len(blob) // 4
    seq = [0]

    def first(**kw):
        x = dict(job="lk", kind=pb.ALL_REDUCE, dtype=pb.FLOAT32, count=n_el, rank=0,
                 incarnation=inc)
        x.update(kw)
        x["seq"] = seq[0]
        seq[0] += 1
        return pb.CollectiveHeader(**x)

    refusals = {
        "no_header": lambda: [frame_bytes(pb, None, data=blob)],
        "empty_job": lambda: [frame_bytes(pb, first(job=""), data=blob)],
        "unknown_job": lambda: [frame_bytes(pb, first(job="nope"), data=blob)],
        "stale_incarnation": lambda: [frame_bytes(pb, first(incarnation=inc + 1), data=blob)],
        "bad_kind": lambda: [frame_bytes(pb, first(kind=99), data=blob)],
        "bad_dtype": lambda: [frame_bytes(pb, first(dtype=42), data=blob)],
        "count_2_60": lambda: [frame_bytes(pb, first(count=1 << 60), data=blob)],
        "too_many_bytes": lambda: [frame_bytes(pb, first(count=n_el // 2), data=blob)],
        "bad_second_frame": lambda: [frame_bytes(pb, first(count=2 * n_el), data=blob),
                                     b"\x0a\x05ab"],
        "bad_offset": lambda: [frame_bytes(pb, first(count=2 * n_el), data=blob),
                               frame_bytes(pb, offset=7, data=blob)],
        "unparseable_first": lambda: [b"\x0a\x05ab" + blob],
    }

    def round_of_calls():
        for name, frames in refusals.items():
            try:
                list(coll(iter(frames()), timeout=CALL_DEADLINE_S))
                code = "OK"
            except pw.grpc.RpcError as e:
                code = e.code().name
            if code not in BAD_INPUT | {"NOT_FOUND", "FAILED_PRECONDITION"}:
                pw.expect(False, "refused_calls_leak: %s: got %s" % (name, code))

    for _ in range(20):
        round_of_calls()
    before = d.rss_kb()
    t0 = time.monotonic()
    for _ in range(200):
        round_of_calls()
    time.sleep(0.5)
    after = d.rss_kb()
    grew = (after - before) / 1024.0
    pw.log("refused_calls_leak: %d refused calls of 256 KiB in %.1fs: RSS %.1f -> %.1f MiB"
           % (200 * len(refusals), time.monotonic() - t0, before / 1024.0, after / 1024.0))
    if sanitized(d):
        pw.log("refused_calls_leak: RSS not checked under ASan (LeakSanitizer checks at exit)")
    else:
        pw.expect(grew < 32, "refused_calls_leak: the daemon grew by %.1f MiB over %d refused "
                  "calls (a refusal path keeps what it received)" % (grew, 200 * len(refusals)))
    member.leave()
    conn.close()
    still_serves(d, "refused_calls_leak")


def case_tiny_frames(d, rng):
    """An all_reduce of 128 KiB whose ranks send their input in frames of 3
    and 5 bytes (70000 frames): each float is split between frames, and the
    hub, which reduces inputs where they arrived, must neither get the sum
    wrong nor keep bookkeeping per frame while it waits for the slower rank
    (with no bound on the pieces it holds it grew by 4.2-4.9 MiB here, with
    the bound by 0.5)."""
    count = 32 * 1024
    conns, members, inc = two_ranks(d, "tf")
    still_serves(d, "tiny_frames (before)")
    rss0 = d.rss_kb()
    peak = [rss0]
    done = threading.Event()

    def sample():
        while not done.wait(0.02):
            peak[0] = max(peak[0], d.rss_kb())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.monotonic()
    out = pw.in_threads([
        lambda: members[0].collective("ALL_REDUCE", count, pw.rank_tensor(0, count), chunk=3,
                                      seq=0, rpc_timeout=120),
        lambda: members[1].collective("ALL_REDUCE", count, pw.rank_tensor(1, count), chunk=5,
                                      seq=0, rpc_timeout=120)], 150)
    done.set()
    sampler.join()
    want = pw.sum_tensor(range(2), count)
    for r, got in enumerate(out):
        pw.expect(isinstance(got, pw.RpcOutcome) and got.code == 0 and got.data == want,
                  "tiny_frames: rank %d: %s" % (r, got if not isinstance(got, pw.RpcOutcome)
                                                else "%s %r, %s" % (
                                                    got.name, got.message[:200],
                                                    "the right sum" if got.data == want
                                                    else "a wrong result")))
    grew = (peak[0] - rss0) / 1024.0
    pw.log("tiny_frames: %d and %d frames in %.1fs; RSS %.1f MiB, at most %.1f during the call"
           % (-(-4 * count // 3), -(-4 * count // 5), time.monotonic() - t0, rss0 / 1024.0,
              peak[0] / 1024.0))
    if sanitized(d):
        pw.log("tiny_frames: RSS not checked under ASan (its quarantine keeps freed memory)")
    else:
        pw.expect(grew < 2.5, "tiny_frames: the daemon grew by %.1f MiB during an all_reduce "
                  "of 128 KiB in tiny frames (bookkeeping kept per frame)" % grew)
    leave_job(members, conns)
    still_serves(d, "tiny_frames (after)")


CASES = {
    "garbage": case_garbage,
    "h2_junk": case_h2_junk,
    "huge_headers": case_huge_headers,
    "half_open": case_half_open,
    "stream_flood": case_stream_flood,
    "metrics_garbage": case_metrics_garbage,
    "malformed_calls": case_malformed_calls,
    "cancelled_calls": case_cancelled_calls,
    "refused_calls_leak": case_refused_calls_leak,
    "shrunk_segment": case_shrunk_segment,
    "foreign_segment": case_foreign_segment,
    "many_doorbells": case_many_doorbells,
    "payload_slots": case_payload_slots,
    "process_segment": case_process_segment,
    "two_segments": case_two_segments,
    "tiny_frames": case_tiny_frames,
}


def main(argv):
    if "--list" in argv:
        print("\n".join(CASES))
        return 0
    if "--case" not in argv:
        print(__doc__)
        return 2
    name = argv[argv.index("--case") + 1]
    if name not in CASES:
        pw.fail("unknown case %s (--list)" % name)
    pw.stubs()
    binary = pw.paramsyncd_path(argv)
    help_text = subprocess.run([binary, "--help"], capture_output=True, text=True).stdout
    metrics = "--metrics-addr" in help_text
    if name == "metrics_garbage" and not metrics:
        pw.skip("paramsyncd has no --metrics-addr: nothing to send garbage to")
    workdir = pw.workdir("ps-robustness-")  # removed if the case passes, kept if not
    rng = random.Random("%d-%s" % (SEED, name))
    with pw.Cleanup() as cleanup:
        d = cleanup.add(pw.Daemon(binary, workdir, name, ["--log-level", "warn"],
                                  metrics=metrics))
        d.start()
        pw.log("case %s: paramsyncd at %s (metrics %s), seed %d, log %s"
               % (name, d.addr, d.metrics_port, SEED, d.logpath))
        CASES[name](d, rng)
        status = d.stop()
        pw.expect(status == 0, "%s: SIGTERM: paramsyncd %s (want exit 0 within 15 s); log "
                  "tail:\n%s" % (name, status if isinstance(status, str) else
                                 "exited %s" % status, d.log_text()[-3000:]))
    pw.done()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

#!/usr/bin/env python3
"""Writes the fuzz targets' seed corpus: small handmade valid and edge-case inputs.

    make_corpus.py [DIR]          write DIR/<target>/<name> (default: corpus/ beside this file)
    make_corpus.py --check DIR    exit 1 unless DIR holds exactly what would be written

Standard library only: protobuf messages are encoded by hand below, so the
seeds do not depend on any protobuf library's idea of the wire format, and
can be deliberately wrong. Input formats (see tests/fuzz/fuzz_input.h):
  frame     [k][k slice lengths][Frame bytes]
  messages  [selector][k][k slice lengths][message bytes]; selector indexes
            the table in fuzz_messages.c
  init_url  the URL's bytes
"""
import os
import sys

MASK64 = (1 << 64) - 1

# ---- protobuf wire format, by hand ----
VARINT, I64, LEN, SGROUP, EGROUP, I32 = 0, 1, 2, 3, 4, 5


def varint(v):
    v &= MASK64  # negative int32/int64 go as 10-byte two's complement
    out = bytearray()
    while v >= 0x80:
        out.append((v & 0x7F) | 0x80)
        v >>= 7
    out.append(v)
    return bytes(out)


def overlong(v, n):
    """v as an n-byte varint (valid but not minimal)."""
    out = bytearray()
    for i in range(n):
        b = (v >> (7 * i)) & 0x7F
        out.append(b | (0x80 if i < n - 1 else 0))
    return bytes(out)


def key(field, wt):
    return varint((field << 3) | wt)


def f_varint(field, v):
    return key(field, VARINT) + varint(v)


def f_len(field, data):
    if isinstance(data, str):
        data = data.encode()
    return key(field, LEN) + varint(len(data)) + data


def f_i32(field, raw4):
    return key(field, I32) + raw4


def f_i64(field, raw8):
    return key(field, I64) + raw8


def packed(field, values):
    return f_len(field, b"".join(varint(v) for v in values))


# ---- paramsync.v1 messages (field numbers from proto/paramsync/v1/paramsync.proto) ----
KINDS = dict(barrier=1, broadcast=2, all_reduce=3, reduce=4, all_gather=5, gather=6, scatter=7,
             reduce_scatter=8, all_to_all=9, send=10, recv=11)
HEADER_FIELDS = dict(job=1, group=2, seq=3, kind=4, op=5, dtype=6, count=7, root=8, peer=9,
                     rank=10, tag=11, timeout_ms=12, chunk_bytes=13, incarnation=14)


def header(**kw):
    out = b""
    for name, value in kw.items():
        n = HEADER_FIELDS[name]
        out += f_len(n, value) if name == "job" else f_varint(n, value)
    return out


def result(code=0, message="", source=0, nbytes=0):
    out = f_varint(1, code) if code else b""
    out += f_len(2, message) if message else b""
    out += f_varint(3, source) if source else b""
    out += f_varint(4, nbytes) if nbytes else b""
    return out


def frame(hdr=None, res=None, offset=0, data=None):
    out = f_len(1, hdr) if hdr is not None else b""
    out += f_len(2, res) if res is not None else b""
    out += f_varint(3, offset) if offset else b""
    out += f_len(15, data) if data is not None else b""
    return out


def split(msg, cuts=()):
    assert len(cuts) <= 15 and all(0 <= c <= 255 for c in cuts)
    return bytes([len(cuts)]) + bytes(cuts) + msg


def frame_seeds():
    ar = header(job="job-a", seq=3, kind=KINDS["all_reduce"], op=0, dtype=0, count=4, rank=1,
                incarnation=7)
    data16 = bytes(range(16))
    first = frame(ar, data=data16)
    s = {
        "empty": split(b""),
        "header_only": split(frame(ar)),
        "first_frame": split(first),
        # Cuts inside the header's key, inside the data length, inside the data.
        "first_frame_cut_key": split(first, [1]),
        "first_frame_cut_data_len": split(first, [len(first) - 17]),
        "first_frame_cut_data": split(first, [len(first) - 8, 3, 0, 1]),
        "first_frame_byte_slices": split(first, [1] * 15),
        "first_frame_empty_slices": split(first, [0, 0, 5, 0, 0, 0, 9, 0]),
        "data_frame": split(frame(offset=4096, data=b"\xff" * 64), [3, 30]),
        "data_before_header": split(f_len(15, data16) + f_len(1, ar)),
        "result_frame": split(frame(res=result(nbytes=16), data=data16)),
        "result_error": split(frame(res=result(code=9, message="ranks 0 and 1 disagree on count"))),
        "empty_data": split(frame(ar, data=b"")),
        "header_twice": split(f_len(1, header(job="a")) + f_len(1, header(count=5))),
        "unknown_fields": split(f_i32(5, b"\x01\x02\x03\x04") + f_i64(6, b"\0" * 8) +
                                f_varint(7, 1) + f_len(8, b"xyz") + first),
        "unknown_after_data": split(first + f_varint(9, 300)),
        "overlong_varints": split(key(3, VARINT) + overlong(5, 10) + key(15, LEN) +
                                  overlong(2, 10) + b"ab"),
        "count_2_60": split(frame(header(job="j", kind=KINDS["all_reduce"], count=1 << 60))),
        "negative_rank": split(frame(header(job="j", kind=KINDS["recv"], peer=-1, rank=-5))),
        "kind_out_of_range": split(frame(header(job="j", kind=99, op=42, dtype=77))),
        "max_u64": split(frame(header(seq=MASK64, count=MASK64, incarnation=MASK64),
                               offset=MASK64)),
        # Invalid: the decoder must refuse these cleanly.
        "bad_two_data_fields": split(f_len(15, b"ab") + f_len(15, b"cd")),
        "bad_data_truncated": split(key(15, LEN) + varint(100) + b"short"),
        "bad_data_len_huge": split(key(15, LEN) + varint(MASK64)),
        "bad_data_wire_type": split(f_varint(15, 3)),
        "bad_field_zero": split(f_varint(0, 1)),
        "bad_group": split(key(4, SGROUP) + key(4, EGROUP)),
        "bad_varint_11_bytes": split(key(3, VARINT) + b"\xff" * 10 + b"\x01"),
        "bad_truncated_key": split(b"\x80"),
        "bad_header_truncated": split(key(1, LEN) + varint(40) + ar[:10]),
        "bad_header_inner": split(f_len(1, key(1, LEN) + varint(9) + b"x")),
        "bad_fixed_truncated": split(key(9, I64) + b"\0\0\0"),
        "bad_len_over_64m": split(key(8, LEN) + varint(65 << 20)),
    }
    return s


# Selector values: the table in fuzz_messages.c.
JOIN_REQ, LEAVE_REQ, NEW_GROUP_REQ, DESCRIBE_REQ, REGISTER_REQ, STATUS_REQ, HEALTH_REQ, FRAME, \
    HEADER, RESULT, JOIN_EVENT, DESCRIBE_RESP, NEW_GROUP_RESP, LEAVE_RESP, REGISTER_RESP, \
    STATUS_RESP, HEALTH_RESP = range(17)


def msg(selector, body, cuts=()):
    return bytes([selector]) + split(body, cuts)


def message_seeds():
    join = f_len(1, "job-a") + f_varint(2, 4) + f_varint(3, -1) + f_varint(4, 5000)
    # GroupInfo, ranks packed in one and not in the other (both are valid).
    group_infos = [f_varint(1, 1) + packed(2, [0, 2]), f_varint(1, 2) + f_varint(2, 1) +
                   f_varint(2, 3)]

    def groups(field):
        return b"".join(f_len(field, g) for g in group_infos)
    describe = f_len(1, "job-a") + f_varint(2, 4) + f_varint(3, 9) + f_len(4, "127.0.0.1:29500") + \
        groups(5) + packed(6, [0, 1, 2, 3])
    rank_status = f_varint(1, 2) + f_len(2, "joined") + f_len(3, "ipv4:127.0.0.1:5555") + \
        f_len(4, "agent-1")
    inflight = f_len(1, "job-a") + f_varint(3, 12) + f_varint(4, 3) + f_varint(5, 4) + \
        packed(6, [0, 1]) + packed(7, [2, 3]) + f_i64(8, b"\0\0\0\0\0\0\xf0\x3f") + \
        f_len(9, "arriving") + f_varint(11, 1024) + f_varint(12, 8)
    job_status = f_len(1, "job-a") + f_varint(2, 4) + f_varint(3, 9) + f_len(5, "running") + \
        f_len(6, rank_status) + groups(7)
    status = f_len(1, "embedded") + f_len(2, "0.1.0") + f_len(3, "127.0.0.1:29500") + \
        f_len(4, job_status) + f_len(5, inflight) + f_len(6, "agent-1") + \
        f_i64(7, b"\0\0\0\0\0\0\x24\x40")
    hdr = header(job="job-a", seq=1, kind=KINDS["broadcast"], dtype=7, count=10, root=0, rank=2)
    s = {
        "join": msg(JOIN_REQ, join),
        "join_cut": msg(JOIN_REQ, join, [2, 1, 3]),
        "join_empty": msg(JOIN_REQ, b""),
        "join_extremes": msg(JOIN_REQ, f_len(1, "j" * 300) + f_varint(2, 0x7FFFFFFF) +
                             f_varint(3, -0x80000000) + f_len(5, "agent") + f_len(6, "token")),
        "join_world_negative": msg(JOIN_REQ, f_len(1, "j") + f_varint(2, -1)),
        "join_non_utf8": msg(JOIN_REQ, f_len(1, b"\xff\xfe\x00job")),
        "join_wrong_wire_type": msg(JOIN_REQ, f_varint(1, 5)),
        "leave": msg(LEAVE_REQ, f_len(1, "job-a") + f_varint(2, 3)),
        "new_group_packed": msg(NEW_GROUP_REQ, f_len(1, "job-a") + f_varint(2, 1) +
                                packed(3, [0, 1, 2]) + f_varint(4, 1)),
        "new_group_unpacked": msg(NEW_GROUP_REQ, f_len(1, "job-a") + f_varint(2, 2) +
                                  f_varint(3, 3) + f_varint(3, 1) + f_varint(4, 3)),
        "new_group_mixed": msg(NEW_GROUP_REQ, packed(3, [5]) + f_varint(3, 6) + packed(3, [])),
        "new_group_bad_ranks": msg(NEW_GROUP_REQ, packed(3, [-1, 1 << 40, 2, 2])),
        "new_group_truncated_packed": msg(NEW_GROUP_REQ, key(3, LEN) + varint(5) + b"\x01\x02"),
        "describe_job": msg(DESCRIBE_REQ, f_len(1, "job-a")),
        "register_agent": msg(REGISTER_REQ, f_len(1, "10.0.0.2:29500")),
        "status_all": msg(STATUS_REQ, b""),
        "status_job": msg(STATUS_REQ, f_len(1, "job-a")),
        "health": msg(HEALTH_REQ, f_len(1, "paramsync.v1.Worker")),
        "frame": msg(FRAME, frame(hdr, data=b"\x01" * 40), [5]),
        "header": msg(HEADER, hdr),
        "header_all_fields": msg(HEADER, header(job="x", group=3, seq=MASK64, kind=KINDS["send"],
                                                op=7, dtype=9, count=1 << 60, root=-1, peer=-1,
                                                rank=0x7FFFFFFF, tag=0xFFFFFFFF,
                                                timeout_ms=0xFFFFFFFF, chunk_bytes=1 << 22,
                                                incarnation=1)),
        "result": msg(RESULT, result(code=4, message="rank 3 did not arrive", source=2,
                                     nbytes=1 << 33)),
        "join_event_ready": msg(JOIN_EVENT, f_varint(1, 1) + f_varint(2, 0) + f_varint(3, 2) +
                                f_len(4, "127.0.0.1:29500") + f_varint(5, 1)),
        "join_event_lost": msg(JOIN_EVENT, f_varint(1, 2) + f_varint(2, 1) +
                               f_len(6, "rank 1 left without Leave")),
        "join_event_kind_unknown": msg(JOIN_EVENT, f_varint(1, 1000)),
        "describe_job_response": msg(DESCRIBE_RESP, describe, [7, 20]),
        "new_group_response": msg(NEW_GROUP_RESP, f_varint(1, 1) + f_varint(2, -1) +
                                  f_varint(3, 2)),
        "leave_response_unknown": msg(LEAVE_RESP, f_varint(99, 1)),
        "register_response": msg(REGISTER_RESP, f_len(1, "agent-7")),
        "status_response": msg(STATUS_RESP, status, [9, 9, 9]),
        "health_response": msg(HEALTH_RESP, f_varint(1, 1)),
        "bad_truncated_string": msg(DESCRIBE_REQ, key(1, LEN) + varint(10) + b"abc"),
        "bad_nested": msg(DESCRIBE_RESP, f_len(5, key(2, LEN) + varint(3) + b"\x01")),
        "bad_end_group": msg(STATUS_REQ, key(2, EGROUP)),
    }
    return s


def init_url_seeds():
    urls = [
        "", "env://", "env://?job=train&world_size=4&rank=0", "tcp://127.0.0.1:29500",
        "tcp://[::1]:29500?job=a&world_size=2", "tcp://host:1?rank=3", "unix:/run/paramsync.sock",
        "unix:/tmp/s?job=x", "file:///tmp/paramsync-announce", "file:///a?b&c=d",
        "file://relative/path", "file://", "tcp://", "unix:", "env:", "http://x:1", "?",
        "env://?", "env://?&&", "env://?job", "env://?job=", "env://?world_size=0",
        "env://?world_size=-1", "env://?world_size=2147483648", "env://?world_size=99999999999999999999",
        "env://?rank=-1", "env://?rank=1x", "env://?rank= 1", "env://?job=a&job=b",
        "env://?unknown=1", "tcp://a:1?job=%00&rank=00000000000000000001", "tcp://a:1?=",
        "tcp://a:1???", "tcp://" + "h" * 300 + ":1",
    ]
    return {"url_%02d" % i: u.encode() for i, u in enumerate(urls)}


TARGETS = {"frame": frame_seeds, "messages": message_seeds, "init_url": init_url_seeds}


def generate():
    return {t: f() for t, f in TARGETS.items()}


def main(argv):
    check = "--check" in argv
    args = [a for a in argv if a != "--check"]
    root = args[0] if args else os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus")
    corpus = generate()
    if check:
        bad = []
        for t, seeds in corpus.items():
            d = os.path.join(root, t)
            have = set(os.listdir(d)) if os.path.isdir(d) else set()
            for name in sorted(have - set(seeds)):
                bad.append("%s/%s: not written by make_corpus.py" % (t, name))
            for name, data in sorted(seeds.items()):
                p = os.path.join(d, name)
                if not os.path.isfile(p):
                    bad.append("%s/%s: missing" % (t, name))
                else:
                    with open(p, "rb") as f:
                        if f.read() != data:
                            bad.append("%s/%s: differs" % (t, name))
        for b in bad:
            print("make_corpus: " + b, file=sys.stderr)
        if bad:
            print("make_corpus: run tests/fuzz/make_corpus.py and commit corpus/", file=sys.stderr)
            return 1
        print("make_corpus: %d seeds current" % sum(len(s) for s in corpus.values()))
        return 0
    for t, seeds in corpus.items():
        d = os.path.join(root, t)
        os.makedirs(d, exist_ok=True)
        for name in os.listdir(d):
            if name not in seeds:
                os.unlink(os.path.join(d, name))
        for name, data in seeds.items():
            with open(os.path.join(d, name), "wb") as f:
                f.write(data)
    print("make_corpus: wrote %d seeds under %s" % (sum(len(s) for s in corpus.values()), root))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

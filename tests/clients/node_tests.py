#!/usr/bin/python3
"""Runs the Node.js client's tests (node --test) for ctest, or skips them with a reason
when client/node/node_modules is missing (scripts/setup runs npm ci).

    node_tests.py NODE TEST.js...
"""
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import pyharness as H  # noqa: E402

NODE_DIR = os.path.join(os.path.dirname(os.path.dirname(HERE)), "client", "node")


def main():
    node, tests = sys.argv[1], sys.argv[2:]
    if not tests:
        H.fail("no client/node/test/*.test.js")
    if not os.path.isdir(os.path.join(NODE_DIR, "node_modules", "@grpc", "grpc-js")):
        H.skip("client/node/node_modules is missing: run `npm ci` in client/node "
               "(scripts/setup does)")
    if not os.environ.get("PARAMSYNC_DAEMON"):
        H.fail("PARAMSYNC_DAEMON is not set")
    p = subprocess.run([node, "--test"] + tests, cwd=NODE_DIR, capture_output=True, text=True,
                       timeout=600)
    sys.stdout.write(p.stdout)
    sys.stderr.write(p.stderr)
    summary = {}
    for line in p.stdout.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0] == "#" and parts[1] in ("pass", "fail", "skipped"):
            summary[parts[1]] = int(parts[2])
    if p.returncode != 0 or summary.get("fail", 1) != 0:
        H.fail("node --test failed")
    if summary.get("skipped", 0) or not summary.get("pass"):
        H.fail("node --test skipped tests or passed none: %s" % summary)
    print("PASS: %d node tests" % summary["pass"])
    if os.environ.get("PS_NODE_SKIPPED"):
        print("SKIPPED: %s" % os.environ["PS_NODE_SKIPPED"])


if __name__ == "__main__":
    main()

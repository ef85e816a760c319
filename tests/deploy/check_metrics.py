#!/usr/bin/python3
"""Scrapes the /metrics of a coordinator and its agents after a test job.

  check_metrics.py --all-reduce N COORDINATOR_URL AGENT_URL...

Checks, failing with a message on the first that does not hold:
  - every URL answers 200 with the Prometheus text format;
  - `promtool check metrics` (Debian's prometheus package) passes on each
    exposition, lint included, where promtool is installed (it says so when
    it is not);
  - paramsync_build_info names the right role on each daemon;
  - the agents' paramsync_collectives_total{kind="all_reduce",code="OK"}
    add up to N (one per rank, counted on the job's hub);
  - the coordinator's paramsync_agents gauge, when it exports one, equals
    the number of agent URLs.
"""
import argparse
import re
import shutil
import subprocess
import sys
import urllib.request

SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)')


def scrape(url):
    with urllib.request.urlopen(url, timeout=10) as r:
        if r.status != 200:
            raise SystemExit("%s: HTTP %d" % (url, r.status))
        ctype = r.headers.get("Content-Type", "")
        body = r.read().decode()
    if not ctype.startswith("text/plain"):
        raise SystemExit("%s: Content-Type %r, expected text/plain (exposition format)"
                         % (url, ctype))
    return body


def samples(body):
    out = []
    for line in body.splitlines():
        if not line or line.startswith("#"):
            continue
        m = SAMPLE.match(line)
        if not m:
            raise SystemExit("unparsable sample line: %r" % line)
        labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2) or ""))
        out.append((m.group(1), labels, float(m.group(3))))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--all-reduce", type=int, required=True, metavar="N")
    ap.add_argument("coordinator")
    ap.add_argument("agents", nargs="+")
    a = ap.parse_args()
    promtool = shutil.which("promtool")
    if not promtool:
        print("metrics: promtool not installed: exposition lint not run")
    total = 0.0
    for url, role in [(a.coordinator, "coordinator")] + [(u, "agent") for u in a.agents]:
        body = scrape(url)
        if promtool:
            p = subprocess.run([promtool, "check", "metrics"], input=body, text=True,
                               capture_output=True)
            # 1: the exposition does not parse; 3: it parses but breaks the
            # naming and help-text rules. Either is a finding.
            if p.returncode != 0:
                raise SystemExit("%s: promtool check metrics: %s" % (url, p.stdout + p.stderr))
        s = samples(body)
        roles = [l.get("role") for n, l, v in s if n == "paramsync_build_info"]
        if roles != [role]:
            raise SystemExit("%s: paramsync_build_info roles %r, expected [%r]" % (url, roles, role))
        n = sum(v for name, l, v in s if name == "paramsync_collectives_total"
                and l.get("kind") == "all_reduce" and l.get("code") == "OK")
        if role == "agent":
            total += n
        else:
            agents = [v for name, l, v in s if name == "paramsync_agents"]
            if agents and agents[0] != len(a.agents):
                raise SystemExit("%s: paramsync_agents %g, expected %d"
                                 % (url, agents[0], len(a.agents)))
        print("metrics: %s (%s): %d samples, all_reduce OK = %g" % (url, role, len(s), n))
    if total != a.all_reduce:
        raise SystemExit("metrics: agents count %g all_reduce collectives, expected %d"
                         % (total, a.all_reduce))
    print("metrics: OK")


if __name__ == "__main__":
    sys.exit(main())

"""A real Prometheus server (Debian's prometheus), started on loopback with a
temporary config and data directory, scrapes a paramsyncd during a real
workload and answers PromQL queries (HTTP API /api/v1/query) with the work
done; it also loads deploy/prometheus/alerts.yml without errors."""

import json
import os
import shutil
import subprocess
import time
import urllib.parse
import urllib.request

import harness as h

N, K, COUNT = 2, 25, 4096
B = COUNT * 4


def get_json(url, timeout=5):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read().decode())


def query(base, promql):
    """The value of an instant query as a float, or None when the result is empty."""
    q = urllib.parse.urlencode({"query": promql})
    r = get_json(f"{base}/api/v1/query?{q}")
    h.check(r.get("status") == "success", f"query {promql!r}: {r}")
    res = r["data"]["result"]
    if not res:
        return None
    h.check(len(res) == 1, f"query {promql!r} returned {len(res)} series: {res}")
    return float(res[0]["value"][1])


def wait_query(base, promql, want, timeout=45):
    deadline = time.time() + timeout
    got = None
    while time.time() < deadline:
        got = query(base, promql)
        if got == want:
            return got
        time.sleep(0.5)
    return got


def main():
    args = h.parse_args()
    prom = h.need_tool("prometheus")
    wd = h.Workdir("prometheus")
    stubs = h.make_stubs(args.proto_dir, wd.path)
    d = h.Daemon(args.paramsyncd, wd, "embedded")
    target = d.metrics_url[len("http://"):-len("/metrics")]
    rules = os.path.join(args.source_dir, "deploy", "prometheus", "alerts.yml")
    shutil.copy(rules, wd.file("alerts.yml"))
    with open(wd.file("prometheus.yml"), "w") as f:
        f.write(f"""global:
  scrape_interval: 1s
  evaluation_interval: 1s
rule_files:
  - alerts.yml
scrape_configs:
  - job_name: paramsync
    static_configs:
      - targets: ['{target}']
""")
    port = h.free_port()
    base = f"http://127.0.0.1:{port}"
    plog = open(wd.file("prometheus.log"), "w")
    p = subprocess.Popen([prom, f"--config.file={wd.file('prometheus.yml')}",
                          f"--storage.tsdb.path={wd.file('data')}",
                          f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                         stdout=plog, stderr=subprocess.STDOUT, cwd=wd.path)
    workers = []
    try:
        deadline = time.time() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{base}/-/ready", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if p.poll() is not None or time.time() > deadline:
                h.fail(f"prometheus did not become ready (exit {p.poll()}):\n"
                       f"{open(wd.file('prometheus.log')).read()}")
            time.sleep(0.2)
        h.log(f"prometheus ready at {base}, scraping {target}")
        h.expect_equal("up", wait_query(base, 'up{job="paramsync"}', 1.0), 1.0)

        # The alert rules loaded into a real server.
        rr = get_json(f"{base}/api/v1/rules")
        names = [r["name"] for g in rr["data"]["groups"] for r in g["rules"]]
        h.log(f"rules loaded: {names}")
        h.check(len(names) >= 3, f"alerts.yml rules in the server: {names}")

        workers = [h.Worker(stubs, d.addr, "prom", N, r, iters=K, count=COUNT, log_dir=wd.path)
                   for r in range(N)]
        for w in workers:
            w.finish()

        E = h.expect_equal
        E("PromQL all_reduces completed",
          wait_query(base, 'sum(paramsync_collectives_total{kind="all_reduce",code="OK"})',
                     float(N * K)), float(N * K))
        E("PromQL payload bytes received from workers",
          wait_query(base, 'sum(paramsync_payload_bytes_total{direction="received",'
                     'link="worker"})', float(N * K * B)), float(N * K * B))
        E("PromQL duration histogram count",
          wait_query(base, 'sum(paramsync_collective_duration_seconds_count'
                     '{kind="all_reduce"})', float(N * K)), float(N * K))
        E("PromQL straggler sum", wait_query(base, "sum(paramsync_straggler_total)", float(K)),
          float(K))
        med = query(base, 'histogram_quantile(0.5, sum by (le) '
                    '(paramsync_collective_duration_seconds_bucket{kind="all_reduce"}))')
        h.check(med is not None and 0 < med < 60, f"median all_reduce latency {med}")
        h.log(f"ok: median all_reduce latency by PromQL: {med * 1e3:.2f} ms")
        E("PromQL build_info", query(base, 'count(paramsync_build_info{role="embedded"})'), 1.0)
        # Every alert rule evaluated without error against real series (a
        # matching error in a rule only shows at evaluation).
        deadline = time.time() + 20
        while True:
            rules = [r for g in get_json(f"{base}/api/v1/rules")["data"]["groups"]
                     for r in g["rules"]]
            bad = [(r["name"], r.get("health"), r.get("lastError")) for r in rules
                   if r.get("health") != "ok"]
            if not bad or time.time() > deadline:
                break
            time.sleep(0.5)
        h.check(not bad, f"alert rules not healthy in a real server: {bad}")
        firing = [r["name"] for r in rules if r.get("state") == "firing"]
        # Every query of the Grafana dashboard parses and runs in a real server
        # (Grafana's variables replaced the way Grafana would).
        with open(os.path.join(args.source_dir, "deploy", "grafana",
                               "paramsync-dashboard.json")) as f:
            dash = json.load(f)
        exprs = [t["expr"] for p_ in dash["panels"] for t in p_.get("targets", [])]
        for e in exprs:
            promql = (e.replace("$__rate_interval", "1m").replace("$__range", "5m")
                      .replace("$job", ".*").replace("$instance", ".*"))
            q = urllib.parse.urlencode({"query": promql})
            r = get_json(f"{base}/api/v1/query?{q}")
            h.check(r.get("status") == "success", f"dashboard query {promql!r}: {r}")
        h.log(f"ok: the {len(exprs)} dashboard queries run in Prometheus")
        h.expect_equal("alerts firing for a healthy job", firing, [])
        status = d.stop()
        h.check(status == 0, f"paramsyncd exited {status}")
    except BaseException:
        for w in workers:
            w.kill()
        d.kill()
        print(f"daemon log:\n{d.text()}\nprometheus log:\n"
              f"{open(wd.file('prometheus.log')).read()}\n(files kept in {wd.path})")
        p.terminate()
        p.wait(10)
        raise
    p.terminate()
    p.wait(20)
    plog.close()
    wd.cleanup()
    h.finish()


if __name__ == "__main__":
    main()

"""Checks of what operators load next to paramsync, and of docs/METRICS.md:
  --check rules       promtool check rules deploy/prometheus/alerts.yml
  --check rules-unit  promtool test rules tests/metrics/alerts_test.yml
  --check dashboard   deploy/grafana/paramsync-dashboard.json is valid JSON, a
                      well-formed dashboard, and uses only documented metrics
  --check docs        every metric a real daemon exports is documented in
                      docs/METRICS.md, and every documented metric is exported
"""

import json
import os
import re
import subprocess

import harness as h

METRIC = re.compile(r"\bparamsync_[a-z0-9_]+")


def documented(source_dir):
    """Metric names in the table of docs/METRICS.md."""
    with open(os.path.join(source_dir, "docs", "METRICS.md")) as f:
        names = set()
        for line in f:
            m = re.match(r"^\| `(paramsync_[a-z0-9_]+)` \|", line)
            if m:
                names.add(m.group(1))
    h.check(len(names) >= 15, f"the metrics table of docs/METRICS.md: {sorted(names)}")
    return names


def family(name):
    for suffix in ("_bucket", "_sum", "_count"):
        if name.endswith(suffix) and not name.endswith("_total"):
            base = name[: -len(suffix)]
            if base.endswith("_seconds"):
                return base
    return name


def check_rules(args, unit):
    promtool = h.need_tool("promtool")
    if unit:
        cmd = [promtool, "test", "rules", os.path.join(h.HERE, "alerts_test.yml")]
    else:
        cmd = [promtool, "check", "rules",
               os.path.join(args.source_dir, "deploy", "prometheus", "alerts.yml")]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=h.HERE)
    print(r.stdout + r.stderr)
    h.check(r.returncode == 0, f"{' '.join(cmd)} exited {r.returncode}")
    if not unit:
        with open(cmd[-1]) as f:
            used = {family(m) for m in METRIC.findall(f.read())}
        missing = used - documented(args.source_dir)
        h.check(not missing, f"alerts.yml uses undocumented metrics: {sorted(missing)}")


def check_dashboard(args):
    path = os.path.join(args.source_dir, "deploy", "grafana", "paramsync-dashboard.json")
    with open(path) as f:
        try:
            d = json.load(f)
        except json.JSONDecodeError as e:
            h.fail(f"{path} is not valid JSON: {e}")
    for key in ("title", "uid", "panels", "templating", "schemaVersion"):
        h.check(key in d, f"dashboard has {key}")
    ids, exprs = set(), []
    for p in d["panels"]:
        h.check(p["id"] not in ids, f"panel id {p['id']} used twice")
        ids.add(p["id"])
        g = p["gridPos"]
        h.check(g["x"] >= 0 and g["w"] > 0 and g["x"] + g["w"] <= 24,
                f"panel {p['title']!r} fits the 24-column grid: {g}")
        if p["type"] == "row":
            continue
        h.check(p.get("datasource", {}).get("uid") == "${datasource}",
                f"panel {p['title']!r} uses the $datasource variable")
        h.check(p.get("targets"), f"panel {p['title']!r} has queries")
        for t in p["targets"]:
            h.check(t.get("expr"), f"panel {p['title']!r} query {t.get('refId')} has an expr")
            exprs.append(t["expr"])
    variables = {v["name"] for v in d["templating"]["list"]}
    h.check({"datasource", "job", "instance"} <= variables, f"template variables {variables}")
    used = {family(m) for e in exprs for m in METRIC.findall(e)}
    missing = used - documented(args.source_dir)
    h.check(not missing, f"the dashboard uses undocumented metrics: {sorted(missing)}")
    # What the issue asks the dashboard for: latency, bandwidth and stragglers.
    for want in ("paramsync_collective_duration_seconds", "paramsync_payload_bytes_total",
                 "paramsync_straggler_total", "paramsync_arrival_skew_seconds"):
        h.check(want in used, f"the dashboard shows {want}")
    h.log(f"ok: {len(ids)} panels, {len(exprs)} queries over {len(used)} metrics")


def check_docs(args):
    wd = h.Workdir("docs")
    d = h.Daemon(args.paramsyncd, wd, "embedded")
    try:
        text = d.scrape()
        d.stop()
    except BaseException:
        d.kill()
        raise
    exported = set(re.findall(r"^# TYPE (\S+) ", text, re.M))
    docs = documented(args.source_dir)
    h.log(f"exported: {sorted(exported)}")
    h.expect_equal("exported but not documented", sorted(exported - docs), [])
    h.expect_equal("documented but not exported", sorted(docs - exported), [])
    wd.cleanup()


def main():
    args = h.parse_args(lambda p: p.add_argument(
        "--check", required=True, choices=["rules", "rules-unit", "dashboard", "docs"]))
    if args.check in ("rules", "rules-unit"):
        check_rules(args, args.check == "rules-unit")
    elif args.check == "dashboard":
        check_dashboard(args)
    else:
        check_docs(args)
    h.finish()


if __name__ == "__main__":
    main()

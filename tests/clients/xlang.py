#!/usr/bin/python3
"""One job, three languages: a C, a Python and a Node.js worker run all_reduce
(several ops and dtypes, and a multi-frame tensor), broadcast, all_gather,
gather, scatter and barrier together, each checking exact results
(xlang_worker.c, xlang_worker.py, xlang_worker.js). Three runs rotate the
languages over ranks 0, 1 and 2, so that each language is a root. Then C,
Python and Node.js ranks of one agent take a large all_to_all and all_gather
together by peer copies (peer_jobs), and a gather, a scatter and an uneven
all_to_all (split sizes); and an all_to_all from ps_mem_alloc/empty() memory
over the agent's --shm-resident-bytes, where the ranks read each other's
segments through mappings they keep (mem_peer_jobs); and barriers that
C, Python and Node.js ranks of one agent meet on a page they share (barrier_jobs); and
Python and Node.js ranks whose object collectives fail, naming the rank they cannot read
(object_jobs).

    xlang.py --paramsyncd BIN --c-worker BIN --python VENV_PY [--node NODE]
"""
import argparse
import os
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import pyharness as H  # noqa: E402

REPO = os.path.dirname(os.path.dirname(HERE))
# "ok" lines each rank prints: 9 all_reduce, 2 broadcast, all_gather, 2 scatter,
# barrier, and gather on its destinations (ranks 0 and 2).
OK_LINES = [16, 15, 16]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--paramsyncd", required=True)
    p.add_argument("--c-worker", required=True)
    p.add_argument("--python", required=True)
    p.add_argument("--node", default=shutil.which("node"))
    a = p.parse_args()
    if not os.path.exists(a.python):
        H.fail("%s does not exist: the client_python_install test makes it" % a.python)
    if not a.node:
        H.skip("node is not installed")
    if not os.path.isdir(os.path.join(REPO, "client", "node", "node_modules", "@grpc")):
        H.skip("client/node/node_modules is missing: run `npm ci` in client/node "
               "(scripts/setup does)")
    workers = {
        "C": [a.c_worker],
        "Python": [a.python, os.path.join(HERE, "xlang_worker.py")],
        "Node": [a.node, os.path.join(HERE, "xlang_worker.js")],
    }
    orders = [["C", "Python", "Node"], ["Node", "C", "Python"], ["Python", "Node", "C"]]
    ok = True
    with H.Daemon(a.paramsyncd, metrics=True) as d:
        for k, order in enumerate(orders):
            job = "xlang-%d" % k
            envs = [H.clean_env(PARAMSYNC_ADDR=d.addr, PARAMSYNC_JOB=job, WORLD_SIZE=3, RANK=r)
                    for r in range(3)]
            res = H.run_workers([workers[lang] for lang in order], envs, timeout=120)
            print("=== job %s: ranks %s" % (job, ", ".join("%d=%s" % (r, lang)
                                                        for r, lang in enumerate(order))))
            for r, (rc, out, err) in enumerate(res):
                n_ok = sum(1 for line in out.splitlines() if line.endswith(" ok"))
                good = rc == 0 and n_ok == OK_LINES[r]
                print("--- rank %d (%s): %s, %d checks passed%s" % (
                    r, order[r], "exit %s" % rc, n_ok,
                    "" if good else " (expected exit 0 and %d)" % OK_LINES[r]))
                if not good:
                    print(out.rstrip())
                    print(err.rstrip()[-3000:])
                ok = ok and good
        ok = (ok and peer_jobs(d, workers) and barrier_jobs(d, workers)
              and object_jobs(d, workers))
        if not ok:
            print("--- daemon log (tail)\n" + "\n".join(d.read_log().splitlines()[-30:]))
    ok = ok and mem_peer_jobs(a.paramsyncd, workers)
    if not ok:
        H.fail("a worker failed")
    print("PASS: C, Python and Node.js workers agree on every result, in every rank order; "
          "%s ranks take peer copies together" % ("C and Python" if no_node_helper()
                                                   else "C, Python and Node.js"))


def no_node_helper():
    """The Node.js client's native helper was not built (ctest says so): its ranks take
    no peer copies."""
    return os.environ.get("PARAMSYNC_NODE_NATIVE") == "0"


def peer_jobs(d, workers):
    """C, Python and Node.js ranks on one agent take a large all_to_all, all_gather,
    gather, scatter and uneven all_to_all (split sizes) by peer copies together (XLANG_PEER=1: the workers' peer_steps),
    in three rank orders, each language a root: every result checked, and none of those
    kinds reaches the agent but the exchanges of addresses (all_gather)."""
    return jobs_without_agent(d, workers, 1, "peer copies", ("all_to_all", "gather", "scatter"),
                              5)


def barrier_jobs(d, workers):
    """C, Python and Node.js ranks on one agent meet at barriers on the page they share
    (XLANG_PEER=3: the workers' barrier_steps), in three rank orders: none reaches the agent,
    none lets a rank go before the last arrived, and where rank 2 calls an all_reduce
    instead every rank is told at once."""
    return jobs_without_agent(d, workers, 3, "direct barriers", ("barrier",), 3)


def object_jobs(d, workers):
    """Python and Node.js ranks (C has no object collectives) call all_gather_object
    together (XLANG_PEER=4): each side fails with an error naming the first rank of the
    other language, whose bytes it cannot read, and an all_reduce after it succeeds."""
    ok = True
    for k, order in enumerate([["Python", "Node", "Python"], ["Node", "Python", "Node"]]):
        ok = run_peer_job(workers, order, d.addr, "xlang-objects-%d" % k, 4,
                          "object collectives", {"Python": 2, "Node": 2}) and ok
    return ok


def jobs_without_agent(d, workers, steps, what, kinds, checks):
    """Jobs of the workers' steps XLANG_PEER=steps, each worker passing `checks` checks,
    in three rank orders of C, Python and Node.js ranks on the agent d (C and Python ranks
    alone without the Node.js helper, which both paths need), after which no call of
    `kinds` may have reached the agent: the ranks did them between themselves."""
    def calls():
        m = H.scrape(d.metrics_url)
        return sum(m.get('paramsync_collectives_total{kind="%s",code="OK"}' % k, 0)
                   for k in kinds)
    before = calls()
    ok = True
    orders = [["C", "Python", "Node"], ["Node", "C", "Python"], ["Python", "Node", "C"]]
    if no_node_helper():
        print("SKIPPED: Node.js ranks in the %s jobs (no native helper: no Node.js headers, or "
              "PARAMSYNC_NODE_HELPER=OFF); C and Python ranks only" % what)
        orders = [["C", "Python", "C"], ["Python", "C", "Python"]]
    for k, order in enumerate(orders):
        ok = run_peer_job(workers, order, d.addr, "xlang-%d-%d" % (steps, k), steps, what,
                          {"C": checks, "Python": checks, "Node": checks}) and ok
    went = calls() - before
    if ok and went:
        print("FAIL: %d %s calls reached the agent; %s should have taken them"
              % (went, "/".join(kinds), what))
        ok = False
    return ok


def run_peer_job(workers, order, addr, job, steps, what, want):
    """Runs job on the agent at addr, rank r in language order[r] taking the workers'
    steps XLANG_PEER=steps (2: each counting its mappings of the others' segments):
    whether every rank exited 0 with want[its language] checks passed."""
    envs = [H.clean_env(PARAMSYNC_ADDR=addr, PARAMSYNC_JOB=job, WORLD_SIZE=3, RANK=r,
                        XLANG_PEER=steps, XLANG_MAPS=len(order) - 1,
                        XLANG_ORDER=",".join(order)) for r in range(3)]
    res = H.run_workers([workers[lang] for lang in order], envs, timeout=120)
    print("=== job %s (%s): ranks %s" % (job, what, ", ".join(
        "%d=%s" % (r, lang) for r, lang in enumerate(order))))
    ok = True
    for r, (rc, out, err) in enumerate(res):
        n_ok = sum(1 for line in out.splitlines() if line.endswith(" ok"))
        good = rc == 0 and n_ok == want[order[r]]
        print("--- rank %d (%s): exit %s, %d checks passed%s" % (
            r, order[r], rc, n_ok, "" if good else " (expected exit 0 and %d)" % want[order[r]]))
        if not good:
            print(out.rstrip())
            print(err.rstrip()[-3000:])
        ok = ok and good
    return ok


def mem_peer_jobs(paramsyncd, workers):
    """An all_to_all of 8 MiB of blocks from ps_mem_alloc/empty() memory, C, Python and
    Node.js ranks on one agent whose --shm-resident-bytes (1M) it is over: by peer copies
    (none reaches the agent), each rank reading the others' segments through mappings it
    keeps (it counts them: XLANG_MAPS)."""
    ok = True
    orders = [["C", "Python", "Node"], ["Python", "C", "C"]]
    if no_node_helper():
        print("SKIPPED: Node.js ranks in the registered-memory jobs (no native helper); C and "
              "Python ranks only")
        orders = [["C", "Python", "C"], ["Python", "C", "Python"]]
    with H.Daemon(paramsyncd, "--shm-resident-bytes", "1M", metrics=True) as d:
        for k, order in enumerate(orders):
            ok = run_peer_job(workers, order, d.addr, "xlang-mem-%d" % k, 2,
                              "peer copies from registered memory",
                              {"C": 3, "Python": 2, "Node": 2}) and ok
        went = H.scrape(d.metrics_url).get(
            'paramsync_collectives_total{kind="all_to_all",code="OK"}', 0)
        if ok and went:
            print("FAIL: %d all_to_all calls on registered memory reached the agent; peer "
                  "copies should have taken them" % went)
            ok = False
        if not ok:
            print("--- daemon log (tail)\n" + "\n".join(d.read_log().splitlines()[-30:]))
    return ok


if __name__ == "__main__":
    main()

// Validates rendered Kubernetes manifests offline, against the Kubernetes
// OpenAPI schemas as the npm package kubernetes-models compiles them (and
// @kubernetes-models/prometheus-operator for the operator's kinds).
//
//   node validate.mjs FILE.yaml...     every object of every file; exit 1 on any error
//   node validate.mjs --self-test      proves that broken objects are rejected
//
// kubernetes-models' validate() checks types, enums, formats and required
// fields but lets unknown field names through. So each object is validated
// through a Proxy that records which fields the schema's validator looks at:
// a field it never reads (in an object whose keys it never enumerates, as it
// does for maps such as labels) is not in the schema, and is reported, as
// `kubectl apply --validate=strict` would.
//
// Besides the schemas, paramsync's own rules for its workloads are checked
// (deploy/k8s: non-root, read-only root, no capabilities, resources, probes
// on declared ports, ConfigMaps that exist, selectors that select).
import { readFileSync } from "node:fs";
import path from "node:path";
import { fileURLToPath, pathToFileURL } from "node:url";
import { parseAllDocuments } from "yaml";

const here = path.dirname(fileURLToPath(import.meta.url));
const packages = [
  path.join(here, "node_modules/kubernetes-models"),
  path.join(here, "node_modules/@kubernetes-models/prometheus-operator"),
];

const validators = new Map();

// The compiled schema validator of apiVersion/kind, read from the model
// class's own import (so that no name mapping is guessed here).
async function validatorFor(apiVersion, kind) {
  const key = `${apiVersion}/${kind}`;
  if (validators.has(key)) return validators.get(key);
  const rel = `${apiVersion}/${kind}.js`; // "v1/Service.js", "apps/v1/DaemonSet.js"
  let found = null;
  for (const pkg of packages) {
    let src;
    const file = path.join(pkg, rel);
    try {
      src = readFileSync(file, "utf8");
    } catch {
      continue;
    }
    const m = src.match(/from\s*"((?:\.\.\/)+_schemas\/\w+\.js)"/);
    if (!m) throw new Error(`${file}: no schema import found`);
    found = (await import(pathToFileURL(path.resolve(path.dirname(file), m[1])))).validate;
    break;
  }
  validators.set(key, found);
  return found;
}

// Wraps value so that every property read is recorded per object.
function track(value, where, seen) {
  if (value === null || typeof value !== "object") return value;
  const rec = { where, value, read: new Set(), enumerated: false };
  seen.push(rec);
  const copy = Array.isArray(value) ? [] : {};
  for (const k of Object.keys(value)) copy[k] = track(value[k], `${where}/${k}`, seen);
  return new Proxy(copy, {
    get(t, k, r) {
      if (typeof k === "string") rec.read.add(k);
      return Reflect.get(t, k, r);
    },
    has(t, k) {
      if (typeof k === "string") rec.read.add(k);
      return Reflect.has(t, k);
    },
    ownKeys(t) {
      rec.enumerated = true;
      return Reflect.ownKeys(t);
    },
  });
}

export async function schemaErrors(obj) {
  if (!obj || typeof obj !== "object" || !obj.apiVersion || !obj.kind) {
    return ["not a Kubernetes object (apiVersion and kind are required)"];
  }
  const validate = await validatorFor(obj.apiVersion, obj.kind);
  if (!validate) return [`no schema for ${obj.apiVersion} ${obj.kind}`];
  const seen = [];
  const errs = [];
  if (!validate(track(obj, "", seen))) {
    for (const e of validate.errors) {
      errs.push(`${e.instancePath || "/"}: ${e.keyword} ${JSON.stringify(e.params)}`);
    }
  }
  for (const r of seen) {
    if (Array.isArray(r.value) || r.enumerated) continue;
    for (const k of Object.keys(r.value)) {
      // kubernetes-models compiles its schemas without the properties named
      // "description" (PriorityClass.description, for one): never read, so
      // not judged here.
      if (!r.read.has(k) && k !== "description") errs.push(`${r.where || "/"}: unknown field "${k}"`);
    }
  }
  return errs;
}

const WORKLOADS = new Set(["StatefulSet", "DaemonSet", "Deployment", "Job"]);

function podTemplate(o) {
  return WORKLOADS.has(o.kind) ? o.spec?.template : null;
}

function matches(selector, labels) {
  return Object.entries(selector || {}).every(([k, v]) => labels?.[k] === v);
}

// paramsync's rules over the whole rendered set.
export function policyErrors(objs) {
  const errs = [];
  const configMaps = new Set(objs.filter((o) => o.kind === "ConfigMap").map((o) => o.metadata.name));
  const configData = new Map(objs.filter((o) => o.kind === "ConfigMap").map((o) => [o.metadata.name, o.data || {}]));
  const pods = objs.filter(podTemplate).map((o) => ({ o, t: podTemplate(o) }));
  for (const { o, t } of pods) {
    const id = `${o.kind}/${o.metadata.name}`;
    const ps = t.spec;
    if (ps.automountServiceAccountToken !== false) errs.push(`${id}: mounts a service account token`);
    for (const c of ps.containers || []) {
      const cid = `${id} container ${c.name}`;
      const sc = c.securityContext || {};
      const nonRoot = sc.runAsNonRoot ?? ps.securityContext?.runAsNonRoot;
      if (nonRoot !== true) errs.push(`${cid}: runAsNonRoot is not true`);
      if (sc.readOnlyRootFilesystem !== true) errs.push(`${cid}: readOnlyRootFilesystem is not true`);
      if (sc.allowPrivilegeEscalation !== false) errs.push(`${cid}: allowPrivilegeEscalation is not false`);
      if (!(sc.capabilities?.drop || []).includes("ALL")) errs.push(`${cid}: capabilities do not drop ALL`);
      for (const r of ["cpu", "memory"]) {
        if (!c.resources?.requests?.[r]) errs.push(`${cid}: no ${r} request`);
      }
      if (!c.resources?.limits?.memory) errs.push(`${cid}: no memory limit`);
      const ports = new Map((c.ports || []).map((p) => [p.name, p.containerPort]));
      const numbers = new Set(ports.values());
      for (const pn of ["startupProbe", "readinessProbe", "livenessProbe"]) {
        const p = c[pn];
        if (!p) continue;
        const port = p.grpc?.port ?? p.tcpSocket?.port ?? p.httpGet?.port;
        if (typeof port === "string" ? !ports.has(port) : !numbers.has(port)) {
          errs.push(`${cid}: ${pn} probes port ${port}, which the container does not declare`);
        }
      }
      const env = {};
      for (const ef of c.envFrom || []) {
        const n = ef.configMapRef?.name;
        if (n && !configMaps.has(n)) errs.push(`${cid}: envFrom ConfigMap ${n} is not rendered`);
        Object.assign(env, configData.get(n) || {});
      }
      for (const e of c.env || []) if (typeof e.value === "string") env[e.name] = e.value;
      // The kubelet's gRPC probes speak plaintext: with TLS on the gRPC port
      // they must go to the plaintext health port (--health-listen).
      if (env.PARAMSYNC_TLS_CERT) {
        const hl = /:(\d+)$/.exec(env.PARAMSYNC_HEALTH_LISTEN || "");
        for (const pn of ["startupProbe", "readinessProbe", "livenessProbe"]) {
          const gp = c[pn]?.grpc?.port;
          if (gp === undefined) continue;
          if (!hl) errs.push(`${cid}: ${pn} is a gRPC probe but TLS is on and PARAMSYNC_HEALTH_LISTEN is not set`);
          else if (gp !== Number(hl[1])) {
            errs.push(`${cid}: ${pn} probes gRPC port ${gp} over TLS; the plaintext health port is ${hl[1]}`);
          }
        }
      }
      if (WORKLOADS.has(o.kind) && o.kind !== "Job" && !c.readinessProbe) {
        errs.push(`${cid}: no readinessProbe`);
      }
      if (WORKLOADS.has(o.kind) && o.kind !== "Job" && !c.livenessProbe) {
        errs.push(`${cid}: no livenessProbe`);
      }
    }
    for (const v of ps.volumes || []) {
      const n = v.configMap?.name;
      if (n && !configMaps.has(n)) errs.push(`${id}: volume ${v.name}: ConfigMap ${n} is not rendered`);
    }
  }
  const labelsIn = (ns) => pods.filter(({ o }) => (o.metadata.namespace || "") === (ns || "")).map(({ t }) => t.metadata?.labels || {});
  for (const o of objs) {
    const id = `${o.kind}/${o.metadata?.name}`;
    if (o.kind === "Service" && o.spec?.selector) {
      if (!labelsIn(o.metadata.namespace).some((l) => matches(o.spec.selector, l))) {
        errs.push(`${id}: selector ${JSON.stringify(o.spec.selector)} selects no pod template`);
      }
    }
    if (o.kind === "PodDisruptionBudget" || o.kind === "NetworkPolicy") {
      const sel = o.kind === "NetworkPolicy" ? o.spec.podSelector : o.spec.selector;
      const ml = sel?.matchLabels;
      if (ml && Object.keys(ml).length && !labelsIn(o.metadata.namespace).some((l) => matches(ml, l))) {
        errs.push(`${id}: selector ${JSON.stringify(ml)} selects no pod template`);
      }
    }
  }
  return errs;
}

function load(file) {
  const docs = parseAllDocuments(readFileSync(file, "utf8"));
  const objs = [];
  for (const d of docs) {
    if (d.errors.length) throw new Error(`${file}: ${d.errors[0].message}`);
    const o = d.toJS();
    if (o !== null) objs.push(o);
  }
  return objs;
}

async function validateFile(file) {
  const objs = load(file);
  const errs = [];
  if (objs.length === 0) errs.push(`${file}: no objects`);
  const kinds = {};
  for (const o of objs) {
    kinds[o.kind] = (kinds[o.kind] || 0) + 1;
    for (const e of await schemaErrors(o)) errs.push(`${file}: ${o.kind}/${o.metadata?.name}: ${e}`);
  }
  for (const e of policyErrors(objs)) errs.push(`${file}: ${e}`);
  const summary = Object.entries(kinds).map(([k, n]) => `${n} ${k}`).join(", ");
  return { errs, summary, n: objs.length };
}

// Breaks valid objects in known ways; each must be rejected with the
// expected message, and the unbroken object must pass.
async function selfTest(file) {
  const objs = load(file);
  const pick = (kind) => {
    const o = objs.find((x) => x.kind === kind);
    if (!o) throw new Error(`self-test: ${file} has no ${kind}`);
    return structuredClone(o);
  };
  const cases = [
    ["a valid DaemonSet", pick("DaemonSet"), () => {}, null],
    ["a misspelt field in a container", pick("DaemonSet"),
      (o) => { o.spec.template.spec.containers[0].imagePullPolicyy = "Always"; }, /unknown field "imagePullPolicyy"/],
    ["a misspelt top-level spec field", pick("StatefulSet"),
      (o) => { o.spec.replica = 1; }, /unknown field "replica"/],
    ["a misspelt field of a gRPC probe", pick("StatefulSet"),
      (o) => { o.spec.template.spec.containers[0].livenessProbe = { grpc: { port: 29400, servce: "" } }; },
      /unknown field "servce"/],
    ["a string containerPort", pick("DaemonSet"),
      (o) => { o.spec.template.spec.containers[0].ports[0].containerPort = "29500"; },
      /containerPort: type \{"type":"integer"\}/],
    ["a string replicas", pick("StatefulSet"), (o) => { o.spec.replicas = "1"; },
      /replicas: type \{"type":"integer"\}/],
    ["an invalid enum", pick("Service"), (o) => { o.spec.internalTrafficPolicy = "Nearby"; },
      /internalTrafficPolicy: enum/],
    ["a missing required field", pick("DaemonSet"), (o) => { delete o.spec.selector; },
      /required \{"missingProperty":"selector"\}/],
    ["a list where a map belongs", pick("ConfigMap"), (o) => { o.data = ["a"]; }, /data: type/],
    ["a misspelt NetworkPolicy field", pick("NetworkPolicy"),
      (o) => { o.spec.ingres = []; }, /unknown field "ingres"/],
  ];
  if (objs.some((o) => o.kind === "PodMonitor")) {
    cases.push(["a misspelt PodMonitor field", pick("PodMonitor"),
      (o) => { o.spec.podMetricsEndpoints[0].prot = "metrics"; }, /unknown field "prot"/]);
  }
  let failed = 0;
  for (const [name, obj, breakIt, want] of cases) {
    breakIt(obj);
    const errs = await schemaErrors(obj);
    const ok = want === null ? errs.length === 0 : errs.some((e) => want.test(e));
    console.log(`self-test: ${name}: ${want === null ? "accepted" : "rejected"}: ${ok ? "yes" : "NO"}` +
      (errs.length ? ` (${errs[0]})` : ""));
    if (!ok) failed++;
  }
  // Policy: a container with a writable root file system must be reported.
  const bad = objs.map((o) => structuredClone(o));
  const ds = bad.find((o) => o.kind === "DaemonSet");
  ds.spec.template.spec.containers[0].securityContext.readOnlyRootFilesystem = false;
  const perrs = policyErrors(bad);
  const pok = perrs.some((e) => /readOnlyRootFilesystem/.test(e));
  console.log(`self-test: a writable root file system: rejected: ${pok ? "yes" : "NO"}`);
  if (!pok) failed++;
  // Policy: over TLS, a gRPC probe on the TLS port must be reported.
  if (objs.some((o) => o.kind === "ConfigMap" && o.data?.PARAMSYNC_TLS_CERT)) {
    const tls = objs.map((o) => structuredClone(o));
    const ss = tls.find((o) => o.kind === "StatefulSet");
    ss.spec.template.spec.containers[0].readinessProbe = { grpc: { port: 29400, service: "" } };
    const terrs = policyErrors(tls);
    const tok = terrs.some((e) => /probes gRPC port 29400 over TLS/.test(e));
    console.log(`self-test: a gRPC probe on the TLS port: rejected: ${tok ? "yes" : "NO"}`);
    if (!tok) failed++;
  }
  return failed;
}

const args = process.argv.slice(2);
if (args[0] === "--self-test") {
  const failed = await selfTest(args[1]);
  console.log(failed ? `self-test: ${failed} broken objects were NOT rejected` : "self-test: OK");
  process.exit(failed ? 1 : 0);
}
let bad = 0;
for (const f of args) {
  const { errs, summary, n } = await validateFile(f);
  if (errs.length) {
    bad++;
    for (const e of errs) console.log(`INVALID ${e}`);
  } else {
    console.log(`valid: ${path.basename(f)}: ${n} objects (${summary})`);
  }
}
if (args.length === 0) {
  console.error("usage: node validate.mjs FILE.yaml... | --self-test FILE.yaml");
  process.exit(2);
}
process.exit(bad ? 1 : 0);

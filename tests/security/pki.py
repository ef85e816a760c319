#!/usr/bin/python3
"""Throwaway certificates for the security tests, made with the openssl CLI.

make(dir) creates two CAs and returns a dict of paths:
  ca, ca_key            CA "paramsync-test-ca"
  server, server_key    signed by ca; CN localhost, SAN IP:127.0.0.1, DNS:localhost;
                        serverAuth + clientAuth (agents present it as a client too)
  client, client_key    signed by ca; CN worker; clientAuth
  other_ca              another CA "paramsync-other-ca"
  rogue, rogue_key      signed by other_ca; the same names as server (a look-alike)
EC P-256 keys, valid one day: the whole set takes well under a second.
"""
import os
import shutil
import subprocess

import psworker as P


def _run(*args):
    r = subprocess.run(["openssl"] + list(args), capture_output=True, text=True)
    if r.returncode != 0:
        P.fail("openssl %s: %s" % (" ".join(args), r.stderr))


def _ca(d, name, cn):
    key, crt = os.path.join(d, name + ".key"), os.path.join(d, name + ".pem")
    _run("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
         "-keyout", key, "-out", crt, "-days", "1", "-subj", "/CN=" + cn,
         "-addext", "basicConstraints=critical,CA:TRUE",
         "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    return crt, key


def _leaf(d, name, cn, ca, ca_key, ext):
    key, csr, crt = (os.path.join(d, name + s) for s in (".key", ".csr", ".pem"))
    extf = os.path.join(d, name + ".ext")
    with open(extf, "w") as f:
        f.write(ext)
    _run("req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
         "-keyout", key, "-out", csr, "-subj", "/CN=" + cn)
    _run("x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial",
         "-out", crt, "-days", "1", "-extfile", extf)
    return crt, key


SERVER_EXT = ("basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\n"
              "extendedKeyUsage=serverAuth,clientAuth\n"
              "subjectAltName=IP:127.0.0.1,DNS:localhost\n")
CLIENT_EXT = ("basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\n"
              "extendedKeyUsage=clientAuth\n")


def make(d):
    if not shutil.which("openssl"):
        P.skip("openssl is not installed (scripts/packages.d/faults.txt)")
    os.makedirs(d, exist_ok=True)
    out = {}
    out["ca"], out["ca_key"] = _ca(d, "ca", "paramsync-test-ca")
    out["server"], out["server_key"] = _leaf(d, "server", "localhost", out["ca"],
                                             out["ca_key"], SERVER_EXT)
    out["client"], out["client_key"] = _leaf(d, "client", "worker", out["ca"], out["ca_key"],
                                             CLIENT_EXT)
    out["other_ca"], out["other_ca_key"] = _ca(d, "other-ca", "paramsync-other-ca")
    out["rogue"], out["rogue_key"] = _leaf(d, "rogue", "localhost", out["other_ca"],
                                           out["other_ca_key"], SERVER_EXT)
    return out

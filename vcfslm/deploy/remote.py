"""What `serve up` and `serve status` ask a node, run by its own Python over SSH.

The servers' proxies answer only the router's node and their own, and the router listens
on its node's loopback: the node reaches them, the operator's machine may not. One call answers every
question at once: HTTP calls (GETs, and the POSTs of the router's management API; with the key, fed
on stdin so it is in no command line or
log, where asked), and the peak RSS of process trees.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping, Sequence
from typing import Any

# Runs on the guest under any Python 3.8+: the standard library only.
PROBE = r'''
import json, os, ssl, sys, urllib.request, urllib.error
ask = json.loads(sys.stdin.read())
out = {"http": {}, "rss": {}}
contexts = {}
for item in ask.get("get", []):
    req = urllib.request.Request(item["url"], method=item.get("method", "GET"))
    if item.get("key"):
        req.add_header("Authorization", "Bearer " + ask["key"])
    context = None
    if item["url"].startswith("https:"):
        ca = item.get("ca") or ""
        if ca not in contexts:
            contexts[ca] = ssl.create_default_context(cafile=ca or None)
        context = contexts[ca]
    try:
        with urllib.request.urlopen(req, timeout=item.get("timeout", 5), context=context) as r:
            out["http"][item["id"]] = {"status": r.status, "body": r.read(200000).decode("utf-8", "replace")}
    except urllib.error.HTTPError as e:
        out["http"][item["id"]] = {"status": e.code, "body": e.read(2000).decode("utf-8", "replace")}
    except Exception as e:
        out["http"][item["id"]] = {"status": None, "error": type(e).__name__ + ": " + str(e)}
def children():
    kids = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                ppid = int(open("/proc/%s/stat" % d).read().rsplit(")", 1)[1].split()[1])
            except Exception:
                continue
            kids.setdefault(ppid, []).append(int(d))
    return kids
def hwm(pid):
    try:
        for line in open("/proc/%d/status" % pid):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except Exception:
        return None
kids = children() if ask.get("rss") else {}
for name, pid in ask.get("rss", {}).items():
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo.extend(kids.get(p, []))
    values = [v for v in (hwm(p) for p in tree) if v is not None]
    out["rss"][name] = max(values) if values else None
print(json.dumps(out))
'''


def probe_command(python: str) -> str:
    return f"{shlex.quote(python)} -c {shlex.quote(PROBE)}"


def probe_input(gets: Sequence[Mapping[str, Any]], rss: Mapping[str, int], key: str | None = None) -> str:
    """The question as the probe reads it on stdin: calls {id, url, key: bool, timeout, method
    (GET when absent), ca: the CA file on the node an https URL is verified with (absent: the
    node's trust store)}."""
    return json.dumps({"get": list(gets), "rss": dict(rss), "key": key or ""})


def parse_probe(stdout: str) -> dict[str, Any]:
    lines = [line for line in stdout.splitlines() if line.strip().startswith("{")]
    if not lines:
        raise ValueError(f"the node's probe printed no answer: {stdout[-300:]!r}")
    return json.loads(lines[-1])

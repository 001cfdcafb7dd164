"""The `stepwire` command: serve the whole stack, run one service, or stream a completion.

It sits above the services: it starts them as processes (or runs one in this process) and never shares
their code, so each service stays importable on its own.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

import httpx

from launcher.resuming_stream import stream_chat

USAGE = """stepwire serve [--model DIR] [--executors N]  start executors, scheduler and gateway on localhost
stepwire executor|scheduler|gateway [...]      start one service (--help for its flags)
stepwire generate "prompt" [--max-tokens N]    stream a completion from a running gateway
stepwire certs DIR [--names a,b]               make a development CA and a certificate per role"""


def generate(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="stepwire generate", description="Stream a chat completion.")
    ap.add_argument("prompt")
    ap.add_argument("--url", default=os.environ.get("STEPWIRE_URL", "http://127.0.0.1:8000"))
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=0.7)
    a = ap.parse_args(argv)
    model = httpx.get(a.url + "/v1/models").json()["data"][0]["id"]
    body = {"model": model, "messages": [{"role": "user", "content": a.prompt}], "stream": True,
            "max_tokens": a.max_tokens, "temperature": a.temperature}
    key = os.environ.get("STEPWIRE_API_KEY")
    try:
        # A break mid-stream is resumed through the gateway URL, from the last event seen.
        for text in stream_chat(a.url, body, {"Authorization": f"Bearer {key}"} if key else None):
            print(text, end="", flush=True)
    except RuntimeError as e:
        sys.exit(f"stepwire: {e}")
    print()


def certs(argv: list[str]) -> None:
    from security.identity import DEFAULT_TRUST_DOMAIN, TRUST_DOMAIN_PATTERN

    ap = argparse.ArgumentParser(prog="stepwire certs", description=(
        "Make a development CA (DIR/ca.crt, DIR/ca.key) and, for each role (gateway, scheduler, executor, "
        "operator), DIR/<role>/tls.crt, tls.key and ca.crt: the layout of a Kubernetes TLS Secret, for --tls-dir. "
        "Each certificate names its role as the URI spiffe://<trust-domain>/<role>. Not for production."))
    ap.add_argument("dir")
    ap.add_argument("--names", default="", help="extra host names or IPs for every service's certificate, "
                    "comma-separated")
    ap.add_argument("--trust-domain", default=DEFAULT_TRUST_DOMAIN, help="the services' --trust-domain "
                    f"(default {DEFAULT_TRUST_DOMAIN})")
    a = ap.parse_args(argv)
    if not re.fullmatch(TRUST_DOMAIN_PATTERN, a.trust_domain):
        ap.error(f"--trust-domain {a.trust_domain!r}: use lower-case letters, digits, '.', '-' and '_'")
    from security.dev_certs import make_dev_certs

    d = make_dev_certs(a.dir, tuple(n.strip() for n in a.names.split(",") if n.strip()), a.trust_domain)
    print(f"development CA and certificates in {d}: pass --tls-dir {d}/<service> to each service; {d}/operator "
          "is the identity that may call the scheduler's Stats (scripts, grpcurl)")


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
        print(USAGE)
        return
    cmd, rest = sys.argv[1], sys.argv[2:]
    if cmd == "serve":
        from launcher.local_stack import serve

        serve(rest)
    elif cmd == "generate":
        generate(rest)
    elif cmd == "certs":
        certs(rest)
    elif cmd == "executor":
        from executor_service.server import main as run
        run(rest)
    elif cmd == "scheduler":
        from scheduler_service.server import main as run
        run(rest)
    elif cmd == "gateway":
        from gateway.server import main as run
        run(rest)
    else:
        sys.exit(f"stepwire: unknown command {cmd!r}\n{USAGE}")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Gateway chaos: streams that resume (docs/resumable_streams.md) while gateways are killed and clients cut
their own connections.

`stepwire serve` runs an executor (deterministic mode, so that a request's tokens do not depend on its batch), a
scheduler and `--gateways` gateway workers (2) sharing one port, with the tiny random model and the embedded
model's tokenizer. `--clients` threads (32) stream chat completions for `--seconds` (60), one after another,
greedy and seeded in turn. Every `--kill-every` seconds (10) a random gateway worker is killed with SIGKILL (serve
starts it again); and a client cuts its own connection after a few events in `--cut` of its requests (10%). A
broken stream is resumed with GET /v1/streams/{id} and its last SSE id, through the same port, until it ends.
Then every distinct request is run again with no fault, and each answer's text is compared with that run's.

The SSE ids count the tokens each event covers (twice, plus one on the last), so the client knows what it got:
`lost` is the tokens the final usage says were generated that no event covered, `duplicated` the tokens covered
twice. `resume_gap_p99_ms`: from the moment a stream broke to the first event of its resumption.

Prints a table and `RESULT gateway_chaos completed=<fraction> resumed=<count> lost=<tokens>
duplicated=<tokens> identical=<yes|no> resume_gap_p99_ms=<...>`.
Usage: bench/gateway_chaos.py [--seconds 60] [--clients 32] [--gateways 2] [--kill-every 10] [--cut 0.1]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(ROOT / "tests"))      # the tiny test model
sys.path.insert(2, str(ROOT / "bench"))

import httpx  # noqa: E402
from determinism import cpu_model  # noqa: E402

TOKENS = 48
MODEL = {"name": ""}     # the served model's name, asked of a gateway at start
BROKEN = (httpx.TransportError, httpx.RemoteProtocolError)


@dataclass
class Stream:
    key: tuple[int, int | None]         # (prompt, seed): the no-fault run's answer to compare with
    id: str | None = None               # the stream's, once known (header or first event)
    last: int | None = None             # the last SSE id received
    text: str = ""
    covered: int = 0                    # tokens the events received so far cover
    duplicated: int = 0
    usage: int | None = None            # completion tokens, from the usage chunk
    resumed: int = 0
    resent: int = 0                     # sent again: its gateway died before the request reached the scheduler
    gaps: list[float] = field(default_factory=list)
    done: bool = False
    error: str = ""


def body(key) -> dict:
    prompt, seed = key
    text = f"Request {prompt}: tell me about {prompt * 7}."
    b = {"model": MODEL["name"], "messages": [{"role": "user", "content": text}],
         "max_tokens": TOKENS, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    return b | ({"temperature": 0.0} if seed is None else {"temperature": 0.8, "seed": seed})


def read(r, s: Stream, cut_after: int | None, on_first=None) -> bool:
    """Events of one connection into `s`; True once the stream ended ([DONE]), False if it was cut here.
    `on_first()` is called at this connection's first event."""
    if getattr(r, "status_code", 200) != 200:
        raise RuntimeError(f"{r.status_code}: {r.read()[:300]!r}")
    last, n = None, 0
    for line in r.iter_lines():
        if line.startswith("id: "):
            last = int(line[4:])
        elif line == "data: [DONE]":
            s.done = True
            return True
        elif line.startswith("data: "):
            if n == 0 and on_first is not None:
                on_first()
            event = json.loads(line[6:])
            if "error" in event:      # a server error (its gateway lost the scheduler): resumed like a break
                kind = httpx.RemoteProtocolError if event["error"].get("type") == "server_error" else RuntimeError
                raise kind(f"error event: {event['error']}")
            s.id = event["id"]
            covered = last // 2
            if covered < s.covered:
                s.duplicated += s.covered - covered
            for c in event.get("choices", []):
                s.text += c.get("delta", {}).get("content", "") or ""
            s.covered = max(s.covered, covered)
            if event.get("usage"):
                s.usage = event["usage"]["completion_tokens"]
            s.last = last
            n += 1
            if cut_after is not None and n >= cut_after:
                return False
    raise httpx.RemoteProtocolError("the stream ended without [DONE]")


def one(urls: list[str], s: Stream, rng: random.Random, cut: float, deadline: float) -> None:
    cut_after = rng.randint(1, 5) if rng.random() < cut else None
    while s.id is None:
        try:
            with httpx.stream("POST", rng.choice(urls) + "/v1/chat/completions", json=body(s.key), timeout=60) as r:
                s.id = r.headers.get("x-stepwire-stream-id")      # before any event: the stream's id
                if read(r, s, cut_after):
                    return
        except BROKEN:
            if s.id is None:          # the gateway died before it answered: the request is sent again
                s.resent += 1
                time.sleep(0.05)
                if time.monotonic() > deadline:
                    s.error = "no gateway answered"
                    return
    broke = [time.monotonic()]        # when the stream last broke: a resume's gap runs from there

    def resumed_first_event():
        s.gaps.append(time.monotonic() - broke[0])
        broke[0] = None
    while time.monotonic() < deadline:
        headers = {"Last-Event-ID": str(s.last)} if s.last is not None else {}
        try:
            with httpx.stream("GET", f"{rng.choice(urls)}/v1/streams/{s.id}", headers=headers, timeout=60) as r:
                if r.status_code == 404 and s.last is None:
                    # Killed before it submitted the request: nothing of it exists, and nothing was seen.
                    s.id = None
                    s.resent += 1
                    one(urls, s, rng, 0.0, deadline)
                    return
                if r.status_code == 503:      # that gateway lost the scheduler under the resume: try again
                    raise httpx.RemoteProtocolError("503 on resume")
                if r.status_code != 200:
                    s.error = (f"resume of {s.id} after event {s.last}, {time.time():.3f}: {r.status_code} "
                               f"{r.read()[:200]!r}")
                    return
                s.resumed += 1
                if read(r, s, None, resumed_first_event):
                    return
        except BROKEN:
            time.sleep(0.05)       # that gateway is down, or went down under the resumed stream
        broke[0] = broke[0] or time.monotonic()
    s.error = "not resumed in time"


def clients(urls, n: int, seconds: float, cut: float, seed: int) -> list[Stream]:
    done: list[Stream] = []
    lock = threading.Lock()
    end = time.monotonic() + seconds

    def loop(c: int):
        rng = random.Random(seed * 1000 + c)
        i = 0
        while time.monotonic() < end:
            key = (c * 1000 + i, None if i % 2 == 0 else c * 1000 + i)
            s = Stream(key)
            try:
                one(urls, s, rng, cut, time.monotonic() + 120)
            except RuntimeError as e:             # refused, or an error event: counted, not fatal to the client
                s.error = str(e)
            with lock:
                done.append(s)
            i += 1
    threads = [threading.Thread(target=loop, args=(c,), daemon=True) for c in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return done


def reference(urls, keys, n: int) -> dict:
    """Each request's text with no fault, `n` at a time."""
    out, todo, lock = {}, list(keys), threading.Lock()

    def loop():
        while True:
            with lock:
                if not todo:
                    return
                key = todo.pop()
            for _ in range(5):            # a worker serve is still starting again may refuse the first try
                s = Stream(key)
                try:
                    with httpx.stream("POST", urls[0] + "/v1/chat/completions", json=body(key), timeout=120) as r:
                        read(r, s, None)
                    break
                except (RuntimeError, *BROKEN):
                    time.sleep(1)
            with lock:
                out[key] = s.text
    threads = [threading.Thread(target=loop, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--gateways", type=int, default=2)
    ap.add_argument("--kill-every", type=float, default=10)
    ap.add_argument("--cut", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log", type=Path, help="where `stepwire serve`'s output goes (default: nowhere)")
    a = ap.parse_args()
    import psutil
    from gateway_stack import tiny_model_with_tokenizer
    from serving import start_stack

    from launcher.processes import MODULE


    with tempfile.TemporaryDirectory() as tmp:
        model = tiny_model_with_tokenizer(Path(tmp) / "model")
        # `stepwire serve`: the gateway workers share one port (SO_REUSEPORT), as behind a Service, and one started
        # again joins it only once it is ready; serve starts a killed worker again on its own.
        proc, url, _ = start_stack(tls=False, model=model, extra=("--gateway-workers", str(a.gateways),
                                                                   "--deterministic"), log=a.log)
        try:
            urls = [url]
            MODEL["name"] = httpx.get(url + "/v1/models").json()["data"][0]["id"]
            rng = random.Random(a.seed)
            streams: list[Stream] = []
            load = threading.Thread(target=lambda: streams.extend(clients(urls, a.clients, a.seconds, a.cut,
                                                                          a.seed)), daemon=True)
            load.start()
            kills = []
            while True:
                load.join(a.kill_every)
                if not load.is_alive():
                    break
                # A gateway worker's title is its command line (launcher/forked.py). Not the fork server's, whose
                # preload list names the gateway's module too: its death takes every service with it.
                workers = [c for c in psutil.Process(proc.pid).children(recursive=True)
                           if c.status() != psutil.STATUS_ZOMBIE
                           and " ".join(c.cmdline()).split()[1:3] == ["-m", MODULE["gateway"]]]
                if workers:
                    victim = rng.choice(workers)
                    victim.kill()
                    kills.append(victim.pid)
                    print(f"{time.time():.3f} killed gateway worker {victim.pid}", flush=True)
            time.sleep(2)
            ref = reference(urls, {s.key for s in streams}, a.clients)
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    completed = [s for s in streams if s.done and not s.error]
    lost = sum(max((s.usage or 0) - s.covered, 0) for s in completed) + sum(TOKENS for s in streams if s.error)
    dup = sum(s.duplicated for s in streams)
    identical = all(s.text == ref.get(s.key) for s in completed)
    gaps = sorted(g for s in streams for g in s.gaps)
    p99 = gaps[min(len(gaps) - 1, int(len(gaps) * 0.99))] * 1000 if gaps else 0.0
    print(f"cpu: {cpu_model()}  model: tiny random (embedded tokenizer), deterministic  gateways: {a.gateways}  "
          f"clients: {a.clients}  seconds: {a.seconds:g}  kills: {len(kills)}  cut: {a.cut:.0%}")
    print(f"{'streams':>8} {'completed':>10} {'resumed':>8} {'resent':>7} {'lost':>6} {'dup':>6} {'gap p50 ms':>11} "
          f"{'gap p99 ms':>11}")
    p50 = statistics.median(gaps) * 1000 if gaps else 0.0
    print(f"{len(streams):8d} {len(completed):10d} {sum(s.resumed for s in streams):8d} "
          f"{sum(s.resent for s in streams):7d} {lost:6d} {dup:6d} {p50:11.1f} {p99:11.1f}")
    for s in [s for s in streams if s.error][:5]:
        print(f"failed: {s.key}: {s.error}")
    print(f"RESULT gateway_chaos completed={len(completed) / max(len(streams), 1):.4f} "
          f"resumed={sum(s.resumed for s in streams)} lost={lost} duplicated={dup} "
          f"identical={'yes' if identical else 'no'} resume_gap_p99_ms={p99:.0f}")


if __name__ == "__main__":
    main()

"""Print one request's trace as a tree from the receiver's JSON lines, with the steps that served it.

    python -m tools.trace_tree spans.jsonl [TRACE_ID]      (default: the latest request's trace)

The request's own trace holds the gateway and scheduler spans; each engine step is a trace of its own
that links to the request, so the steps (and their executor spans) are listed under the request span
that they link to.
"""

from __future__ import annotations

import json
import sys


def _line(s: dict, t0: int, depth: int) -> str:
    start = (s["start_ns"] - t0) / 1e6
    dur = (s["end_ns"] - s["start_ns"]) / 1e6
    keys = ("gen_ai.usage.input_tokens", "gen_ai.usage.output_tokens", "gen_ai.response.finish_reasons",
            "stepwire.prefix_cache.hit_tokens", "stepwire.step.num_requests", "stepwire.step.scheduled_tokens",
            "stepwire.step.wire_bytes")
    attrs = " ".join(f"{k.split('.')[-1]}={s['attributes'][k]}" for k in keys if k in s["attributes"])
    events = ",".join(e["name"] for e in s["events"])
    return (f"{'  ' * depth}{s['name']} [{s['service']}] +{start:.1f}ms {dur:.1f}ms"
            + (f" {attrs}" if attrs else "") + (f" events={events}" if events else ""))


def render(spans: list[dict], trace_id: str | None = None, max_steps: int = 4) -> str:
    if trace_id is None:
        trace_id = max((s for s in spans if s["name"] == "scheduler.request"), key=lambda s: s["start_ns"])["trace_id"]
    children: dict[str, list[dict]] = {}
    for s in spans:
        children.setdefault(s["parent_id"], []).append(s)
    linked: dict[str, list[dict]] = {}
    for s in spans:
        for lk in s["links"]:
            linked.setdefault(lk["span_id"], []).append(s)
    mine = [s for s in spans if s["trace_id"] == trace_id]
    ids = {s["span_id"] for s in mine}
    roots = [s for s in mine if s["parent_id"] not in ids]
    t0 = min(s["start_ns"] for s in mine)
    out: list[str] = []

    def walk(s: dict, depth: int) -> None:
        out.append(_line(s, t0, depth))
        for c in sorted(children.get(s["span_id"], []), key=lambda c: c["start_ns"]):
            walk(c, depth + 1)
        steps = sorted(linked.get(s["span_id"], []), key=lambda c: c["start_ns"])
        for i, st in enumerate(steps):
            if i == max_steps and len(steps) > max_steps + 1:
                out.append(f"{'  ' * (depth + 1)}... {len(steps) - max_steps - 1} more linked steps ...")
                continue
            if max_steps <= i < len(steps) - 1:
                continue
            out.append(f"{'  ' * (depth + 1)}(linked step)")
            walk(st, depth + 2)

    for r in sorted(roots, key=lambda s: s["start_ns"]):
        walk(r, 0)
    return "\n".join(out)


def main() -> None:
    spans = [json.loads(line) for line in open(sys.argv[1])]
    print(render(spans, sys.argv[2] if len(sys.argv) > 2 else None))


if __name__ == "__main__":
    main()

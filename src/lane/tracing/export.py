"""A request's trace as a Chrome trace-event file (Perfetto, chrome://tracing) and as
one self-contained HTML page drawing the seed's swimlane picture."""
from __future__ import annotations

import html
import json

from lane.tracing import LANES, PHASES, STEPS


def _t0(spans: list[dict]) -> float:
    timed = [s["start"] for s in spans if not s.get("skipped") and s["step"] >= 10]
    return min(timed) if timed else min((s["start"] for s in spans), default=0.0)


def _rank(s: dict) -> int:
    return int(s.get("attrs", {}).get("rank") or 0)


def chrome_trace(trace: dict) -> dict:
    """Trace-event JSON: one process per instance (behind lane proxy: the proxy, prefill and
    decode; else one), one track (thread) per lane of each rank, times in µs from the request's
    start; args.step and args.request_id on every event; a skipped step is an instant event
    whose args.skipped gives the reason."""
    spans, rid = trace["spans"], trace["request_id"]
    t0 = _t0(spans)
    instances = sorted({s.get("attrs", {}).get("instance", "") for s in spans})
    events: list[dict] = []
    for pid, inst in enumerate(instances, 1):
        events.append({"ph": "M", "pid": pid, "name": "process_name",
                       "args": {"name": f"lane request {rid}" + (f" · {inst}" if inst else "")}})
        for rank in sorted({_rank(s) for s in spans if s.get("attrs", {}).get("instance", "") == inst} | {0}):
            for i, lane in enumerate(LANES):
                tid = rank * len(LANES) + i
                name = lane if rank == 0 else f"{lane} (rank {rank})"
                events.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": name}})
                events.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_sort_index",
                               "args": {"sort_index": tid}})
    for s in spans:
        args = {"step": s["step"], "request_id": rid, "lane": s["lane"], "phase": PHASES[s["phase"]],
                "pid": s.get("pid", 0), **s.get("attrs", {})}
        ev = {"name": f'{s["step"]} {s["name"]}', "cat": PHASES[s["phase"]],
              "pid": instances.index(s.get("attrs", {}).get("instance", "")) + 1,
              "tid": _rank(s) * len(LANES) + LANES.index(s["lane"]), "ts": round((s["start"] - t0) * 1e6, 3),
              "args": args}
        if s.get("skipped"):
            args["skipped"] = s["skipped"]
            ev.update(ph="i", s="t")
        else:
            ev.update(ph="X", dur=round(s["dur"] * 1e6, 3))
        events.append(ev)
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "metadata": {"request_id": rid, "model": trace.get("model"), "clock": "CLOCK_MONOTONIC"}}


def _where(s: dict, ranks: list[int] | None = None) -> str:
    """Where a span ran: its instance's role (behind lane proxy) and its rank(s) ("r0,1"), ""
    for a lone rank 0."""
    attrs = s.get("attrs", {})
    if ranks is None:
        ranks = [_rank(s)] if "rank" in attrs else []
    role = attrs.get("instance", "").split(" ")[0]
    return " ".join(filter(None, (role, "r" + ",".join(map(str, ranks)) if ranks else "")))


def page_spans(spans: list[dict]) -> list[dict]:
    """The spans the page draws: a rank's span that does what rank 0's does (the k-th span of a
    step, in one instance) joins rank 0's box (``ranks``: each rank's duration); the rest stand
    alone. Each says where it ran (``where``: instance role and ranks)."""
    out, first, seen = [], {}, {}
    for s in sorted(spans, key=lambda s: (s["start"], s["step"])):
        key = (s.get("attrs", {}).get("instance", ""), s["step"], bool(s.get("skipped")))
        k = seen[key + (_rank(s),)] = seen.get(key + (_rank(s),), -1) + 1
        s = dict(s, where=_where(s), ranks={_rank(s): s["dur"]})
        head = first.get(key + (k,))
        if head is not None and _rank(s) not in head["ranks"]:
            head["ranks"][_rank(s)] = s["dur"]
            head["dur"] = max(head["dur"], s["dur"])
            head["where"] = _where(head, sorted(head["ranks"]))
            continue
        first.setdefault(key + (k,), s)
        out.append(s)
    return out


def html_page(trace: dict) -> str:
    """The swimlane page: ten lanes left to right, time downwards, phase bands, numbered
    boxes with durations and where each ran (instance, ranks), arrows where work passes
    between lanes, TTFT at step 40. The ranks of one step (the k-th span of it in an instance)
    share a box; its hover gives each rank's time. The header says which steps ran."""
    from lane.tracing.steps import coverage_line

    spans = page_spans(trace["spans"])
    data = {"request_id": trace["request_id"], "model": trace.get("model"), "spans": spans,
            "lanes": list(LANES), "phases": list(PHASES), "coverage": coverage_line(trace["spans"]),
            "catalogue": {n: [s.lane, s.span, s.what] for n, s in STEPS.items()}}
    payload = json.dumps(data).replace("</", "<\\/")
    return _PAGE.replace("__TITLE__", html.escape(f"lane trace {trace['request_id']}")).replace("__DATA__", payload)


_PAGE = r"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>__TITLE__</title>
<style>
body { font: 12px/1.3 system-ui, sans-serif; margin: 0; color: #222; background: #fff; }
header { padding: 10px 14px; border-bottom: 1px solid #ccc; position: sticky; top: 0; background: #fff; z-index: 5; }
header h1 { font-size: 15px; margin: 0 0 4px 0; }
#lanes { position: sticky; top: 58px; z-index: 4; background: #f6f6f6; height: 24px; border-bottom: 1px solid #bbb; }
.lane-header { position: absolute; top: 4px; font-weight: 600; text-align: center; }
#chart { position: relative; }
.band { position: absolute; left: 0; right: 0; }
.band-label { position: absolute; left: 4px; font-weight: 700; color: #555; writing-mode: vertical-rl; transform: rotate(180deg); }
.lane-line { position: absolute; top: 0; bottom: 0; border-left: 1px dashed #ddd; }
.step { position: absolute; height: 17px; border-radius: 3px; padding: 0 4px; box-sizing: border-box;
        white-space: nowrap; overflow: hidden; text-overflow: ellipsis; border: 1px solid rgba(0,0,0,.25); cursor: default; }
.step b { margin-right: 3px; }
.step .where { font-size: 10px; color: #333; background: rgba(255,255,255,.6); border-radius: 2px; padding: 0 2px; margin-right: 3px; }
.step.skipped { background: #e4e4e4 !important; color: #888; border-style: dashed; }
.time { position: absolute; left: 24px; width: 76px; text-align: right; color: #666; font-variant-numeric: tabular-nums; }
.ttft { position: absolute; left: 0; right: 0; border-top: 2px solid #d62728; }
.ttft span { position: absolute; right: 8px; top: -16px; color: #d62728; font-weight: 700; background: #fff; }
svg { position: absolute; left: 0; top: 0; pointer-events: none; }
</style></head>
<body>
<header><h1>__TITLE__</h1><div id="summary"></div></header>
<div id="lanes"></div>
<div id="chart"><svg id="arrows"></svg></div>
<script>
const DATA = __DATA__;
const LANE_W = 150, LEFT = 110, ROW = 21;
const COLORS = ["#9ecae1", "#a1d99b", "#fdd0a2", "#dadaeb", "#fcbba1", "#c7e9c0", "#c6dbef", "#fdae6b", "#d9d9d9", "#bcbddc"];
const laneX = l => LEFT + DATA.lanes.indexOf(l) * LANE_W;
const timed = DATA.spans.filter(s => !s.skipped);
const reqSpans = timed.filter(s => s.step >= 10);  // times count from the request's first step
const t0 = Math.min(...(reqSpans.length ? reqSpans : timed).map(s => s.start));
const firstToken = timed.find(s => s.step === 40) || timed.find(s => s.step === 39);
const ttftEnd = firstToken ? firstToken.start + firstToken.dur : null;
const sendSpan = timed.find(s => s.step === 10) || timed.find(s => s.step === 11);
// bands: start-up, prefill (to the first token), decode loop, background; skipped steps at their phase's end
function band(s) {
  if (s.skipped) return s.phase;
  if (s.step <= 9) return 0;
  if (s.step >= 53) return 3;
  return (ttftEnd !== null && s.start >= ttftEnd - 1e-9 && s.step !== 40) ? 2 : 1;
}
const rows = [[], [], [], []];
for (const s of DATA.spans) rows[band(s)].push(s);
for (const r of rows) r.sort((a, b) => (!!a.skipped - !!b.skipped) || (a.start - b.start) || (a.step - b.step));
const chart = document.getElementById("chart"), lanesDiv = document.getElementById("lanes");
DATA.lanes.forEach((l, i) => {
  const h = document.createElement("div"); h.className = "lane-header"; h.textContent = l;
  h.style.left = laneX(l) + "px"; h.style.width = (LANE_W - 6) + "px"; lanesDiv.appendChild(h);
});
let y = 6; const placed = [];
rows.forEach((list, p) => {
  if (!list.length) return;
  const top = y;
  for (const s of list) {
    const box = document.createElement("div");
    box.className = "step" + (s.skipped ? " skipped" : "");
    box.dataset.step = s.step; box.dataset.lane = s.lane;
    box.style.left = laneX(s.lane) + "px"; box.style.top = y + "px"; box.style.width = (LANE_W - 6) + "px";
    box.style.background = COLORS[DATA.lanes.indexOf(s.lane)];
    const dur = s.skipped ? "skipped: " + s.skipped : (s.dur * 1000 >= 0.01 ? (s.dur * 1000).toFixed(2) + " ms" : "");
    box.dataset.where = s.where;
    box.innerHTML = "<b>" + s.step + "</b>" + (s.where ? "<span class=\"where\">" + s.where + "</span>" : "")
      + s.name + " <i>" + dur + "</i>";
    const perRank = Object.keys(s.ranks || {}).length > 1 ? "\nranks: " + Object.entries(s.ranks).map(([r, d]) =>
      "r" + r + " " + (d * 1000).toFixed(3) + " ms").join(", ") : "";
    const attrs = Object.entries(s.attrs || {}).map(([k, v]) => k + ": " + JSON.stringify(v)).join("\n");
    box.title = s.step + " " + s.name + " (" + s.lane + ") - " + (DATA.catalogue[s.step] || ["", "", ""])[2] + "\n"
      + (s.skipped ? "skipped: " + s.skipped : "start +" + ((s.start - t0) * 1000).toFixed(3) + " ms, "
      + (s.dur * 1000).toFixed(3) + " ms") + (s.where ? "\nran on: " + s.where : "") + perRank
      + (attrs ? "\n" + attrs : "");
    chart.appendChild(box);
    if (!s.skipped) {
      const t = document.createElement("div"); t.className = "time"; t.style.top = y + "px";
      t.textContent = ((s.start - t0) * 1000).toFixed(1) + " ms"; chart.appendChild(t);
      placed.push({s, y});
    }
    if (s === firstToken || (firstToken && s.step === 40)) {
      const m = document.createElement("div"); m.className = "ttft"; m.style.top = (y + ROW - 2) + "px";
      const ttft = sendSpan ? ((s.start + s.dur - sendSpan.start) * 1000).toFixed(1) : "?";
      m.innerHTML = "<span>TTFT " + ttft + " ms (step " + s.step + ")</span>"; chart.appendChild(m);
    }
    y += ROW;
  }
  const b = document.createElement("div"); b.className = "band";
  b.style.top = (top - 3) + "px"; b.style.height = (y - top + 3) + "px";
  b.style.background = ["#fafafa", "#f3f8fd", "#f7fbf3", "#fdf8f3"][p];
  b.style.borderTop = "2px solid #ccc"; b.dataset.phase = DATA.phases[p];
  const lab = document.createElement("div"); lab.className = "band-label"; lab.textContent = DATA.phases[p];
  lab.style.top = "4px"; b.appendChild(lab); chart.insertBefore(b, chart.firstChild);
  y += 8;
});
DATA.lanes.forEach(l => { const d = document.createElement("div"); d.className = "lane-line";
  d.style.left = (laneX(l) - 3) + "px"; chart.appendChild(d); });
chart.style.height = y + "px";
const svg = document.getElementById("arrows");
svg.setAttribute("width", LEFT + DATA.lanes.length * LANE_W); svg.setAttribute("height", y);
svg.innerHTML = '<defs><marker id="a" markerWidth="8" markerHeight="8" refX="7" refY="4" orient="auto">'
  + '<path d="M0,0 L8,4 L0,8 z" fill="#555"/></marker></defs>';
for (let i = 1; i < placed.length; i++) {  // work passing from one lane to another
  const a = placed[i - 1], b = placed[i];
  if (a.s.lane === b.s.lane || b.y - a.y > ROW * 2) continue;
  const x1 = laneX(a.s.lane) + (LANE_W - 6) / 2, x2 = laneX(b.s.lane) + (LANE_W - 6) / 2;
  const line = document.createElementNS("http://www.w3.org/2000/svg", "line");
  line.setAttribute("x1", x1); line.setAttribute("y1", a.y + 17); line.setAttribute("x2", x2); line.setAttribute("y2", b.y);
  line.setAttribute("stroke", "#555"); line.setAttribute("stroke-width", "1"); line.setAttribute("marker-end", "url(#a)");
  line.setAttribute("class", "arrow"); svg.appendChild(line);
}
const decodes = timed.filter(s => s.step === 43).length, chunks = timed.filter(s => s.step === 17).length;
const hit = timed.filter(s => s.step === 16).map(s => (s.attrs || {}).hit_tokens || 0).reduce((a, b) => a + b, 0);
document.getElementById("summary").textContent = DATA.coverage.split("\n")[0] + " · model " + (DATA.model || "?")
  + " · " + timed.length
  + " spans, " + DATA.spans.filter(s => s.skipped).length + " skipped steps · prefill chunks " + chunks
  + " · prefix-cache hit " + hit + " tokens · decode steps " + decodes
  + (ttftEnd !== null && sendSpan ? " · TTFT " + ((ttftEnd - sendSpan.start) * 1000).toFixed(1) + " ms" : "")
  + " · hover a box for its attributes";
document.body.dataset.rendered = "1";
</script></body></html>
"""

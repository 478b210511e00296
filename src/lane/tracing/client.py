"""``lane trace``: send a request (or name one), fetch its trace from a ``lane serve --trace``,
add the client's own steps (10 and 40, on the same monotonic clock when client and
server share a machine), write trace.json and trace.html."""
from __future__ import annotations

import json
import os
import time

import httpx2 as httpx

from lane.bench.request import RequestInput, build_body, chunk_text, endpoint_path
from lane.tracing import Span, span_dict
from lane.tracing.export import chrome_trace, html_page


def carries_token(chunk: dict, endpoint: str) -> bool:
    """Whether an SSE chunk brings generated tokens (step 40 is the first such): its text
    may be empty (a first token that is EOS, text held back), but a chat stream's opening
    role-only chunk, sent before any token, does not count."""
    choices = chunk.get("choices") or []  # none: the usage or timing chunk
    if not choices or endpoint != "chat":
        return bool(choices)
    return bool(chunk_text(chunk, endpoint)) or choices[0].get("finish_reason") is not None


def send_traced_request(base_url: str, model: str, prompt: str, max_tokens: int, chat: bool,
                        headers: dict) -> tuple[str, list[dict]]:
    """Stream one request; returns (its id, the client's spans 10 and 40)."""
    endpoint = "chat" if chat else "completions"
    url = base_url + endpoint_path(endpoint)
    body = build_body(RequestInput(prompt, 0, max_tokens, model, endpoint, extra_body={"temperature": 0}))
    rid, first = None, None
    t_send = time.monotonic()
    with httpx.stream("POST", url, json=body, headers=headers, timeout=600) as r:
        if r.status_code != 200:
            raise RuntimeError(f"the server answered {r.status_code}: {r.read().decode(errors='replace')[:300]}")
        t_sent = time.monotonic()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"the request failed: {chunk['error']}")
            rid = rid or chunk.get("id")
            if first is None and carries_token(chunk, endpoint):
                first = time.monotonic()
    if rid is None:
        raise RuntimeError("the response carried no request id")
    spans = [span_dict(Span(10, t_send, t_sent - t_send, [rid], {"endpoint": url}, os.getpid()))]
    if first is not None:
        spans.append(span_dict(Span(40, first, 0.0, [rid], {"ttft_ms": round((first - t_send) * 1000, 2)},
                                    os.getpid())))
    return rid, spans


def fetch_trace(base_url: str, request_id: str, headers: dict, wait_s: float = 10.0) -> dict:
    """The server's trace; waits briefly for the engine's last spans (sent after the output)."""
    deadline = time.monotonic() + wait_s
    while True:
        r = httpx.get(f"{base_url}/v1/traces/{request_id}", headers=headers, timeout=30)
        if r.status_code == 404 and "traces" not in r.text and "no trace" not in r.text:
            raise RuntimeError(f"{base_url} has no trace route: start it with `lane serve --trace`")
        if r.status_code == 200:
            trace = r.json()
            if any(s["step"] == 52 for s in trace["spans"]) or time.monotonic() > deadline:
                return trace
        elif time.monotonic() > deadline:
            raise RuntimeError(f"no trace for {request_id!r}: {r.text[:300]} (is the server running with --trace?)")
        time.sleep(0.2)


def write_trace(trace: dict, output_dir: str) -> tuple[str, str]:
    os.makedirs(output_dir, exist_ok=True)
    json_path = os.path.join(output_dir, "trace.json")
    html_path = os.path.join(output_dir, "trace.html")
    with open(json_path, "w") as f:
        json.dump(chrome_trace(trace), f)
    with open(html_path, "w") as f:
        f.write(html_page(trace))
    return json_path, html_path


def run(base_url: str, prompt: str | None, request_id: str | None, model: str | None, max_tokens: int,
        chat: bool, output_dir: str, api_key: str | None) -> tuple[str, str, dict]:
    base_url = base_url.rstrip("/").removesuffix("/v1")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    client_spans: list[dict] = []
    if request_id is None:
        if model is None:
            r = httpx.get(base_url + "/v1/models", headers=headers, timeout=30)
            r.raise_for_status()
            model = r.json()["data"][0]["id"]
        request_id, client_spans = send_traced_request(base_url, model, prompt or "", max_tokens, chat, headers)
    trace = fetch_trace(base_url, request_id, headers)
    trace["spans"] = sorted(trace["spans"] + client_spans, key=lambda s: (bool(s.get("skipped")), s["start"]))
    json_path, html_path = write_trace(trace, output_dir)
    return json_path, html_path, trace

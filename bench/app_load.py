"""What a public app.py holds up to, measured over its HTTP API the way the browser talks to it (join the queue,
read the session's event stream): the bytes a streamed generation sends, a flooding session beside a normal one,
over-long prompts beside a normal request, hidden events called by number, and a list of bad inputs.

    python app.py --port 7860 &                                 # the shipped default, default limits
    python -m bench.app_load --url http://127.0.0.1:7860 --out runs/app_load.jsonl

Every figure is a count or a ratio to a normal request measured in the same run (timings here are noisy); one JSON
line per measurement. tests/test_app_limits.py runs the same probes against a tiny model.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import statistics
import threading
import time
import uuid
from pathlib import Path

import httpx

from prism import cli

logger = logging.getLogger(__name__)

PROMPT = "The history of the river"
ADDRESS = "0x"  # an object address in a message: '<... object at 0x7f...>'


class RawClient:
    """One browser session (its own session hash) speaking Gradio's queue protocol."""

    def __init__(self, url: str, config: dict | None = None, timeout: float = 600.0) -> None:
        self.url = url.rstrip("/")
        self.session = uuid.uuid4().hex[:12]
        self.timeout = timeout
        self.config = config or httpx.get(self.url + "/config", timeout=30).json()
        self.index = {d["api_name"]: d["id"] for d in self.config["dependencies"] if d.get("api_name")}

    def fn(self, name: str) -> int:
        return self.index[name]

    def join(self, fn_index: int, data: list) -> tuple[int, dict]:
        """Ask for one event: (HTTP status, the JSON answer: an event id or a refusal's detail)."""
        body = {"data": data, "fn_index": fn_index, "session_hash": self.session, "event_data": None,
                "trigger_id": None}
        r = httpx.post(self.url + "/gradio_api/queue/join", content=json.dumps(body, allow_nan=True),
                       headers={"content-type": "application/json"}, timeout=30)
        try:
            return r.status_code, r.json()
        except json.JSONDecodeError:
            return r.status_code, {"detail": r.text[:300]}

    def call(self, fn_index: int, data: list) -> dict:
        """Join and read the stream to the event's end: {ok, status, output, error, bytes, updates, seconds}."""
        start = time.perf_counter()
        status, answer = self.join(fn_index, data)
        if status != 200:
            return {"ok": False, "status": status, "error": answer.get("detail"), "bytes": 0, "updates": 0,
                    "seconds": time.perf_counter() - start}
        event = answer["event_id"]
        size, updates = 0, 0
        with httpx.stream("GET", f"{self.url}/gradio_api/queue/data?session_hash={self.session}",
                          timeout=self.timeout) as stream:
            for line in stream.iter_lines():
                if not line.startswith("data:"):
                    continue
                message = json.loads(line[5:])
                if message.get("event_id") != event:
                    continue
                size += len(line.encode()) + 2
                if message.get("msg") == "process_generating":
                    updates += 1
                if message.get("msg") == "process_completed":
                    out = message.get("output") or {}
                    return {"ok": bool(message.get("success")), "status": status, "output": out.get("data"),
                            "error": out.get("error"), "bytes": size, "updates": updates,
                            "seconds": time.perf_counter() - start}
        return {"ok": False, "status": status, "error": "the stream ended", "bytes": size, "updates": updates,
                "seconds": time.perf_counter() - start}


_SEEDS = itertools.count(1)


def generate_args(prompt: str = PROMPT, tokens: int = 8) -> list:
    """prompt, max new, temperature, top-p, seed, session, stop. Greedy, but a new seed each time: a session
    reuses its last original text when the settings repeat, and that would measure nothing."""
    return [prompt, tokens, 0, 1, next(_SEEDS), None, None]


def stream_bytes(url: str, tokens: int, preset: str | None = None) -> dict:
    """The bytes one generation of `tokens` tokens sends over the event stream (with a preset: both columns)."""
    client = RawClient(url)
    if preset:
        client.call(client.fn("preset"), [preset, None])
    out = client.call(client.fn("generate"), generate_args(tokens=tokens))
    return {"probe": "stream_bytes", "tokens": tokens, "preset": preset, "bytes": out["bytes"],
            "updates": out["updates"], "bytes_per_update": round(out["bytes"] / max(out["updates"], 1)),
            "ok": out["ok"]}


def normal_seconds(url: str, tokens: int, repeats: int = 3) -> float:
    """Median seconds of a normal generation with the server otherwise idle."""
    client = RawClient(url)
    return statistics.median(client.call(client.fn("generate"), generate_args(tokens=tokens))["seconds"]
                             for _ in range(repeats))


def flood(url: str, tokens: int, n_requests: int = 70, flood_tokens: int | None = None, repeats: int = 3) -> dict:
    """One session sends n_requests generate joins (of flood_tokens tokens, default `tokens`) at once; while they
    arrive another session generates `tokens` tokens `repeats` times. Returns how many of the flood the server took,
    what it said to the rest, and the normal request's median time as a ratio to the same request on an idle
    server."""
    alone = normal_seconds(url, tokens, repeats)
    flooder = RawClient(url)
    fn = flooder.fn("generate")
    answers: list[tuple[int, dict]] = []
    lock = threading.Lock()

    def send() -> None:
        answer = flooder.join(fn, generate_args(tokens=flood_tokens or tokens))
        with lock:
            answers.append(answer)

    threads = [threading.Thread(target=send) for _ in range(n_requests)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    normal = RawClient(url, flooder.config)
    during = [normal.call(normal.fn("generate"), generate_args(tokens=tokens)) for _ in range(repeats)]
    for t in threads:
        t.join()
    span = time.perf_counter() - start
    accepted = sum(status == 200 for status, _ in answers)
    refused = [a.get("detail", "") for status, a in answers if status != 200]
    return {"probe": "flood", "requests": n_requests, "accepted": accepted, "refused": len(refused),
            "refusal": refused[0] if refused else None, "normal_ok": all(d["ok"] for d in during),
            "normal_ratio": round(statistics.median(d["seconds"] for d in during) / alone, 2),
            "alone_s": round(alone, 3), "flood_span_s": round(span, 3)}


def long_prompts(url: str, tokens: int, prompt_chars: int = 50_000) -> dict:
    """Two sessions send prompts of prompt_chars characters while a third generates normally."""
    alone = normal_seconds(url, tokens)
    long_prompt = ("the river " * (prompt_chars // 10 + 1))[:prompt_chars]
    results: list[dict] = []

    def send() -> None:
        client = RawClient(url)
        results.append(client.call(client.fn("generate"), generate_args(long_prompt, tokens)))

    threads = [threading.Thread(target=send) for _ in range(2)]
    for t in threads:
        t.start()
    normal = RawClient(url)
    during = normal.call(normal.fn("generate"), generate_args(tokens=tokens))
    for t in threads:
        t.join()
    statuses = [(r["output"] or [None, None, ""])[2] if r["ok"] else r["error"] for r in results]
    return {"probe": "long_prompts", "prompt_chars": prompt_chars, "answers": statuses,
            "long_ratio": round(max(r["seconds"] for r in results) / alone, 2), "normal_ok": during["ok"],
            "normal_ratio": round(during["seconds"] / alone, 2)}


def hidden_events(url: str, n_requests: int = 10) -> dict:
    """The token click's decompose has no api_name; called by number it works like /decompose, and a session that
    sends n_requests of it at once gets at most max_pending_model of them queued (it is a model event)."""
    client = RawClient(url)
    deps = client.config["dependencies"]
    named = next(d for d in deps if d.get("api_name") == "decompose")
    hidden = [d["id"] for d in deps if d.get("api_visibility") != "public" and d.get("inputs") == named["inputs"]
              and d.get("outputs") == named["outputs"]]
    client.call(client.fn("generate"), generate_args(tokens=4))
    first = client.call(hidden[0], ["original", 1, None])
    statuses: list[int] = []

    def send() -> None:
        statuses.append(client.join(hidden[0], ["original", 1, None])[0])

    threads = [threading.Thread(target=send) for _ in range(n_requests)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"probe": "hidden_events", "hidden_decompose_events": len(hidden), "called_by_number_ok": first["ok"],
            "sent_at_once": n_requests, "accepted": statuses.count(200), "refused": statuses.count(429)}


BAD_GENERATE = {
    "NaN temperature": ["x", 4, math.nan, 1, 0],
    "infinite temperature": ["x", 4, math.inf, 1, 0],
    "NaN max new tokens": ["x", math.nan, 0, 1, 0],
    "negative max new tokens": ["x", -3, 0, 1, 0],
    "huge max new tokens": ["x", 10**9, 0, 1, 0],
    "seed overflow": ["x", 4, 0, 1, 2**70],
    "NaN seed": ["x", 4, 0, 1, math.nan],
    "NaN top-p": ["x", 4, 0.7, math.nan, 0],
    "lone surrogate": ["a \ud800 b", 4, 0, 1, 0],
    "empty prompt": ["", 4, 0, 1, 0],
    "None prompt": [None, 4, 0, 1, 0],
    "number as prompt": [12345, 4, 0, 1, 0],
    "missing inputs": ["x"],
}


def _message(out: dict) -> str:
    """What the user reads: the error, or the status line (a '⚠️' text) among the outputs, or 'ok'."""
    if not out["ok"]:
        return str(out["error"] or "(an error without a message)")
    for value in out["output"] or []:
        if isinstance(value, str) and value.startswith(("⚠️", "Generated", "added", "removed")):
            return value[:300]
    return "ok"


def bad_inputs(url: str) -> dict:
    """Each bad input: the answer (a status line or an error) must be short, readable and name no object
    address; the server must answer a normal request afterwards."""
    client = RawClient(url)
    answers = {}
    for name, data in BAD_GENERATE.items():
        out = client.call(client.fn("generate"), data if name == "missing inputs" else data + [None, None])
        answers[name] = _message(out)
    others = {
        "decompose index None": (client.fn("decompose"), ["original", None, None]),
        "decompose index NaN": (client.fn("decompose"), ["original", math.nan, None]),
        "scale factor 1e308": (client.fn("scale"), [1, 1e308, None]),
        "scale factor NaN": (client.fn("scale"), [1, math.nan, None]),
        "prototype id huge": (client.fn("prototype"), [10**30]),
        "remove NaN": (client.fn("remove_intervention"), [math.nan, None]),
        "controller server path": (client.fn("controller"), ["/etc/passwd.safetensors", None, True, None, None]),
        "controller long name": (client.fn("controller"), ["a" * 5000 + ".safetensors", None, True, None, None]),
        "search surrogate": (client.fn("search"), ["\ud800", "label", "all", "relevance"]),
    }
    for name, (fn, data) in others.items():
        answers[name] = _message(client.call(fn, data))
    after = client.call(client.fn("generate"), generate_args(tokens=2))
    raw = [n for n, a in answers.items() if ADDRESS in a or "Traceback" in a or "object at" in a]
    return {"probe": "bad_inputs", "tried": len(answers), "raw_answers": raw, "answers": answers,
            "server_answers_after": after["ok"]}


def main(argv: list[str] | None = None) -> None:
    parser = cli.parser("python -m bench.app_load", __doc__)
    parser.add_argument("--url", required=True, help="a running app.py")
    parser.add_argument("--tokens", type=int, default=8, help="new tokens of the normal request")
    parser.add_argument("--stream-tokens", type=int, default=256, help="tokens of the streamed-bytes probe")
    parser.add_argument("--preset", default=None, help="also measure the bytes with this preset applied")
    parser.add_argument("--out", default=None, help="append the JSON lines here as well")
    args = cli.parse(parser, argv)
    rows = [stream_bytes(args.url, args.stream_tokens)]
    if args.preset:
        rows.append(stream_bytes(args.url, args.stream_tokens, args.preset))
    rows += [flood(args.url, args.tokens), long_prompts(args.url, args.tokens), hidden_events(args.url),
             bad_inputs(args.url)]
    for row in rows:
        line = json.dumps(row, ensure_ascii=False)
        print(line)  # noqa: T201 - the benchmark's output
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            with open(args.out, "a") as f:
                f.write(line + "\n")


if __name__ == "__main__":
    main()

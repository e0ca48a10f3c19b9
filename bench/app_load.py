"""What a public app.py holds up to, measured over its HTTP API the way the browser talks to it (join the queue,
read the session's event stream): the bytes a streamed generation sends, a flooding session beside a normal one,
over-long prompts beside a normal request, hidden events called by number, and a list of bad inputs. With --audit,
the public-app audit's floods as well: Gradio's direct routes flooded from one session, a stream of fresh session
hashes aimed at pushing a working user's session out of the store, and one visitor's stream of the dearest
generations; each beside a well-behaved session whose wait is reported as a ratio to its quiet time.

    python app.py --port 7860 &                                 # the shipped default, default limits
    python -m bench.app_load --url http://127.0.0.1:7860 --out runs/app_load.jsonl
    python app.py --host 0.0.0.0 --port 7860 2> runs/app.log &  # as `docker run` binds it
    python -m bench.app_load --url http://127.0.0.1:7860 --audit --only audit --server-log runs/app.log --pid PID
    SPACE_ID=me/prism SYSTEM=spaces python app.py --port 7860 2> runs/app.log &   # a simulated Space
    python -m bench.app_load --url http://127.0.0.1:7860 --audit --only audit --space --server-log runs/app.log

Every figure is a count or a ratio to a normal request measured in the same run (timings here are noisy); one JSON
line per measurement. tests/test_app_limits.py runs the same probes against a tiny model.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import re
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
NO_MESSAGE = "(an error without a message)"
MAX_ANSWER_CHARS = 300  # a status line is at most 200 characters; an error Gradio wraps a little longer


class RawClient:
    """One browser session (its own session hash) speaking Gradio's queue protocol."""

    def __init__(self, url: str, config: dict | None = None, timeout: float = 600.0,
                 headers: dict | None = None) -> None:
        self.url = url.rstrip("/")
        self.session = uuid.uuid4().hex[:12]
        self.timeout = timeout
        self.headers = headers or {}  # e.g. the X-Forwarded-For a Space's proxy would append
        self.config = config or httpx.get(self.url + "/config", timeout=30, headers=self.headers).json()
        self.index = {d["api_name"]: d["id"] for d in self.config["dependencies"] if d.get("api_name")}

    def fn(self, name: str) -> int:
        return self.index[name]

    def open(self, patience_s: float = 180.0) -> RawClient:
        """Make this session known to the server with a cheap event, waiting while the server refuses new pages
        from this address (a probe before may have used the address's allowance). Returns self."""
        end = time.perf_counter() + patience_s
        while True:
            out = self.call(self.fn("interventions"), [None])
            if out["ok"] or "new pages" not in str(out["error"]) or time.perf_counter() > end:
                return self
            time.sleep(3.0)

    def join(self, fn_index: int, data: list) -> tuple[int, dict]:
        """Ask for one event: (HTTP status, the JSON answer: an event id or a refusal's detail)."""
        body = {"data": data, "fn_index": fn_index, "session_hash": self.session, "event_data": None,
                "trigger_id": None}
        r = httpx.post(self.url + "/gradio_api/queue/join", content=json.dumps(body, allow_nan=True),
                       headers={"content-type": "application/json", **self.headers}, timeout=30)
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
                          timeout=self.timeout, headers=self.headers) as stream:
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


def normal_seconds(url: str, tokens: int, repeats: int = 3, headers: dict | None = None) -> float:
    """Median seconds of a normal generation with the server otherwise idle."""
    client = RawClient(url, headers=headers)
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
        return str(out["error"] or NO_MESSAGE)
    for value in out["output"] or []:
        if isinstance(value, str) and value.startswith(("⚠️", "Generated", "added", "removed")):
            return value[:300]
    for value in out["output"] or []:  # a panel (HTML) that shows the refusal inside it
        if isinstance(value, str) and "⚠️" in value:
            return re.sub(r"<[^>]+>", "", value[value.index("⚠️"):])[:300]
    return "ok"


def bad_inputs(url: str) -> dict:
    """Each bad input: the answer (a status line or an error) must be short, readable and name no object
    address; the server must answer a normal request afterwards."""
    client = RawClient(url).open()
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
        # the audit's unexpected exceptions: token indices on /attribute and /link, ids in /map's table
        "attribute index infinite": (client.fn("attribute"), ["original", math.inf, None]),
        "attribute index missing": (client.fn("attribute"), ["original", None, None]),
        "link token index infinite": (client.fn("link"), [PROMPT, 4, 0, 1, 0, "original", {"index": math.inf},
                                                           None]),
        "link token not a dict": (client.fn("link"), [PROMPT, 4, 0, 1, 0, "original", [[1, 2]], None]),
        "map ids not integers": (client.fn("map"), ["", {"headers": ["id"], "data": [["x"], [1e300], [None]]},
                                                     None, None]),
        "map table missing": (client.fn("map"), ["", None, "card", None]),
    }
    for name, (fn, data) in others.items():
        answers[name] = _message(client.call(fn, data))
    status, unknown = client.join(100_000, [])
    answers["unknown event number"] = f"HTTP {status}: {unknown.get('detail')}"
    after = client.call(client.fn("generate"), generate_args(tokens=2))
    raw = [n for n, a in answers.items() if ADDRESS in a or "Traceback" in a or "object at" in a]
    return {"probe": "bad_inputs", "tried": len(answers), "raw_answers": raw, "answers": answers,
            "unexpected": [n for n, a in answers.items() if "Something went wrong" in a],
            "empty": [n for n, a in answers.items() if not a.strip() or a == NO_MESSAGE],
            "long": [n for n, a in answers.items() if len(a) > MAX_ANSWER_CHARS],
            "server_answers_after": after["ok"]}


# ----------------------------------------------------------------------------------------------------------------
# The public-app audit's floods (issue 40), each beside a well-behaved session.

VICTIM = "198.51.100.2"  # documentation addresses (RFC 5737): what a Space's proxy appends for each client
FLOODER = "203.0.113.7"
SUPPRESSED = 1  # the well-behaved user's intervention: the state a flood must not push out of the store


def forwarded(space: bool, address: str, forged: str | None = None) -> dict:
    """The X-Forwarded-For a Space's proxy would pass on: what the client wrote (forged), then its real address.
    Off a Space (space False) nothing: the app believes the connection's peer."""
    if not space:
        return {}
    return {"x-forwarded-for": f"{forged}, {address}" if forged else address}


class Bystander:
    """A well-behaved user: one intervention, then a normal generation now and then while a flood runs; its wait
    is measured against the same generation on the quiet server, and its session's state is checked after."""

    def __init__(self, url: str, tokens: int, space: bool) -> None:
        self.client = RawClient(url, headers=forwarded(space, VICTIM)).open()
        self.tokens = tokens
        added = self.client.call(self.client.fn("suppress"), [SUPPRESSED, None])
        if not added["ok"]:
            raise RuntimeError(f"the bystander's intervention was refused: {added['error']}")
        self.state = self.interventions()
        self.alone = statistics.median(self.generate()["seconds"] for _ in range(3))
        self.during: list[dict] = []

    def generate(self) -> dict:
        return self.client.call(self.client.fn("generate"), generate_args(tokens=self.tokens))

    def interventions(self):
        return self.client.call(self.client.fn("interventions"), [None])["output"]

    def run_until(self, done: threading.Event, at_least: int = 3, pause_s: float = 1.0) -> None:
        while len(self.during) < at_least or not done.is_set():
            self.during.append(self.generate())
            done.wait(pause_s)

    def report(self) -> dict:
        seconds = [d["seconds"] for d in self.during]
        return {"normal_ok": all(d["ok"] for d in self.during), "normal_n": len(seconds),
                "normal_ratio": round(statistics.median(seconds) / self.alone, 2),
                "normal_ratio_max": round(max(seconds) / self.alone, 2), "alone_s": round(self.alone, 3),
                "evicted": self.interventions() != self.state}


def _beside(bystander: Bystander, flood_fn, pause_s: float = 1.0, pid: int | None = None) -> dict:
    """Run flood_fn while the bystander generates in a thread of its own, pause_s apart: the flood's span, and the
    CPU seconds this benchmark (the flood and the bystander, on the same machine) and the server (with its pid)
    used meanwhile: a bystander's wait on one machine includes the flooder's own work."""
    done = threading.Event()
    watcher = threading.Thread(target=bystander.run_until, args=(done, 3, pause_s))
    start, cpu, server = time.perf_counter(), time.process_time(), cpu_seconds(pid)
    watcher.start()
    try:
        flood_fn()
    finally:
        done.set()
        watcher.join()
    server_after = cpu_seconds(pid)
    return {"flood_span_s": round(time.perf_counter() - start, 1), "bench_cpu_s": round(time.process_time() - cpu, 1),
            "server_cpu_s": None if server is None else round(server_after - server, 1)}


def cpu_seconds(pid: int | None) -> float | None:
    """User + system CPU seconds of a process (Linux /proc), or None."""
    if pid is None:
        return None
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _count(statuses: list[tuple[int, str]]) -> dict:
    by_status: dict[str, int] = {}
    for status, _ in statuses:
        by_status[str(status)] = by_status.get(str(status), 0) + 1
    refusals = sorted({detail[:120] for status, detail in statuses if status != 200})
    return {"by_status": by_status, "refusals": refusals[:5]}


def direct_routes(url: str, tokens: int, n_requests: int = 100, space: bool = False, pid: int | None = None) -> dict:
    """Gradio's direct routes, /gradio_api/run/<api> and /gradio_api/api/<api>, run an event outside the queue
    wherever Gradio leaves them open: one session sends n_requests generations at once to each (the audit: 100 of
    100 accepted, a bystander waiting 77x over a flood of 200)."""
    bystander = Bystander(url, tokens, space)
    session = uuid.uuid4().hex[:12]
    answers: list[tuple[int, str]] = []
    lock = threading.Lock()

    def send(route: str) -> None:
        body = {"data": [PROMPT, tokens, 0, 1, next(_SEEDS)], "session_hash": session}
        try:
            r = httpx.post(f"{url.rstrip('/')}/gradio_api/{route}/generate", json=body, timeout=900,
                           headers=forwarded(space, FLOODER))
            answer = (r.status_code, str(_detail(r)))
        except httpx.HTTPError as err:
            answer = (0, type(err).__name__)
        with lock:
            answers.append(answer)

    def flood_them() -> None:
        threads = [threading.Thread(target=send, args=(route,)) for route in ("run", "api")
                   for _ in range(n_requests)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    spent = _beside(bystander, flood_them, pid=pid)
    return {"probe": "direct_routes", "space": space, "sent": 2 * n_requests,
            "ran": sum(status == 200 for status, _ in answers), **_count(answers), **spent, **bystander.report()}


def fresh_sessions(url: str, tokens: int, n_requests: int = 1200, seconds: float = 70.0, space: bool = False,
                   workers: int = 16, spread: bool = False, pid: int | None = None) -> dict:
    """A client invents a new session hash for every request, n_requests of them paced over `seconds` (the
    audit: ~1,200 in 70 s pushed a working user's interventions out of the 1,000-session store and filled the
    queue). Each asks for an intervention, which gives its session state. On a simulated Space each also forges
    the left of X-Forwarded-For; with spread (a Space only) each comes from an address of its own, as from many
    machines, so only the store's own rule can protect the bystander. Reports what the server said and whether
    the bystander lost its session."""
    if spread and not space:
        raise ValueError("spread needs space: off a Space the app sees the connection's own address")
    bystander = Bystander(url, tokens, space)
    config = bystander.client.config
    answers: list[tuple[int, str]] = []
    lock = threading.Lock()

    def send(n: int) -> None:
        address = f"203.0.{n // 250}.{n % 250 + 1}" if spread else FLOODER
        client = RawClient(url, config, headers=forwarded(space, address, forged=f"10.{n // 250}.{n % 250}.1"))
        try:
            status, answer = client.join(client.fn("suppress"), [2, None])
            answer = (status, str(answer.get("detail") or ""))
        except httpx.HTTPError as err:
            answer = (0, type(err).__name__)
        with lock:
            answers.append(answer)

    def flood_them() -> None:
        from concurrent.futures import ThreadPoolExecutor

        start = time.perf_counter()
        with ThreadPoolExecutor(workers) as pool:
            for n in range(n_requests):
                time.sleep(max(0.0, start + n * seconds / n_requests - time.perf_counter()))
                pool.submit(send, n)

    # the bystander reads its page between generations (a third of the flood each time): a store that drops the
    # least recently used session would drop it while it is quiet
    spent = _beside(bystander, flood_them, pause_s=seconds / 3, pid=pid)
    return {"probe": "fresh_sessions", "space": space, "spread": spread, "sent": n_requests,
            "accepted": sum(status == 200 for status, _ in answers), **_count(answers), **spent,
            **bystander.report()}


def dear_generations(url: str, tokens: int, seconds: float = 90.0, prompt_tokens: int = 480, new_tokens: int = 256,
                     space: bool = False, pid: int | None = None) -> dict:
    """One visitor asks for the dearest generation the limits allow (a prompt of about prompt_tokens tokens,
    new_tokens new, with an intervention: two columns) again and again for `seconds`, retrying two seconds after
    each refusal (the audit: each one costs 28x a normal request, and the limits counted it as one event)."""
    bystander = Bystander(url, tokens, space)
    heavy = RawClient(url, headers=forwarded(space, FLOODER)).open()
    heavy.call(heavy.fn("suppress"), [2, None])
    prompt = ("the river " * (prompt_tokens // 2))[:prompt_tokens * 5]
    ran: list[float] = []
    refused: list[str] = []

    def flood_them() -> None:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            out = heavy.call(heavy.fn("generate"), [prompt, new_tokens, 0, 1, next(_SEEDS), None, None])
            message = _message(out)
            if out["ok"] and not message.startswith("⚠️"):
                ran.append(out["seconds"])
            else:
                refused.append(message[:120])
                time.sleep(2.0)

    spent = _beside(bystander, flood_them, pid=pid)
    return {"probe": "dear_generations", "space": space, "ran": len(ran), "refused": len(refused),
            "refusals": sorted(set(refused))[:3],
            "dear_cost_ratio": round(statistics.median(ran) / bystander.alone, 1) if ran else None,
            **spent, **bystander.report()}


def _detail(r: httpx.Response):
    try:
        return r.json().get("detail", "")
    except (json.JSONDecodeError, AttributeError):
        return r.text[:120]


def rss_mb(pid: int | None) -> float | None:
    """The server's resident memory (Linux), or None."""
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        return None
    return None


def _lines(path: str | None) -> int | None:
    if path is None:
        return None
    with open(path, "rb") as f:
        return sum(1 for _ in f)


def audit(url: str, tokens: int, space: bool, server_log: str | None = None, pid: int | None = None) -> list[dict]:
    """The audit's floods in turn, then the bad inputs; last a summary row: the worst bystander ratio, evictions,
    unexpected/empty/raw answers, and the server's log lines per refused request (with --server-log)."""
    log_before, rss_before = _lines(server_log), rss_mb(pid)
    floods = [direct_routes(url, tokens, space=space, pid=pid), fresh_sessions(url, tokens, space=space, pid=pid)]
    if space:
        floods.append(fresh_sessions(url, tokens, space=space, spread=True, pid=pid))
    floods.append(dear_generations(url, tokens, space=space, pid=pid))
    bad = bad_inputs(url)
    refused = sum(n for row in floods if "by_status" in row for status, n in row["by_status"].items()
                  if status != "200") + floods[-1]["refused"] + sum(a != "ok" for a in bad["answers"].values())
    log_after = _lines(server_log)
    rows = [*floods, bad]
    rows.append({"probe": "audit_summary", "space": space,
                 "worst_normal_ratio": max(r["normal_ratio"] for r in floods),
                 "worst_single_wait_ratio": max(r["normal_ratio_max"] for r in floods),
                 "evictions": sum(r["evicted"] for r in floods), "bystander_ok": all(r["normal_ok"] for r in floods),
                 "unexpected": bad["unexpected"], "empty": bad["empty"], "raw": bad["raw_answers"],
                 "long": bad["long"], "refused_requests": refused,
                 "log_lines": None if log_before is None else log_after - log_before,
                 "rss_mb_before": rss_before, "rss_mb_after": rss_mb(pid)})
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = cli.parser("python -m bench.app_load", __doc__)
    parser.add_argument("--url", required=True, help="a running app.py")
    parser.add_argument("--tokens", type=int, default=8, help="new tokens of the normal request")
    parser.add_argument("--stream-tokens", type=int, default=256, help="tokens of the streamed-bytes probe")
    parser.add_argument("--preset", default=None, help="also measure the bytes with this preset applied")
    parser.add_argument("--out", default=None, help="append the JSON lines here as well")
    parser.add_argument("--audit", action="store_true",
                        help="also run the public-app audit's floods (direct routes, fresh sessions, dear "
                             "generations; several minutes)")
    parser.add_argument("--only", choices=["all", "audit"], default="all", help="'audit': only the audit's probes")
    parser.add_argument("--space", action="store_true",
                        help="the server is a simulated Space (SPACE_ID set): send the X-Forwarded-For its proxy "
                             "would append, a forged entry to its left")
    parser.add_argument("--server-log", default=None, help="the server's log file: count its lines per refusal")
    parser.add_argument("--pid", type=int, default=None, help="the server's process id: report its memory")
    args = cli.parse(parser, argv)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request would bury the results
    if args.only == "audit" and not args.audit:
        parser.error("--only audit needs --audit")
    rows = []
    if args.only == "all":
        rows.append(stream_bytes(args.url, args.stream_tokens))
        if args.preset:
            rows.append(stream_bytes(args.url, args.stream_tokens, args.preset))
        rows += [flood(args.url, args.tokens), long_prompts(args.url, args.tokens), hidden_events(args.url),
                 bad_inputs(args.url)]
    if args.audit:
        rows += audit(args.url, args.tokens, args.space, args.server_log, args.pid)
    for row in rows:
        line = json.dumps(row, ensure_ascii=False)
        print(line)  # noqa: T201 - the benchmark's output
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            with open(args.out, "a") as f:
                f.write(line + "\n")


if __name__ == "__main__":
    main()

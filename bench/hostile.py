"""`pie serve` under hostile and careless clients (issue 41's Done-when), on loopback only.

    python -m bench.hostile [--slow 2000] [--soak 300] [--concurrency 6] [--max-tokens 16]

Starts `pie serve` in a subprocess (bench.serve.Server) and runs three phases, each bounded in
count and time and stopping by itself, with a thread asking `/health` every 50 ms throughout:

- **big prompt**: a 5 MB chat message; the time to its answer (a 4xx) and /health's worst latency
  while it was refused;
- **slow connections**: --slow connections that each send one header byte a second; when the
  server closed each (within the header timeout, `pie serve --timeout-headers`), the server's open
  file descriptors at the peak, and /health's latency meanwhile;
- **soak**: --soak mixed requests at --concurrency (chat and completions, streamed and not, greedy
  on the dev prompts; bad bodies; clients that leave mid-stream) against a server of as many
  instance slots and no queue, each 429 retried as the openai client does: requests lost (an
  error on a valid request, a stream without [DONE]), mixed up (a greedy text unlike the same request's
  first answer) and the server's RSS after warm-up and at the end.

Writes results/hostile.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

from .common import RESULTS, load_prompts, machine, table, write
from .serve import Server


class HealthProbe:
    """Asks /health every `every` seconds on a thread of its own; each sample is (t, latency or None)."""

    def __init__(self, url: str, every: float = 0.05, timeout: float = 10.0):
        import httpx

        self.http = httpx.Client(base_url=url, timeout=timeout)
        self.every, self.samples = every, []
        self.t0 = time.perf_counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import httpx

        while not self._stop.is_set():
            t = time.perf_counter()
            try:
                ok = self.http.get("/health").status_code == 200
            except httpx.HTTPError:
                ok = False
            self.samples.append((t - self.t0, time.perf_counter() - t if ok else None))
            self._stop.wait(max(0.0, self.every - (time.perf_counter() - t)))

    def window(self, start: float, end: float) -> dict:
        xs = [lat for t, lat in self.samples if start <= t <= end]
        good = [x for x in xs if x is not None]
        return {"samples": len(xs), "failed": len(xs) - len(good), "max_ms": 1e3 * max(good, default=float("nan")),
                "p50_ms": 1e3 * sorted(good)[len(good) // 2] if good else float("nan")}

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.http.close()


def _proc(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _fds(pid: int) -> int:
    return len(list(Path(f"/proc/{pid}/fd").iterdir()))


def big_prompt(server: Server, probe: HealthProbe, megabytes: float) -> dict:
    import httpx

    text = "word " * int(megabytes * (1 << 20) / 5)
    body = {"model": server.model, "messages": [{"role": "user", "content": text}], "max_tokens": 4}
    start = probe.now()
    t = time.perf_counter()
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)
    took = time.perf_counter() - t
    time.sleep(0.2)  # a probe sample after it too
    return {"bytes": len(text), "status": r.status_code, "code": r.json().get("error", {}).get("code"),
            "seconds": took, "health": probe.window(start, probe.now())}


def slow_connections(server: Server, probe: HealthProbe, count: int, limit_s: float) -> dict:
    """`count` connections that send a header byte a second; each one's close time since it opened."""
    request = f"GET /health HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\nX-Slow: ".encode() + b"a" * 10_000
    socks, opened, closed = [], [], {}
    start = probe.now()
    for _ in range(count):
        s = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        s.setblocking(False)
        socks.append(s)
        opened.append(time.perf_counter())
    peak_fds = _fds(server.proc.pid)
    deadline = time.perf_counter() + limit_s
    sent = 0
    while len(closed) < count and time.perf_counter() < deadline:
        for i, s in enumerate(socks):
            if i in closed:
                continue
            try:
                if s.recv(4096) == b"":
                    closed[i] = time.perf_counter() - opened[i]
                    continue
                closed[i] = time.perf_counter() - opened[i]  # an answer (408/431/503): the server ended it
            except BlockingIOError:
                try:
                    s.send(request[sent:sent + 1])
                except BlockingIOError:
                    pass
                except OSError:
                    closed[i] = time.perf_counter() - opened[i]
            except OSError:
                closed[i] = time.perf_counter() - opened[i]
        sent += 1
        peak_fds = max(peak_fds, _fds(server.proc.pid))
        time.sleep(1.0)
    for s in socks:
        s.close()
    times = sorted(closed.values())
    return {"connections": count, "closed": len(times), "still_open_at_limit": count - len(times),
            "close_p50_s": times[len(times) // 2] if times else None, "close_max_s": times[-1] if times else None,
            "server_fds_peak": peak_fds, "health": probe.window(start, probe.now())}


def soak(server: Server, probe: HealthProbe, requests: int, concurrency: int, max_tokens: int, seed: int) -> dict:
    import httpx

    prompts = [p["prompt"] for p in load_prompts(8)]
    rng = random.Random(seed)
    kinds = ["chat", "chat_stream", "completion", "completion_stream", "bad", "leave"]
    plan = [(i, rng.choice(kinds), rng.randrange(len(prompts))) for i in range(requests)]
    first: dict[tuple[str, int], str] = {}
    lock = threading.Lock()
    out = {"lost": 0, "mixed_up": 0, "retried_429": 0, "by_kind": {k: 0 for k in kinds}, "errors": []}

    def body(kind: str, p: int) -> tuple[str, dict]:
        if kind.startswith("completion"):
            return "/v1/completions", {"model": server.model, "prompt": prompts[p], "max_tokens": max_tokens,
                                       "temperature": 0, "stream": kind.endswith("stream")}
        return "/v1/chat/completions", {"model": server.model, "messages": [{"role": "user", "content": prompts[p]}],
                                        "max_tokens": max_tokens, "temperature": 0,
                                        "stream": kind.endswith("stream") or kind == "leave"}

    def attempt(http, kind: str, p: int) -> tuple[int, bool, str | None, str]:
        """(status, ok, greedy text or None, why not ok)."""
        if kind == "bad":
            r = http.post("/v1/chat/completions", content=b'{"model": 1, "messages": ')
            return r.status_code, 400 <= r.status_code < 500, None, str(r.status_code)
        path, b = body(kind, p)
        if kind == "leave":  # reads one chunk and goes
            with http.stream("POST", path, json=b) as r:
                next(r.iter_lines(), None)
            return r.status_code, r.status_code == 200, None, str(r.status_code)
        if not b["stream"]:
            r = http.post(path, json=b)
            if r.status_code != 200:
                return r.status_code, False, None, f"{r.status_code} {r.text[:160]}"
            c = r.json()["choices"][0]
            return 200, True, c["text"] if "text" in c else c["message"]["content"], ""
        parts, done = [], False
        with http.stream("POST", path, json=b) as r:
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    choice = json.loads(line[6:])["choices"]
                    if choice:
                        c = choice[0]
                        parts.append(c.get("text") or (c.get("delta") or {}).get("content") or "")
        ok = r.status_code == 200 and done
        return r.status_code, ok, "".join(parts), f"{r.status_code}, [DONE] {'seen' if done else 'missing'}"

    def one(item) -> None:
        _, kind, p = item
        with httpx.Client(base_url=server.url, timeout=300) as http:
            for _ in range(50):  # a 429 is retried after its Retry-After, as the openai client does
                status, ok, text, why = attempt(http, kind, p)
                if status != 429:
                    break
                with lock:
                    out["retried_429"] += 1
                time.sleep(0.5)
        with lock:
            out["by_kind"][kind] += 1
            if not ok:
                out["lost"] += 1
                out["errors"].append(f"{kind} prompt {p}: {why}")
            elif text is not None:
                key = ("completion" if kind.startswith("completion") else "chat", p)
                if first.setdefault(key, text) != text:
                    out["mixed_up"] += 1

    warm = max(1, requests // 6)
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, plan[:warm]))
        rss_warm = _proc(server.proc.pid, "VmRSS")
        start = probe.now()
        rss = []  # (requests done, RSS MB) after each 50
        for at in range(warm, requests, 50):
            list(pool.map(one, plan[at:at + 50]))
            rss.append((min(at + 50, requests), _proc(server.proc.pid, "VmRSS") / 1024))
    time.sleep(1.0)
    out.update(requests=requests, concurrency=concurrency, max_tokens=max_tokens, warm_up=warm,
               rss_after_warm_up_mb=rss_warm / 1024, rss_end_mb=_proc(server.proc.pid, "VmRSS") / 1024,
               rss_peak_mb=_proc(server.proc.pid, "VmHWM") / 1024, rss_by_requests=rss,
               health=probe.window(start, probe.now()))
    out["errors"] = out["errors"][:20]
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--big-mb", type=float, default=5.0)
    ap.add_argument("--slow", type=int, default=2000)
    ap.add_argument("--slow-limit-s", type=float, default=40.0, help="how long the slow phase waits at most")
    ap.add_argument("--soak", type=int, default=300)
    ap.add_argument("--concurrency", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=None)
    args = ap.parse_args(argv)
    server = Server(SimpleNamespace(dtype="auto", model=args.model, inferlet="text-completion"),
                    max_instances=args.concurrency)
    probe = HealthProbe(server.url)
    try:
        report = {"machine": machine(), "args": vars(args), "prompts": "the first 8 dev prompts (data/)",
                  "big_prompt": big_prompt(server, probe, args.big_mb),
                  "slow_connections": slow_connections(server, probe, args.slow, args.slow_limit_s),
                  "soak": soak(server, probe, args.soak, args.concurrency, args.max_tokens, args.seed)}
    finally:
        probe.stop()
        server.stop()
    b, s, k = report["big_prompt"], report["slow_connections"], report["soak"]
    md = table(["phase", "figure", "value"], [
        ["big prompt", f"{b['bytes'] / 1e6:.1f} MB chat message: status (code)", f"{b['status']} ({b['code']})"],
        ["big prompt", "seconds to its answer", b["seconds"]],
        ["big prompt", "/health worst latency meanwhile, ms", b["health"]["max_ms"]],
        ["slow connections", "closed by the server / opened", f"{s['closed']} / {s['connections']}"],
        ["slow connections", "close time p50 / max, s", f"{s['close_p50_s']:.1f} / {s['close_max_s']:.1f}"],
        ["slow connections", "server fds at the peak", s["server_fds_peak"]],
        ["slow connections", "/health worst latency, ms (failed probes)",
         f"{s['health']['max_ms']:.1f} ({s['health']['failed']})"],
        ["soak", f"{k['requests']} requests at concurrency {k['concurrency']}: lost / mixed up",
         f"{k['lost']} / {k['mixed_up']}"],
        ["soak", "429s retried (a slot still held by a client that left)", k["retried_429"]],
        ["soak", "server RSS after warm-up / end / peak, MB",
         f"{k['rss_after_warm_up_mb']:.0f} / {k['rss_end_mb']:.0f} / {k['rss_peak_mb']:.0f}"],
        ["soak", "/health worst latency, ms (failed probes)", f"{k['health']['max_ms']:.1f} ({k['health']['failed']})"],
    ])
    write("hostile", report, "# pie serve under hostile clients (`python -m bench.hostile`)\n\n" + md + "\n")
    chart(probe.samples)
    print(md)
    return report


def chart(samples) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3))
    ax.plot([t for t, lat in samples if lat is not None], [1e3 * lat for t, lat in samples if lat is not None], lw=0.6)
    ax.scatter([t for t, lat in samples if lat is None], [0 for _, lat in samples if lat is None], c="red", s=6,
               label="failed probe")
    ax.set_xlabel("seconds since the server was up")
    ax.set_ylabel("/health latency, ms")
    ax.set_yscale("log")
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(RESULTS / "hostile.png", dpi=120)


if __name__ == "__main__":
    main()

"""Every model a running server lists answers one request: `python -m loadtests.smoke [--url URL]`.

Prints how long /v1/models took, then one line per model (status, seconds) and exits 1 if any model did not
answer 200. Loopback only, each request bounded.
"""

import argparse
import sys
import time

import httpx

from loadtests.generator import LOOPBACK


def request_for(http: httpx.Client, card: dict) -> httpx.Response:
    """One request of the kind the model serves: classify for classifiers, embeddings for an encoder's base or
    variants without labels, a short completion for the rest."""
    if card["labels"]:
        return http.post("/v1/classify", json={"model": card["id"], "input": "WINNER! claim your prize now"})
    if card.get("encoder"):
        return http.post("/v1/embeddings", json={"model": card["id"], "input": "hello"})
    return http.post("/v1/completions", json={"model": card["id"], "prompt": "Hello", "max_tokens": 8})


def smoke(url: str, timeout_s: float = 300.0) -> tuple[float, list[tuple[str, int, float]]]:
    """-> (seconds /v1/models took, (model, status, seconds) for every model it lists)."""
    with httpx.Client(base_url=url, timeout=timeout_s) as http:
        t = time.perf_counter()
        cards = http.get("/v1/models").json()["data"]
        listed_s = time.perf_counter() - t
        encoder_bases = _encoders(http, cards)
        rows = []
        for card in cards:
            card = {**card, "encoder": (card["parent"] or card["id"]) in encoder_bases}
            t = time.perf_counter()
            rows.append((card["id"], request_for(http, card).status_code, time.perf_counter() - t))
    return listed_s, rows


def _encoders(http: httpx.Client, cards: list[dict]) -> set[str]:
    """Bases that are encoders, as the server itself tells: an embeddings request to them succeeds."""
    bases = [c["id"] for c in cards if c["kind"] == "base"]
    return {b for b in bases if http.post("/v1/embeddings", json={"model": b, "input": "x"}).status_code == 200}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtests.smoke", description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    args = p.parse_args(argv)
    host = httpx.URL(args.url).host
    if host not in LOOPBACK:
        p.error(f"--url must be on loopback ({', '.join(LOOPBACK)}), got {host}")
    listed_s, rows = smoke(args.url)
    print(f"/v1/models: {len(rows)} models in {listed_s * 1000:.0f} ms")
    for model, status, seconds in rows:
        print(f"  {model:32s} {status}  {seconds:6.2f} s")
    failed = [m for m, status, _ in rows if status != 200]
    print(f"{len(rows) - len(failed)} of {len(rows)} models answered 200" + (f"; failed: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

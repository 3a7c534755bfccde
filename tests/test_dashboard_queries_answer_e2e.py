# SPDX-License-Identifier: Apache-2.0
"""Every query of aiokv's Grafana dashboard answers on a real Prometheus scraping a served engine.

The bug: docs/grafana-aiokv.json held 12 panels and nothing checked that their queries answer:
a renamed series, a label that is not there or a PromQL slip shows the operator an empty panel,
and no test fails.
The invariant: a real Prometheus (Debian's `prometheus`, started here on a free port with its own
configuration and storage) scrapes `vllm serve` with aiokv while it serves two tenants' prompts
twice (vLLM's own prefix cache off, so the second time they are aiokv's hits, loaded from disk);
then every query of every panel answers with data, and the template variable's query with the
served model; the figures the panels show are the engine's own (blocks stored, bytes per tenant
for both tenants, a hit rate between 0 and 1, finite load and save latencies); the tokens equal a
run without aiokv. With AIOKV_DASHBOARD_PNG set, the dashboard is drawn there
(tools/dashboard.py: docs/img/dashboard.png).
The fix: docs/grafana-aiokv.json (20 panels), tools/dashboard.py (the queries as Grafana sends
them), tests/prometheus.py.
"""

from __future__ import annotations

import json
import math
import os
import time
import urllib.request

import pytest

from aiokv.data import format as fmt
from tests.e2e import happened, prompts, run
from tests.prometheus import SCRAPE_S, Prometheus
from tools import dashboard
from tools.servers import Server

pytestmark = pytest.mark.vllm

BLOCK = 32
PER = (200 - 1) // BLOCK  # full blocks a 200-token prompt stores and hits (its last token is computed)
COST = fmt.slot_bytes(2 * 2 * 2 * 64 * BLOCK * 4)  # the tiny model's block: K and V, 2 layers, 2 heads of 64, fp32
PS = prompts(4, 200, seed=411)
SALTS = ["alice", "alice", "bob", "bob"]
FLAGS = [
    "--enforce-eager",
    "--dtype",
    "float32",
    "--block-size",
    str(BLOCK),
    "--max-model-len",
    "1024",
    "--kv-cache-memory-bytes",
    str(64 << 20),
    "--no-enable-prefix-caching",  # the second pass is aiokv's: loads, and their latencies
    "--seed",
    "0",
    "--enable-prompt-tokens-details",
]


def _complete(srv: Server, prompt: list[int], salt: str) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    body.update(return_token_ids=True, cache_salt=salt)
    req = urllib.request.Request(
        srv.url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.load(r)


def _until(cond, what: str, timeout: float = 120) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.5)


def test_every_panel_of_the_dashboard_answers_on_a_real_prometheus(tiny_model, tmp_path):
    base = run(
        dict(model=tiny_model, block_size=BLOCK, prefix_caching=False, phases=[dict(prompts=PS, salts=SALTS)] * 2)
    )
    srv = Server(
        tiny_model,
        FLAGS,
        str(tmp_path / "serve.log"),
        {
            "kv_connector": "AioKVConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"path": str(tmp_path / "cache"), "capacity": "1GiB", "staging": "32MiB"},
        },
    )
    prom = None
    try:
        srv.wait_ready()
        prom = Prometheus(str(tmp_path / "prom"), [f"127.0.0.1:{srv.port}"]).start()
        _until(lambda: prom.scraped("vllm:aiokv_capacity_bytes") >= 2, "Prometheus's first scrapes")
        first = [_complete(srv, p, s) for p, s in zip(PS, SALTS)]
        # saves commit in the background: the second pass finds every block once they are in
        _until(lambda: srv.metrics().get("vllm:aiokv_blocks", 0) >= len(PS) * PER, "the first pass's saves")
        second = [_complete(srv, p, s) for p, s in zip(PS, SALTS)]
        _until(lambda: srv.metrics().get("vllm:aiokv_hit_tokens_total", 0) >= len(PS) * PER * BLOCK, "the hits' stats")
        m = srv.metrics("vllm:aiokv_")
        # Prometheus has scraped the final figures (a scrape after the last one moved)
        _until(
            lambda: (
                [float(r["value"][1]) for r in prom.query("sum(vllm:aiokv_hit_tokens_total)")]
                == [m["vllm:aiokv_hit_tokens_total"]]
            ),
            "Prometheus to scrape the final figures",
        )
        time.sleep(3 * SCRAPE_S)  # a few samples of the settled figures, for rate() and increase()
        at = time.time()
        answers = {}
        dash = dashboard.load()
        for panel, target in dashboard.targets(dash):
            expr = dashboard.expand(target["expr"], rate_interval="2m")
            answers[(panel["title"], target["refId"])] = got = prom.query(expr, at=at)
            assert got, f"panel {panel['title']!r} query {target['refId']} answered nothing: {expr}"
        assert "tiny" in prom.api("label/model_name/values", **{"match[]": "vllm:aiokv_queried_tokens_total"})
        if os.environ.get("AIOKV_DASHBOARD_PNG"):
            dashboard.render(prom, dash, os.environ["AIOKV_DASHBOARD_PNG"], end=at, minutes=4)
    finally:
        if prom is not None:
            prom.stop()
        rc = srv.stop()
    assert rc == 0, srv.text()[-4000:]

    def value(title: str, ref: str = "A") -> float:
        return float(answers[(title, ref)][0]["value"][1])

    assert value("Blocks stored") == len(PS) * PER == m["vllm:aiokv_blocks"]
    tenants = {r["metric"]["tenant"]: float(r["value"][1]) for r in answers[("Bytes per tenant", "A")]}
    assert tenants == {"alice": 2 * PER * COST, "bob": 2 * PER * COST}, tenants
    assert 0 < value("Hit rate (tokens, 1h)") <= 1
    assert value("Index loading (namespaces)") == 0 and value("Breakers open") == 0
    for title in ("Load latency (per rank)", "Save latency (per rank)"):
        assert all(math.isfinite(float(r["value"][1])) for ref in "ABC" for r in answers[(title, ref)]), title
    res = {
        "tokens": [[r["choices"][0]["token_ids"] for r in first], [r["choices"][0]["token_ids"] for r in second]],
        "finish": [["length"] * len(PS)] * 2,
        "metrics": {k.removesuffix("_total"): v for k, v in m.items()},
    }
    happened(res, base, hit_tokens=len(PS) * PER * BLOCK, loaded_blocks=len(PS) * PER, saved_blocks=len(PS) * PER)
    assert [(r["usage"]["prompt_tokens_details"] or {}).get("cached_tokens", 0) for r in second] == [PER * BLOCK] * 4

"""A bounded soak of `agentrt serve` (`agentrt bench soak`): concurrent streaming clients with
growing multi-turn conversations and mid-stream disconnects, for 20 s (`AGENTRT_SOAK_SECONDS`
sets a longer run). Every request is answered, none with a 5xx or an error inside its stream, the
server logs no traceback and keeps serving, and its memory beyond the state cache's RAM tier
stays bounded. The report's figures are printed."""

from __future__ import annotations

import json
import os

import pytest

from agentrt.bench.soak import SoakConfig, soak

SECONDS = float(os.environ.get("AGENTRT_SOAK_SECONDS", "20"))
MAX_GROWTH_MIB = 128  # anonymous memory beyond the RAM tier's growth (measured: ~13 in 60 s)


def _print(config, report: dict) -> None:
    plugins = config.pluginmanager
    reporter, capture = plugins.get_plugin("terminalreporter"), plugins.get_plugin("capturemanager")
    if reporter is None or capture is None:
        return
    figures = {k: report[k] for k in ("requests", "ttft_s", "rss", "wall_s")}
    figures["state_cache"] = {k: report["state_cache"][k] for k in ("saved", "dropped")}
    with capture.global_and_fixture_disabled():
        reporter.write_line("")
        reporter.write_line(f"soak ({SECONDS:.0f} s): {json.dumps(figures)}")


@pytest.mark.slow
def test_soak_answers_everything_without_errors_or_growth(request):
    config = SoakConfig(clients=4, seconds=SECONDS, max_tokens=16, disconnect=0.2, turns=6)
    report = soak(config)
    _print(request.config, report)
    requests = report["requests"]
    assert requests["5xx"] == 0 and requests["stream_errors"] == 0, report["failures"]
    assert requests["unanswered"] == 0, report["failures"]
    assert requests["served"] >= 2 * config.clients and requests["disconnected"] > 0
    assert requests["cached_token_share"] > 0.3  # the conversations' shared prefixes are reused
    assert report["server_alive"] and report["server_tracebacks"] == 0
    assert report["state_cache"]["saved"] > 0
    if report["rss"].get("available", True):
        assert report["rss"]["anon_growth_beyond_ram_tier_mib"] < MAX_GROWTH_MIB, report["rss"]

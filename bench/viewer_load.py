"""How fast `harness view` opens a run: a 10k-call training run against a 1k-call one, in one run, and against the
issue's budget (a page in < 1 s for a run of 10k calls).

Each run is a training run as the trainer records it: steps of 2-call episodes (`<run>-train000NN`), judged,
merged into samples, with per-step metrics. Calls are agent turns: a ~1k-token prompt, a ~100-token completion.
Measured:
- API: the requests the run page makes (curves, the first page of episodes with its facets) and the episode
  page's, each median of --repeat, on the closed file;
- the page in headless Chromium (Playwright), when it can run: navigation to the run page until the episodes
  table and the reward curve are drawn, and to an episode until its tokens are drawn.

    python bench/viewer_load.py [--calls 10000] [--small 1000] [--repeat 5] [--no-docs]

Writes its section of docs/BENCHMARKS.md (between the viewer_load markers) unless --no-docs.
"""

from __future__ import annotations

import argparse
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from datetime import date
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.docs_section import write_section  # noqa: E402
from harness.core.merge import merge_episode  # noqa: E402
from harness.core.records import ENGINE, OK, Call, Choice, EpisodeOutcome, Judgement  # noqa: E402
from harness.store.database import Store  # noqa: E402
from harness.viewer.app import Viewer, create_app  # noqa: E402
from tests.support import BackgroundApp  # noqa: E402

EPISODES_PER_STEP = 250
BUDGET_S = 1.0


def build_run(path: Path, n_calls: int, seed: int = 0) -> tuple[str, str]:
    """A recorded training run of n_calls calls; returns (run id, one episode id)."""
    rng = random.Random(seed)
    run_id = uuid.uuid4().hex[:16]
    words = " ".join(rng.choices(["alpha", "beta", "gamma", "delta", "tool", "result", "answer"], k=800))
    with Store.open(path) as store:
        store.start_run(run_id, {"bench": True}, "bench")
        n_episodes = n_calls // 2
        for first in range(0, n_episodes, EPISODES_PER_STEP):
            step = first // EPISODES_PER_STEP + 1
            step_run = f"{run_id}-train{step:05d}"
            calls, outcomes, judgements, merged = [], [], [], []
            for e in range(first, min(first + EPISODES_PER_STEP, n_episodes)):
                episode_id = f"{step_run}-t{e % 50:03d}-{e // 50 % 5}"
                prompt = [rng.randrange(150_000) for _ in range(1000)]
                episode_calls = []
                for k in range(2):
                    completion = [rng.randrange(150_000) for _ in range(100)]
                    episode_calls.append(_call(run_id, episode_id, k, prompt, completion, words, rng))
                    prompt = prompt + completion + [rng.randrange(150_000) for _ in range(20)]
                reward = rng.random()
                calls += episode_calls
                outcomes.append(EpisodeOutcome(episode_id, step_run, f"t{e % 50:03d}", e // 50 % 5, 1, "finished",
                                               0, "42", None, time.time(), rng.uniform(500, 5000), None))
                judgements.append(Judgement(episode_id, "bench", "h", reward, {"n": 1}, None, time.time()))
                merged.append((episode_id, merge_episode(episode_calls), reward))
            store.add_calls(calls)
            for o in outcomes:
                store.add_outcome(o)
            store.add_judgements(judgements)
            store.add_merged_episodes(run_id, merged)
            store.add_metrics(run_id, step, {"reward/mean": rng.random(), "actor/kl": rng.random() / 10,
                                             "actor/entropy": rng.uniform(1, 3), "response/length_mean": 100})
    return run_id, merged[0][0]


def _call(run_id, episode_id, index, prompt, completion, words, rng) -> Call:
    request = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": words}]}
    response = {"choices": [{"index": 0, "message": {"role": "assistant", "content": words[:400]}}]}
    return Call(call_id=uuid.uuid4().hex, run_id=run_id, episode_id=episode_id, call_index=index, endpoint="chat",
                stream=False, requested_model="gpt-4o-mini", served_model="policy", role_key="r", system_hash=None,
                tools_hash=None, request=orjson.dumps(request), response=orjson.dumps(response), prompt_ids=prompt,
                choices=[Choice(0, completion, [-rng.random() for _ in completion], "stop", words[:400], None,
                                None)],
                token_source=ENGINE, status=OK, http_status=200, error=None, started_at=time.time(),
                latency_ms=rng.uniform(50, 900), ttft_ms=None, weight_version=0, prompt_tokens=len(prompt),
                completion_tokens=len(completion), extra={})


def median_s(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def measure(db: Path, run_id: str, episode_id: str, repeat: int) -> dict:
    viewer = Viewer(db)
    out = {
        "api_run_page_s": median_s(lambda: (viewer.answer("curves", run_id),
                                            viewer.answer("episodes", run_id, {"limit": "100"})), repeat),
        "api_episode_s": median_s(lambda: viewer.answer("episode", episode_id), repeat),
        "api_runs_s": median_s(lambda: viewer.answer("runs"), repeat),
    }
    chromium = shutil.which("chromium")
    if chromium is None:
        return out
    from playwright.sync_api import sync_playwright

    from tests.viewer.test_browser_engine import CHROMIUM_ARGS

    app = BackgroundApp(create_app(viewer))
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
            page = browser.new_page()

            def run_page():
                page.goto("about:blank")
                page.goto(f"{app.url}/#/run/{run_id}")
                page.wait_for_selector("table#episodes tr[data-episode-id]")
                page.wait_for_selector('figure[data-series="reward_mean"] svg circle')

            def episode_page():
                page.goto("about:blank")
                page.goto(f"{app.url}/#/episode/{episode_id}")
                page.wait_for_selector('.sample[data-sample-index="0"] span.tok')

            out["page_run_s"] = median_s(run_page, repeat)
            out["page_episode_s"] = median_s(episode_page, repeat)
            browser.close()
    finally:
        app.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=10_000)
    parser.add_argument("--small", type=int, default=1_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--no-docs", action="store_true")
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for n in (args.small, args.calls):
            db = Path(tmp) / f"run{n}.duckdb"
            started = time.perf_counter()
            run_id, episode_id = build_run(db, n)
            print(f"built a {n}-call run in {time.perf_counter() - started:.1f} s", flush=True)
            results[n] = measure(db, run_id, episode_id, args.repeat)
            print(n, {k: round(v, 3) for k, v in results[n].items()}, flush=True)
    small, big = results[args.small], results[args.calls]
    rows = [f"| {name} | {small[key] * 1000:.0f} | {big[key] * 1000:.0f} | {big[key] / small[key]:.2f}x | "
            f"{big[key] / BUDGET_S:.2f} |" for key, name in (
                ("page_run_s", "run page in Chromium (curves + episodes drawn)"),
                ("page_episode_s", "episode page in Chromium (tokens drawn)"),
                ("api_run_page_s", "API: curves + first 100 episodes with facets"),
                ("api_episode_s", "API: one episode (calls, samples, breaks)"),
                ("api_runs_s", "API: runs list")) if key in big]
    text = "\n".join([
        "## viewer_load",
        "",
        f"`python bench/viewer_load.py` ({date.today()}, {platform.machine()}, {platform.python_version()}): "
        f"`harness view` on a recorded training run of {args.calls:,} calls ({args.calls // 2:,} two-call episodes "
        f"in steps of {EPISODES_PER_STEP}, merged, judged, with metrics) against one of {args.small:,} calls, "
        f"on the closed DuckDB file; median of {args.repeat}. Goal (issue 8): the page in < 1 s at 10k calls.",
        "",
        f"| what | {args.small:,} calls, ms | {args.calls:,} calls, ms | 10x the calls costs | share of the 1 s "
        "budget |",
        "|---|---|---|---|---|",
        *rows,
    ])
    print(text)
    if not args.no_docs:
        write_section("viewer_load", text)


if __name__ == "__main__":
    main()

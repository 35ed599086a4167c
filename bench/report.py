"""The report at scale: time to write it for a 100,000-row run, its size, and (optionally) how
fast Chromium opens it and filters it (issue 14; goal: under 5 s and under 30 MB).

    python -m bench.report [--rows 100000] [--repeat 3] [--browser] [--quick]

Each scenario writes a synthetic run dir (config.json, summary.json, traces.jsonl whose rows
have the shape `Episode.to_row` gives, plus `usage` and `finish_reason`), then times
`tt.report` on it, whole (read, figures, page, write) and by phase. Scenarios:

* short: one rollout per task, short prompts and answers (an echo- or math-style eval):
  every text fits, nothing is cut;
* chat: 4 rollouts per task, ~300-character prompts, ~1,500-character completions (a chat
  eval): the texts exceed the page's budget and are cut to fit.

`--browser` also opens each page in headless Chromium (/usr/bin/chromium through selenium)
and times the first table on screen, the "failed" filter, and a text search.
"""

from __future__ import annotations

import argparse
import gc
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson

import trio_tasksets as tt
from trio_tasksets._report import page
from trio_tasksets._report.data import load_run
from trio_tasksets._report.figures import compute

from .common import env_info, goal_line, markdown_table

_WORDS = (
    "the a of to and in is it that for on with as was at by an be this from or have not are "
    "which one all their there been has more when will would who so no if out up what about "
    "into than them can only other new some could these two may then do first any my now "
    "such like our over man me even most made after also did many before must through back "
    "years where much your way well down should because each just those people how too "
    "little state good very make world still own see men work long get here between both "
    "life being under never day same another know while last might us great old year off "
    "come since against go came right used take three window slot task rollout reward trio"
)
WORDS = _WORDS.split()


def words(rng: random.Random, chars: int) -> str:
    out: list[str] = []
    size = 0
    while size < chars:
        word = rng.choice(WORDS)
        out.append(word)
        size += len(word) + 1
    return " ".join(out)


def rows(n: int, rollouts: int, prompt: int, completion: int, seed: int = 0) -> Iterator[bytes]:
    rng = random.Random(seed)
    t = 1_800_000_000.0
    for i in range(n // rollouts):
        question = words(rng, prompt)
        answer = rng.choice(WORDS)
        data = {"prompt": question, "answer": answer, "info": {"index": i}, "system_prompt": None}
        for r in range(rollouts):
            failed = rng.random() < 0.08
            text = words(rng, completion) + " " + answer
            duration = rng.lognormvariate(0.0, 0.6)
            t += 0.01
            row: dict[str, Any] = {
                "id": f"{rng.getrandbits(128):032x}",
                "task": {"key": f"task-{i}", "data": data},
                "rollout": r,
                "ok": not failed,
                "reward": 0.0 if failed else float(rng.random() < 0.6),
                "completion": None if failed else text,
                "messages": [] if failed else [
                    {"role": "user", "content": question},
                    {"role": "assistant", "content": text},
                ],
                "errors": [{"type": rng.choice(["ModelTimeoutError", "ModelHTTPError"]),
                            "message": "the model did not answer in 60 s", "attempt": 1}]
                if failed else [],
                "attempts": 1,
                "timing": {"started": t, "finished": t + duration, "duration": duration},
                "usage": {"prompt_tokens": prompt // 4, "completion_tokens": completion // 4},
                "finish_reason": "stop",
            }  # fmt: skip
            yield orjson.dumps(row, option=orjson.OPT_APPEND_NEWLINE)


def make_run(root: Path, name: str, n: int, rollouts: int, prompt: int, completion: int) -> Path:
    run_dir = root / name
    run_dir.mkdir()
    with (run_dir / "traces.jsonl").open("wb") as out:
        for line in rows(n, rollouts, prompt, completion):
            out.write(line)
    run = load_run(run_dir)
    fig = compute(run)
    summary = {
        "planned": len(run), "finished": len(run), "ok": fig.ok, "failed": fig.failed,
        "kept_from_resume": 0, "reward_mean": fig.reward_mean, "reward_std": fig.reward_std,
        "duration_s": 1000.0, "rollouts_per_s": len(run) / 1000.0, "interrupted": False,
        "model": "bench", "rollouts_per_example": rollouts,
    }  # fmt: skip
    (run_dir / "summary.json").write_bytes(orjson.dumps(summary))
    config = {"identity": {"model": "bench", "taskset": "bench:Synthetic"},
              "eval": {"num_examples": n // rollouts, "rollouts_per_example": rollouts}}  # fmt: skip
    (run_dir / "config.json").write_bytes(orjson.dumps(config))
    return run_dir


def phases(run_dir: Path) -> dict[str, float]:
    """CPU seconds of each phase of one report: read (parse and take apart the rows), figures,
    page (the figures again, the JSON, the HTML), write. GC paused, as `tt.report` does."""
    clock = time.process_time
    gc.disable()
    try:
        began = clock()
        run = load_run(run_dir)
        read = clock()
        compute(run)
        figures = clock()
        html = page([run])
        built = clock()
        (run_dir / "phases.html").write_text(html)
        written = clock()
    finally:
        gc.enable()
    return {
        "read": read - began,
        "figures": figures - read,
        "page": built - figures,
        "write": written - built,
    }


def browser_times(path: Path) -> dict[str, float]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    with tempfile.TemporaryDirectory() as profile:
        options = webdriver.ChromeOptions()
        options.binary_location = shutil.which("chromium") or "/usr/bin/chromium"
        for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                     "--no-first-run", "--disable-background-networking",
                     "--disable-component-update", "--disable-sync",
                     f"--user-data-dir={profile}"):  # fmt: skip
            options.add_argument(flag)
        service = Service(shutil.which("chromedriver") or "/usr/bin/chromedriver")
        driver = webdriver.Chrome(options=options, service=service)
        try:
            driver.set_page_load_timeout(120)
            began = time.perf_counter()
            driver.get(path.resolve().as_uri())
            count = driver.find_element(By.ID, "count")
            WebDriverWait(driver, 120).until(lambda d: count.get_attribute("data-matched"))
            opened = time.perf_counter()
            Select(driver.find_element(By.ID, "f-status")).select_by_value("failed")
            filtered = time.perf_counter()
            Select(driver.find_element(By.ID, "f-status")).select_by_value("all")
            every = count.get_attribute("data-matched")
            before = time.perf_counter()
            driver.execute_script(
                "const box = document.getElementById('f-text'); box.value = 'window slot';"
                "box.dispatchEvent(new Event('input'));"
            )
            WebDriverWait(driver, 120, poll_frequency=0.005).until(
                lambda d: count.get_attribute("data-matched") != every
            )
            searched = time.perf_counter() - 0.15  # the search box waits 150 ms for typing
            return {
                "open": opened - began,
                "filter": filtered - opened,
                "search": searched - before,
            }
        finally:
            driver.quit()


SCENARIOS = {
    "short": {"rollouts": 1, "prompt": 40, "completion": 12},
    "chat": {"rollouts": 4, "prompt": 300, "completion": 1500},
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--browser", action="store_true", help="also time the page in Chromium")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 5,000 rows, 1 repeat")
    args = parser.parse_args(argv)
    if args.quick:
        args.rows, args.repeat = 5_000, 1
    print("# bench.report: the report of a large run")
    for key, value in env_info():
        print(f"  {key}: {value}")
    table = []
    goals = []
    with tempfile.TemporaryDirectory(prefix="tt-bench-report-") as tmp:
        for name, shape in SCENARIOS.items():
            run_dir = make_run(Path(tmp), name, args.rows, **shape)
            traces_mb = (run_dir / "traces.jsonl").stat().st_size / 1e6
            seconds, cpu = [], []
            for _ in range(args.repeat):
                began, began_cpu = time.perf_counter(), time.process_time()
                out = tt.report(run_dir)
                seconds.append(time.perf_counter() - began)
                cpu.append(time.process_time() - began_cpu)
            split = phases(run_dir)
            size_mb = out.stat().st_size / 1e6
            run = load_run(run_dir)
            page([run])
            cut = f"{len(run.cut):,} cut to {run.cap:,} chars" if run.cut else "none cut"
            row = [name, f"{len(run):,}", f"{traces_mb:.1f} MB", f"{statistics.median(seconds):.2f} s",
                   f"{statistics.median(cpu):.2f} s",
                   " / ".join(f"{v:.2f}" for v in split.values()), f"{size_mb:.1f} MB", cut]  # fmt: skip
            if args.browser:
                times = browser_times(out)
                row.append(" / ".join(f"{v:.2f}" for v in times.values()))
            table.append(row)
            goals.append(goal_line(statistics.median(seconds) < 5, f"{name}: under 5 s",
                                   f"{statistics.median(seconds):.2f} s"))  # fmt: skip
            goals.append(goal_line(size_mb < 30, f"{name}: under 30 MB", f"{size_mb:.1f} MB"))
    headers = ["scenario", "rows", "traces.jsonl", "report: wall", "CPU",
               "CPU: read / figures / page / write (s)", "page size", "texts"]  # fmt: skip
    if args.browser:
        headers.append("Chromium: open / filter / search (s)")
    print()
    print(markdown_table(headers, table))
    print()
    print("\n".join(goals))
    return 0


if __name__ == "__main__":
    sys.exit(main())

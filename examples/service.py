"""A long-running service over a feed: the pattern `trio-tasksets eval` is the bounded case of.

It holds `env.serving()` for its life, reads the taskset's channel through the windowed core
(`tt.as_completed`, so results are published as they complete and a slow publisher
back-pressures the feed), runs each task with `env.run_slot`, and prints each episode as one
JSON line on stdout.

Shutdown: on SIGINT or SIGTERM it stops pulling at once, lets the episodes in flight finish
within `--grace` seconds (then cancels them), and exits 0. A second signal cancels at once.

    python examples/service.py                 # echo-stream, forever
    python examples/service.py --max-episodes 5 -c 4
"""

from __future__ import annotations

import argparse
import json
import signal
import sys

import trio

import trio_tasksets as tt
from trio_tasksets import EchoStreamConfig, EchoStreamTaskset


async def serve(window: int, max_episodes: int | None, grace: float, gap: float) -> None:
    env = tt.Env(EchoStreamTaskset(EchoStreamConfig(gap=gap)))
    ctx = tt.ModelContext(tt.EchoClient(), "echo")
    published = 0

    async def run(task: tt.Task) -> tt.Episode:
        return await env.run_slot(tt.RunSlot(task), ctx)

    with trio.CancelScope() as everything:
        async with env.serving(), env.taskset.channel() as tasks, trio.open_nursery() as nursery:
            feed = tt.until(tasks)  # the tasks until feed.stop(): then no pull, runs go on

            def shut_down() -> None:
                feed.stop()
                everything.deadline = min(everything.deadline, trio.current_time() + grace)

            async def on_signals() -> None:
                with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                    async for signum in signals:
                        if feed.stopped:
                            everything.cancel()  # a second signal: stop now
                        print(f"service: {signal.Signals(signum).name}: stopping", file=sys.stderr)
                        shut_down()

            nursery.start_soon(on_signals)
            async with tt.as_completed(feed, run, window=window) as results:
                async for _, episode in results:
                    print(json.dumps(episode.to_row()), flush=True)
                    published += 1
                    if max_episodes is not None and published >= max_episodes:
                        shut_down()
            nursery.cancel_scope.cancel()
    print(f"service: published {published} episodes", file=sys.stderr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-c", "--max-concurrent", type=int, default=8)
    parser.add_argument("--max-episodes", type=int, default=None)
    parser.add_argument("--grace", type=float, default=10.0, help="seconds for in-flight runs")
    parser.add_argument("--gap", type=float, default=0.5, help="seconds between feed tasks")
    args = parser.parse_args()
    trio.run(serve, args.max_concurrent, args.max_episodes, args.grace, args.gap)


if __name__ == "__main__":
    main()

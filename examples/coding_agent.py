"""A coding agent that needs a box: the model writes code with file tools, the reward runs the
task's tests inside the rollout's sandbox.

Each task asks for a function in ``solution.py``. The env (`CodingAgent`, a `tt.ToolEnv`)
gives the model `write_file`, `read_file`, `list_dir` and `shell`, all running in the
rollout's sandbox (`tt.current_sandbox()`): a box made on the first tool call, destroyed
when the rollout ends. Its reward (`run_tests`) writes the task's tests into that same box
after the rollout (the model never saw them, and any file of that name it wrote is
replaced) and runs them there: 1.0 when they pass. Nothing the model wrote or started
outlives its rollout.

Against any OpenAI-compatible endpoint, with bubblewrap (no network, the host's files
read-only, a private /work):

    trio-tasksets eval examples/coding_agent.py:CodingTasks \\
        --env-class examples/coding_agent.py:CodingAgent --sandbox bwrap \\
        -m MODEL --base-url URL -r 4 --max-sandboxes 1-4-32

Offline, the model played by a `ScriptedClient` that writes a right answer to each task:

    python examples/coding_agent.py [--sandbox local|bwrap|docker:IMAGE]

`tests/test_coding_agent.py` runs both ways.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import trio

import trio_tasksets as tt
from trio_tasksets.testing import ScriptedClient, reply

SOLUTION = "solution.py"
TESTS = "test_solution.py"

PROMPT = (
    "Write {file} defining {signature}: {what} Use the write_file tool to write it; you may "
    "run it with the shell tool (python3 is there). When you are done, reply DONE."
)


class CodingTasks(tt.Taskset[tt.Task, tt.TasksetConfig]):
    """Four small functions to write, each with the tests that check it (in `info`, which
    the model is not shown)."""

    def load(self) -> list[tt.Task]:
        return [
            _task(
                "fizzbuzz",
                "fizzbuzz(n: int) -> list[str]",
                "the strings for 1..n, Fizz for multiples of 3, Buzz of 5, FizzBuzz of both.",
                "assert fizzbuzz(5) == ['1', '2', 'Fizz', '4', 'Buzz']\n"
                "assert fizzbuzz(15)[-1] == 'FizzBuzz'\nassert fizzbuzz(0) == []\n",
            ),
            _task(
                "palindrome",
                "is_palindrome(text: str) -> bool",
                "whether the text reads the same both ways, ignoring case and anything but "
                "letters and digits.",
                "assert is_palindrome('A man, a plan, a canal: Panama')\n"
                "assert not is_palindrome('trio')\nassert is_palindrome('')\n",
            ),
            _task(
                "word_count",
                "word_count(text: str) -> dict[str, int]",
                "how many times each lower-cased word (split on whitespace) occurs.",
                "assert word_count('a b A') == {'a': 2, 'b': 1}\nassert word_count('') == {}\n",
            ),
            _task(
                "fib",
                "fib(n: int) -> int",
                "the n-th Fibonacci number, fib(0) == 0, fib(1) == 1, fast for n up to 1000.",
                "assert [fib(i) for i in range(8)] == [0, 1, 1, 2, 3, 5, 8, 13]\n"
                "assert fib(90) == 2880067194370816120\nfib(1000)\n",
            ),
        ]


def _task(key: str, signature: str, what: str, tests: str) -> tt.Task:
    name = signature.partition("(")[0]
    prompt = PROMPT.format(file=SOLUTION, signature=signature, what=what)
    return tt.Task(prompt, key=key, info={"tests": f"from solution import {name}\n{tests}"})


async def run_tests(task: tt.Task, completion: str) -> dict[str, float]:
    """The reward: the task's tests, run in the rollout's sandbox (where the model wrote its
    code) with ``python3``; 1.0 when they pass. `tests_ran` is 0.0 when they could not run
    at all (the sandbox failed), apart from tests that ran and failed."""
    box = tt.current_sandbox()
    await box.write_file(TESTS, str(task.info["tests"]).encode())
    try:
        result = await box.exec(["python3", TESTS], timeout=30)
    except tt.sandboxes.SandboxError:
        return {"reward": 0.0, "tests_ran": 0.0}
    return {"reward": float(result.returncode == 0), "tests_ran": 1.0}


class CodingAgent(tt.ToolEnv[tt.Task]):
    """The coding tasks' env: file tools and a shell in the rollout's sandbox, the tests as
    the reward. `sandbox` defaults to bubblewrap (`--sandbox` replaces it)."""

    def __init__(self, taskset: tt.Taskset[tt.Task, Any], **kwargs: Any) -> None:
        kwargs.setdefault("sandbox", tt.sandboxes.bwrap())
        kwargs.setdefault("reward", run_tests)
        tools = [
            tt.tools.write_file(),
            tt.tools.read_file(),
            tt.tools.list_dir(),
            tt.tools.shell(timeout=30),
        ]
        super().__init__(taskset, tools, max_turns=8, **kwargs)


# --- offline: a scripted model that writes a right answer -----------------------------------

ANSWERS = {
    "fizzbuzz": "def fizzbuzz(n):\n    return ['FizzBuzz' if i % 15 == 0 else 'Fizz' if i % 3 == 0"
    " else 'Buzz' if i % 5 == 0 else str(i) for i in range(1, n + 1)]\n",
    "palindrome": "def is_palindrome(text):\n    kept = [c.lower() for c in text if c.isalnum()]\n"
    "    return kept == kept[::-1]\n",
    "word_count": "def word_count(text):\n    counts = {}\n    for word in text.lower().split():\n"
    "        counts[word] = counts.get(word, 0) + 1\n    return counts\n",
    "fib": "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n"
    "    return a\n",
}


def scripted_model(answers: dict[str, str] = ANSWERS) -> ScriptedClient:
    """A model that, for each task, writes the answer in `answers` (by the function the
    prompt names), lists the folder and imports it with the shell, then replies DONE."""

    def step(messages: list[dict[str, Any]], tools: Any) -> tt.Completion:
        prompt = str(messages[0]["content"]) if messages else ""
        done = sum(1 for message in messages if message.get("role") == "tool")
        if done == 0:
            key = next(k for k in answers if _names(k) in prompt)
            code = answers[key]
            return reply(tool_calls=[("write_file", {"path": SOLUTION, "content": code})])
        if done == 1:
            # -B: no __pycache__ beside it (list_dir runs at the same time, in any order)
            check = "python3 -B -c 'import solution; print(\"imported\")'"
            return reply(tool_calls=[("list_dir", {"path": "."}), ("shell", {"command": check})])
        return tt.Completion("DONE")

    return ScriptedClient(step)


def _names(key: str) -> str:
    return {"palindrome": "is_palindrome"}.get(key, key) + "("


async def main(sandbox: str, max_sandboxes: str) -> list[tt.Episode]:
    env = CodingAgent(
        CodingTasks(),
        sandbox=tt.sandboxes.parse(sandbox),
        max_sandboxes=tt.parse_window(max_sandboxes, parameter="max_sandboxes"),
    )
    ctx = tt.ModelContext(scripted_model(), "scripted")

    async def tasks() -> Any:
        for task in env.taskset:
            yield tt.RunSlot(task)

    return await tt.run_stream(tasks(), lambda slot: env.run_slot(slot, ctx), window=4)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sandbox", default="bwrap", help="local, bwrap, docker:IMAGE")
    parser.add_argument("--max-sandboxes", default="1-2-8", help="N or MIN-START-MAX")
    args = parser.parse_args()
    for episode in trio.run(main, args.sandbox, args.max_sandboxes):
        print(json.dumps({"task": episode.task.key, "reward": episode.reward, "ok": episode.ok}))

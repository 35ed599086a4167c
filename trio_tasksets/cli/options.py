"""What the commands share: `UsageError`, the model options (`eval`, `worker`), small parsers."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from ..models import EchoClient, ModelClient, ModelContext, OpenAIClient, Sampling, api_key_from_env

__all__ = ["UsageError", "add_model_options", "model_context", "names"]

if TYPE_CHECKING:
    Commands = argparse._SubParsersAction[argparse.ArgumentParser]  # the subcommands of `main`


class UsageError(Exception):
    """A bad command line: printed with the command's usage, exit 2, before any work."""


def names(text: str) -> tuple[str, ...]:
    """The comma-separated names of an option such as `--retry-on A,B`."""
    return tuple(part.strip() for part in text.split(",") if part.strip())


def add_model_options(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """Add the model options (`-m`, `--base-url`, `--api-key-var`, sampling, ...)."""
    model = parser.add_argument_group("the model")
    model.add_argument(
        "-m",
        "--model",
        default="echo",
        help="model name; 'echo' (default) is the built-in offline model",
    )
    model.add_argument(
        "--base-url",
        default=None,
        metavar="URL",
        help="an OpenAI-compatible endpoint, e.g. http://127.0.0.1:8000/v1",
    )
    model.add_argument(
        "--api-key-var",
        default=None,
        metavar="VAR",
        help="the environment variable holding the API key",
    )
    model.add_argument(
        "--timeout", type=float, default=120.0, metavar="S", help="per-request timeout in seconds"
    )
    model.add_argument("--temperature", type=float, default=None)
    model.add_argument("--max-tokens", type=int, default=None)
    model.add_argument("--top-p", type=float, default=None)
    model.add_argument("--sampling-seed", type=int, default=None)
    model.add_argument(
        "--echo-delay",
        type=float,
        default=0.0,
        metavar="S",
        help="latency of the echo model, to watch the window work",
    )
    return model  # fmt: skip


def model_context(args: argparse.Namespace) -> ModelContext:
    """The model the options name; a bad value is a `UsageError` naming its flag."""
    client: ModelClient
    if args.model == "echo" and args.base_url is None:
        if args.echo_delay < 0:
            raise UsageError(f"--echo-delay must be >= 0, got {args.echo_delay}")
        client = EchoClient(delay=args.echo_delay)
    else:
        if args.base_url is None:
            raise UsageError(
                f"-m/--model {args.model!r} needs --base-url (an OpenAI-compatible endpoint "
                f"such as http://127.0.0.1:8000/v1 or https://api.openai.com/v1), or use -m echo"
            )
        if args.timeout <= 0:
            raise UsageError(f"--timeout must be > 0, got {args.timeout}")
        key = None
        if args.api_key_var is not None:
            try:
                key = api_key_from_env(args.api_key_var)
            except ValueError as exc:
                raise UsageError(f"--api-key-var: {exc}") from None
        client = OpenAIClient(args.base_url, key, timeout=args.timeout)
    sampling = Sampling(
        temperature=args.temperature,
        max_tokens=args.max_tokens,
        top_p=args.top_p,
        seed=args.sampling_seed,
    )
    return ModelContext(client, args.model, sampling)

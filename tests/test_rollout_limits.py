"""`tt.RolloutLimits`: the per-rollout limits as one validated object, how an env takes it
(whole, or by its keyword arguments), and how it travels (JSON, tightened by a caller's)."""

from __future__ import annotations

import argparse
import math
from typing import Any

import pytest

import trio_tasksets as tt
from trio_tasksets._cli.env_options import add_env_options, build_env, env_options, env_spec
from trio_tasksets._core.exceptions import MalformedEntry
from trio_tasksets._env.spec import Declaration, EnvSpec

SECONDS = ("rollout_timeout", "working_limit", "stall_timeout", "tool_timeout")
COUNTS = ("max_turns", "token_limit")


class Static(tt.Taskset[tt.Task, tt.TasksetConfig]):
    def load(self) -> list[tt.Task]:
        return [tt.Task("hi", answer="hi")]


def test_nothing_is_bounded_by_default() -> None:
    limits = tt.RolloutLimits()
    assert all(getattr(limits, name) is None for name in (*SECONDS, *COUNTS))
    assert not limits.bounds_attempt
    assert limits.to_json() == {}


@pytest.mark.parametrize("name", SECONDS)
@pytest.mark.parametrize("bad", [0, -1, math.inf, math.nan, True, "5"])
def test_seconds_must_be_finite_and_above_zero(name: str, bad: Any) -> None:
    with pytest.raises(tt.ConfigError, match=f"{name} must be a number of seconds > 0") as raised:
        tt.RolloutLimits(**{name: bad})
    assert raised.value.parameter == name


@pytest.mark.parametrize("name", COUNTS)
@pytest.mark.parametrize("bad", [0, -3, 1.5, True, "2"])
def test_counts_must_be_ints_of_one_or_more(name: str, bad: Any) -> None:
    with pytest.raises(tt.ConfigError, match=f"{name} must be an int >= 1") as raised:
        tt.RolloutLimits(**{name: bad})
    assert raised.value.parameter == name


def test_it_is_frozen_and_int_seconds_are_floats() -> None:
    limits = tt.RolloutLimits(rollout_timeout=3, max_turns=4)
    assert type(limits.rollout_timeout) is float
    with pytest.raises(AttributeError):
        limits.rollout_timeout = 5.0  # type: ignore[misc]
    assert limits.bounds_attempt
    assert not tt.RolloutLimits(max_turns=4, tool_timeout=1).bounds_attempt


def test_within_takes_the_tighter_of_each_and_updated_replaces() -> None:
    own = tt.RolloutLimits(rollout_timeout=10, working_limit=5, max_turns=8)
    asked = tt.RolloutLimits(rollout_timeout=4, working_limit=50, token_limit=100)
    assert own.within(asked) == tt.RolloutLimits(
        rollout_timeout=4, working_limit=5, max_turns=8, token_limit=100
    )
    assert own.within(None) is own
    assert own.updated(asked) == tt.RolloutLimits(
        rollout_timeout=4, working_limit=50, max_turns=8, token_limit=100
    )
    assert own.updated(tt.RolloutLimits()) is own


def test_it_travels_as_json_and_refuses_what_is_not_limits() -> None:
    limits = tt.RolloutLimits(stall_timeout=2.5, token_limit=7)
    assert limits.to_json() == {"stall_timeout": 2.5, "token_limit": 7}
    assert tt.RolloutLimits.from_json(limits.to_json()) == limits
    for bad, parameter in (([], "limits"), ({"rollout_time": 1}, "limits"),
                           ({"max_turns": 0}, "max_turns")):  # fmt: skip
        with pytest.raises(tt.ConfigError) as raised:
            tt.RolloutLimits.from_json(bad)
        assert raised.value.parameter == parameter


def test_an_env_takes_it_whole_or_by_keyword_not_both() -> None:
    limits = tt.RolloutLimits(rollout_timeout=3, working_limit=2)
    assert tt.Env(Static(), rollout_limits=limits).rollout_limits is limits
    assert tt.Env(Static(), rollout_timeout=3, working_limit=2).rollout_limits == limits
    with pytest.raises(tt.ConfigError, match="rollout_limits and stall_timeout") as raised:
        tt.Env(Static(), rollout_limits=limits, stall_timeout=1)
    assert raised.value.parameter == "rollout_limits"
    with pytest.raises(tt.ConfigError, match=r"must be a tt\.RolloutLimits"):
        tt.Env(Static(), rollout_limits={"rollout_timeout": 3})  # type: ignore[arg-type]
    env = tt.Env(Static())
    env.stall_timeout = 4  # a limit set as an attribute sets the object
    assert env.rollout_limits == tt.RolloutLimits(stall_timeout=4)
    with pytest.raises(tt.ConfigError, match="stall_timeout"):
        env.stall_timeout = -1
    assert env.rollout_limits == tt.RolloutLimits(stall_timeout=4)  # unchanged


class Tools(tt.ToolEnv[tt.Task]):
    def __init__(self, taskset: Any, **kwargs: Any) -> None:
        super().__init__(taskset, [], max_turns=3, **kwargs)


def test_the_env_spec_carries_the_object_whole() -> None:
    env = Tools(Static(), rollout_timeout=7.5)
    env.tool_timeout = 2.0
    spec = EnvSpec.of(env)
    assert spec.limits == env.rollout_limits
    assert '"limits": {"rollout_timeout": 7.5, "max_turns": 3, "tool_timeout": 2.0}' in (
        spec.to_json()
    )
    assert EnvSpec.from_json(spec.to_json()) == spec
    # What the spec sets replaces the rebuilt env's own; what it leaves unset keeps it.
    assert spec.build(Static()).rollout_limits == env.rollout_limits
    partial = EnvSpec("x", {}, limits=tt.RolloutLimits(stall_timeout=1.0))
    assert partial.build(Static(), target_env=Tools).rollout_limits == tt.RolloutLimits(
        stall_timeout=1.0, max_turns=3
    )


def test_a_declaration_carries_the_limits_an_eval_set() -> None:
    plain = Declaration.of(tt.Env(Static()))
    assert plain.limits is None
    assert '"limits"' not in plain.to_json()  # an env without limits: entries as before
    limited = Declaration.of(tt.Env(Static(), working_limit=3))
    assert limited.limits == tt.RolloutLimits(working_limit=3)
    assert Declaration.from_json(limited.to_json()) == limited
    assert limited.differs(plain) is None  # never a reason to refuse
    with pytest.raises(MalformedEntry, match="not a declaration"):
        Declaration.from_json('{"taskset": "x", "limits": {"max_turns": -1}}')


def test_the_cli_builds_the_object_from_its_flags_at_its_edge() -> None:
    parser = argparse.ArgumentParser()
    add_env_options(parser)
    args = parser.parse_args(["echo", "--rollout-timeout", "30", "--stall-timeout", "5"])
    args.command = "eval"
    expected = tt.RolloutLimits(rollout_timeout=30, stall_timeout=5)
    given = env_options(args)
    assert given.limits == expected
    assert env_spec(given).limits == expected
    assert build_env(given, endpoint=False).rollout_limits == expected
    plain = parser.parse_args(["echo"])
    plain.command = "eval"
    assert env_spec(env_options(plain)).limits == tt.RolloutLimits()

"""The env side: what one slot of an eval is and how it runs. Rooms: `env` (`Env`, episodes,
retries, per-rollout limits), `traces` (durable rows), `loading` (objects by name),
`groups` (a task's rollouts as one unit), `agents` (`ToolEnv`), `spec` (an env described
by names and JSON, rebuilt in another process), `backend` (where an eval's slots run),
`boxes` (an env's sandboxes: a box per rollout or group, made on first use, admitted by a
window of their own)."""

__all__: list[str] = []  # its rooms are imported by module

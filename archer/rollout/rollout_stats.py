"""What the agentic loop did in one rollout call, and the step metrics it gives.

The loop fills a ``RolloutStats`` per call; a training step that generates several batches (dynamic sampling)
merges them, and ``metrics()`` gives, over every response generated in the step (the tool-call counts also
count the calls of AEPO's probes, ``add_calls``, whose responses are discarded and count nowhere else):

- ``rollout/initial_rollouts``: global samples per prompt (mean; ARPO's ``initial_rollouts``, AEPO's m);
- ``rollout/branches``: branches made (total), ``rollout/refills``: fresh samples added after the initial ones;
- ``rollout/branch_depth_mean``: branch points on a response's path (0 for a global sample), mean;
- ``rollout/branch_entropy_mean``, ``rollout/branch_entropy_delta_mean``: H and dH = H - H_init where a branch
  was made (absent in a step without branches); ``rollout/tool_step_entropy_mean``: H after every tool answer;
- ``rollout/turns_mean``: segments the model wrote per response;
- the tool metrics of archer.tools.tool_metrics (``tools/<name>/{calls, failures, mean_latency_s}``,
  ``tools/calls_per_response``, ``tools/call_limit_reached``) and ``tools/invalid_calls`` (calls that named no
  configured tool or could not be read, answered with an error and counted toward call_limit; and calls left
  unclosed where a segment ended at eos or the budget, never answered, also after a Hermes turn's closed calls;
  and calls to a tool the row's ``tools`` do not allow), of which ``tools/disallowed_calls`` are the last kind.

And where the generation stage's time goes (archer/rollout/agentic.py):

- ``rollout/decode_batch_mean``: sequences decoding at once, mean over the decode steps (tokens sampled /
  steps); ``rollout/decode_occupancy``: that mean over the largest batch of the call (1: the running batch
  stayed as full as it ever was; a round that waits for its slowest sequence, or trajectories waiting for
  tools, lower it);
- ``rollout/tool_wait_s``: seconds a response waited for its tool answers, mean (a branch counts its own
  waits, after its branch point);
- ``rollout/longest_trajectory_share``: the call's critical time (the longest chain of a trajectory's own
  decoding and tool waits, with what it depends on: a branch its parent up to the segment that decided it, a
  refill its prompt's earlier trajectories) over the call's wall time: near 1 when nothing waits for a wave.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import numpy as np

from archer.tools import CallRecord, tool_metrics


@dataclass
class RolloutStats:
    tools: tuple[str, ...] = ()
    records: list[CallRecord] = field(default_factory=list)
    invalid_calls: int = 0
    disallowed_calls: int = 0  # of the invalid calls: to a configured tool the row may not use
    calls_per_response: list[int] = field(default_factory=list)
    limit_reached: list[bool] = field(default_factory=list)
    turns: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    initial_rollouts: list[int] = field(default_factory=list)  # per prompt
    refills: int = 0
    branch_entropies: list[float] = field(default_factory=list)  # H at each branch made
    branch_deltas: list[float] = field(default_factory=list)  # dH at each branch made
    step_entropies: list[float] = field(default_factory=list)  # H after every tool answer
    decode_steps: int = 0
    decode_tokens: int = 0
    decode_slot_steps: int = 0  # steps x the largest batch, per call
    tool_wait_s: float = 0.0  # summed over the responses
    generation_s: float = 0.0  # wall seconds of the calls
    critical_s: float = 0.0  # critical seconds of the calls

    @staticmethod
    def merge(parts: list[RolloutStats]) -> RolloutStats:
        """One record of several calls (the generation batches of a step)."""
        out = RolloutStats(tools=parts[0].tools if parts else ())
        for part in parts:
            for f in fields(RolloutStats):
                if f.name != "tools":
                    setattr(out, f.name, getattr(out, f.name) + getattr(part, f.name))
        return out

    def add_calls(self, other: RolloutStats) -> None:
        """Count the tool calls of ``other`` (AEPO's probes, whose responses are discarded) in the tool
        metrics; the per-response figures stay those of this record's responses."""
        self.records += other.records
        self.invalid_calls += other.invalid_calls
        self.disallowed_calls += other.disallowed_calls

    def metrics(self) -> dict[str, float]:
        out = tool_metrics(self.records, tools=self.tools, calls_per_response=self.calls_per_response,
                           limit_reached=self.limit_reached)
        out["tools/invalid_calls"] = float(self.invalid_calls)
        out["tools/disallowed_calls"] = float(self.disallowed_calls)
        out["rollout/branches"] = float(len(self.branch_entropies))
        out["rollout/refills"] = float(self.refills)
        for name, values in (("initial_rollouts", self.initial_rollouts), ("branch_depth_mean", self.depths),
                             ("turns_mean", self.turns), ("branch_entropy_mean", self.branch_entropies),
                             ("branch_entropy_delta_mean", self.branch_deltas),
                             ("tool_step_entropy_mean", self.step_entropies)):
            if values:
                out[f"rollout/{name}"] = float(np.mean(values))
        if self.decode_steps:
            out["rollout/decode_batch_mean"] = self.decode_tokens / self.decode_steps
            out["rollout/decode_occupancy"] = self.decode_tokens / self.decode_slot_steps
        if self.calls_per_response:
            out["rollout/tool_wait_s"] = self.tool_wait_s / len(self.calls_per_response)
        if self.generation_s > 0:
            out["rollout/longest_trajectory_share"] = self.critical_s / self.generation_s
        return out

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
        return out

"""Rollout: generation engines behind one interface (SamplingParams -> RolloutOutput, turn-by-turn and continuous
sessions; base.py), with what both engines share (endings.py: eos ids and stop strings; per-row seeded sampling in
fast/sampling.py), and on top of them the multi-turn tool loop (agentic.py), one scheduler in which every
trajectory is its own request, ARPO's rounds decided in logical time (prompt_rounds.py), with its call formats
(call_formats.py), answer fitting (tool_text.py), ARPO/AEPO branching rules (branching.py), config keys
(agentic_config.py) and per-step stats (rollout_stats.py)."""

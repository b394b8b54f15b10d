"""Rollout: generation engines behind one interface (SamplingParams -> RolloutOutput, and turn-by-turn
sessions), and on top of them the multi-turn tool loop (agentic.py) with its call formats (call_formats.py),
answer fitting (tool_text.py), ARPO/AEPO branching rules (branching.py), config keys (agentic_config.py) and
per-step stats (rollout_stats.py)."""

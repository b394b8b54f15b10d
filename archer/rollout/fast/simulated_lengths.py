"""For benchmarks only: response lengths drawn per request, so that a random-weight model, which never samples its
eos token, ends its responses with a real run's long tail (bench/async_rl.py, docs/async.md).

Set ``ARCHER_SIMULATED_LENGTHS=prompt=P,median=M,sigma=S`` (every prompt exactly P tokens long, as the benchmarks'
prompts are) and the fast engine cuts each response at a length drawn from a lognormal distribution (median M,
shape S) keyed by the row's noise key, so a request paused and resumed keeps its length, whatever rows decode
beside it; the response's own budget (max_response_length) caps it, and a cut response ends as ``length``.
Unset (the default), nothing changes.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass
from statistics import NormalDist

from archer.errors import ArcherError

ENV = "ARCHER_SIMULATED_LENGTHS"


@dataclass(frozen=True)
class LengthDraws:
    prompt: int
    median: float
    sigma: float

    def length(self, key: int) -> int:
        """The drawn response length of the row with noise ``key`` (at least 1)."""
        u = ((key * 2654435761) % 2**32 + 0.5) / 2**32  # the 32-bit key, spread over (0, 1)
        return max(1, round(self.median * math.exp(self.sigma * NormalDist().inv_cdf(u))))

    def cap(self, budget: int, key: int, sequence_length: int) -> int:
        """A budget cut so that the response (the tokens past the prompt) ends at its drawn length."""
        sampled = max(0, sequence_length - self.prompt)
        return max(1, min(budget, self.length(key) - sampled))


@functools.cache
def from_environment() -> LengthDraws | None:
    """The draws ``ARCHER_SIMULATED_LENGTHS`` asks for (None when it is unset)."""
    text = os.environ.get(ENV, "").strip()
    if not text:
        return None
    try:
        fields = dict(part.split("=", 1) for part in text.split(","))
        draws = LengthDraws(int(fields["prompt"]), float(fields["median"]), float(fields["sigma"]))
    except (KeyError, ValueError) as e:
        raise ArcherError(f"{ENV}={text!r} cannot be read ({e})",
                          "set it as prompt=P,median=M,sigma=S (e.g. prompt=1024,median=512,sigma=0.84), or unset "
                          "it") from None
    if draws.prompt < 1 or draws.median <= 0 or draws.sigma < 0:
        raise ArcherError(f"{ENV}={text!r}: prompt must be >= 1, median > 0 and sigma >= 0", "fix the values")
    return draws

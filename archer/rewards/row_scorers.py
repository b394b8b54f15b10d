"""Reward managers by name (verl's ``reward_model.reward_manager``): how the rows of a batch reach the scorer.

Each manager takes the batch's decoded responses and row fields and returns one raw result per row (a number or
a dict with "score"); archer.rewards.reward_stage checks the results, shapes them and places them on tokens. The
scorer is ``custom_reward_function`` when it is set, else archer's built-in routing (archer.rewards.routing).
``reward_model.reward_kwargs`` are the manager's keyword arguments, as in verl:

- ``naive``: ``compute_score(data_source=, solution_str=, ground_truth=, extra_info=)`` once per row, in order;
  takes no reward_kwargs. The built-in rewards (no custom function) score ``eval.score_workers`` rows at once.
- ``batch``: one call ``compute_score(data_sources=, solution_strs=, ground_truths=, extra_infos=,
  **reward_kwargs)`` with one list per field, which returns a list with one result per row; needs
  ``custom_reward_function``.
- ``dapo``: as naive, with the eos token's text cut from the end of the response (verl's DAPO manager); its
  reward_kwargs ``overlong_buffer_cfg`` ({enable, len, penalty_factor, log}) and ``max_resp_len`` (default
  data.max_response_length) are DAPO's overlong buffer, the same shaping as ``reward_model.overlong_buffer``.
- ``prime``: ``compute_score(data_source, solution_str, ground_truth, extra_info)`` per row in parallel worker
  processes, all under one deadline; a row whose call raises or is still running at the deadline scores 0 (as
  verl's PRIME manager) and gets the extra ``reward_failed`` = 1 (0 for the others), so failures show in the
  metrics. reward_kwargs ``timeout`` (seconds, default 300) and ``num_processes`` (default 64) are archer's.
"""

from __future__ import annotations

import inspect
import logging
import multiprocessing
import os
import pickle
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from archer.algorithms.registry import Registry
from archer.errors import ArcherError
from archer.rewards.math import set_verify_workers
from archer.rewards.routing import default_compute_score
from archer.rewards.shaping import OverlongBuffer

log = logging.getLogger("archer.rewards")

ComputeScore = Callable[..., Any]

REWARD_MANAGERS: Registry[type[RowScorer]] = Registry("reward manager", "reward_model.reward_manager")
_CUSTOM_FIX = ("fix the reward function or that row's ground truth; a custom reward is set with "
               "custom_reward_function.path=FILE custom_reward_function.name=FN")


@dataclass(frozen=True)
class ScoreRows:
    """What a manager scores: one entry per row of the batch."""

    data_sources: list[str]
    texts: list[str]
    ground_truths: list[Any]
    extra_infos: list[Any]
    abilities: list[str | None]


@dataclass(frozen=True)
class ManagerContext:
    """What a manager may need besides its kwargs: the tokenizer, data.max_response_length, and how many rows the
    built-in rewards may score at once (eval.score_workers)."""

    tokenizer: Any
    max_response_length: int
    score_workers: int = 1


class RowScorer:
    """A reward manager: ``score(rows)`` gives one raw result per row. ``overlong`` is a buffer the manager
    brings with it (dapo's reward_kwargs), else None."""

    needs_custom_function = False
    overlong: OverlongBuffer | None = None

    def __init__(self, compute_score: ComputeScore | None, context: ManagerContext) -> None:
        self.compute_score = compute_score
        self.context = context

    def score(self, rows: ScoreRows) -> list[Any]:
        raise NotImplementedError

    def _one(self, rows: ScoreRows, i: int, text: str) -> Any:
        """The scorer's result for row ``i`` (keyword call), an ArcherError naming the row when it raises."""
        kwargs = {"data_source": rows.data_sources[i], "solution_str": text,
                  "ground_truth": rows.ground_truths[i], "extra_info": rows.extra_infos[i]}
        try:
            if self.compute_score is not None:
                return self.compute_score(**kwargs)
            return default_compute_score(**kwargs, ability=rows.abilities[i])
        except ArcherError:
            raise
        except Exception as exc:
            raise ArcherError(f"the reward function failed on row {i} (data_source {rows.data_sources[i]!r}): "
                              f"{type(exc).__name__}: {exc}", _CUSTOM_FIX) from exc


@REWARD_MANAGERS.register("naive")
class NaiveScorer(RowScorer):
    """verl's naive manager: one keyword call per row, in order."""

    def score(self, rows: ScoreRows) -> list[Any]:
        workers = self.context.score_workers
        if workers <= 1 or self.compute_score is not None or len(rows.texts) < 2:
            return [self._one(rows, i, text) for i, text in enumerate(rows.texts)]
        # the built-in rewards only (a custom function may not be thread-safe): threads over as many math-verify
        # processes; results keep row order
        set_verify_workers(workers)
        with ThreadPoolExecutor(workers) as pool:
            return list(pool.map(lambda i: self._one(rows, i, rows.texts[i]), range(len(rows.texts))))


@REWARD_MANAGERS.register("dapo")
class DapoScorer(RowScorer):
    """verl's DAPO manager: naive with the eos text cut off the response, and DAPO's overlong buffer."""

    def __init__(self, compute_score: ComputeScore | None, context: ManagerContext, *,
                 overlong_buffer_cfg: Mapping[str, Any] | None = None, max_resp_len: int | None = None) -> None:
        super().__init__(compute_score, context)
        cfg = dict(overlong_buffer_cfg or {})
        unknown = sorted(set(cfg) - {"enable", "len", "penalty_factor", "log"})
        if unknown:
            raise ArcherError(f"reward_model.reward_kwargs.overlong_buffer_cfg has unknown key(s) {unknown}",
                              "use enable, len, penalty_factor and log (verl's DAPO overlong buffer)")
        if cfg.get("enable"):
            max_len = int(max_resp_len) if max_resp_len is not None else context.max_response_length
            self.overlong = OverlongBuffer(max_len, int(cfg.get("len", 0)), float(cfg.get("penalty_factor", 1.0)))
        self.eos_text = getattr(context.tokenizer, "eos_token", None) or None

    def score(self, rows: ScoreRows) -> list[Any]:
        out = []
        for i, text in enumerate(rows.texts):
            if self.eos_text and text.endswith(self.eos_text):
                text = text[:-len(self.eos_text)]
            out.append(self._one(rows, i, text))
        return out


@REWARD_MANAGERS.register("batch")
class BatchScorer(RowScorer):
    """verl's batch manager: one call with a list per field and the reward_kwargs; a list of results back."""

    needs_custom_function = True

    def __init__(self, compute_score: ComputeScore | None, context: ManagerContext, **reward_kwargs: Any) -> None:
        super().__init__(compute_score, context)
        self.reward_kwargs = reward_kwargs

    def score(self, rows: ScoreRows) -> list[Any]:
        assert self.compute_score is not None  # checked when the manager is built
        try:
            results = self.compute_score(data_sources=list(rows.data_sources), solution_strs=list(rows.texts),
                                         ground_truths=list(rows.ground_truths), extra_infos=list(rows.extra_infos),
                                         **self.reward_kwargs)
        except ArcherError:
            raise
        except Exception as exc:
            raise ArcherError(f"the batch reward function failed on a batch of {len(rows.texts)} rows: "
                              f"{type(exc).__name__}: {exc}", _CUSTOM_FIX) from exc
        listed = None if isinstance(results, str | bytes | Mapping) or not isinstance(results, Iterable) \
            else list(results)
        if listed is None or len(listed) != len(rows.texts):
            got = repr(results)[:80] if listed is None else f"{len(listed)} results"
            raise ArcherError(
                f"the batch reward function returned {got} for {len(rows.texts)} rows; reward_manager=batch "
                "needs one result per row",
                "return a list with one float (or {'score': float, ...}) per solution_str, in order")
        return listed


def _call_positional(fn: ComputeScore | None, data_source: str, solution_str: str, ground_truth: Any,
                     extra_info: Any, ability: str | None) -> Any:
    """One row's score in a worker process (verl's PRIME call: positional arguments)."""
    if fn is None:
        return default_compute_score(data_source, solution_str, ground_truth, extra_info, ability=ability)
    return fn(data_source, solution_str, ground_truth, extra_info)


def _process_context() -> multiprocessing.context.BaseContext:
    """fork where the platform has it (the scorer, loaded from a file, is inherited rather than re-imported)."""
    methods = multiprocessing.get_all_start_methods()
    return multiprocessing.get_context("fork" if "fork" in methods else "spawn")


@REWARD_MANAGERS.register("prime")
class PrimeScorer(RowScorer):
    """verl's PRIME manager: rows scored in parallel processes under one deadline; failures score 0."""

    def __init__(self, compute_score: ComputeScore | None, context: ManagerContext, *, timeout: float = 300.0,
                 num_processes: int = 64) -> None:
        super().__init__(compute_score, context)
        if not (float(timeout) > 0 and int(num_processes) >= 1):
            raise ArcherError(f"reward_model.reward_kwargs timeout={timeout} / num_processes={num_processes} of "
                              "reward_manager=prime must be positive", "set timeout (seconds) > 0 and "
                              "num_processes >= 1")
        try:
            pickle.dumps(compute_score)
        except Exception as exc:  # a lambda or a nested function cannot reach a worker process
            raise ArcherError(f"reward_manager=prime runs the reward function in worker processes, and "
                              f"{compute_score!r} cannot be sent to one ({type(exc).__name__}: {exc})",
                              "define the reward function with def at the top level of its file, or use "
                              "reward_manager=naive") from None
        self.timeout = float(timeout)
        self.num_processes = int(num_processes)

    def score(self, rows: ScoreRows) -> list[Any]:
        if not rows.texts:
            return []
        workers = min(self.num_processes, len(rows.texts), os.cpu_count() or 1)
        pool = _process_context().Pool(processes=workers)
        try:
            pending = [pool.apply_async(_call_positional, (self.compute_score, rows.data_sources[i], text,
                                                           rows.ground_truths[i], rows.extra_infos[i],
                                                           rows.abilities[i]))
                       for i, text in enumerate(rows.texts)]
            deadline = time.monotonic() + self.timeout
            return [self._collect(job, deadline, rows, i) for i, job in enumerate(pending)]
        finally:
            pool.terminate()  # ends the processes of calls still running at the deadline
            pool.join()

    def _collect(self, job: Any, deadline: float, rows: ScoreRows, i: int) -> Any:
        try:
            result = job.get(timeout=max(0.0, deadline - time.monotonic()))
        except multiprocessing.TimeoutError:
            log.warning("reward_manager=prime: row %d (data_source %r) did not finish within %g s; it scores 0",
                        i, rows.data_sources[i], self.timeout)
            return {"score": 0.0, "reward_failed": 1.0}
        except Exception as exc:
            log.warning("reward_manager=prime: row %d (data_source %r) failed (%s: %s); it scores 0",
                        i, rows.data_sources[i], type(exc).__name__, exc)
            return {"score": 0.0, "reward_failed": 1.0}
        if isinstance(result, Mapping):
            return {**result, "reward_failed": 0.0}
        if isinstance(result, tuple | list) and result:
            result = result[0]  # verl's PRIME: a sequence result scores its first element
        return {"score": result, "reward_failed": 0.0}


def check_manager(name: str, reward_kwargs: Mapping[str, Any], *, has_custom_function: bool) -> type[RowScorer]:
    """The class of manager ``name`` once its reward_kwargs and its need of a custom function are checked (before
    any model loads); an unknown name or keyword is one error listing the choices."""
    cls = REWARD_MANAGERS.lookup(name)
    if cls.needs_custom_function and not has_custom_function:
        raise ArcherError(f"reward_model.reward_manager={name} calls your batch function, and "
                          "custom_reward_function.path is not set",
                          "set custom_reward_function.path=FILE custom_reward_function.name=FN (a function "
                          "compute_score(data_sources, solution_strs, ground_truths, extra_infos, **kwargs) -> list), "
                          "or use reward_manager=naive")
    try:
        inspect.signature(cls).bind(None, None, **reward_kwargs)
    except TypeError:
        accepted = [p.name for p in inspect.signature(cls).parameters.values()
                    if p.kind is inspect.Parameter.KEYWORD_ONLY]
        takes = f"only {', '.join(accepted)}" if accepted else "none"
        raise ArcherError(f"reward_model.reward_kwargs {sorted(reward_kwargs)} are not arguments of "
                          f"reward_manager={name}; it takes {takes}",
                          "remove them from reward_model.reward_kwargs (a custom function's own arguments go in "
                          "custom_reward_function.reward_kwargs)") from None
    return cls


def build_row_scorer(name: str, compute_score: ComputeScore | None, reward_kwargs: Mapping[str, Any],
                     context: ManagerContext) -> RowScorer:
    """The manager ``name`` with its reward_kwargs (checked by ``check_manager``)."""
    cls = check_manager(name, reward_kwargs, has_custom_function=compute_score is not None)
    return cls(compute_score, context, **reward_kwargs)

"""The three rollout modes behind one interface (archer/trainer/batch_sources.py), with recording fakes for the
worker groups and the separate_async pipeline: what each source asks of them for a step's first call, a dynamic
sampling call and ``sampled``, the policy version it stamps, and what a checkpoint keeps. The modes' whole runs
are tests/test_e2e_train.py, tests/test_async_training.py and tests/test_separate_async.py."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from archer.batch import Batch
from archer.rollout.request_pool import FIRST_POLICY_VERSION, POLICY_VERSION
from archer.trainer.async_batches import prompt_batch_seed
from archer.trainer.batch_sources import ColocateSource, SeparateSource, SyncSource


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    @contextmanager
    def gen_timer(self):
        self.calls.append(("gen start",))
        yield
        self.calls.append(("gen end",))


class FakeLoader:
    def __init__(self) -> None:
        self.read = 0

    def next_batch(self) -> list[dict]:
        self.read += 1
        return [{"prompt_ids": [5, 6], "raw_prompt": "a"}, {"prompt_ids": [7], "raw_prompt": "b"}]


class FakeWorkers:
    def __init__(self, record: Recorder) -> None:
        self.record = record

    def call(self, method: str, prompts: Batch) -> Batch:
        self.record.calls.append((method, list(prompts["uid"]) if "uid" in prompts.rows else None,
                                  prompts.info.get("seed")))
        return Batch({"responses": torch.zeros(len(prompts), 2)}, {"uid": list(prompts["uid"])})

    def shutdown(self) -> None:
        self.record.calls.append(("shutdown",))


def test_sync_reads_a_loader_batch_per_call_and_stamps_the_version_the_engine_holds() -> None:
    record = Recorder()
    loader = FakeLoader()
    source = SyncSource(loader, FakeWorkers(record), pad_token_id=0, seed=3, remote=False)
    first = source.groups(4, 0, None, {}, {}, record.gen_timer)
    again = source.groups(4, 1, 2, {}, {}, record.gen_timer)
    assert record.calls == [("gen start",), ("generate_sequences", ["4-0", "4-1"], prompt_batch_seed(3, 4, 0)),
                            ("gen end",), ("gen start",),
                            ("generate_sequences", ["4.1-0", "4.1-1"], prompt_batch_seed(3, 4, 1)), ("gen end",)]
    for batch in (first, again):  # step 4 updates version 3, which the engine holds
        assert batch[POLICY_VERSION].tolist() == [3, 3] and batch[FIRST_POLICY_VERSION].tolist() == [3, 3]
    source.sampled(4, 10)
    assert source.state() is None and loader.read == 2
    source.shutdown()  # an in-process group stays: the trainer's own process holds it
    assert record.calls[-1] == ("gen end",)
    SyncSource(loader, FakeWorkers(record), 0, 3, remote=True).shutdown()
    assert record.calls[-1] == ("shutdown",)


class FakeAsyncBatches:
    def __init__(self, record: Recorder) -> None:
        self.record, self.loader, self.workers = record, FakeLoader(), FakeWorkers(record)
        self.restored = None

    def next(self, step: int, metrics: dict, *, quota: int | None, extra: bool) -> Batch:
        self.record.calls.append(("next", step, quota, extra))
        return Batch({"x": torch.zeros(1)})

    def state(self) -> dict:
        return {"next_number": 7, "batches": []}

    def restore(self, state: dict | None) -> None:
        self.restored = state


def test_colocate_async_asks_the_pools_and_later_calls_admit_one_more_batch() -> None:
    record = Recorder()
    batches = FakeAsyncBatches(record)
    source = ColocateSource(batches, pad_token_id=0, seed=0, remote=False)  # type: ignore[arg-type]
    source.groups(2, 0, None, {}, {}, record.gen_timer)
    source.groups(2, 1, 3, {}, {}, record.gen_timer)
    source.sampled(2, 5)
    assert record.calls == [("gen start",), ("next", 2, None, False), ("gen end",),
                            ("gen start",), ("next", 2, 3, True), ("gen end",)]
    assert source.state() == {"next_number": 7, "batches": []}
    source.restore({"next_number": 3, "batches": []}, Path("ckpt"))
    assert batches.restored == {"next_number": 3, "batches": []}


class FakePipeline:
    def __init__(self, record: Recorder) -> None:
        self.record = record
        self.batches = FakeAsyncBatches(record)

    def __getattr__(self, name: str):
        def method(*args):
            self.record.calls.append((name, *[a for a in args if not isinstance(a, (dict, Batch))]))
            return Batch({"x": torch.zeros(1)}, {"uid": np.array(["1-0"])})
        return method


def test_separate_async_takes_the_call_in_flight_syncs_then_starts_the_next_once_sampled() -> None:
    record = Recorder()
    source = SeparateSource(FakePipeline(record))  # type: ignore[arg-type]
    source.groups(3, 0, None, {}, {}, record.gen_timer)
    source.groups(3, 1, 2, {}, {}, record.gen_timer)
    source.sampled(3, 5)
    source.generate(Batch({"x": torch.zeros(1)}), 3)
    # prepare (a first step starts its call), the wait timed as gen, the weights of version 2 (step 3 updates it)
    assert record.calls[:4] == [("prepare", 3), ("gen start",), ("take",), ("gen end",)]
    assert record.calls[4:] == [("sync", 2), ("gen start",), ("more_groups", 3, 2), ("gen end",),
                                ("launch_next", 3, 5), ("generate", 3)]

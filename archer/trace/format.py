"""Trace format v1 (docs/traces.md): the on-disk spec, the writer and the reader.

A trace directory holds

    summary.json        run metadata: format_version, kind, project/experiment, created_at, updated_at,
                        latest_step, num_steps_written, write_every, step_file_pattern, tokenizer; a run
                        with tools adds call_tags ([opening, closing] tags of the model's tool calls)
    manifest.jsonl      one JSON line per written step: step, created_at, file, num_responses,
                        response_len, num_valid_tokens and statistics of the step
    latest_step.txt     the newest written step
    steps/step_XXXXXX.npz   np.savez_compressed arrays of one step (fields below; each numeric reward extra
                        adds a float32 field ``reward_extra/<key>``; a run with tools adds TOOL_FIELDS;
                        policy_version, staleness, rollout_rs_rejected and first_policy_version came later:
                        older traces lack them)
    tokenizer/          the run's tokenizer, so the trace can be read without the run

Every file is replaced atomically (temporary file + os.replace, optional fsync): a crash leaves either the
old or the new version. A step file is written before its manifest line, so the manifest never names a
missing file; a resumed run first drops the steps after its checkpoint (``truncate_after``) and writes them
again, so no step appears twice. The entropy writer (trace/entropy.py), the influence writer
(trace/influence.py) and the explorer (viz/) share this module.
"""

from __future__ import annotations

import json
import math
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from archer.atomic_files import TMP_PREFIX, replace_atomically, write_json_atomically, write_text_atomically
from archer.contained_paths import OutsideFolderError, resolve_inside
from archer.errors import ArcherError

FORMAT_VERSION = 1
KINDS = ("entropy", "influence")
SUMMARY = "summary.json"
MANIFEST = "manifest.jsonl"
LATEST = "latest_step.txt"
STEPS_DIR = "steps"
TOKENIZER_DIR = "tokenizer"
STEP_FILE_PATTERN = "steps/step_{step:06d}.npz"
_SUMMARY_FIELDS = ("format_version", "kind", "created_at", "updated_at", "latest_step", "num_steps_written",
                   "write_every", "step_file_pattern", "tokenizer")

# Fields of a step file: name -> (dtype, shape description). Both kinds share the first block.
RESPONSE_FIELDS = {
    "entropies": ("float16", "[num_responses, response_len] entropy of each response token (old policy)"),
    "response_mask": ("bool", "[num_responses, response_len] True on the tokens the policy wrote and learns "
                      "from (and an eos appended at call_limit; the tokens of rollout_rs_rejected too); False on "
                      "padding and tool output"),
    "responses": ("int32", "[num_responses, response_len] response token ids"),
    "response_index": ("int32", "[num_responses] row of the response in the step's batch"),
    "prompt_length": ("int32", "[num_responses] number of real prompt tokens"),
    "prompts": ("int32", "[num_responses, prompt_len] left-padded prompt token ids"),
    "uid": ("str", "[num_responses] prompt group id (responses to one prompt share it)"),
    "sample_index": ("int32", "[num_responses] index of the response within its prompt group"),
    "old_log_probs": ("float16", "[num_responses, response_len] log-prob of each token (old policy)"),
    "reward": ("float32", "[num_responses] sequence score of the response"),
    "acc": ("float32", "[num_responses] the reward's accuracy of the response (its acc; score > 0 without one)"),
    "advantage": ("float32", "[num_responses] mean advantage over the response's tokens"),
    "data_source": ("str", "[num_responses] data_source of the prompt"),
    "finish_reason": ("str", "[num_responses] why generation ended: eos | stop | length | call_limit"),
    "policy_version": ("int32", "[num_responses] the policy version that sampled the response: the global step "
                       "whose update made its weights (0: the initial model); with a partial rollout, the newest"),
    "first_policy_version": ("int32", "[num_responses] the policy version of the response's first token: below "
                             "policy_version when a partial rollout resumed it under newer weights"),
    "staleness": ("int32", "[num_responses] policy versions between policy_version and the version the step "
                  "updates (0 in the synchronous loop)"),
    "rollout_rs_rejected": ("bool", "[num_responses, response_len] True on the tokens the rollout correction's "
                            "rejection (algorithm.rollout_correction.rollout_rs) took out of the loss; "
                            "response_mask is True there too"),
}
# Fields of a run with tools (the multi-turn loop, archer/rollout/agentic.py); absent otherwise.
TOOL_FIELDS = {
    "tool_mask": ("bool", "[num_responses, response_len] True on tool output: context the policy did not write "
                  "(response_mask is False there)"),
    "num_tool_calls": ("int32", "[num_responses] tool calls answered in the response"),
    "num_turns": ("int32", "[num_responses] segments the model wrote"),
    "branch_parent": ("int32", "[num_responses] sample_index (same uid) of the response it branched from, -1 for "
                      "a global sample"),
    "branch_position": ("int32", "[num_responses] position of its first token of its own (the tokens before it "
                        "are its parent's), -1 for a global sample"),
}
REWARD_EXTRA_PREFIX = "reward_extra/"
REWARD_EXTRA_FIELD = (
    "float32", "[num_responses] a numeric extra the reward returned under <key> (booleans as 0/1), NaN in the "
    "rows it did not; one field per key, named reward_extra/<key>")
INFLUENCE_FIELDS = {
    "influence": ("float16", "[num_responses, response_len] influence score per token, NaN where not computed"),
    "selected_row_id": ("int32", "[num_responses] row of the response in the step's batch"),
    "accepted": ("bool", "[num_responses] reward equals the group maximum"),
    "group_id": ("int32", "[num_responses] index of the prompt group within the step"),
}

ALL_FIELDS = {**RESPONSE_FIELDS, **TOOL_FIELDS, **INFLUENCE_FIELDS}
TOKEN_FIELDS = ("entropies", "response_mask", "responses", "old_log_probs", "influence", "tool_mask",
                "rollout_rs_rejected")
MAX_STEP_BYTES = 4 << 30  # what a reader unpacks of one step file at most (4 GiB: ~300M tokens of every field)
MAX_STEP_ARRAYS = 256  # members of one step file at most


def field_spec(name: str) -> tuple[str, str] | None:
    """(dtype, description) of a step-file field, None for a field the format does not define."""
    return REWARD_EXTRA_FIELD if name.startswith(REWARD_EXTRA_PREFIX) else ALL_FIELDS.get(name)


def step_file_name(step: int) -> str:
    return STEP_FILE_PATTERN.format(step=step)


def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def value_stats(values: np.ndarray, prefix: str) -> dict[str, float]:
    """mean/std/min/max/p50/p90/p99 of ``values`` (float64), named ``{prefix}_{stat}``; NaN when empty."""
    values = np.asarray(values, dtype=np.float64)
    if values.size == 0:
        return {f"{prefix}_{k}": float("nan") for k in ("mean", "std", "min", "max", "p50", "p90", "p99")}
    p50, p90, p99 = np.percentile(values, [50, 90, 99])
    return {f"{prefix}_mean": float(values.mean()), f"{prefix}_std": float(values.std()),
            f"{prefix}_min": float(values.min()), f"{prefix}_max": float(values.max()),
            f"{prefix}_p50": float(p50), f"{prefix}_p90": float(p90), f"{prefix}_p99": float(p99)}


class BackgroundWrites:
    """Runs write jobs on one thread, in submission order, so compression and file I/O stay off the step.

    At most ``depth`` jobs wait; an error in a job is raised by the next ``submit`` or ``flush``.
    """

    def __init__(self, name: str, depth: int = 2) -> None:
        self._jobs: queue.Queue = queue.Queue(maxsize=depth)
        self._error: BaseException | None = None
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def submit(self, job: Callable[..., Any], *args: Any) -> None:
        self._raise_error()
        self._jobs.put((job, args))

    def flush(self) -> None:
        """Wait until every submitted job is done."""
        self._jobs.join()
        self._raise_error()

    def _run(self) -> None:
        while True:
            job, args = self._jobs.get()
            try:
                if self._error is None:
                    job(*args)
            except BaseException as e:  # handed to the training thread by _raise_error
                self._error = e
            finally:
                self._jobs.task_done()

    def _raise_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error


class TraceWriter:
    """Writes one trace directory: step files, the manifest, latest_step.txt and summary.json.

    ``write_every`` N writes steps N, 2N, ...; ``fsync`` makes each replacement durable before the next.
    ``write_step_later`` hands the work to a background thread; ``flush`` waits for it (the trainer flushes
    before every checkpoint, so a resumed run never misses a step its checkpoint covers).
    """

    def __init__(self, out_dir: str | Path, *, kind: str, write_every: int = 1, fsync: bool = False,
                 metadata: dict[str, Any] | None = None, tokenizer: Any = None) -> None:
        if kind not in KINDS:
            raise ValueError(f"unknown trace kind {kind!r}; expected one of {KINDS}")
        if int(write_every) < 1:
            raise ArcherError(f"trace write_every={write_every} must be at least 1",
                              "set trainer.entropy_trace.write_every (or influence_trace) to 1 or more")
        self.dir = Path(out_dir)
        self.kind = kind
        self.write_every = int(write_every)
        self.fsync = bool(fsync)
        self.metadata = dict(metadata or {})
        self._background: BackgroundWrites | None = None
        # read and checked before anything is written: a damaged manifest stops the run with the folder as it was
        self.entries = read_manifest(self.dir / MANIFEST) if (self.dir / MANIFEST).exists() else []
        self._step_paths(self.entries)
        (self.dir / STEPS_DIR).mkdir(parents=True, exist_ok=True)
        self._remove_debris()
        existing = self._existing_summary()
        if existing.get("kind", kind) != kind:
            raise ArcherError(f"{self.dir} holds an {existing['kind']} trace, not an {kind} trace",
                              "give each trace its own output_dir")
        self.metadata = {**{k: v for k, v in existing.items() if k not in _SUMMARY_FIELDS}, **self.metadata}
        self.created_at = existing.get("created_at", now_iso())
        if tokenizer is not None and not (self.dir / TOKENIZER_DIR).exists():
            tokenizer.save_pretrained(str(self.dir / TOKENIZER_DIR))
        self._write_summary()

    def should_write(self, step: int) -> bool:
        return step % self.write_every == 0

    def write_step(self, step: int, arrays: dict[str, np.ndarray], stats: dict[str, float]) -> Path:
        """Write the step file, then its manifest line (replacing an older line of the same step)."""
        check_step_arrays(arrays, self.kind)
        path = self.dir / step_file_name(step)
        replace_atomically(path, lambda f: np.savez_compressed(f, **arrays), fsync=self.fsync)
        mask = arrays["response_mask"]
        entry = {"step": int(step), "created_at": now_iso(), "file": step_file_name(step),
                 "num_responses": int(mask.shape[0]), "response_len": int(mask.shape[1]),
                 "num_valid_tokens": int(mask.sum()), **stats}
        self.entries = [e for e in self.entries if e["step"] != step] + [entry]
        self.entries.sort(key=lambda e: e["step"])
        self._write_manifest()
        write_text_atomically(self.dir / LATEST, f"{self.entries[-1]['step']}\n", fsync=self.fsync)
        self._write_summary()
        return path

    def write_step_later(self, step: int, arrays: dict[str, np.ndarray],
                         stats: Callable[[dict[str, np.ndarray]], dict[str, float]]) -> None:
        """Compute ``stats(arrays)`` and write the step on the background thread."""
        if self._background is None:
            self._background = BackgroundWrites(f"trace-writer-{self.kind}")
        self._background.submit(lambda: self.write_step(step, arrays, stats(arrays)))

    def flush(self) -> None:
        """Wait for the steps handed to ``write_step_later``; raises the error of a failed write."""
        if self._background is not None:
            self._background.flush()

    def truncate_after(self, step: int) -> int:
        """Drop every step after ``step`` (a resumed run writes them again); returns how many were dropped."""
        dropped = [e for e in self.entries if e["step"] > step]
        if not dropped:
            return 0
        files = self._step_paths(dropped)  # every one inside the trace, else nothing is changed
        self.entries = [e for e in self.entries if e["step"] <= step]
        self._write_manifest()
        latest = self.entries[-1]["step"] if self.entries else None
        write_text_atomically(self.dir / LATEST, "" if latest is None else f"{latest}\n", fsync=self.fsync)
        self._write_summary()
        for file in files:
            file.unlink(missing_ok=True)
        return len(dropped)

    def _step_paths(self, entries: list[dict[str, Any]]) -> list[Path]:
        """The step files ``entries`` name, each inside the trace directory (else OutsideFolderError)."""
        return [resolve_inside(self.dir, e["file"], source=self.dir / MANIFEST, entry=f"step {e['step']}'s file",
                               what="the trace directory") for e in entries]

    def _write_manifest(self) -> None:
        text = "".join(json.dumps(e, allow_nan=True) + "\n" for e in self.entries)
        write_text_atomically(self.dir / MANIFEST, text, fsync=self.fsync)

    def _existing_summary(self) -> dict[str, Any]:
        try:
            summary = json.loads((self.dir / SUMMARY).read_text())
        except (OSError, ValueError):
            return {}
        return summary if isinstance(summary, dict) else {}

    def _write_summary(self) -> None:
        summary = {
            **self.metadata,
            "format_version": FORMAT_VERSION,
            "kind": self.kind,
            "created_at": self.created_at,
            "updated_at": now_iso(),
            "latest_step": self.entries[-1]["step"] if self.entries else None,
            "num_steps_written": len(self.entries),
            "write_every": self.write_every,
            "step_file_pattern": STEP_FILE_PATTERN,
            "tokenizer": TOKENIZER_DIR if (self.dir / TOKENIZER_DIR).exists() else None,
        }
        write_json_atomically(self.dir / SUMMARY, summary, fsync=self.fsync)

    def _remove_debris(self) -> None:
        """Temporary files of a write a crash interrupted."""
        for folder in (self.dir, self.dir / STEPS_DIR):
            for tmp in folder.glob(f"{TMP_PREFIX}*"):
                tmp.unlink(missing_ok=True)


def check_step_arrays(arrays: dict[str, np.ndarray], kind: str) -> None:
    """The required fields are present with the spec's dtypes, ranks and matching shapes (else ValueError)."""
    required = ["entropies", "response_mask", "responses", "response_index"]
    if kind == "influence":
        required += ["influence", "selected_row_id", "reward", "accepted", "group_id"]
    missing = [k for k in required if k not in arrays]
    if missing:
        raise ValueError(f"{kind} trace step is missing fields {missing}")
    shape = arrays["response_mask"].shape
    if len(shape) != 2:
        raise ValueError(f"trace field response_mask must be 2-D [num_responses, response_len], got shape {shape}")
    for name, array in arrays.items():
        spec = field_spec(name)
        if spec is None:
            continue
        dtype, _ = spec
        kind_ok = array.dtype.kind == "U" if dtype == "str" else array.dtype == np.dtype(dtype)
        if not kind_ok:
            raise ValueError(f"trace field {name} must be {dtype}, got {array.dtype}")
        rank = 2 if name in TOKEN_FIELDS or name == "prompts" else 1
        if array.ndim != rank or array.shape[0] != shape[0]:
            raise ValueError(f"trace field {name} has shape {array.shape}, expected {rank}-D with {shape[0]} rows")
        if name in TOKEN_FIELDS and array.shape != shape:
            raise ValueError(f"trace field {name} has shape {array.shape}, expected {shape}")
    _check_tool_fields(arrays)
    if "rollout_rs_rejected" in arrays and np.any(arrays["rollout_rs_rejected"] & ~arrays["response_mask"]):
        raise ValueError("trace field rollout_rs_rejected is True at a token response_mask leaves out (the policy "
                         "wrote every rejected token)")


def _check_tool_fields(arrays: dict[str, np.ndarray]) -> None:
    """Tool output is never a learned token; a branch has both its parent and its position, a root neither."""
    if "tool_mask" in arrays and np.any(arrays["tool_mask"] & arrays["response_mask"]):
        raise ValueError("trace fields tool_mask and response_mask are both True at some token")
    if ("branch_parent" in arrays) != ("branch_position" in arrays):
        raise ValueError("trace fields branch_parent and branch_position come together; one is missing")
    if "branch_parent" in arrays:
        parent, position = arrays["branch_parent"], arrays["branch_position"]
        if np.any(parent < -1) or np.any((parent >= 0) != (position >= 0)):
            raise ValueError("trace fields branch_parent and branch_position must both be -1 (a global sample) or "
                             "both be at least 0 (a branch)")
        if np.any(position >= arrays["response_mask"].shape[1]):
            raise ValueError("trace field branch_position points past the response length")


class ManifestError(ArcherError):
    """A manifest line that is JSON but not an entry of this format (the explorer and a resume share it)."""


_ENTRY = "a JSON object with an integer step (0 or more) and a file name (a string), as archer writes them"


def _manifest_entry(record: Any) -> str | None:
    """What is wrong with a decoded manifest line, or None when it is an entry."""
    if not isinstance(record, dict):
        return f"a JSON {type(record).__name__}" if not isinstance(record, list) else "a JSON array"
    step, file = record.get("step"), record.get("file")
    if "step" not in record or "file" not in record:
        return f"an object without {' and '.join(k for k in ('step', 'file') if k not in record)}"
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        return f"step {step!r}"
    if not isinstance(file, str):
        return f"file {file!r}"
    return None


def read_manifest(path: Path) -> list[dict[str, Any]]:
    """Manifest entries by step. A line that is not JSON (a torn line: a writer killed mid-append by another
    tool) is ignored; a JSON line that is not an entry, or a step listed twice, is a ManifestError naming the
    file, the line and what was expected."""
    entries: list[dict[str, Any]] = []
    line_of: dict[int, int] = {}
    for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), start=1):
        line = line.strip()
        if not line:
            continue
        try:
            record = json.loads(line)
        except ValueError:
            continue
        problem = _manifest_entry(record)
        if problem is None and record["step"] in line_of:
            problem = f"step {record['step']} again (line {line_of[record['step']]} has it)"
        if problem is not None:
            raise ManifestError(f"{path} line {number} holds {problem}; expected {_ENTRY}",
                                "restore the trace's manifest.jsonl, or delete that line (a step without its line "
                                "is not shown, and a resumed run writes it again)")
        line_of[record["step"]] = number
        entries.append(record)
    return sorted(entries, key=lambda e: e["step"])


class TraceError(Exception):
    """A trace file that cannot be read (missing, corrupt, outside the trace directory)."""


def _manifest_shape(entry: dict[str, Any]) -> tuple[int, int] | None:
    """(num_responses, response_len) of a manifest line, None where it does not give both as integers."""
    shape = entry.get("num_responses"), entry.get("response_len")
    return shape if all(isinstance(v, int) and not isinstance(v, bool) for v in shape) else None  # type: ignore[return-value]


def step_file_headers(npz: np.lib.npyio.NpzFile) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """(shape, dtype) of each array of an open step file, read from the arrays' headers alone (nothing unpacked);
    ValueError for a member that is not an array of the .npy format versions 1 or 2, or past MAX_STEP_ARRAYS."""
    infos = npz.zip.infolist()
    if len(infos) > MAX_STEP_ARRAYS:
        raise ValueError(f"it holds {len(infos)} members, more than the {MAX_STEP_ARRAYS} a step file may")
    headers = {}
    for info in infos:
        if not info.filename.endswith(".npy"):
            raise ValueError(f"its member {info.filename!r} is not a .npy array")
        with npz.zip.open(info) as f:
            version = np.lib.format.read_magic(f)
            if version == (1, 0):
                shape, _, dtype = np.lib.format.read_array_header_1_0(f)
            elif version == (2, 0):
                shape, _, dtype = np.lib.format.read_array_header_2_0(f)
            else:
                raise ValueError(f"its array {info.filename!r} has .npy format version {version}, not 1.0 or 2.0")
        headers[info.filename[: -len(".npy")]] = (tuple(int(n) for n in shape), dtype)
    return headers


def check_step_headers(headers: dict[str, tuple[tuple[int, ...], np.dtype]], entry: dict[str, Any]) -> None:
    """The arrays a step file claims fit its manifest line and the explorer's memory cap, checked before any is
    unpacked (else ValueError): response_mask is [num_responses, response_len] as the manifest line says, every
    token field has that shape, every other field is 1-D or 2-D with num_responses rows, and together they take
    at most MAX_STEP_BYTES once unpacked."""
    expected = _manifest_shape(entry)
    mask = headers.get("response_mask", ((), None))[0]
    if expected is not None and len(mask) == 2 and mask != expected:
        raise ValueError(f"its response_mask has shape {mask}, its manifest line says num_responses={expected[0]}, "
                         f"response_len={expected[1]}")
    shape = mask if len(mask) == 2 else expected  # None: a line without the shape and a file without a mask
    total = 0
    for name, (dims, dtype) in headers.items():
        if dtype.hasobject:
            raise ValueError(f"its field {name} holds Python objects")
        if not 1 <= len(dims) <= 2 or (shape is not None and dims[0] != shape[0]):
            raise ValueError(f"its field {name} has shape {dims}, expected 1-D or 2-D"
                             + (f" with {shape[0]} rows" if shape is not None else ""))
        if shape is not None and name in TOKEN_FIELDS and dims != shape:
            raise ValueError(f"its field {name} has shape {dims}, expected {shape}")
        total += math.prod(dims) * dtype.itemsize
    if total > MAX_STEP_BYTES:
        raise ValueError(f"its arrays would take {total / 2**20:.0f} MB unpacked, more than the "
                         f"{MAX_STEP_BYTES / 2**20:.0f} MB cap on one step (MAX_STEP_BYTES)")


def _load_summary(trace_dir: Path) -> dict[str, Any]:
    """A trace's summary.json as a dict (ArcherError when it is not valid JSON or not an object)."""
    path = trace_dir / SUMMARY
    try:
        summary = json.loads(path.read_text())
    except ValueError as e:
        raise ArcherError(f"{path} is not valid JSON ({e})",
                          "the trace directory is damaged; rewrite it or restore summary.json") from e
    if not isinstance(summary, dict):
        raise ArcherError(f"{path} does not hold a JSON object",
                          "the trace directory is damaged; rewrite it or restore summary.json")
    return summary


def is_trace_dir(path: Path) -> bool:
    """A folder whose summary.json names a trace format version (a run's own summary.json does not)."""
    try:
        return "format_version" in _load_summary(path)
    except (OSError, ArcherError):
        return False


def trace_dirs_in(folder: Path) -> list[Path]:
    """The trace folders of ``folder``: those its summary.json names (a quickstart's ``influence_trace`` and
    ``entropy_trace``, which lie a level down), then those directly inside it (a run directory), by name."""
    inside = sorted(p for p in folder.iterdir() if p.is_dir() and is_trace_dir(p)) if folder.is_dir() else []
    named = [p for p in _named_traces(folder) if p not in inside]
    return named + inside


def _named_traces(folder: Path) -> list[Path]:
    """The trace folders a quickstart's summary.json names; a relative name is read from where the quickstart
    ran, else from ``folder`` (its ``run_dir``). Only folders inside ``folder`` count: a summary is data, and
    a name pointing elsewhere opens nothing."""
    try:
        summary = json.loads((folder / SUMMARY).read_text())
    except (OSError, ValueError):
        return []
    if not isinstance(summary, dict):
        return []
    found = []
    for key in ("influence_trace", "entropy_trace"):
        value, run_dir = summary.get(key), summary.get("run_dir")
        if not isinstance(value, str):
            continue
        candidates = [Path(value)]
        if isinstance(run_dir, str) and Path(value).is_relative_to(run_dir):
            candidates.append(folder / Path(value).relative_to(run_dir))
        inside = folder.resolve()
        found += [c for c in candidates if inside in c.resolve().parents and c.is_dir() and is_trace_dir(c)][:1]
    return found


def _not_a_trace_dir(path: Path, reason: str) -> ArcherError:
    found = trace_dirs_in(path)
    if found:
        return ArcherError(f"{path} is not a trace directory ({reason}); it holds the trace folder(s) "
                           f"{', '.join(p.name for p in found)}", f"pass --trace-dir {found[0]}"
                           + (" (or another of them)" if len(found) > 1 else ""))
    return ArcherError(f"{path} is not a trace directory ({reason}), and no folder inside it is one",
                       "point --trace-dir at <run>/entropy_trace or <run>/influence_trace (a run writes them "
                       "with +trainer.entropy_trace.enable=True / +trainer.influence_trace.enable=True)")


def read_trace_summary(trace_dir: str | Path) -> dict[str, Any]:
    """summary.json of a trace directory of this format version; for any other folder an ArcherError that
    names the trace folders inside it (a run directory holds them)."""
    path = Path(trace_dir)
    if not (path / SUMMARY).is_file():
        raise _not_a_trace_dir(path, f"no {SUMMARY}")
    summary = _load_summary(path)
    if "format_version" not in summary:
        raise _not_a_trace_dir(path, f"its {SUMMARY} has no format_version, as a run's own has not")
    if summary["format_version"] != FORMAT_VERSION:
        raise ArcherError(f"{trace_dir}: trace format_version {summary['format_version']!r} is not supported "
                          f"(expected {FORMAT_VERSION})", "write the trace with this version of archer")
    return summary


class TraceReader:
    """Reads a trace directory lazily: the manifest is re-read when it changes, step files on demand.

    Only files inside the trace directory are opened. Decoded steps are kept in a small LRU cache.
    """

    def __init__(self, trace_dir: str | Path, cache_size: int = 4) -> None:
        self.dir = Path(trace_dir).resolve()
        self.summary = read_trace_summary(trace_dir)
        self.kind: str = self.summary.get("kind", "entropy")
        self._manifest_key: tuple[int, int] | None = None
        self._entries: list[dict[str, Any]] = []
        self._cache: OrderedDict[tuple[int, int, int, int], dict[str, np.ndarray]] = OrderedDict()
        self.cache_size = cache_size

    def refresh(self) -> bool:
        """Re-read the manifest (and summary) if it changed on disk; True when it did."""
        path = self.dir / MANIFEST
        try:
            st = path.stat()
        except FileNotFoundError:
            changed = self._manifest_key is not None
            self._manifest_key, self._entries = None, []
            self._cache.clear()
            return changed
        key = (st.st_ino, st.st_mtime_ns, st.st_size)
        if key == self._manifest_key:
            return False
        self._manifest_key = key
        self._entries = read_manifest(path)
        self.summary = _load_summary(self.dir)
        return True

    def entries(self) -> list[dict[str, Any]]:
        self.refresh()
        return list(self._entries)

    def steps(self) -> list[int]:
        return [e["step"] for e in self.entries()]

    def entry(self, step: int) -> dict[str, Any]:
        for e in self.entries():
            if e["step"] == step:
                return e
        raise TraceError(f"step {step} is not in {self.dir / MANIFEST}")

    def step_path(self, step: int) -> Path:
        """The step's file, inside the trace directory (else TraceError: only this step is refused)."""
        try:
            return resolve_inside(self.dir, self.entry(step)["file"], source=self.dir / MANIFEST,
                                  entry=f"step {step}'s file", what="the trace directory")
        except OutsideFolderError as e:
            raise TraceError(e.problem) from e

    def load_step(self, step: int) -> dict[str, np.ndarray]:
        """All arrays of one step (cached); TraceError names the file when it is missing or corrupt.

        The cache is keyed by the file's identity, so a step rewritten by a resumed run is read again.
        """
        path = self.step_path(step)
        try:
            st = path.stat()
        except FileNotFoundError as e:
            raise TraceError(f"step {step}: file {path} is missing") from e
        key = (step, st.st_ino, st.st_mtime_ns, st.st_size)
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        arrays = self.read_fields(step)
        try:
            check_step_arrays(arrays, self.kind)
        except ValueError as e:
            raise TraceError(f"step {step}: file {path} does not match trace format v1 ({e})") from e
        self._cache[key] = arrays
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return arrays

    def read_fields(self, step: int, names: tuple[str, ...] | None = None) -> dict[str, np.ndarray]:
        """The arrays ``names`` (None: all) of one step's file, not cached. Their shapes and sizes are checked
        against the step's manifest line and MAX_STEP_BYTES from the arrays' headers before any is unpacked, so a
        small file claiming huge arrays costs no memory; TraceError names the file when it is missing, corrupt or
        does not fit."""
        path = self.step_path(step)
        try:
            with np.load(path, allow_pickle=False) as npz:
                try:
                    check_step_headers(step_file_headers(npz), self.entry(step))
                except ValueError as e:
                    raise TraceError(f"step {step}: file {path} does not fit its manifest line ({e})") from e
                return {name: npz[name] for name in npz.files if names is None or name in names}
        except TraceError:
            raise
        except FileNotFoundError as e:
            raise TraceError(f"step {step}: file {path} is missing") from e
        except Exception as e:  # zipfile, zlib and numpy raise many types for a damaged file
            raise TraceError(f"step {step}: file {path} cannot be read ({type(e).__name__}: {e})") from e

    def tokenizer_dir(self) -> Path | None:
        """The tokenizer saved with the trace, if any: a folder inside the trace directory. A summary naming one
        elsewhere (an absolute path, ``..``, a link out) names none: nothing outside the trace is read for it."""
        name = self.summary.get("tokenizer")
        if not isinstance(name, str) or not name:
            return None
        path = (self.dir / name).resolve()
        return path if self.dir in path.parents and path.is_dir() else None

"""The explorer's state behind the UI: one TraceReader, the tokenizer, per-step caches, and every view as a
method returning plain values (tables, HTML, figures, file paths).

It holds no Gradio objects, so the tests and the scale benchmark call exactly what the app's callbacks call.
The Health tab's flags are those of the trace's run (viz/health.py), read again when its files change.
A step is loaded lazily, one per request, and kept in the reader's small cache; statistics and the overview
table of a loaded step are cached alongside it. Read are the trace directory, its parent folder's metrics.jsonl,
health.jsonl and entropy_trace (the run the trace lies in, for the Health tab) and what the command line names
(``--model-path``, ``--run-dir``); never a folder that a file names (a trace's summary.json naming a tokenizer or
run elsewhere, a quickstart's summary naming traces outside its folder). CSV exports are written into a private
temporary folder.
"""

from __future__ import annotations

import hashlib
import html
import tempfile
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from archer.errors import ArcherError
from archer.health.monitor import HEALTH_FILE
from archer.step_lines import METRICS_FILE
from archer.trace.format import TraceError, TraceReader, is_trace_dir, read_trace_summary, trace_dirs_in
from archer.viz import queries, render
from archer.viz.health import RunHealth, run_dir_of, trace_row

STEP_CACHE = 4
CSV_KEEP = 32  # CSV exports kept in the private temporary folder


def existing_trace_dir(trace_dir: str | Path) -> Path:
    """The trace folder to open: ``trace_dir`` itself, or the trace that a quickstart folder's summary.json
    names (its influence trace first); an ArcherError when it does not exist or holds no trace (naming the trace
    folders inside a run directory). Checked before heavy imports."""
    path = Path(trace_dir).expanduser()
    if not path.is_dir():
        raise ArcherError(f"trace directory {path} does not exist",
                          "pass --trace-dir <run>/entropy_trace or <run>/influence_trace of a run")
    if not is_trace_dir(path):
        named = trace_dirs_in(path)
        if named and (path / "summary.json").is_file() and named[0].parent != path:  # named one level down
            print(f"{path} is a run folder: opening the trace its summary.json names, {named[0]}")
            return named[0]
    read_trace_summary(path)
    return path


class TokenDecoder:
    """Token ids -> text, one string per id, cached per id; "[id]" without a tokenizer or outside its vocab."""

    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = len(tokenizer) if tokenizer is not None else 0
        self._cache: dict[int, str] = {}

    def __call__(self, ids: np.ndarray) -> list[str]:
        ids = np.asarray(ids).reshape(-1)
        missing = [int(i) for i in np.unique(ids) if int(i) not in self._cache]
        if missing:
            known = [i for i in missing if 0 <= i < self.vocab_size]
            texts = self.tokenizer.batch_decode([[i] for i in known], skip_special_tokens=False,
                                                clean_up_tokenization_spaces=False) if known else []
            self._cache.update(zip(known, texts))
            self._cache.update((i, f"[{i}]") for i in missing if not 0 <= i < self.vocab_size)
        cache = self._cache
        return [cache[i] for i in ids.tolist()]

    def text(self, ids: np.ndarray) -> str:
        """A whole sequence decoded at once (special tokens kept), or its ids without a tokenizer."""
        ids = [int(i) for i in np.asarray(ids).reshape(-1)]
        if self.tokenizer is None or any(not 0 <= i < self.vocab_size for i in ids):
            return " ".join(f"[{i}]" for i in ids)
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def load_trace_tokenizer(reader: TraceReader, model_path: str | Path | None) -> tuple[Any, str]:
    """The tokenizer from ``model_path`` (errors are the user's), else the trace's own; with a note for the UI."""
    from archer.models.loading import load_tokenizer

    if model_path is not None:
        return load_tokenizer(model_path, role="tokenizer (--model-path)"), f"tokenizer: {model_path}"
    folder = reader.tokenizer_dir()
    named = reader.summary.get("tokenizer")
    if folder is None and named:
        return None, (f"the trace's summary.json names a tokenizer outside the trace ({str(named)[:200]!r}), which is "
                      "not read: tokens are shown as ids (pass --model-path to name one)")
    if folder is None:
        return None, "no tokenizer in the trace and no --model-path: tokens are shown as ids"
    try:
        return load_tokenizer(folder), f"tokenizer: {folder.name}/ of the trace"
    except ArcherError as e:
        return None, f"the trace's tokenizer could not be loaded ({e.problem}): tokens are shown as ids"


@dataclass
class StepData:
    """One loaded step with what the views reuse."""

    step: int
    arrays: dict[str, np.ndarray]
    stats: dict[str, float]
    entropy_vmax: float
    influence_vmax: float
    _overview: pd.DataFrame | None = field(default=None, repr=False)

    @property
    def overview(self) -> pd.DataFrame:
        if self._overview is None:
            self._overview = queries.overview_table(self.arrays)
        return self._overview


@dataclass
class ResponseView:
    """Everything the response panel shows for one response and one set of view options."""

    metadata: str
    prompt: str
    response: str
    entropy_html: str
    influence_html: str | None
    view: pd.DataFrame
    csv_path: Path


class Explorer:
    """A trace directory opened for exploring; methods raise TraceError for a missing or corrupt step."""

    def __init__(self, trace_dir: str | Path, model_path: str | Path | None = None,
                 run_dir: str | Path | None = None) -> None:
        self.reader = TraceReader(existing_trace_dir(trace_dir))
        self.tokenizer, self.tokenizer_note = load_trace_tokenizer(self.reader, model_path)
        self.decode = TokenDecoder(self.tokenizer)
        self.call_tags = queries.call_tags(self.reader.summary)  # what the heatmaps mark as tool calls
        self._lock = threading.RLock()
        self._steps: OrderedDict[int, StepData] = OrderedDict()
        self._prompt_index: dict[int, tuple[tuple[int, int, int], frozenset[bytes]]] = {}  # step -> (file version, prompts)
        self._tmp = tempfile.TemporaryDirectory(prefix="archer-viz-")
        self.run_dir = run_dir_of(self.reader.dir, run_dir)
        self._health: tuple[str, RunHealth] | None = None

    @property
    def kind(self) -> str:
        return self.reader.kind

    @property
    def has_influence(self) -> bool:
        return self.kind == "influence"

    def steps(self) -> list[int]:
        with self._lock:
            return self.reader.steps()

    def refresh(self) -> bool:
        """Re-read the manifest; True when it changed (new steps of a running training)."""
        with self._lock:
            return self.reader.refresh()

    def manifest_signature(self) -> str:
        """Changes whenever a step is written, rewritten or dropped (the app's timer compares it)."""
        with self._lock:
            return repr([(e["step"], e.get("created_at"), e.get("file")) for e in self.reader.entries()])

    def header(self) -> str:
        """Markdown: the trace, its run, its steps and the tokenizer in use."""
        with self._lock:
            summary, steps = dict(self.reader.summary), self.reader.steps()
        run = " / ".join(str(summary[k]) for k in ("project_name", "experiment_name") if summary.get(k))
        span = f"steps {steps[0]}..{steps[-1]} ({len(steps)} written)" if steps else "no steps written yet"
        text = render.markdown_text  # the summary's text is data: shown as text, never as markup
        return (f"**{text(self.kind)} trace** `{self.reader.dir}`" + (f" — {text(run)}" if run else "")
                + f" — {span}, updated {text(summary.get('updated_at', '?'))} — {text(self.tokenizer_note)}")

    def step_data(self, step: int) -> StepData:
        """The step's arrays (lazily loaded by the reader) with its statistics, recomputed when reloaded."""
        step = int(step)
        with self._lock:
            arrays = self.reader.load_step(step)
            cached = self._steps.get(step)
            if cached is not None and cached.arrays is arrays:
                self._steps.move_to_end(step)
                return cached
            stats = queries.step_stats(arrays)
            data = StepData(step, arrays, stats, *queries.colour_scales(stats))
            self._steps[step] = data
            while len(self._steps) > STEP_CACHE:
                self._steps.popitem(last=False)
            return data

    def stats_table(self, step: int) -> pd.DataFrame:
        """One row: the step's statistics (queries.step_stats)."""
        return pd.DataFrame([{"step": int(step), **self.step_data(step).stats}])

    def overview(self, step: int) -> pd.DataFrame:
        return self.step_data(step).overview

    def response(self, step: int, row: int, *, entropy_range: tuple[float | None, float | None] = (None, None),
                 search: str = "", show_padding: bool = False, sort: str = "position",
                 influence_scale: str = "response", flagged: tuple[str, list[int]] | None = None) -> ResponseView:
        """The response panel: metadata, decoded prompt and response, heatmap(s), the view table and its CSV.
        The influence heatmap's colour scale is the response's own p99 of |influence| (``influence_scale``
        "response") or the step's ("step"). ``flagged``: (what points, the positions) of a health flag's
        pointer at this response, boxed in the heatmaps and named in the metadata."""
        if influence_scale not in queries.INFLUENCE_SCALES:
            raise ValueError(f"influence_scale must be one of {queries.INFLUENCE_SCALES}, got {influence_scale!r}")
        data = self.step_data(step)
        arrays = data.arrays
        row = queries.check_row(arrays, row)
        tokens = queries.token_table(arrays, row, self.decode, tags=self.call_tags)
        view = queries.token_view(tokens, entropy_range=entropy_range, search=search, show_padding=show_padding,
                                  sort=sort)
        in_view = queries.view_mask(tokens, entropy_range=entropy_range, search=search)
        shown = queries.in_response(tokens) | show_padding
        shown_tokens, shown_in_view = tokens[shown], in_view[shown]
        marked = flagged[1] if flagged else ()
        entropy_html = render.heatmap_html(shown_tokens, colour_by="entropy", vmax=data.entropy_vmax,
                                           in_view=shown_in_view, flagged=marked)
        influence_html, influence_vmax = None, data.influence_vmax
        if "influence" in arrays:
            if influence_scale == "response":
                influence_vmax = queries.response_influence_scale(arrays, row)
            influence_html = render.heatmap_html(
                shown_tokens, colour_by="influence", vmax=influence_vmax, in_view=shown_in_view,
                scale=f"p99 of |influence| over this {influence_scale}", flagged=marked)
        metadata = self._metadata(data, row, int(in_view[tokens["valid"].to_numpy()].sum()), len(view), sort,
                                  influence_vmax, influence_scale)
        if flagged:
            metadata += f"  \nhealth: {render.markdown_text(flagged[0])}" + (
                f"; tokens at {' '.join(map(str, marked))} boxed in green" if marked else "")
        return ResponseView(
            metadata=metadata,
            prompt=self._prompt_text(data, row),
            response=self.decode.text(queries.response_ids(arrays, row)),
            entropy_html=entropy_html, influence_html=influence_html, view=view,
            csv_path=self._write_csv(queries.view_csv(view, data.step, row), data.step, row))

    def _metadata(self, data: StepData, row: int, matching: int, rows_in_view: int, sort: str,
                  influence_vmax: float, influence_scale: str) -> str:
        record = data.overview.iloc[row].to_dict()
        cells = " | ".join(f"**{render.markdown_text(k)}** {render.markdown_text(_fmt(v))}"
                           for k, v in {"step": data.step, **record}.items())
        return (f"{cells}  \nview: {rows_in_view} rows (sort: {sort}); {matching} valid tokens match the filter "
                f"and search; colour scale max: entropy {data.entropy_vmax:.3g} (step)"
                + (f", |influence| {influence_vmax:.3g} ({influence_scale})" if "influence" in data.arrays else ""))

    def _write_csv(self, text: str, step: int, row: int) -> Path:
        digest = hashlib.sha1(text.encode("utf-8")).hexdigest()[:10]
        path = Path(self._tmp.name) / f"trace_step{step:06d}_row{row}_{digest}.csv"
        if path.exists():
            path.touch()  # the newest again: it must outlive the pruning below
        else:
            path.write_text(text, encoding="utf-8")
        older = sorted(Path(self._tmp.name).glob("*.csv"), key=lambda p: p.stat().st_mtime_ns)[:-CSV_KEEP]
        for stale in older:  # Gradio has copied them into its own cache when they were shown
            stale.unlink(missing_ok=True)
        return path

    def top_tokens(self, step: int, k: int) -> tuple[pd.DataFrame, pd.DataFrame]:
        """The step's k highest- and k lowest-entropy valid tokens."""
        arrays = self.step_data(step).arrays
        return (queries.top_tokens(arrays, k, self.decode, highest=True),
                queries.top_tokens(arrays, k, self.decode, highest=False))

    def histogram(self, step: int, bins: int = 50) -> Figure:
        counts, edges = queries.entropy_histogram(self.step_data(step).arrays, bins)
        return render.histogram_figure(counts, edges, int(step))

    def curves(self) -> Figure:
        with self._lock:
            entries = self.reader.entries()
        return render.curves_figure(queries.curves(entries))

    def health_signature(self) -> str:
        """Changes whenever the run's metrics.jsonl or health.jsonl does."""
        if self.run_dir is None:
            return ""
        files = [self.run_dir / METRICS_FILE, self.run_dir / HEALTH_FILE]
        return repr([(p.name, p.stat().st_mtime_ns, p.stat().st_size) for p in files if p.exists()])

    def run_health(self) -> RunHealth | None:
        """The flags of the trace's run (None when the trace's run folder holds no metrics.jsonl)."""
        if self.run_dir is None:
            return None
        key = self.health_signature()
        with self._lock:
            if self._health is None or self._health[0] != key:
                self._health = (key, RunHealth.read(self.run_dir))
            return self._health[1]

    def trace_row(self, step: int, batch_row: int) -> int:
        """The row of this trace holding row ``batch_row`` of the step's batch (IndexError when it holds none)."""
        row = trace_row(self.step_data(step).arrays, batch_row)
        if row is None:
            raise IndexError(f"response {batch_row} of step {step} is not in this {self.kind} trace"
                             + (" (it holds only the prompt groups it traced: open the run's entropy trace)"
                                if self.has_influence else ""))
        return row

    def _response_panels(self, data: StepData, rows: np.ndarray, max_tokens: int) -> list[tuple[str, str]]:
        overview = data.overview
        panels = []
        for row in rows:
            tokens = queries.token_table(data.arrays, int(row), self.decode, tags=self.call_tags)
            tokens = tokens[queries.in_response(tokens)]
            record = overview.iloc[int(row)]
            title = f"step {data.step} · row {int(row)}" + "".join(
                f" · {k} {_fmt(record[k])}" for k in ("sample_index", "reward", "advantage", "accepted", "learned_tokens",
                                                    "entropy_mean") if k in record)
            panels.append((title, render.heatmap_html(tokens, vmax=data.entropy_vmax, max_tokens=max_tokens,
                                                      legend=False)))
        return panels

    def prompt_group(self, step: int, row: int, max_tokens: int = 256) -> tuple[str, str]:
        """The decoded prompt of ``row`` and the heatmaps of all responses to it (same uid), side by side."""
        data = self.step_data(step)
        row = queries.check_row(data.arrays, row)
        rows = _group_of(data, row)
        return self._prompt_text(data, row), render.panels_html(self._response_panels(data, rows, max_tokens))

    def prompt_choices(self, step: int) -> list[tuple[str, str]]:
        """(label, uid) of each prompt of the step: its uid, number of responses and of branches."""
        arrays = self.step_data(step).arrays
        uids = arrays["uid"] if "uid" in arrays else np.zeros(0, dtype=str)
        branched = arrays["branch_parent"] >= 0 if "branch_parent" in arrays else np.zeros(len(uids), dtype=bool)
        choices = []
        for uid in queries.prompt_uids(arrays):
            members = uids == uid
            label = f"{uid} · {int(members.sum())} responses"
            if "branch_parent" in arrays:
                label += f", {int(branched[members].sum())} branches"
            choices.append((label, uid))
        return choices

    def first_row(self, step: int, uid: str) -> int:
        """The row of the prompt's first response (IndexError when the step has no such uid)."""
        rows = queries.group_rows(self.step_data(step).arrays, uid)
        if not len(rows):
            raise IndexError(f"step {step} has no prompt with uid {uid!r}")
        return int(rows[0])

    def branch_tree(self, step: int, row: int) -> tuple[str | None, pd.DataFrame, str]:
        """The uid of ``row``, the tree table of its prompt's responses and their SVG tree (``row`` highlighted)."""
        data = self.step_data(step)
        arrays = data.arrays
        row = queries.check_row(arrays, row)
        if "uid" not in arrays:
            return None, pd.DataFrame(), "<p>the step has no prompt uids: its responses cannot be grouped</p>"
        uid = str(arrays["uid"][row])
        tree = queries.branch_tree(arrays, uid)
        marks = {}
        for r in tree["row"] if "tool_mask" in arrays else []:  # the tool output and calls on each lane
            tokens = queries.token_table(arrays, int(r), self.decode, tags=self.call_tags)
            marks[int(r)] = (tokens["tool"].to_numpy(), tokens["tool_call"].to_numpy())
        note = "" if "branch_parent" in arrays else (
            "<p>this trace records no branch parents (a run without tools): every response is a root</p>")
        return uid, tree, note + render.branch_tree_svg(tree, marks, vmax=data.entropy_vmax, selected=row)

    def _prompt_text(self, data: StepData, row: int) -> str:
        prompt = queries.prompt_ids(data.arrays, row)
        return "(the step has no prompt ids)" if prompt is None else self.decode.text(prompt)

    def prompt_steps(self, step: int, row: int) -> list[int]:
        """The other steps whose trace holds ``row``'s prompt (by its token ids), ascending."""
        wanted = queries.prompt_ids(self.step_data(step).arrays, queries.check_row(self.step_data(step).arrays, row))
        if wanted is None:
            return []
        return [s for s in self.steps() if s != int(step) and wanted.tobytes() in self._prompts_of(s)]

    def _prompts_of(self, step: int) -> frozenset[bytes]:
        """The prompt token ids of a step's responses (as bytes), read from its file's prompt arrays alone and
        kept per file version; a step that cannot be read holds none."""
        path = self.reader.step_path(step)
        try:
            st = path.stat()
            version = (st.st_ino, st.st_mtime_ns, st.st_size)
            with self._lock:
                cached = self._prompt_index.get(step)
                if cached is not None and cached[0] == version:
                    return cached[1]
            arrays = self.reader.read_fields(step, ("prompts", "prompt_length"))
        except (OSError, TraceError):
            return frozenset()
        prompts = frozenset(queries.prompt_ids(arrays, r).tobytes() for r in range(len(arrays["prompts"]))) \
            if "prompts" in arrays else frozenset()
        with self._lock:
            self._prompt_index[step] = (version, prompts)
        return prompts

    def compare_steps(self, step: int, row: int, other_step: int,
                      max_tokens: int = 256) -> tuple[pd.DataFrame, str]:
        """The responses to ``row``'s prompt at ``step`` and at ``other_step`` (matched by prompt ids)."""
        data, other = self.step_data(step), self.step_data(other_step)
        row = queries.check_row(data.arrays, row)
        here = _group_of(data, row)
        there = queries.matching_rows(data.arrays, row, other.arrays)
        summary = pd.DataFrame([_group_summary(data, here), _group_summary(other, there)])
        columns = []
        for d, rows in ((data, here), (other, there)):
            body = "".join(f'<div class="archer-panel-title">{html.escape(t)}</div>{h}'
                           for t, h in self._response_panels(d, rows, max_tokens))
            columns.append((f"step {d.step}: {len(rows)} responses",
                            body or "<p>this prompt is not in the step</p>"))
        return summary, render.panels_html(columns)


def _group_of(data: StepData, row: int) -> np.ndarray:
    """The rows sharing ``row``'s uid (just ``row`` when the step has no uids)."""
    if "uid" not in data.arrays:
        return np.array([row])
    return queries.group_rows(data.arrays, str(data.arrays["uid"][row]))


def _group_summary(data: StepData, rows: np.ndarray) -> dict[str, Any]:
    table = data.overview.iloc[rows]
    out: dict[str, Any] = {"step": data.step, "responses": len(rows),
                           "rows": " ".join(str(int(r)) for r in rows)}
    for name in ("reward", "advantage", "accepted", "learned_tokens", "entropy_mean", "influence_mean"):
        if name in table:
            out[f"{name}_mean" if not name.endswith("_mean") else name] = (
                float(table[name].astype(np.float64).mean()) if len(rows) else float("nan"))
    return out


def _fmt(value: Any) -> str:
    if isinstance(value, (float, np.floating)):
        return f"{float(value):.4g}"
    return str(value)

"""Times the trace explorer (`archer viz`) on a trace of real size: 300 steps x 512 responses x 4096 tokens.

The trace (influence kind, a superset of the entropy kind) is written once with the real TraceWriter into
--dir and reused by later runs of the same shape. Data: entropies in [0, 5] with most tokens near 0, response
lengths from 1 to 4096 (a tenth at the full length), token ids below 150000, prompts of up to 1024 tokens in
groups of 8 responses; the tokenizer is a synthetic 150000-token byte-level vocabulary saved with the trace.

Each interaction is timed as the app's callback does it (``Explorer`` methods) plus Gradio's postprocessing of
the outputs the browser receives; the first call on a step (cold) and the median of the repeats (warm).
With --browser the app is also served and driven in headless Chromium (/usr/bin/chromium): each interaction
is timed from the user's action until the browser shows its result (Playwright's overhead included).

    python bench/viz_scale.py --dir /tmp/archer_viz_scale --browser  # writes the trace the first time
    python bench/viz_scale.py --dir /tmp/archer_viz_scale --delete   # and removes it afterwards
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gradio as gr
import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from archer.trace.format import MANIFEST, SUMMARY, TraceWriter, read_manifest
from archer.trace.influence import influence_stats
from archer.viz.app import build_app
from archer.viz.explorer import Explorer

ALPHABET = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,;:!?()+-*/=_"


def synthetic_tokenizer(vocab_size: int, seed: int = 0) -> PreTrainedTokenizerFast:
    """A byte-level vocabulary of ``vocab_size`` distinct word pieces ('Ġ' = leading space, 'Ċ' = newline)."""
    rng = np.random.default_rng(seed)
    pieces = ["<|endoftext|>", "Ġ", "Ċ", "ĉ"] + list(ALPHABET)
    seen = set(pieces)
    while len(pieces) < vocab_size:
        word = "".join(rng.choice(list(ALPHABET), size=int(rng.integers(2, 9))))
        piece = ("Ġ" if rng.random() < 0.5 else "") + word + ("Ċ" if rng.random() < 0.03 else "")
        if piece not in seen:
            seen.add(piece)
            pieces.append(piece)
    tokenizer = Tokenizer(models.BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>", pad_token="<|endoftext|>")


def synthetic_step(rng: np.random.Generator, n: int, length: int, prompt_len: int, vocab: int,
                   rollout_n: int) -> dict[str, np.ndarray]:
    """One influence-trace step of ``n`` responses padded to ``length`` tokens."""
    lengths = np.where(rng.random(n) < 0.1, length, rng.integers(1, length + 1, n))
    positions = np.arange(length)
    mask = positions[None, :] < lengths[:, None]
    near_zero = rng.exponential(0.03, (n, length))
    spread = rng.uniform(0.2, 5.0, (n, length))
    entropies = np.clip(np.where(rng.random((n, length)) < 0.75, near_zero, spread), 0.0, 5.0)
    entropies = np.where(mask, entropies, 0.0).astype(np.float16)
    responses = np.where(mask, rng.integers(4, vocab, (n, length)), 0).astype(np.int32)
    log_probs = np.where(mask, -entropies.astype(np.float32) * rng.uniform(0.2, 1.5, (n, length)), 0.0)
    prompt_length = np.repeat(rng.integers(16, prompt_len + 1, n // rollout_n), rollout_n).astype(np.int32)
    prompt_ids = np.repeat(rng.integers(4, vocab, (n // rollout_n, prompt_len)), rollout_n, axis=0)
    prompts = np.where(positions[None, :prompt_len] >= prompt_len - prompt_length[:, None], prompt_ids, 0)
    reward = rng.integers(0, 2, n).astype(np.float32)
    groups = np.arange(n) // rollout_n
    group_max = reward.reshape(-1, rollout_n).max(axis=1)[groups]
    computed = mask & (rng.random((n, length)) < 0.9)
    influence = np.where(computed, rng.normal(0.0, 0.02, (n, length)), np.nan).astype(np.float16)
    return {
        "entropies": entropies, "response_mask": mask, "responses": responses,
        "response_index": np.arange(n, dtype=np.int32), "prompt_length": prompt_length,
        "prompts": prompts.astype(np.int32), "uid": np.asarray([f"u{g:04d}" for g in groups]),
        "sample_index": (np.arange(n) % rollout_n).astype(np.int32), "old_log_probs": log_probs.astype(np.float16),
        "reward": reward, "advantage": (reward - reward.reshape(-1, rollout_n).mean(axis=1)[groups]).astype(np.float32),
        "data_source": np.asarray(["math"] * n), "influence": influence,
        "selected_row_id": np.arange(n, dtype=np.int32), "accepted": reward == group_max,
        "group_id": groups.astype(np.int32),
    }


def ensure_trace(folder: Path, args: argparse.Namespace) -> None:
    """Write the trace unless ``folder`` already holds one of this shape (a partial one is completed)."""
    shape = {"bench_shape": [args.steps, args.responses, args.tokens, args.prompt_len, args.vocab]}
    done: set[int] = set()
    if (folder / SUMMARY).exists():
        if json.loads((folder / SUMMARY).read_text()).get("bench_shape") != shape["bench_shape"]:
            raise SystemExit(f"{folder} holds a trace of another shape; remove it or pick another --dir")
        done = {e["step"] for e in read_manifest(folder / MANIFEST)} if (folder / MANIFEST).exists() else set()
    if len(done) >= args.steps:
        return
    writer = TraceWriter(folder, kind="influence", metadata={"project_name": "bench", **shape},
                         tokenizer=synthetic_tokenizer(args.vocab))
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        if step in done:
            continue
        arrays = synthetic_step(np.random.default_rng(step), args.responses, args.tokens, args.prompt_len,
                                args.vocab, rollout_n=8)
        writer.write_step(step, arrays, influence_stats(arrays))
        if step % 25 == 0:
            print(f"wrote step {step}/{args.steps} ({time.perf_counter() - start:.0f} s)", flush=True)


def timed(fn: Callable[[], Any], repeat: int) -> tuple[float, float, Any]:
    """(first call s, median of ``repeat`` further calls s, last result)."""
    start = time.perf_counter()
    result = fn()
    first = time.perf_counter() - start
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return first, statistics.median(times) if times else first, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/archer_viz_scale"))
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--responses", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=150_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--browser", action="store_true", help="also time the app end to end in Chromium")
    parser.add_argument("--delete", action="store_true", help="remove the trace afterwards")
    args = parser.parse_args()
    ensure_trace(args.dir, args)
    size = sum(p.stat().st_size for p in args.dir.rglob("*") if p.is_file())
    print(f"trace: {args.dir} ({size / 2**30:.2f} GiB, {args.steps} steps x {args.responses} x {args.tokens})")

    rows: list[tuple[str, float, float]] = []

    def record(name: str, fn: Callable[[], Any], repeat: int = args.repeat) -> Any:
        first, median, result = timed(fn, repeat)
        rows.append((name, first, median))
        return result

    explorer = record("open: reader + summary + manifest + tokenizer", lambda: Explorer(args.dir), repeat=1)
    plot = gr.Plot(format="png")
    record("open: curves over all steps (figure -> PNG)", lambda: plot.postprocess(explorer.curves()))
    record("open: build the whole app (gr.Blocks)", lambda: build_app(args.dir, poll_seconds=0), repeat=1)
    steps = explorer.steps()
    step, other = steps[len(steps) // 2], steps[-1]
    table, html, download = gr.Dataframe(), gr.HTML(), gr.DownloadButton()
    record("load a step (npz -> arrays, step statistics)", lambda: explorer.step_data(step), repeat=0)
    record("step statistics table", lambda: table.postprocess(explorer.stats_table(step)))
    record("overview table (512 rows)", lambda: table.postprocess(explorer.overview(step)))
    overview = explorer.overview(step)
    row = int(overview.index[overview["length"] == args.tokens][0])
    record(f"response view, row {row} ({args.tokens} tokens): heatmaps + table + CSV",
           lambda: _post_response(explorer.response(step, row), table, html, download))
    record("  entropy filter [1, 5]",
           lambda: _post_response(explorer.response(step, row, entropy_range=(1.0, 5.0)), table, html, download))
    record("  token search 'ab'", lambda: _post_response(explorer.response(step, row, search="ab"), table, html,
                                                         download))
    record("  sort by entropy descending",
           lambda: _post_response(explorer.response(step, row, sort="entropy_desc"), table, html, download))
    record("  show padding", lambda: _post_response(explorer.response(step, row, show_padding=True), table, html,
                                                    download))
    from archer.viz import queries, render

    tokens = queries.token_table(explorer.step_data(step).arrays, row, explorer.decode, tags=explorer.call_tags)
    record("  of which: entropy heatmap HTML alone", lambda: render.heatmap_html(tokens, vmax=1.0))
    record("  of which: CSV text alone", lambda: queries.view_csv(tokens, step, row))
    record("top-K tokens (K=20, highest and lowest)",
           lambda: [table.postprocess(t) for t in explorer.top_tokens(step, 20)])
    record("entropy histogram (figure -> PNG)", lambda: plot.postprocess(explorer.histogram(step)))
    record("prompt group (8 responses, 256 tokens each)", lambda: explorer.prompt_group(step, row))
    record("compare steps (same prompt at another step)", lambda: explorer.compare_steps(step, row, other))

    def tree() -> None:
        _, tree_table, body = explorer.branch_tree(step, row)
        html.postprocess(body)
        table.postprocess(tree_table)

    record("branch tree (the 8 responses of the prompt: SVG + table)", tree)

    def switch() -> None:
        """Everything a step change runs: a step not in the cache, then all its panels."""
        target = steps[switch.next]
        switch.next += 1
        table.postprocess(explorer.stats_table(target))
        table.postprocess(explorer.overview(target))
        [table.postprocess(t) for t in explorer.top_tokens(target, 20)]
        plot.postprocess(explorer.histogram(target))
        _post_response(explorer.response(target, 0), table, html, download)
        explorer.prompt_group(target, 0)
        explorer.compare_steps(target, 0, other)

    switch.next = 0
    record("switch step (uncached step, all panels)", switch)

    print("\n| interaction (server side) | first call (ms) | median of repeats (ms) |\n|---|---|---|")
    for name, first, median in rows:
        print(f"| {name} | {first * 1e3:.0f} | {median * 1e3:.0f} |")
    if args.browser:
        print("\n| interaction in Chromium: until the result is shown | from the action's start (ms) | "
              "from its last key press or click (ms) |\n|---|---|---|")
        for name, total, answer in browser_timings(args.dir, explorer, steps):
            print(f"| {name} | {total * 1e3:.0f} | {answer * 1e3:.0f} |")
    if args.delete:
        shutil.rmtree(args.dir)


def browser_timings(trace: Path, explorer: Explorer, steps: list[int]) -> list[tuple[str, float, float]]:
    """Serve the app and time what a user waits for in headless Chromium: (name, from the start of the action,
    from the end of the action: its last key press or click), in seconds."""
    import socket

    from playwright.sync_api import sync_playwright

    from archer.viz.app import launch

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app = launch(trace, port=port, block=False, poll_seconds=0)
    latest, other = steps[-1], steps[len(steps) // 3]
    lengths = explorer.overview(latest)["length"]
    row = int(lengths.idxmax())  # a longest response of the latest step
    out: list[tuple[str, float, float]] = []
    meta = "(document.querySelector('#archer-meta')?.textContent ?? '')"  # textContent: no forced layout
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path="/usr/bin/chromium", args=[
                "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.set_default_timeout(60_000)

            def until(name: str, action: Callable[[], None], predicate: str, arg: Any = None) -> None:
                start = time.perf_counter()
                action()
                acted = time.perf_counter()
                page.wait_for_function(predicate, arg=arg, polling="raf")
                out.append((name, time.perf_counter() - start, time.perf_counter() - acted))

            def type_in(elem_id: str, text: str) -> None:
                box = page.locator(f"#{elem_id} textarea, #{elem_id} input").first
                box.fill(text)
                box.press("Enter")

            def view_shown(step: int, rows: int, sort: str) -> str:
                return (f"() => {meta}.includes('step {step} | row {row} |') && "
                        f"{meta}.includes('view: {rows} rows (sort: {sort})')")

            def rows_of(step: int, **options: Any) -> int:
                return len(explorer.response(step, row, **options).view)

            until("open the page (latest step, response 0 with both heatmaps)",
                  lambda: page.goto(f"http://127.0.0.1:{port}/"),
                  f"() => {meta}.includes('step {latest} | row 0 |')")
            page.wait_for_timeout(1000)
            until(f"open response {row} ({int(lengths[row])} tokens)",
                  lambda: type_in("archer-row", str(row)), view_shown(latest, rows_of(latest), "position"))
            until("entropy filter min 1", lambda: type_in("archer-emin", "1"),
                  view_shown(latest, rows_of(latest, entropy_range=(1.0, None)), "position"))
            until("token search 'ab'", lambda: type_in("archer-search", "ab"),
                  view_shown(latest, rows_of(latest, entropy_range=(1.0, None), search="ab"), "position"))
            until("sort by entropy descending", lambda: page.get_by_test_id("entropy descending-radio-label").click(),
                  view_shown(latest, rows_of(latest, entropy_range=(1.0, None), search="ab"), "entropy_desc"))
            type_in("archer-emin", "")
            type_in("archer-search", "")
            page.wait_for_timeout(1000)

            def pick(step: int) -> None:
                page.locator("#archer-step input").click()
                page.locator("#archer-step input").press("Control+a")
                page.locator("#archer-step input").press_sequentially(str(step))  # the list shows 100 steps: filter it
                page.locator(f'#archer-step li[role="option"][aria-label="{step}"]').click()

            until(f"switch to step {other} (uncached) until its response shows", lambda: pick(other),
                  view_shown(other, rows_of(other), "entropy_desc"))
            browser.close()
    finally:
        app.close()
    return out


def _post_response(result: Any, table: gr.Dataframe, html: gr.HTML, download: gr.DownloadButton) -> None:
    """Gradio's postprocessing of the response panel's outputs (what the browser receives)."""
    table.postprocess(result.view)
    html.postprocess(result.entropy_html)
    html.postprocess(result.influence_html)
    download.postprocess(str(result.csv_path))


if __name__ == "__main__":
    main()

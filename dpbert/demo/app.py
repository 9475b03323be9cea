"""The Gradio fill-mask demo: DP and non-private checkpoints side by side, each with its epsilon.

`build_app(models)` returns the `gr.Blocks`; `serve(sources, ...)` loads checkpoints and launches
it (what `dpbert demo` and `demo/app.py` run). The API endpoint `/fill_mask` takes one string and
returns, per model, its privacy label and guarantees, the filled sentence and the top-k tokens
with probabilities per mask (schema: docs/INTERNALS.md, "dpbert.demo.app").

The examples it offers are the sentences on which the first private model answers by the
context (`offered_examples`: its top answer differs from its answer averaged over the candidate
sentences), and each column shows the model's verified guarantee and the held-out figures its
release states.

Guarantees: bad input (no [MASK], more than `MAX_MASKS`, text longer than a model takes) is a
`gr.Error`, which `gradio_client` raises as `AppError` with the same message. Serving binds
127.0.0.1 unless told otherwise, with one queue and no analytics.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import gradio as gr
import numpy as np

from dpbert.demo.fill_mask import MASK, MAX_MASKS, MAX_TOP_K, FillMaskInputError, FillMaskModel

EXAMPLES = (
    f"The capital of France is {MASK}.",
    f"The president spoke to {MASK} about the economy.",
    f"I went to the {MASK} to buy some {MASK}.",
    f"The {MASK} of the United States is elected every four years.",
    f"The state of the {MASK} is strong.",
    f"Thank you, and God bless {MASK}.",
    f"We must cut {MASK} for working families.",
    f"Our men and women in {MASK} serve with honor.",
    f"The United {MASK} of America.",
    f"Tonight I want to talk about {MASK}.",
)
MAX_OFFERED = 6


@dataclass(frozen=True, kw_only=True)
class OfferedExamples:
    """The sentences the page offers, chosen by `judge`'s answers (see `offered_examples`)."""

    sentences: tuple[str, ...]
    shifts: tuple[float, ...]  # total variation from judge's average answer, per sentence
    judge: str
    context_dependent: bool  # False: every candidate got judge's usual top answer; shown by shift alone

    def note(self) -> str:
        shifts = ", ".join(f"{x:.2f}" for x in self.shifts)
        how = f"ordered by how far the context moves its distribution from its average (total variation: {shifts})"
        if not self.context_dependent:
            return (
                f"**{self.judge}** gives the same top answer to every candidate sentence, whatever the context; "
                f"they are {how}."
            )
        return (
            f"Examples where **{self.judge}**'s top answer depends on the context (it differs from its top "
            f"answer averaged over all candidate sentences), {how}."
        )


def offered_examples(models: Sequence[FillMaskModel], candidates: Sequence[str] | None = None) -> OfferedExamples:
    """Example sentences on which the judge (the first private model, else the first model) answers
    by the context. Over the candidates every model can take, the judge's distribution at each first
    mask is compared with their average: a sentence qualifies when its top-1 differs from the
    average's, and the qualifying ones are offered by decreasing total variation from the average,
    at most `MAX_OFFERED`; when none qualifies, the first `MAX_OFFERED` by that distance, flagged.
    `candidates` default: the models' own recipe sentences, then `EXAMPLES`. Public sentences and
    the released weights only."""
    judge = next((m for m in models if m.privacy.private), models[0])
    if candidates is None:
        candidates = [*(t for m in models for t in m.sentences), *EXAMPLES]
    usable = []
    for text in dict.fromkeys(candidates):  # keeps order, drops repeats
        try:
            for model in models:
                model.encode(text)
        except FillMaskInputError:
            continue
        usable.append(text)
    if not usable:
        raise ValueError("offered_examples: no candidate sentence fits every model")
    dists = np.stack([judge.mask_distribution(t) for t in usable])
    average = dists.mean(axis=0)
    shifts = 0.5 * np.abs(dists - average).sum(axis=1)
    moved = dists.argmax(axis=1) != average.argmax()
    pool = np.flatnonzero(moved) if moved.any() else np.arange(len(usable))
    chosen = sorted(pool, key=lambda i: -shifts[i])[:MAX_OFFERED]
    return OfferedExamples(
        sentences=tuple(usable[i] for i in chosen),
        shifts=tuple(float(shifts[i]) for i in chosen),
        judge=judge.name,
        context_dependent=bool(moved.any()),
    )


GUARANTEE_NOTE = f"""\
**What the guarantee protects.** A DP checkpoint's (ε, δ) bounds how much any *one example
sequence of the pretraining corpus* can change the released weights, and so everything computed
from them, these predictions included: whether or not one sequence was in the corpus, the
weights are almost equally likely. It says nothing about the vocabulary (unless it is public, as
bert-base-uncased's is), about evaluation metrics or anything else computed from data besides
the weights, and a text spread over many sequences is protected only by a weaker, group bound.
A non-private model (ε = ∞) gives no such guarantee. Up to {MAX_MASKS} {MASK} per sentence.
"""


def fill_mask(models: Sequence[FillMaskModel], text: str, *, top_k: int) -> dict[str, Any]:
    """JSON-friendly predictions of every model for `text`; raises gr.Error on bad input."""
    result: dict[str, Any] = {}
    for model in models:
        try:
            prediction = model.predict(text, top_k=top_k)
        except FillMaskInputError as err:
            raise gr.Error(str(err), title="Cannot fill this sentence", print_exception=False) from err
        result[model.name] = {
            "privacy": model.privacy.to_json(),
            "filled": prediction.filled,
            "masks": [
                [{"token": c.token, "token_id": c.token_id, "score": c.score} for c in mask]
                for mask in prediction.masks
            ],
        }
    return result


def render_predictions(entry: dict[str, Any] | None) -> str:
    """HTML for one model's entry of the `/fill_mask` result: filled sentence, table per mask."""
    if not entry:
        return ""
    tables = []
    for number, candidates in enumerate(entry["masks"], start=1):
        rows = "".join(
            "<tr>"
            f"<td class='dp-token'>{html.escape(c['token'])}</td>"
            f"<td class='dp-score'>{c['score']:.1%}</td>"
            f"<td class='dp-bar'><div style='width:{100 * c['score']:.1f}%'></div></td>"
            "</tr>"
            for c in candidates
        )
        tables.append(
            f"<table class='dp-mask'><caption>{MASK} #{number}</caption>"
            f"<tr><th>token</th><th>probability</th><th></th></tr>{rows}</table>"
        )
    filled = html.escape(entry["filled"])
    return f"<p class='dp-filled'>Top-1: <b>{filled}</b></p>{''.join(tables)}"


_CSS = """
.dp-mask { margin: 0.5em 0; border-collapse: collapse; width: 100%; }
.dp-mask caption { text-align: left; font-weight: 600; }
.dp-mask td, .dp-mask th { padding: 2px 8px; text-align: left; }
.dp-bar { width: 40%; }
.dp-bar div { height: 0.8em; background: #4f7cff; border-radius: 2px; }
"""


def build_app(models: Sequence[FillMaskModel], *, top_k: int = 5) -> gr.Blocks:
    """The demo page over already-loaded models (at least one, names unique); its examples are
    `offered_examples(models)`, each column states the model's verified guarantee and the held-out
    figures its release states."""
    if not models:
        raise ValueError("models: the demo needs at least one model")
    names = [m.name for m in models]
    if len(set(names)) != len(names):
        raise ValueError(f"models: names must be unique, got {names}")
    examples = offered_examples(models)

    with gr.Blocks(title="dpbert fill-mask", analytics_enabled=False) as app:
        gr.Markdown(
            "# dpbert fill-mask\nDifferentially private BERT next to a non-private one: "
            f"write a sentence with {MASK} where a word is missing."
        )
        text = gr.Textbox(
            label="Sentence",
            placeholder=f"The capital of France is {MASK}.",
            lines=2,
            elem_id="sentence",
        )
        submit = gr.Button("Fill", variant="primary", elem_id="fill")
        gr.Examples(examples=[[e] for e in examples.sentences], inputs=[text])
        gr.Markdown(examples.note(), elem_id="examples-note")
        outputs = []
        with gr.Row():
            for number, model in enumerate(models):
                with gr.Column():
                    vocabulary = f"\n\n{model.privacy.vocabulary}" if model.privacy.vocabulary else ""
                    evaluation = f"\n\nAs released: {model.evaluation}." if model.evaluation else ""
                    gr.Markdown(f"### {model.name}\n**{model.privacy.label()}**{vocabulary}{evaluation}")
                    outputs.append(gr.HTML(elem_id=f"predictions-{number}"))
        with gr.Accordion("API response (JSON)", open=False):
            raw = gr.JSON(label="/fill_mask")
        gr.Markdown(GUARANTEE_NOTE)

        def api(sentence: str) -> dict[str, Any]:
            return fill_mask(models, sentence, top_k=top_k)

        def show(result: dict[str, Any]) -> list[str]:
            return [render_predictions((result or {}).get(name)) for name in names]

        gr.on(
            triggers=[submit.click, text.submit],
            fn=api,
            inputs=[text],
            outputs=[raw],
            api_name="fill_mask",
        ).success(show, inputs=[raw], outputs=outputs, api_visibility="private")
    return app


def serve(
    sources: Sequence[str],
    *,
    host: str = "127.0.0.1",
    port: int | None = None,
    share: bool = False,
    top_k: int = 5,
    concurrency_limit: int = 1,
    prevent_thread_lock: bool = False,
) -> gr.Blocks:
    """Load `sources` (folders or Hub ids), compile their smallest length bucket, build the app,
    queue it and launch it (blocking unless `prevent_thread_lock`)."""
    if not 1 <= top_k <= MAX_TOP_K:
        raise ValueError(f"top_k must be in [1, {MAX_TOP_K}], got {top_k}")
    if concurrency_limit < 1:
        raise ValueError(f"concurrency_limit must be >= 1, got {concurrency_limit}")
    models = [FillMaskModel.load(s) for s in sources]
    for model in models:
        model.warm_up()
    app = build_app(models, top_k=top_k)
    app.queue(default_concurrency_limit=concurrency_limit, max_size=64)
    app.launch(
        server_name=host,
        server_port=port,
        share=share,
        prevent_thread_lock=prevent_thread_lock,
        ssr_mode=False,
        footer_links=["api", "gradio"],
        css=_CSS,
    )
    return app

"""The sidebar: the decoding mode at its top, the live metrics panel (its cards, the tokens/s plot
and the figures as JSON), then the conversations kept in this browser and the sampling settings."""

from __future__ import annotations

from dataclasses import dataclass, fields

import gradio as gr

from engine.core.modes import MODES
from engine.core.requests import DEFAULT_K, DEFAULT_MODE, DEFAULT_TEMPERATURE, DEFAULT_TOP_P, MAX_TEMPERATURE
from engine.core.window import Overflow
from engine.interface import EngineClient
from ui import streaming
from ui.render import metrics_html

MAX_CAP = 8192  # the largest cap on new tokens the form offers (0: none but the context)
# Phones: the settings start closed (they would cover the chat), the compact metrics line shows.
CLOSE_SIDEBAR_ON_PHONES = """() => {
  if (window.innerWidth < 768) document.querySelector('#sidebar .toggle-button, .sidebar .toggle-button')?.click();
}"""


@dataclass
class Sidebar:
    conversations: gr.Dropdown
    new: gr.Button
    delete: gr.Button
    export: gr.Button
    upload: gr.UploadButton
    exported: gr.File
    system: gr.Textbox
    mode: gr.Radio
    k: gr.Slider
    temperature: gr.Slider
    top_p: gr.Slider
    max_new_tokens: gr.Slider
    seed: gr.Number
    context_overflow: gr.Radio
    metrics_panel: gr.HTML
    tps_plot: gr.LinePlot
    metrics_json: gr.JSON

    @property
    def settings(self) -> list[gr.components.Component]:
        """The decoding settings' components, ordered as the fields of
        :class:`~ui.streaming.Settings` (as the handlers take them)."""
        return streaming.components_named([field.name for field in fields(streaming.Settings)], self)


def create_ui(engine: EngineClient, overflow: str = Overflow.WINDOW) -> Sidebar:
    """The sidebar's layout: the mode and the figures first, then the conversations and the
    settings (``overflow``: what becomes of a conversation past the input cap, as the server
    does by default)."""
    max_tokens = max(16, min(MAX_CAP, engine.max_context))
    with gr.Sidebar(width=360, label="Settings", elem_id="sidebar"):
        # What the app is for first: the switch between the decoding modes and the live figures,
        # in view on a 1366x768 screen; what each mode does, the conversations and the sampling
        # settings below.
        gr.Markdown("## ⚡ SpecChat\nA small draft model proposes *K* tokens; the target checks them in one pass.")
        # The switch above the cards: the panel grows with an answer's figures, the switch stays in view.
        first_mode = DEFAULT_MODE if DEFAULT_MODE in engine.modes else engine.modes[0]
        mode = gr.Radio(list(engine.modes), label="Decoding mode", elem_id="mode", value=first_mode)
        metrics_panel = gr.HTML(metrics_html({}), elem_id="metrics")
        tps_plot = gr.LinePlot(
            None,
            x="time_s",
            y="tokens_per_s",
            color="series",
            x_title="time (s)",
            y_title="tokens/s",
            title="tokens/s while streaming",
            height=200,
            elem_id="tps-plot",
            color_map={"average": "#4f46e5", "this round": "#10b981"},
        )
        gr.Markdown("\n".join(f"- **{m}**: {MODES[m].help}" for m in engine.modes), elem_id="modes-help")
        with gr.Accordion("Conversations", open=True):
            conversations = gr.Dropdown([], label="Open conversation", elem_id="conversations", filterable=False)
            with gr.Row():
                new = gr.Button("New chat", size="sm", elem_id="new-chat")
                delete = gr.Button("Delete", size="sm", variant="stop", elem_id="delete-chat")
            with gr.Row():
                export = gr.Button("Export", size="sm", elem_id="export")
                upload = gr.UploadButton(
                    "Import", size="sm", file_types=[".json", ".md"], type="filepath", elem_id="import"
                )
            exported = gr.File(label="Exported (JSON, Markdown)", file_count="multiple", visible=False)
        with gr.Accordion("Sampling and system prompt", open=True, elem_id="sampling"):
            system = gr.Textbox(
                "",
                label="System prompt",
                lines=2,
                max_lines=8,
                placeholder="Empty: the model's own default",
                elem_id="system",
            )
            # (live whatever the mode above: Compare takes K too, for its own two modes)
            k = gr.Slider(
                1, 8, value=DEFAULT_K, step=1, label="Draft length K", info=f"drafts per round in {draft_modes(engine)}"
            )
            temperature = gr.Slider(
                0.0, MAX_TEMPERATURE, value=DEFAULT_TEMPERATURE, step=0.05, label="Temperature", info="0 = greedy"
            )
            top_p = gr.Slider(0.05, 1.0, value=DEFAULT_TOP_P, step=0.05, label="Top-p")
            max_new_tokens = gr.Slider(
                0,
                max_tokens,
                value=streaming.FORM_MAX_NEW_TOKENS,
                step=8,
                label="Max new tokens",
                info=f"{streaming.UNCAPPED} = until the model stops (within the context);"
                " a cut answer can be continued",
                elem_id="max-new-tokens",
            )
            seed = gr.Number(-1, precision=0, minimum=-1, label="Seed", info="-1 = a new random seed each time")
            context_overflow = gr.Radio(
                list(Overflow),
                value=overflow,
                label="A conversation longer than the input cap",
                info="window: its oldest turns leave the model's view; stop: it is refused",
                elem_id="context-overflow",
            )
        with gr.Accordion("All metrics (JSON)", open=False):
            metrics_json = gr.JSON(label="metrics")
    return Sidebar(
        conversations,
        new,
        delete,
        export,
        upload,
        exported,
        system,
        mode,
        k,
        temperature,
        top_p,
        max_new_tokens,
        seed,
        context_overflow,
        metrics_panel,
        tps_plot,
        metrics_json,
    )


def draft_modes(engine: EngineClient) -> str:
    """The served modes whose drafts a request's K sets (the others choose their own)."""
    return ", ".join(m for m in engine.modes if MODES[m].takes_k) or "no mode served here"


def wire(demo: gr.Blocks, sidebar: Sidebar) -> None:
    demo.load(None, js=CLOSE_SIDEBAR_ON_PHONES)

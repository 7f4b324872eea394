"""The web page (Gradio): the only package that imports ``gradio``. One module per concern:
:mod:`ui.page` lays the page out and wires it from :mod:`ui.sidebar`, :mod:`ui.chat`,
:mod:`ui.conversations` and :mod:`ui.compare`; :mod:`ui.render` draws, :mod:`ui.streaming`
paces what handlers stream; :mod:`ui.launch` serves it."""

import os

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # no usage pings to the internet (read at gradio's import)

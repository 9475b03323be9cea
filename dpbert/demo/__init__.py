"""The Gradio fill-mask demo: inference (``fill_mask``) and the app (``app``).

``FillMaskModel.load(folder_or_hub_id)`` scores sentences with [MASK]; ``build_app(models)``
returns the page; ``serve(sources, host=..., port=..., share=...)`` loads and launches it, as
``dpbert demo`` and ``demo/app.py`` do.
"""

from dpbert.demo.app import build_app, fill_mask, serve
from dpbert.demo.fill_mask import (
    MAX_MASKS,
    FillMaskInputError,
    FillMaskModel,
    FillMaskResult,
    ModelPrivacy,
    TokenScore,
)

__all__ = [
    "MAX_MASKS",
    "FillMaskInputError",
    "FillMaskModel",
    "FillMaskResult",
    "ModelPrivacy",
    "TokenScore",
    "build_app",
    "fill_mask",
    "serve",
]

"""The dev accuracy that transformers (PyTorch) reproduces from an exported sequence classifier."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def hf_dev_accuracy(model_dir: Path, sst2_dir: Path, max_length: int = 12) -> float:
    """Load `model_dir` with AutoModelForSequenceClassification and score the SST-2 dev split of
    `sst2_dir` (the test fixture), as a user of the export would."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from dpbert.data import glue

    hf = AutoModelForSequenceClassification.from_pretrained(str(model_dir)).eval()
    dev = glue.load_split(glue.get_task("sst2"), sst2_dir, "validation")
    enc = AutoTokenizer.from_pretrained(str(model_dir))(
        list(dev.texts[0]), padding="max_length", truncation=True, max_length=max_length, return_tensors="pt"
    )
    with torch.no_grad():
        preds = hf(**enc).logits.argmax(-1).numpy()
    return float(np.mean(preds == dev.labels))
